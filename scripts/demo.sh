#!/usr/bin/env bash
# Installs what is missing, builds strata (Release), prepares the default example's corpus and
# trains the default example — a byte-level MoE language model on English text — through the
# coordinator, with several local workers (`strata launch`).
#
#   scripts/demo.sh                 2 workers (room for a third to join)
#   scripts/demo.sh --steps 200     any `strata launch` flags pass through
#
# While it runs, kill a worker (pkill -KILL -f 'id [w]orker-1') and the others carry on; add one
# with the command the launch prints ("add a worker: ..."). Each worker i writes its metrics to
# build/moe_lm_metrics.jsonl.i (one JSON object per step).
# Environment: as scripts/build.sh (STRATA_BUILD_DIR, STRATA_CMAKE_ARGS, STRATA_JOBS), and
# STRATA_WORKERS (default 2) workers with STRATA_WORKER_THREADS (default 1) threads each.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="${STRATA_BUILD_DIR:-build}"
scripts/build.sh strata

data=examples/moe_lm/data/fortunes.txt
[ -s "$data" ] || python3 examples/moe_lm/prepare_data.py --out "$data"

workers="${STRATA_WORKERS:-2}"
exec "$build_dir/bin/strata" launch --config examples/moe_lm/config.textproto \
  --workers "$workers" --max-workers "$((workers + 1))" --threads "${STRATA_WORKER_THREADS:-1}" \
  --metrics-out "$build_dir/moe_lm_metrics.jsonl" "$@"
