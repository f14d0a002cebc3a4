#!/usr/bin/env bash
# Runs each cargo-fuzz target for a bounded time, starting from the committed corpus.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
#
# CI runs `fuzz/run.sh 20` (every target, 20 s each); before a release, run an hour or more
# per target: `fuzz/run.sh 3600`. New interesting inputs go to a scratch directory, so the
# committed corpus only changes when you merge them in on purpose (README "Fuzzing").
# A crash or a hang over 10 s fails the run; the input is left in fuzz/artifacts/TARGET/ and
# printed in hex, so a CI log is enough to reproduce it.
set -euo pipefail
cd "$(dirname "$0")"

secs=${1:-20}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(packet webhook multipart config request_head telegram_update connection outbox_log feishu_frame feishu_longconn feishu_event wechat_update slack_frame discord_frame dingtalk_frame wecom_frame matrix_sync)

command -v cargo-fuzz >/dev/null || {
  echo "== cargo install cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
}

# libFuzzer with AddressSanitizer wants the nightly toolchain. Without one, fuzz on stable with
# no sanitizer: imgate has no unsafe code of its own, and coverage guidance still works.
if rustup run nightly rustc --version >/dev/null 2>&1; then
  fuzz=(cargo +nightly fuzz)
  sanitizer=address
else
  fuzz=(env RUSTC_BOOTSTRAP=1 cargo fuzz)
  sanitizer=none
fi
opts=(--sanitizer "$sanitizer" --target-dir ../target/fuzz)

echo "== cargo fuzz build (sanitizer: $sanitizer)"
"${fuzz[@]}" build "${opts[@]}"

for t in "${targets[@]}"; do
  scratch=$(mktemp -d)
  echo "== fuzz $t for ${secs}s ($(ls corpus/"$t" | wc -l) corpus inputs)"
  if ! "${fuzz[@]}" run "${opts[@]}" "$t" "$scratch" "corpus/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>"$scratch.log"; then
    tail -40 "$scratch.log"
    for f in artifacts/"$t"/*; do
      [ -f "$f" ] && { echo "-- $f"; od -A d -t x1z "$f" | head -40; }
    done
    echo "fuzz: target $t failed" >&2
    exit 1
  fi
  grep -E '^stat::number_of_executed_units|^#[0-9]+ +DONE' "$scratch.log" | tail -2
  # libFuzzer copies every input that adds coverage to the first directory, including corpus
  # inputs it loaded; count only those whose content is not in the corpus yet.
  hashes() { find "$1" -type f -exec sha1sum {} + | cut -d' ' -f1 | sort -u; }
  fresh=$(comm -13 <(hashes "corpus/$t") <(hashes "$scratch") | wc -l)
  echo "inputs with new coverage, not in the corpus: $fresh"
  rm -rf "$scratch" "$scratch.log"
done
echo "fuzz: all targets ran clean"
