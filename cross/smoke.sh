#!/usr/bin/env bash
# Runs a cross-built imgate under qemu-user: --version, check on the example config, then
# `imgate run` serving the Card and accepting a webhook POST on loopback.
#
#   cross/smoke.sh [--install] TARGET     (after cross/build.sh TARGET)
#
# --install adds qemu-user-static (and the armhf C library for the glibc target) from Debian.
set -euo pipefail
cd "$(dirname "$0")/.."

install=0
if [ "${1:-}" = "--install" ]; then install=1; shift; fi
t="${1:?usage: cross/smoke.sh [--install] TARGET}"
bin="dist/imgate-$t"
[ -x "$bin" ] || { echo "smoke: $bin missing; run cross/build.sh $t first" >&2; exit 1; }

case "$t" in
  aarch64-*) qemu=(qemu-aarch64-static); pkgs=(qemu-user-static) ;;
  armv7-*gnueabihf) qemu=(qemu-arm-static -L /usr/arm-linux-gnueabihf); pkgs=(qemu-user-static libc6-armhf-cross) ;;
  armv7-*musleabihf) qemu=(qemu-arm-static); pkgs=(qemu-user-static) ;;
  x86_64-*) qemu=(); pkgs=() ;;
  *) echo "smoke: unknown target $t" >&2; exit 1 ;;
esac
if [ "$install" = 1 ] && [ ${#pkgs[@]} -gt 0 ]; then
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
run() { "${qemu[@]}" "$bin" "$@"; }

work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

echo "== $t: --version"
run --version | tee "$work/version"
grep -q '^imgate ' "$work/version"

echo "== $t: check on the example config"
run check --config systemd/imgate.conf >/dev/null

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$work/imgate.conf" <<CONF
[server]
listen = 127.0.0.1:$port
state_dir = $work/state
[webhook.smoke]
secret = smoke-secret
CONF

echo "== $t: run"
start=$(date +%s%N)
# Not through run(): $! must be the emulated process itself, so SIGTERM reaches imgate.
"${qemu[@]}" "$bin" run --config "$work/imgate.conf" 2>"$work/log" &
pid=$!
for _ in $(seq 1 200); do
  curl -fs "http://127.0.0.1:$port/connector-card.json" -o "$work/card.json" && break
  sleep 0.05
done
echo "first answer after $(( ($(date +%s%N) - start) / 1000000 )) ms (under emulation)"
grep -q '"connector_card_id":"im.imgate"' "$work/card.json" || { cat "$work/log"; exit 1; }
code=$(curl -s -o "$work/answer" -w '%{http_code}' -H 'Authorization: Bearer smoke-secret' \
  -H 'Content-Type: application/json' -d '{"message_id":"smoke-1","sender_id":"qemu","text":"hi"}' \
  "http://127.0.0.1:$port/hooks/smoke")
cat "$work/answer"; echo
[ "$code" = 202 ] || { echo "smoke: webhook answered $code" >&2; cat "$work/log"; exit 1; }
kill -TERM "$pid"
wait "$pid"
pid=
echo "== $t: smoke test passed (clean exit on SIGTERM)"
