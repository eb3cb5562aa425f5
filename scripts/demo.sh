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
# build/moe_lm_metrics.jsonl.i (one JSON object per step). Checkpoints go to build/moe_lm_ckpt every
# 300 steps (a folder from an earlier run is moved aside to build/moe_lm_ckpt.old-<time>, unless
# --resume continues it); then
#   build/bin/strata generate --checkpoint build/moe_lm_ckpt --prompt "The meaning of life is"
# continues a prompt from the newest.
# Environment: as scripts/build.sh (STRATA_BUILD_DIR, STRATA_CMAKE_ARGS, STRATA_JOBS), and
# STRATA_WORKERS (default 2) workers with STRATA_WORKER_THREADS (default 1) threads each.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="${STRATA_BUILD_DIR:-build}"
scripts/build.sh strata

data=examples/moe_lm/data/fortunes.txt
[ -s "$data" ] || python3 examples/moe_lm/prepare_data.py --out "$data"

workers="${STRATA_WORKERS:-2}"
ckpt="$build_dir/moe_lm_ckpt"
resume=0
for a in "$@"; do [ "$a" = --resume ] && resume=1; done
if [ -e "$ckpt" ] && [ "$resume" = 0 ]; then
  old="$ckpt.old-$(date +%Y%m%d-%H%M%S)"
  mv "$ckpt" "$old"
  echo "demo: moved the checkpoints of an earlier run to $old"
fi
exec "$build_dir/bin/strata" launch --config examples/moe_lm/config.textproto \
  --workers "$workers" --max-workers "$((workers + 1))" --threads "${STRATA_WORKER_THREADS:-1}" \
  --metrics-out "$build_dir/moe_lm_metrics.jsonl" \
  --checkpoint-dir "$ckpt" --checkpoint-every 300 "$@"
