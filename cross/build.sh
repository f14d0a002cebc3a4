#!/usr/bin/env bash
# Builds stripped release binaries of imgate for edge boards into dist/.
#
#   cross/build.sh [--install] [--features LIST] [TARGET...]
#
# Targets (default: the seven static ones the packages carry):
#   aarch64-unknown-linux-musl      Raspberry Pi 3/4/5 with a 64-bit OS, most current routers
#   armv7-unknown-linux-musleabihf  ARMv7 OpenWrt routers (arm_cortex-a7_neon-vfpv4)
#   arm-unknown-linux-musleabihf    ARMv6 hard-float: every Pi with 32-bit Raspberry Pi OS,
#                                   Pi Zero and Pi 1 included (the armhf .deb)
#   mipsel-unknown-linux-musl       MIPS little-endian routers (ramips/mt7621: mipsel_24kc)
#   mips-unknown-linux-musl         MIPS big-endian routers (ath79: mips_24kc)
#   riscv64gc-unknown-linux-musl    RISC-V 64-bit boards
#   x86_64-unknown-linux-musl       x86 mini PCs, VMs, any x86_64 Linux
#   armv7-unknown-linux-gnueabihf   (on request) ARMv7 linked to glibc >= 2.28
#
# --features LIST builds only the webhook provider and the ones listed (comma-separated, e.g.
# telegram,wechat; empty for webhooks alone), into dist/imgate-TARGET+telegram+wechat.
# Uses cargo-zigbuild with zig from PyPI as the cross linker (no system cross gcc needed).
# --install adds what is missing: the rustup targets (rust-src for the targets built from
# source), and ziglang + cargo-zigbuild from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

install=0
features=
minimal=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --install) install=1 ;;
    --features) minimal=1; features="${2?--features needs a list}"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=(aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf
  arm-unknown-linux-musleabihf mipsel-unknown-linux-musl mips-unknown-linux-musl
  riscv64gc-unknown-linux-musl x86_64-unknown-linux-musl)

# These build their standard library from rust-src: the MIPS targets have no prebuilt one
# (tier 3), the registry here answers 404 for the others' (ARMv6, ARMv7, RISC-V musl), and a
# std of our own can leave out unwind tables and the backtrace printer.
from_source() {
  case "$1" in
    armv7-unknown-linux-musleabihf | arm-unknown-linux-musleabihf | mips*-unknown-linux-musl | riscv64gc-unknown-linux-musl) return 0 ;;
    *) return 1 ;;
  esac
}

if [ "$install" = 1 ]; then
  for t in "${targets[@]}"; do
    if from_source "$t"; then rustup component add rust-src; else rustup target add "$t"; fi
  done
  if ! command -v cargo-zigbuild >/dev/null 2>&1 || ! python3 -c 'import ziglang' 2>/dev/null; then
    python3 -m pip install --quiet ziglang cargo-zigbuild
  fi
fi
command -v cargo-zigbuild >/dev/null || { echo "cross: cargo-zigbuild missing; run with --install" >&2; exit 1; }

feature_args=()
suffix=
if [ "$minimal" = 1 ]; then
  # A small build is for small flash: redb at opt-level z too (263 KB less on mipsel; the full
  # builds keep it at 3, Cargo.toml says why).
  feature_args=(--no-default-features --features "$features" --config 'profile.release.package.redb.opt-level="z"')
  suffix=$(printf '%s' "$features" | tr -s ', ' '++' | sed 's/^+*//; s/+*$//')
  suffix="+${suffix:-webhook}"
fi

mkdir -p dist
for t in "${targets[@]}"; do
  case "$t" in
    # Pin an old glibc so the binary runs on older Raspberry Pi OS releases too.
    *-gnueabihf) zt="$t.2.28" ;;
    *) zt="$t" ;;
  esac
  echo "== building $t ${feature_args[*]}"
  if from_source "$t"; then
    # zig brings musl's C runtime, which the target's rust-std would otherwise ship. MIPS and
    # RISC-V default to a static-pie that crashed under qemu on `run`: link plainly static.
    # Without unwind tables and std's backtrace printer (panics abort, and a stripped binary's
    # backtrace names no function anyway): 515 KB less on mipsel. MIPS code that is not
    # position-independent: 599 KB less.
    flags="-C link-self-contained=no -C force-unwind-tables=no"
    case "$t" in mips* | riscv*) flags="$flags -C target-feature=+crt-static" ;; esac
    case "$t" in mips*) flags="$flags -C relocation-model=static" ;; esac
    # A small build is for small flash, and trades what a panic says for 300 KB on mipsel: a
    # panic aborts at once, with no message and no place (they print nothing to read; a full
    # build prints both), and std picks its smaller algorithms.
    std_features=
    if [ "$minimal" = 1 ]; then
      flags="$flags -Zunstable-options -C panic=immediate-abort -Z location-detail=none"
      std_features=optimize_for_size
    fi
    var="CARGO_TARGET_$(printf '%s' "$t" | tr 'a-z-' 'A-Z_')_RUSTFLAGS"
    # -Zbuild-std is unstable: RUSTC_BOOTSTRAP lets this stable toolchain use it for this one
    # build. -Zbuild-std-features without `backtrace` leaves out std's default one.
    env "$var=$flags" RUSTC_BOOTSTRAP=1 cargo zigbuild --release --locked --target "$zt" \
      "${feature_args[@]}" -Zbuild-std=std,panic_abort -Zbuild-std-features=$std_features
  else
    cargo zigbuild --release --locked --target "$zt" "${feature_args[@]}"
  fi
  out="dist/imgate-$t$suffix"
  cp "target/$t/release/imgate" "$out"
  size=$(stat -c %s "$out")
  printf '%s: %s bytes (%s KiB)\n' "$out" "$size" $((size / 1024))
done
