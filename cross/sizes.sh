#!/usr/bin/env bash
# Prints the size of every binary in dist/ (full builds and the small ones --features made) and
# of every .ipk's installed files in target/dist/, as docs/boards.md's table shows them, and fails when
# a build is over its budget: the full aarch64 build 4 MiB, a full MIPS build 5 MiB, a MIPS
# build of webhooks and one provider 3 MiB (docs/boards.md, "Small builds for small flash").
#
#   cross/sizes.sh        (after cross/build.sh, and cross/package.sh for the .ipk lines)
set -euo pipefail
cd "$(dirname "$0")/.."

MiB=$((1024 * 1024))
over=0
budget_of() {
  case "$1" in
    imgate-aarch64-unknown-linux-musl) echo $((4 * MiB)) ;;
    imgate-mips*-unknown-linux-musl) echo $((5 * MiB)) ;;
    # Webhooks and one provider (a build of two or more has no budget of its own).
    imgate-mips*-unknown-linux-musl+*+*) echo "" ;;
    imgate-mips*-unknown-linux-musl+*) echo $((3 * MiB)) ;;
    *) echo "" ;;
  esac
}

printf '| binary | bytes | KiB | budget |\n| --- | ---: | ---: | --- |\n'
for f in dist/imgate-*; do
  [ -f "$f" ] || continue
  name=${f##*/}
  size=$(stat -c %s "$f")
  budget=$(budget_of "$name")
  verdict=
  if [ -n "$budget" ]; then
    verdict="≤ $((budget / MiB)) MiB"
    [ "$size" -le "$budget" ] || { verdict="$verdict: OVER by $((size - budget)) bytes"; over=1; }
  fi
  printf '| `%s` | %s | %s | %s |\n' "$name" "$size" $((size / 1024)) "$verdict"
done
for ipk in target/dist/*.ipk; do
  [ -f "$ipk" ] || continue
  installed=$(tar -xzOf "$ipk" ./control.tar.gz | tar -xzOf - ./control | sed -n 's/^Installed-Size: //p')
  printf '| `%s` installed | %s | %s | |\n' "${ipk##*/}" "$installed" $((installed / 1024))
done
[ "$over" = 0 ] || { echo "sizes: a build is over its budget" >&2; exit 1; }
