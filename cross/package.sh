#!/usr/bin/env bash
# Builds imgate's installable packages from the static binaries cross/build.sh left in dist/:
#
#   .deb  arm64, armhf (ARMv6: every Raspberry Pi), amd64, riscv64
#         Raspberry Pi OS, Debian, Ubuntu (systemd)
#   .ipk  aarch64_cortex-a53, aarch64_generic, arm_cortex-a7_neon-vfpv4, mipsel_24kc, mips_24kc,
#         x86_64   OpenWrt 24.10 and older (opkg, procd)
#
# into target/dist/, with SHA256SUMS. Made with dpkg-deb and tar (no cargo-deb: the maintainer
# scripts are written out in packaging/, and the .ipk is the same few files in OpenWrt's format).
#
#   cross/package.sh [--version V] [--only deb|ipk] [--deb-arch ARCH]
#
# --version overrides Cargo.toml's (the install test builds a newer one); --only and --deb-arch
# build a subset. Maintainer and Homepage come from Cargo.toml's authors and homepage.
set -euo pipefail
# A failure inside $(…) ends the script too (bash does not pass -e into substitutions by default).
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

cargo_field() { sed -n "s/^$1 = \"\\(.*\\)\"/\\1/p" Cargo.toml | head -n 1; }
cargo_list_first() { sed -n "s/^$1 = \\[\"\\([^\"]*\\)\".*/\\1/p" Cargo.toml | head -n 1; }

version=$(cargo_field version)
only=
deb_arches=(arm64 armhf amd64 riscv64)
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --deb-arch) deb_arches=("$2"); shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "package: unknown argument $1" >&2; exit 2 ;;
  esac
done
maintainer=$(cargo_list_first authors)
homepage=$(cargo_field homepage)
[ -n "$version" ] && [ -n "$maintainer" ] && [ -n "$homepage" ] || {
  echo "package: Cargo.toml needs version, authors and homepage" >&2
  exit 1
}
# Reproducible: every timestamp is the last commit's.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"

out=target/dist
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# The Rust target whose static binary each package architecture carries.
rust_target() {
  case "$1" in
    arm64 | aarch64_*) echo aarch64-unknown-linux-musl ;;
    # Raspberry Pi OS's armhf is ARMv6 hard-float (Pi Zero and Pi 1 included): the ARMv6 build.
    armhf) echo arm-unknown-linux-musleabihf ;;
    arm_cortex-a7_neon-vfpv4) echo armv7-unknown-linux-musleabihf ;;
    mipsel_24kc) echo mipsel-unknown-linux-musl ;;
    mips_24kc) echo mips-unknown-linux-musl ;;
    riscv64) echo riscv64gc-unknown-linux-musl ;;
    amd64 | x86_64) echo x86_64-unknown-linux-musl ;;
    *) echo "package: no binary for $1" >&2; return 1 ;;
  esac
}

binary() {
  local t bin
  t=$(rust_target "$1")
  bin="dist/imgate-$t"
  [ -x "$bin" ] || { echo "package: $bin missing; run cross/build.sh $t first" >&2; return 1; }
  echo "$bin"
}

# The packaged config: the template imgate init writes, set up for a service on a LAN: every
# address, the generated API key, the state dir given. Each change is checked, so a reworded
# template cannot slip through unchanged.
packaged_config() {
  local state_dir="$1" dest="$2"
  sed -e 's|^listen = 127\.0\.0\.1:8787$|listen = 0.0.0.0:8787|' \
      -e 's|^api_key =$|api_key_file = /etc/imgate/api_key|' \
      -e "s|^state_dir = ./imgate-data\$|state_dir = $state_dir|" \
      systemd/imgate.conf > "$dest"
  for want in 'listen = 0.0.0.0:8787' 'api_key_file = /etc/imgate/api_key' "state_dir = $state_dir"; do
    grep -qx "$want" "$dest" || { echo "package: the config template no longer has the line for: $want" >&2; return 1; }
  done
}

# A maintainer script with packaging/api-key.sh spliced in where it says #API_KEY#.
with_api_key() {
  local line
  while IFS= read -r line; do
    if [ "$line" = "#API_KEY#" ]; then cat packaging/api-key.sh; else printf '%s\n' "$line"; fi
  done < "$1"
}

description() {
  cat <<'EOF'
Description: xAgent IM Connector Server for edge devices
 imgate bridges instant-messaging systems (generic webhooks, Telegram,
 Feishu/Lark, WeChat, Slack, Discord, DingTalk) into xAgent, an AI-agent server, as an IM
 Connector Server (Connector Protocol 3.0). Every inbound message is
 committed to disk before the sender hears back, redelivered until xAgent
 has it, expired after its TTL and bounded by count and byte caps. One
 static binary, one config file, a few MiB of memory.
EOF
}

# DEP-5 copyright with the license text itself (MIT is not in common-licenses).
copyright() {
  cat <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: imgate
Source: $homepage

Files: *
Copyright: $(sed -n 's/^Copyright (c) //p' LICENSE-MIT)
License: MIT

License: MIT
EOF
  sed -n '/^Permission/,$p' LICENSE-MIT | sed -e 's/^$/./' -e 's/^/ /'
}

changelog() {
  cat <<EOF
imgate ($version) stable; urgency=medium

  * Release $version, built from git $(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown).

 -- $maintainer  $(date -u -R -d "@$SOURCE_DATE_EPOCH")
EOF
}

stamp() { find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +; }

build_deb() {
  local arch="$1" root="$work/deb-$1" bin
  bin=$(binary "$arch")
  rm -rf "$root"
  install -d "$root/DEBIAN" "$root/usr/bin" "$root/usr/lib/systemd/system" "$root/etc/imgate" \
    "$root/usr/share/doc/imgate" "$root/usr/share/lintian/overrides" "$root/usr/share/man/man1" \
    "$root/usr/share/man/man5"
  install -m 0755 "$bin" "$root/usr/bin/imgate"
  install -m 0644 systemd/imgate.service "$root/usr/lib/systemd/system/imgate.service"
  packaged_config /var/lib/imgate "$root/etc/imgate/imgate.conf"
  chmod 0640 "$root/etc/imgate/imgate.conf"
  copyright > "$root/usr/share/doc/imgate/copyright"
  changelog | gzip -9n > "$root/usr/share/doc/imgate/changelog.gz"
  gzip -9n < packaging/imgate.1 > "$root/usr/share/man/man1/imgate.1.gz"
  # The config reference on the device: `man imgate.conf`.
  bash cross/config-man.sh | gzip -9n > "$root/usr/share/man/man5/imgate.conf.5.gz"
  chmod 0644 "$root/usr/share/doc/imgate/"* "$root/usr/share/man/man1/imgate.1.gz" "$root/usr/share/man/man5/imgate.conf.5.gz"
  # A static binary is the point of this package (no libc to depend on), and the config may
  # hold secrets (webhook secrets, tokens), so it is not world-readable.
  printf '%s\n' "imgate: statically-linked-binary [usr/bin/imgate]" \
    "imgate: non-standard-file-perm 0640 != 0644 [etc/imgate/imgate.conf]" > "$root/usr/share/lintian/overrides/imgate"
  chmod 0644 "$root/usr/share/lintian/overrides/imgate"
  install -m 0755 packaging/deb/preinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
  with_api_key packaging/deb/postinst > "$root/DEBIAN/postinst"
  chmod 0755 "$root/DEBIAN/postinst"
  echo /etc/imgate/imgate.conf > "$root/DEBIAN/conffiles"
  (cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) \
    > "$root/DEBIAN/md5sums"
  {
    echo "Package: imgate"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Installed-Size: $(du -sk --apparent-size --exclude=DEBIAN "$root" | cut -f1)"
    echo "Section: net"
    echo "Priority: optional"
    echo "Homepage: $homepage"
    description
  } > "$root/DEBIAN/control"
  chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/conffiles" "$root/DEBIAN/md5sums"
  stamp "$root"
  dpkg-deb --root-owner-group -Zxz --build "$root" "$out/imgate_${version}_${arch}.deb" >/dev/null
  echo "$out/imgate_${version}_${arch}.deb"
}

build_ipk() {
  local arch="$1" dir="$work/ipk-$1" bin
  bin=$(binary "$arch")
  rm -rf "$dir"
  install -d "$dir/data/usr/bin" "$dir/data/etc/init.d" "$dir/data/etc/imgate" "$dir/data/lib/upgrade/keep.d" "$dir/control"
  install -m 0755 "$bin" "$dir/data/usr/bin/imgate"
  install -m 0755 packaging/openwrt/imgate.init "$dir/data/etc/init.d/imgate"
  # sysupgrade keeps the config, the API key and the state (the init script rewrites this when
  # state_dir moves).
  printf '/etc/imgate/\n/srv/imgate/\n' > "$dir/data/lib/upgrade/keep.d/imgate"
  chmod 0644 "$dir/data/lib/upgrade/keep.d/imgate"
  # /var is RAM on OpenWrt: the default keeps accepted messages on flash (docs/operations.md, "OpenWrt").
  packaged_config /srv/imgate "$dir/data/etc/imgate/imgate.conf"
  chmod 0640 "$dir/data/etc/imgate/imgate.conf"
  install -m 0755 packaging/openwrt/postinst packaging/openwrt/prerm "$dir/control/"
  with_api_key packaging/openwrt/postinst-pkg > "$dir/control/postinst-pkg"
  chmod 0644 "$dir/control/postinst-pkg"
  echo /etc/imgate/imgate.conf > "$dir/control/conffiles"
  {
    echo "Package: imgate"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Installed-Size: $(du -sb --apparent-size "$dir/data" | cut -f1)"
    echo "Section: net"
    echo "License: MIT"
    echo "Source: $homepage"
    echo "SourceName: imgate"
    echo "Require-User: imgate:imgate"
    description
  } > "$dir/control/control"
  chmod 0644 "$dir/control/control" "$dir/control/conffiles"
  echo "2.0" > "$dir/debian-binary"
  stamp "$dir"
  local tarflags=(--format=gnu --numeric-owner --owner=0 --group=0 --sort=name --mtime="@$SOURCE_DATE_EPOCH")
  tar "${tarflags[@]}" -C "$dir/data" -cf - . | gzip -9n > "$dir/data.tar.gz"
  tar "${tarflags[@]}" -C "$dir/control" -cf - . | gzip -9n > "$dir/control.tar.gz"
  # OpenWrt's ipkg-build: a gzipped tar of the three members, in this order.
  tar "${tarflags[@]}" -C "$dir" -cf - ./debian-binary ./data.tar.gz ./control.tar.gz | gzip -9n \
    > "$out/imgate_${version}_${arch}.ipk"
  echo "$out/imgate_${version}_${arch}.ipk"
}

deb_list=() ipk_list=()
[ "$only" = ipk ] || deb_list=("${deb_arches[@]}")
[ "$only" = deb ] || ipk_list=(aarch64_cortex-a53 aarch64_generic arm_cortex-a7_neon-vfpv4 mipsel_24kc mips_24kc x86_64)
# Every binary is looked for before anything is built: a missing one names itself and nothing
# is written, rather than a package without its binary.
declare -A looked=()
missing=0
for a in "${deb_list[@]}" "${ipk_list[@]}"; do
  t=$(rust_target "$a")
  [ -z "${looked[$t]:-}" ] || continue
  looked[$t]=1
  binary "$a" >/dev/null || missing=1
done
[ "$missing" = 0 ] || exit 1

built=()
for a in "${deb_list[@]}"; do pkg=$(build_deb "$a"); built+=("$pkg"); done
for a in "${ipk_list[@]}"; do pkg=$(build_ipk "$a"); built+=("$pkg"); done
(cd "$out" && sha256sum -- "${built[@]##*/}" > SHA256SUMS)
for f in "${built[@]}"; do printf '%s: %s bytes\n' "$f" "$(stat -c %s "$f")"; done
echo "$out/SHA256SUMS"
