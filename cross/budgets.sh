#!/usr/bin/env bash
# Prints the edge budgets (binary size, peak RSS idle, with a 50 MiB backlog and at the largest
# backlog the default caps allow, cold start to READY) of the x86_64 musl build;
# docs/benchmarks.md shows the latest figures.
#
#   cross/budgets.sh [--install]
set -euo pipefail
cd "$(dirname "$0")/.."
bash cross/build.sh "$@" x86_64-unknown-linux-musl
IMGATE_BIN="$PWD/dist/imgate-x86_64-unknown-linux-musl" \
  cargo test --release --test budgets -- --ignored --nocapture
