#!/usr/bin/env bash
# The GPU check: every GPU test and GPU benchmark of strata on this machine's GPU, then a short
# `strata train --device cuda` of the default example, each under a time limit, ending in one
# summary table. The tests alone (--quick) and the benchmarks alone (--benchmarks) are each meant
# to fit the default budget; everything in one call may not (a check the budget leaves out is
# SKIPPED, and counts as a failure). Runs from a source tree (after scripts/build.sh) or from
# a package made by scripts/package.sh (it sits at the package's top, beside bin/ and lib/).
#
#   scripts/gpu-check.sh [--quick | --benchmarks] [--logs DIR] [--archive FILE.tar.gz]
#                        [--budget SECONDS]
#
#   --quick      the GPU tests only
#   --benchmarks the GPU benchmarks and training runs only (a second call after --quick, with a
#                budget of its own and other --logs / --archive)
#   --logs       where each check's full output goes (default: a new folder under /tmp)
#   --archive    also pack the logs and the summary into one .tar.gz (for a machine that returns few
#                files)
#   --budget     the whole check's time limit (default 480 s); each check gets at most what is left
#
# Without a GPU (no driver, or `strata version` sees none) it says so and exits 0: nothing to check.
# Exit status: 0 when every check that ran passed, 1 otherwise, 2 on a usage error.
#
# cuBLAS, cudart and NCCL come from the machine: from a PyTorch install's nvidia-* wheels when
# there is one, else from /usr/local/cuda. The package's own libraries (gRPC, RocksDB, Gloo,
# OpenBLAS, ...) are found through the binaries' RUNPATH ($ORIGIN/../lib).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

quick=0
tests_too=1
logs=""
archive=""
budget=480
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --benchmarks) tests_too=0 ;;
    --logs) logs=${2:?--logs needs a folder}; shift ;;
    --archive) archive=${2:?--archive needs a file name}; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$quick" = 1 ] && [ "$tests_too" = 0 ]; then
  echo "gpu-check: --quick (tests only) and --benchmarks (benchmarks only) exclude each other" >&2
  exit 2
fi
case "$budget" in
  ''|*[!0-9]*) echo "gpu-check: --budget wants whole seconds, not '$budget'" >&2; exit 2 ;;
esac

# Where the binaries and the examples are: a package (bin/ beside this script) or a source tree
# (this script in scripts/, binaries in the build folder).
if [ -x "$here/bin/strata" ]; then
  bin=$here/bin tests=$here/bin source=$here/share/strata
else
  source=$(cd "$here/.." && pwd)
  build=${STRATA_BUILD_DIR:-$source/build}
  bin=$build/bin tests=$build/tests
fi
if [ ! -x "$bin/strata" ]; then
  echo "gpu-check: no strata binary in $bin: build first (scripts/build.sh), or run the" \
       "gpu-check.sh of a package" >&2
  exit 2
fi
# The tests read the examples and run strata from here, not from the paths compiled into them.
export STRATA_SOURCE_DIR=$source STRATA_BIN_DIR=$bin

nvroot=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
if [ -n "$nvroot" ] && [ -d "$nvroot" ]; then
  nvlibs=$(find "$nvroot" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
  export LD_LIBRARY_PATH="${nvlibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"

version=$("$bin/strata" version 2>&1)
gpus=$(echo "$version" | sed -n 's/.*cuda: \([0-9]*\) GPU(s).*/\1/p')
if [ -z "$gpus" ] || [ "$gpus" = 0 ]; then
  echo "gpu-check: no GPU here ($(echo "$version" | head -1)); nothing to check"
  exit 0
fi

[ -n "$logs" ] || logs=$(mktemp -d /tmp/strata-gpu-check.XXXXXX)
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)  # the checks run in it: paths into it must not be relative
summary=$logs/summary.md
started=$(date +%s)
failed=0
rows=()

gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)
echo "gpu-check: $(echo "$gpu" | head -1)"
echo "$version" | sed 's/^/gpu-check: /'
echo "gpu-check: logs in $logs"

# run NAME LIMIT COMMAND...: runs one check under min(LIMIT, what is left of the budget).
run() {
  local name=$1 limit=$2; shift 2
  local left=$((budget - ($(date +%s) - started)))
  if [ "$left" -lt 10 ]; then
    rows+=("| $name | SKIPPED | the budget of ${budget} s is spent | 0 |")
    failed=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc secs detail result
  t0=$(date +%s)
  # In the logs folder: whatever a check writes to its working folder stays with its log.
  (cd "$logs" && exec timeout --kill-after=10 "$limit" "$@") > "$logs/$name.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - t0))
  # gtest's closing lines: "[  PASSED  ] N tests.", "[  SKIPPED ] N tests, listed below:", ...
  local passed skipped failed_tests
  count() { sed -n "s/^\\[  $1 *\\] \\([0-9]*\\) tests\\{0,1\\}$2.*/\\1/p" "$logs/$name.log" | tail -1; }
  passed=$(count PASSED '\.')
  skipped=$(count SKIPPED ', listed below')
  failed_tests=$(count FAILED ', listed below')
  detail=""
  [ -n "$passed" ] && detail="$passed passed"
  [ -n "$failed_tests" ] && detail="${detail:+$detail, }$failed_tests failed"
  [ -n "$skipped" ] && detail="${detail:+$detail, }$skipped skipped"
  if [ "$rc" = 0 ] && [ "$passed" = 0 ]; then
    # A filter that matched nothing (gtest exits 0 having checked nothing), or every test skipped
    # on a machine that has a GPU (the binary found no CUDA device: a library path?).
    result=FAIL detail="${skipped:+$skipped skipped, }no test passed"
    failed=1
  elif [ "$rc" = 0 ]; then
    result=PASS
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    result=TIMEOUT detail="${detail:+$detail, }killed after ${limit} s"
    failed=1
  else
    result=FAIL detail="${detail:+$detail, }exit $rc"
    failed=1
  fi
  rows+=("| $name | $result | ${detail:-exit 0} | $secs |")
  echo "gpu-check: $name: $result (${secs} s)"
}

if [ "$tests_too" = 1 ]; then
  # Every GPU test: the gpu-labelled suites, NCCL's and staging's (nccl_test), and data
  # parallelism's GPU buckets.
  for t in cuda_ops_test moe_layer_gpu_test model_gpu_test train_gpu_test tiered_store_gpu_test \
           tiered_training_gpu_test \
           nccl_test data_parallel_test; do
    if [ -x "$tests/$t" ]; then
      run "$t" 180 "$tests/$t"
    else
      rows+=("| $t | MISSING | not in $tests | 0 |")
      failed=1
    fi
  done
  # Workers with their models on the GPU (here all on one GPU, exchanging through page-locked host
  # memory): against one GPU process in six layouts, and an elastic job with a worker SIGKILLed
  # and a joiner, against its failure-free replay.
  run distributed_gpu 240 "$tests/distributed_test" --gtest_filter='*/DistributedGpuTest.*'
  run elastic_gpu 180 "$tests/elastic_test" --gtest_filter='ElasticTest.GpuWorkers*'
fi

if [ "$quick" = 0 ]; then
  # The GPU benchmarks: they check their own results and exit 1 on a wrong one.
  for b in bench_moe_gpu bench_tier_gpu; do
    if [ -x "$bin/$b" ]; then
      run "$b" 240 "$bin/$b" $([ "$b" = bench_moe_gpu ] && echo --iters 10 --warmup 2)
    else
      rows+=("| $b | MISSING | not in $bin | 0 |")
      failed=1
    fi
  done
  # The MoE layer in mixed precision: bf16 GEMMs on the experts' compute copies.
  [ -x "$bin/bench_moe_gpu" ] &&
    run "bench_moe_gpu_bf16" 180 "$bin/bench_moe_gpu" --bf16 --iters 10 --warmup 2
  # CPU against GPU side by side on the default example, free and synced (docs/gpu.md, Parity).
  if [ -x "$bin/bench_parity" ]; then
    cfg=$source/examples/moe_lm/config.textproto
    run "parity_free" 90 "$bin/bench_parity" --config "$cfg" --steps 30
    run "parity_sync" 90 "$bin/bench_parity" --config "$cfg" --steps 30 --sync
    run "parity_sync_bf16" 90 "$bin/bench_parity" --config "$cfg" --steps 30 --sync --bf16 \
      --tol 1e-3
  fi
  # Generation on the GPU: prefill and decode through the KV cache in HBM, in memory and with the
  # experts offloaded to a ring of HBM slots (docs/inference.md); it checks nothing itself, the
  # decode tests above do.
  if [ -x "$bin/bench_generate" ]; then
    run "bench_generate" 240 "$bin/bench_generate" --device cuda --rounds 1 --train-steps 10 \
      --config "$source/examples/moe_lm/config.textproto" \
      --config "$source/examples/larger_than_memory/config.textproto"
  fi
  # Experts in the tiered store with the model on the GPU, against in-memory GPU training in the
  # same run, bounded by compute, the SSD and the host<->device link (docs/gpu.md); then
  # larger_than_gpu at a quarter of its size (20 GiB of expert state from 5.5 GiB of HBM and 8 GiB
  # of page-locked host memory), its step time against its I/O bound. fio where it is installed.
  nofio=$(command -v fio > /dev/null || echo --no-fio)
  if [ -x "$bin/bench_out_of_core" ]; then
    run "out_of_core_gpu" 150 "$bin/bench_out_of_core" --device cuda --rounds 1 $nofio
    ltg=$source/examples/larger_than_gpu
    if python3 "$ltg/scale.py" 0.25 > "$logs/ltg-0.25.textproto" 2> "$logs/scale.log"; then
      run "larger_than_gpu_0.25" 150 "$bin/bench_out_of_core" --device cuda \
        --config "$logs/ltg-0.25.textproto" --warmup 1 --steps 2 --rounds 1 $nofio
    else
      rows+=("| larger_than_gpu_0.25 | FAIL | scale.py: $(head -c 200 "$logs/scale.log") | 0 |")
      failed=1
    fi
  fi
  # End to end: tokens/s and model FLOP utilization against cuBLAS's dense bf16 rate in the same
  # run, for the default example and examples/gpu_moe (2.3 B parameters).
  if [ -x "$bin/bench_train" ]; then
    run "bench_train" 180 "$bin/bench_train" --device cuda \
      --config "$source/examples/moe_lm/config.textproto" \
      --config "$source/examples/gpu_moe/config.textproto"
  fi
  # The default example on the GPU: 300 steps in its default precision (bf16 GEMMs) and in fp32,
  # each's median tokens/s from its metrics.
  for p in bf16 fp32; do
    run "train_cuda_$p" 120 "$bin/strata" train --config \
      "$source/examples/moe_lm/config.textproto" --device cuda --precision "$p" --steps 300 \
      --quiet --metrics-out "$logs/train_cuda_$p.jsonl"
    if [ -s "$logs/train_cuda_$p.jsonl" ]; then
      tps=$(sed -n 's/.*"tokens_per_s":\([0-9.]*\).*/\1/p' "$logs/train_cuda_$p.jsonl" |
            sort -n | awk '{v[NR]=$1} END {if (NR) printf "%.0f", v[int((NR+1)/2)]}')
      last=${#rows[@]}
      rows[last-1]=$(echo "${rows[last-1]}" | sed "s/| exit 0 |/| median ${tps} tok\/s |/")
    fi
  done
fi

total=$(($(date +%s) - started))
{
  echo "| check | result | detail | seconds |"
  echo "|---|---|---|---:|"
  printf '%s\n' "${rows[@]}"
  echo "| all | $([ "$failed" = 0 ] && echo PASS || echo FAIL) | budget ${budget} s | $total |"
} > "$summary"
echo
cat "$summary"
if [ -n "$archive" ]; then
  tar -C "$logs" -czf "$archive" . && echo "gpu-check: logs and summary packed into $archive"
fi
exit "$failed"
