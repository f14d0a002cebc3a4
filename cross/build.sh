#!/usr/bin/env bash
# Builds stripped release binaries of imgate for edge boards into dist/.
#
#   cross/build.sh [--install] [TARGET...]
#
# Targets (default: the three static ones the packages carry):
#   aarch64-unknown-linux-musl      Raspberry Pi 3/4/5 with a 64-bit OS, most current routers
#   armv7-unknown-linux-musleabihf  32-bit Raspberry Pi OS (Pi 2/3/4), ARMv7 OpenWrt routers
#   x86_64-unknown-linux-musl       x86 mini PCs, VMs, any x86_64 Linux
#   armv7-unknown-linux-gnueabihf   the same boards as armv7 musl, linked to glibc >= 2.28
#
# Uses cargo-zigbuild with zig from PyPI as the cross linker (no system cross gcc needed).
# --install adds what is missing: the rustup targets (rust-src for armv7 musl), and
# ziglang + cargo-zigbuild from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

install=0
targets=()
for a in "$@"; do
  case "$a" in
    --install) install=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) targets+=("$a") ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf x86_64-unknown-linux-musl)

# Rust serves no prebuilt standard library for armv7 musl: it is built from rust-src.
from_source() { [ "$1" = armv7-unknown-linux-musleabihf ]; }

if [ "$install" = 1 ]; then
  for t in "${targets[@]}"; do
    if from_source "$t"; then rustup component add rust-src; else rustup target add "$t"; fi
  done
  if ! command -v cargo-zigbuild >/dev/null 2>&1 || ! python3 -c 'import ziglang' 2>/dev/null; then
    python3 -m pip install --quiet ziglang cargo-zigbuild
  fi
fi
command -v cargo-zigbuild >/dev/null || { echo "cross: cargo-zigbuild missing; run with --install" >&2; exit 1; }

mkdir -p dist
for t in "${targets[@]}"; do
  case "$t" in
    # Pin an old glibc so the binary runs on older Raspberry Pi OS releases too.
    *-gnueabihf) zt="$t.2.28" ;;
    *) zt="$t" ;;
  esac
  echo "== building $t"
  if from_source "$t"; then
    # -Zbuild-std is unstable: RUSTC_BOOTSTRAP lets this stable toolchain use it for this one
    # build. zig brings musl's C runtime, which the target's rust-std would otherwise ship.
    CARGO_TARGET_ARMV7_UNKNOWN_LINUX_MUSLEABIHF_RUSTFLAGS="-C link-self-contained=no" \
      RUSTC_BOOTSTRAP=1 cargo zigbuild --release --locked --target "$zt" -Zbuild-std=std,panic_abort
  else
    cargo zigbuild --release --locked --target "$zt"
  fi
  cp "target/$t/release/imgate" "dist/imgate-$t"
  size=$(stat -c %s "dist/imgate-$t")
  printf '%s: %s bytes (%s KiB)\n' "dist/imgate-$t" "$size" $((size / 1024))
done
