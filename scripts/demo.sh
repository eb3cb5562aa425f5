#!/usr/bin/env bash
# Installs what is missing, builds strata (Release), prepares the default example's corpus and
# trains the default example: a byte-level MoE language model on English text.
#
#   scripts/demo.sh                 the default example
#   scripts/demo.sh --steps 200     any `strata train` flags pass through
#
# Metrics go to build/moe_lm_metrics.jsonl (one JSON object per step).
# Environment: as scripts/build.sh (STRATA_BUILD_DIR, STRATA_CMAKE_ARGS, STRATA_JOBS).
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="${STRATA_BUILD_DIR:-build}"
scripts/build.sh strata

data=examples/moe_lm/data/fortunes.txt
[ -s "$data" ] || python3 examples/moe_lm/prepare_data.py --out "$data"

exec "$build_dir/bin/strata" train --config examples/moe_lm/config.textproto \
  --metrics-out "$build_dir/moe_lm_metrics.jsonl" "$@"
