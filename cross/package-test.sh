#!/usr/bin/env bash
# Checks the packages cross/package.sh built, as a board's owner would meet them. Needs root and
# a machine without imgate on it (CI's): it installs, upgrades, removes and purges the amd64 .deb.
#
#   cross/package-test.sh [--install]     (after cross/build.sh and cross/package.sh)
#
# 1. Every .deb and .ipk: its control fields, its files with their modes and owners, and the
#    architecture of the binary inside (ARMv6 in the armhf .deb); dpkg's reading of each foreign
#    .deb (--no-act, with --force-architecture); lintian on every .deb, failing on any error; the
#    .deb's preinst as each Raspberry Pi's CPU answers uname -m.
# 2. The amd64 .deb through its life on this machine: install (the user, the modes, one API key,
#    the unit enabled, the service user able to run imgate and answer /health with the key),
#    reinstall and upgrade with an edited config, remove (config and state kept), purge
#    (nothing left), and an install over a group a cut-short purge left behind.
# --install adds lintian from Debian when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --install ] && ! command -v lintian >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq lintian >/dev/null
fi

dist=target/dist
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "package-test: $*" >&2; exit 1; }
expect() { # what, wanted, got
  [ "$2" = "$3" ] || fail "$1: wanted '$2', got '$3'"
}

# The ELF machine of a binary and its byte order: 183 aarch64, 40 arm, 8 mips, 243 riscv,
# 62 x86_64; "le" or "be" (EI_DATA 1 or 2). e_machine is in the file's own byte order.
elf_machine() {
  local data lo hi
  data=$(od -An -tu1 -j5 -N1 "$1" | tr -d ' ')
  read -r lo hi < <(od -An -tu1 -j18 -N2 "$1")
  if [ "$data" = 2 ]; then echo "$((lo * 256 + hi)) be"; else echo "$((hi * 256 + lo)) le"; fi
}
# What a package architecture's binary must be.
machine_of() {
  case "$1" in
    arm64 | aarch64_*) echo "183 le" ;;
    armhf | arm_*) echo "40 le" ;;
    mipsel_*) echo "8 le" ;;
    mips_*) echo "8 be" ;;
    riscv64) echo "243 le" ;;
    amd64 | x86_64) echo "62 le" ;;
  esac
}

# `tar -tv` lines as "mode owner/group path" for the files that matter.
listing() { awk '{ print $1, $2, $NF }'; }

echo "== the .deb packages"
for arch in arm64 armhf amd64 riscv64; do
  deb="$dist/imgate_${version}_${arch}.deb"
  [ -f "$deb" ] || fail "$deb missing"
  expect "$deb Package" imgate "$(dpkg-deb -f "$deb" Package)"
  expect "$deb Architecture" "$arch" "$(dpkg-deb -f "$deb" Architecture)"
  expect "$deb Depends (a static binary)" "" "$(dpkg-deb -f "$deb" Depends)"
  for field in Maintainer Homepage Description Installed-Size; do
    [ -n "$(dpkg-deb -f "$deb" "$field")" ] || fail "$deb has no $field"
  done
  dpkg-deb --ctrl-tarfile "$deb" | tar -x -O ./conffiles > "$work/conffiles"
  expect "$deb conffiles" /etc/imgate/imgate.conf "$(cat "$work/conffiles")"
  dpkg-deb --contents "$deb" | listing > "$work/contents"
  for want in \
    "-rwxr-xr-x root/root ./usr/bin/imgate" \
    "-rw-r----- root/root ./etc/imgate/imgate.conf" \
    "-rw-r--r-- root/root ./usr/lib/systemd/system/imgate.service" \
    "-rw-r--r-- root/root ./usr/share/doc/imgate/copyright" \
    "-rw-r--r-- root/root ./usr/share/man/man5/imgate.conf.5.gz"; do
    grep -qxF -- "$want" "$work/contents" || { cat "$work/contents"; fail "$deb lacks: $want"; }
  done
  rm -rf "$work/x" && mkdir "$work/x" && dpkg-deb -x "$deb" "$work/x"
  # The config reference it carries is made from the repository's (a key of each part of it).
  for key in '[server] listen' '[queue] log_file_size' '[matrix]'; do
    zcat "$work/x/usr/share/man/man5/imgate.conf.5.gz" | grep -qF "\fB$key\fR" || fail "$deb: imgate.conf(5) lacks $key"
  done
  expect "$deb binary's ELF machine" "$(machine_of "$arch")" "$(elf_machine "$work/x/usr/bin/imgate")"
  if [ "$arch" = armhf ]; then
    # Raspberry Pi OS's armhf runs on ARMv6 (Pi Zero, Pi 1): the binary must not need ARMv7.
    readelf -A "$work/x/usr/bin/imgate" | grep -qE 'Tag_CPU_arch: v6(K|KZ)?$' || fail "$deb: the binary is not built for ARMv6"
  fi
  if [ "$arch" != "$(dpkg --print-architecture)" ] && ! dpkg --print-foreign-architectures | grep -qx "$arch"; then
    # dpkg on this machine reads the package as one of that architecture would: refused for
    # its architecture alone, taken with --force-architecture (nothing is written: --no-act).
    dpkg --no-act -i "$deb" > "$work/dpkg.log" 2>&1 && fail "$deb: dpkg took a package for $arch"
    grep -q "does not match system" "$work/dpkg.log" || { cat "$work/dpkg.log"; fail "$deb: dpkg refused it for another reason"; }
    dpkg --no-act --force-architecture -i "$deb" > "$work/dpkg.log" 2>&1 || { cat "$work/dpkg.log"; fail "$deb: dpkg refused it with --force-architecture"; }
  fi
  cmp -s "$work/x/usr/lib/systemd/system/imgate.service" systemd/imgate.service || fail "$deb: the unit differs from systemd/imgate.service"
  printf '%s: %s bytes, fields and files as expected\n' "$deb" "$(stat -c %s "$deb")"
done

echo "== lintian"
lintian --version
for arch in arm64 armhf amd64 riscv64; do
  # Errors fail; warnings are shown.
  lintian --fail-on error --tag-display-limit 0 "$dist/imgate_${version}_${arch}.deb" || fail "lintian found errors in the $arch package"
done

echo "== the .ipk packages"
for arch in aarch64_cortex-a53 aarch64_generic arm_cortex-a7_neon-vfpv4 mipsel_24kc mips_24kc x86_64; do
  ipk="$dist/imgate_${version}_${arch}.ipk"
  [ -f "$ipk" ] || fail "$ipk missing"
  expect "$ipk members" "./debian-binary ./data.tar.gz ./control.tar.gz" "$(tar -tzf "$ipk" | tr '\n' ' ' | sed 's/ $//')"
  rm -rf "$work/i" && mkdir -p "$work/i/control" "$work/i/data"
  tar -xzf "$ipk" -C "$work/i"
  expect "$ipk debian-binary" 2.0 "$(cat "$work/i/debian-binary")"
  tar -xzf "$work/i/control.tar.gz" -C "$work/i/control"
  ctl="$work/i/control/control"
  expect "$ipk Architecture" "$arch" "$(sed -n 's/^Architecture: //p' "$ctl")"
  expect "$ipk Require-User" "imgate:imgate" "$(sed -n 's/^Require-User: //p' "$ctl")"
  expect "$ipk Depends (a static binary)" "" "$(sed -n 's/^Depends: //p' "$ctl")"
  expect "$ipk conffiles" /etc/imgate/imgate.conf "$(cat "$work/i/control/conffiles")"
  for s in postinst prerm; do [ -x "$work/i/control/$s" ] || fail "$ipk: $s is not executable"; done
  grep -q '^imgate_api_key()' "$work/i/control/postinst-pkg" || fail "$ipk: postinst-pkg lacks the API key step"
  tar -tvzf "$work/i/data.tar.gz" | listing > "$work/contents"
  for want in \
    "-rwxr-xr-x 0/0 ./usr/bin/imgate" \
    "-rwxr-xr-x 0/0 ./etc/init.d/imgate" \
    "-rw-r----- 0/0 ./etc/imgate/imgate.conf" \
    "-rw-r--r-- 0/0 ./lib/upgrade/keep.d/imgate"; do
    grep -qxF -- "$want" "$work/contents" || { cat "$work/contents"; fail "$ipk lacks: $want"; }
  done
  tar -xzf "$work/i/data.tar.gz" -C "$work/i/data"
  expect "$ipk keep.d (sysupgrade keeps the config, the key and the state)" "/etc/imgate/ /srv/imgate/" \
    "$(tr '\n' ' ' < "$work/i/data/lib/upgrade/keep.d/imgate" | sed 's/ $//')"
  expect "$ipk binary's ELF machine" "$(machine_of "$arch")" "$(elf_machine "$work/i/data/usr/bin/imgate")"
  grep -qx 'state_dir = /srv/imgate' "$work/i/data/etc/imgate/imgate.conf" || fail "$ipk: state_dir is not on flash"
  printf '%s: %s bytes, fields and files as expected\n' "$ipk" "$(stat -c %s "$ipk")"
done
for s in "$work"/i/control/postinst "$work"/i/control/prerm "$work"/i/control/postinst-pkg packaging/openwrt/imgate.init; do
  sh -n "$s" || fail "$s: syntax"
done
(cd "$dist" && sha256sum --quiet -c SHA256SUMS) || fail "SHA256SUMS does not match"

echo "== the .deb's preinst on the CPUs Raspberry Pi OS armhf runs on"
# uname -m as each board answers it: Pi 1 and Zero armv6l, Pi 2 armv7l, Pi 3/4/5 (32-bit OS)
# armv7l or armv8l; a pre-ARMv6 CPU is refused before anything is unpacked.
mkdir -p "$work/uname"
for machine in armv6l armv7l armv8l aarch64 armv5tel; do
  printf '#!/bin/sh\necho %s\n' "$machine" > "$work/uname/uname"
  chmod 0755 "$work/uname/uname"
  rc=0
  PATH="$work/uname:$PATH" sh packaging/deb/preinst install > /dev/null 2>&1 || rc=$?
  case "$machine" in armv5*) want=1 ;; *) want=0 ;; esac
  expect "preinst on $machine" "$want" "$rc"
done

echo "== the amd64 .deb installed on this machine"
[ "$(id -u)" = 0 ] || fail "the install test needs root"
if dpkg -s imgate >/dev/null 2>&1 || getent passwd imgate >/dev/null; then
  fail "imgate is already on this machine: the install test wants a machine without it"
fi
deb="$dist/imgate_${version}_amd64.deb"
mode_of() { stat -c '%a %U:%G' "$1"; }
wants=/etc/systemd/system/multi-user.target.wants/imgate.service

dpkg -i "$deb" | tee "$work/install.log"
grep -q "API key for xAgent was generated in /etc/imgate/api_key" "$work/install.log" || fail "no post-install message"
key=$(cat /etc/imgate/api_key)
grep -qF "$key" "$work/install.log" && fail "the post-install message shows the key itself"
[[ "$key" =~ ^[0-9a-f]{64}$ ]] || fail "the API key is not 64 hex digits"
expect "imgate's shell" /usr/sbin/nologin "$(getent passwd imgate | cut -d: -f7)"
uid=$(id -u imgate)
[ "$uid" -lt 1000 ] || fail "imgate is not a system user (uid $uid)"
expect "the config" "640 root:imgate" "$(mode_of /etc/imgate/imgate.conf)"
expect "the API key" "640 root:imgate" "$(mode_of /etc/imgate/api_key)"
expect "the state dir" "700 imgate:imgate" "$(mode_of /var/lib/imgate)"
expect "the binary" "755 root:root" "$(mode_of /usr/bin/imgate)"
[ -L "$wants" ] || fail "the unit was not enabled ($wants)"

# The service user runs the installed binary on the installed config, as the unit would, and
# answers /health only with the generated key.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
sed "s|^listen = 0.0.0.0:8787$|listen = 127.0.0.1:$port|" /etc/imgate/imgate.conf > "$work/port.conf"
# As the packaged config: the service and the members of its group read it.
chown root:imgate "$work/port.conf"
chmod 0640 "$work/port.conf"
chmod 0755 "$work"
setpriv --reuid imgate --regid imgate --init-groups env STATE_DIRECTORY=/var/lib/imgate \
  /usr/bin/imgate run --config "$work/port.conf" 2> "$work/run.log" &
pid=$!
for _ in $(seq 1 100); do
  curl -fs -o /dev/null "http://127.0.0.1:$port/connector-card.json" && break
  sleep 0.1
done
expect "/health without the key" 401 "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")"
expect "/health with the key" 200 "$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $key" "http://127.0.0.1:$port/health")"
# `check` as root probes as the service user: the state dir it owns, one it cannot write.
/usr/bin/imgate check --config "$work/port.conf" > "$work/check.txt" 2>&1 || { cat "$work/check.txt"; fail "imgate check"; }
grep -q "^listen 127.0.0.1:$port as imgate: in use" "$work/check.txt" || fail "check: the port in use ($(cat "$work/check.txt"))"
grep -q "^state_dir /var/lib/imgate: writable by imgate" "$work/check.txt" || fail "check: the state dir as imgate"
install -d -m 0700 "$work/rootonly"
sed "s|^state_dir = .*|state_dir = $work/rootonly|" "$work/port.conf" > "$work/rootonly.conf"
/usr/bin/imgate check --config "$work/rootonly.conf" > "$work/check.txt" 2>&1 || fail "imgate check (root-only dir)"
grep -q "^state_dir $work/rootonly: not writable by imgate" "$work/check.txt" || fail "check: a dir imgate cannot write ($(cat "$work/check.txt"))"
# An operator in the imgate group runs `imgate status` without root; anyone else is told how
# to join the group.
useradd --no-create-home --shell /usr/sbin/nologin imgate-operator
usermod -aG imgate imgate-operator
setpriv --reuid imgate-operator --regid imgate-operator --init-groups \
  /usr/bin/imgate status --config "$work/port.conf" > "$work/status.txt" 2>&1 \
  || { cat "$work/status.txt"; fail "imgate status as a member of the imgate group"; }
grep -q "^xAgent   not connected" "$work/status.txt" || fail "imgate status: no xAgent line"
grep -q "^storage  ok, " "$work/status.txt" || fail "imgate status: no storage line"
setpriv --reuid nobody --regid nogroup --clear-groups \
  /usr/bin/imgate status --config "$work/port.conf" > /dev/null 2> "$work/denied.txt" \
  && fail "imgate status ran for a user outside the imgate group"
grep -q 'usermod -aG imgate' "$work/denied.txt" || fail "imgate status outside the group: no hint ($(cat "$work/denied.txt"))"
userdel imgate-operator
kill -TERM "$pid"
wait "$pid" || { cat "$work/run.log"; fail "the service user's imgate did not exit cleanly"; }
[ -f /var/lib/imgate/imgate.redb ] || fail "no database in /var/lib/imgate"
expect "the database's owner" imgate "$(stat -c %U /var/lib/imgate/imgate.redb)"

echo "# the owner's edit" >> /etc/imgate/imgate.conf
sed -i 's/^log_level = info$/log_level = warn/' /etc/imgate/imgate.conf
cp /etc/imgate/imgate.conf "$work/edited.conf"

dpkg -i "$deb" > "$work/reinstall.log"
cmp -s /etc/imgate/imgate.conf "$work/edited.conf" || fail "reinstalling lost the edited config"
expect "the key after reinstalling" "$key" "$(cat /etc/imgate/api_key)"
grep -q "API key for xAgent was generated" "$work/reinstall.log" && fail "reinstalling generated a second key"

newer="${version}+1"
bash cross/package.sh --version "$newer" --only deb --deb-arch amd64 > /dev/null
dpkg -i "$dist/imgate_${newer}_amd64.deb" > "$work/upgrade.log"
expect "the version after upgrading" "$newer" "$(dpkg-query -W -f '${Version}' imgate)"
cmp -s /etc/imgate/imgate.conf "$work/edited.conf" || fail "upgrading lost the edited config"
expect "the key after upgrading" "$key" "$(cat /etc/imgate/api_key)"
expect "the config after upgrading" "640 root:imgate" "$(mode_of /etc/imgate/imgate.conf)"
rm -f "$dist/imgate_${newer}_amd64.deb"

dpkg -r imgate
[ -e /usr/bin/imgate ] && fail "remove left the binary"
cmp -s /etc/imgate/imgate.conf "$work/edited.conf" || fail "remove did not keep the config"
expect "the key after remove" "$key" "$(cat /etc/imgate/api_key)"
[ -f /var/lib/imgate/imgate.redb ] || fail "remove did not keep the state"
getent passwd imgate >/dev/null || fail "remove deleted the user"

dpkg -P imgate
for gone in /etc/imgate /var/lib/imgate /var/lib/private/imgate /usr/bin/imgate "$wants" \
  /usr/lib/systemd/system/imgate.service /usr/share/doc/imgate; do
  [ -e "$gone" ] || [ -L "$gone" ] && fail "purge left $gone"
done
getent passwd imgate >/dev/null && fail "purge left the user"
getent group imgate >/dev/null && fail "purge left the group"
dpkg -s imgate >/dev/null 2>&1 && fail "dpkg still knows imgate after purge"

# A group left behind (a purge cut short) is taken as it is, and purged with the rest.
groupadd --system imgate
dpkg -i "$deb" > "$work/regroup.log"
expect "imgate's group over a leftover group" imgate "$(id -gn imgate)"
dpkg -P imgate > /dev/null
getent passwd imgate >/dev/null && fail "purge left the user"
getent group imgate >/dev/null && fail "purge left the group"
echo "package-test: every package inspected; install, reinstall, upgrade, remove and purge as expected"
