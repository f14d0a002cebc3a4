#!/usr/bin/env bash
# Runs a cross-built imgate under qemu-user with the board's CPU model: --version, check on the
# example config, then `imgate run` serving the Card, accepting a webhook POST on loopback and
# stopping cleanly on SIGTERM. Then the same with the clock set to 2040 (libfaketime under the
# dynamic qemu): a 64-bit build serves as before; a 32-bit musl build refuses to start with its
# reason (docs/boards.md, "Dates past 2038") rather than abort.
#
#   cross/smoke.sh [--install] TARGET [BINARY]     (after cross/build.sh TARGET)
#
# BINARY defaults to dist/imgate-TARGET. --install adds qemu-user-static, qemu-user and faketime
# (and the armhf C library for the glibc target) from Debian.
set -euo pipefail
cd "$(dirname "$0")/.."

install=0
if [ "${1:-}" = "--install" ]; then install=1; shift; fi
t="${1:?usage: cross/smoke.sh [--install] TARGET [BINARY]}"
bin="${2:-dist/imgate-$t}"
[ -x "$bin" ] || { echo "smoke: $bin missing; run cross/build.sh $t first" >&2; exit 1; }

# qemu's binary name, the CPU model of the oldest board the build is for, and whether std
# reads the clock with a 32-bit time_t there.
time32=0
case "$t" in
  aarch64-*) arch=aarch64; cpu=(-cpu cortex-a53) ;;
  armv7-*gnueabihf) arch=arm; cpu=(-cpu cortex-a7 -L /usr/arm-linux-gnueabihf) ;;
  armv7-*musleabihf) arch=arm; cpu=(-cpu cortex-a7); time32=1 ;;
  arm-*musleabihf) arch=arm; cpu=(-cpu arm1176); time32=1 ;;
  mipsel-*) arch=mipsel; cpu=(-cpu 24Kc); time32=1 ;;
  mips-*) arch=mips; cpu=(-cpu 24Kc); time32=1 ;;
  riscv64*) arch=riscv64; cpu=(-cpu rv64) ;;
  x86_64-*) arch=x86_64; cpu=() ;;
  *) echo "smoke: unknown target $t" >&2; exit 1 ;;
esac
if [ "$install" = 1 ]; then
  pkgs=(qemu-user-static qemu-user faketime)
  case "$t" in *gnueabihf) pkgs+=(libc6-armhf-cross) ;; esac
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
# The static qemu for today; x86_64 runs natively.
if [ "$arch" = x86_64 ]; then today=(); else today=("qemu-$arch-static" "${cpu[@]}"); fi
# 2040: libfaketime cannot reach into a static binary, but it can into the dynamic qemu, whose
# clock reads are the guest's. The monotonic clock stays real, as on a board booted in 2040.
# Preloaded by env (which execs), not by the faketime command (which forks: SIGTERM would stop
# there); -U keeps it out of the guest's environment. UTC, and no JOURNAL_STREAM, so the log
# lines start with the date 2040-03-01.
fake=$(dpkg -L libfaketime 2>/dev/null | grep '/libfaketime\.so\.1$' | head -n 1 || true)
[ -n "$fake" ] || { echo "smoke: libfaketime missing; run with --install" >&2; exit 1; }
dynamic_qemu=$(command -v "qemu-$arch" || true)
{ [ -n "$dynamic_qemu" ] && readelf -l "$dynamic_qemu" | grep -q 'program interpreter'; } ||
  { echo "smoke: no dynamically linked qemu-$arch (Debian's qemu-user) for libfaketime to reach" >&2; exit 1; }
in_2040=(env -u JOURNAL_STREAM TZ=UTC "LD_PRELOAD=$fake" "FAKETIME=@2040-03-01 12:00:00" DONT_FAKE_MONOTONIC=1
  "$dynamic_qemu" -U LD_PRELOAD "${cpu[@]}")

work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

echo "== $t: --version"
"${today[@]}" "$bin" --version | tee "$work/version"
grep -q '^imgate ' "$work/version"

echo "== $t: check on the example config"
"${today[@]}" "$bin" check --config systemd/imgate.conf >/dev/null

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$work/imgate.conf" <<CONF
[server]
listen = 127.0.0.1:$port
state_dir = $work/state
[webhook.smoke]
secret = smoke-secret
CONF

# serve LABEL COMMAND...: runs imgate, takes a webhook, stops it with SIGTERM.
serve() {
  local label="$1" start code; shift
  echo "== $t: run ($label)"
  start=$(date +%s%N)
  # Not through a subshell: $! must be the emulated process itself (env execs it), so SIGTERM
  # reaches imgate.
  "$@" "$bin" run --config "$work/imgate.conf" 2>"$work/log" &
  pid=$!
  for _ in $(seq 1 200); do
    curl -fs "http://127.0.0.1:$port/connector-card.json" -o "$work/card.json" && break
    sleep 0.05
  done
  echo "first answer after $(( ($(date +%s%N) - start) / 1000000 )) ms (under emulation)"
  grep -q '"connector_card_id":"im.imgate"' "$work/card.json" || { cat "$work/log"; exit 1; }
  code=$(curl -s -o "$work/answer" -w '%{http_code}' -H 'Authorization: Bearer smoke-secret' \
    -H 'Content-Type: application/json' -d "{\"message_id\":\"smoke-$label\",\"sender_id\":\"qemu\",\"text\":\"hi\"}" \
    "http://127.0.0.1:$port/hooks/smoke")
  cat "$work/answer"; echo
  [ "$code" = 202 ] || { echo "smoke: webhook answered $code" >&2; cat "$work/log"; exit 1; }
  kill -TERM "$pid"
  wait "$pid"
  pid=
  grep -q "stopped cleanly" "$work/log" || { echo "smoke: no clean stop" >&2; cat "$work/log"; exit 1; }
  rm -f "$work/card.json"
}

serve today "${today[@]}"

if [ "$time32" = 1 ]; then
  echo "== $t: run (2040): a 32-bit build refuses with its reason"
  rc=0
  timeout 60 "${in_2040[@]}" "$bin" run --config "$work/imgate.conf" 2>"$work/log" || rc=$?
  cat "$work/log"
  [ "$rc" = 1 ] && grep -q "past 2038-01-19 03:14:07 UTC" "$work/log" && ! grep -q panicked "$work/log" \
    || { echo "smoke: expected a refusal (exit 1) in 2040, got exit $rc" >&2; exit 1; }
else
  serve 2040 "${in_2040[@]}"
  grep -q '^\[2040-03-01' "$work/log" || { echo "smoke: the 2040 run did not log 2040" >&2; cat "$work/log"; exit 1; }
fi
echo "== $t: smoke test passed (clean exit on SIGTERM; 2040 as expected)"
