#!/usr/bin/env bash
# Installs what is missing and builds strata (Release) into build/.
#
#   scripts/build.sh                everything: library, `strata`, tests, benchmarks, examples
#   scripts/build.sh strata         only the named CMake targets
#
# Environment: STRATA_BUILD_DIR (default build), STRATA_CMAKE_ARGS (extra configure flags, e.g.
# -DSTRATA_WERROR=ON or -DSTRATA_CUDA=OFF), STRATA_JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="${STRATA_BUILD_DIR:-build}"
jobs="${STRATA_JOBS:-$(nproc)}"

scripts/install-deps.sh
# shellcheck disable=SC2086  # STRATA_CMAKE_ARGS is a list of flags
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release ${STRATA_CMAKE_ARGS:-}
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j"$jobs" "${targets[@]}"
