#!/usr/bin/env bash
# The locking check: builds the libraries whose locks carry Abseil's thread-safety annotations
# (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED, ...) with clang's -Wthread-safety as an error,
# so that a member read without its mutex, a *Locked function called without the lock, or a lock
# taken in the wrong order fails the build. GCC ignores the annotations; this is the build that
# reads them. CPU only, and no code is generated (the analysis needs none).
#
#   scripts/check-locking.sh        (from anywhere; STRATA_LOCKING_BUILD_DIR, default build-locking)
#
# Exits 0 when every annotated library compiles without a thread-safety warning.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${STRATA_LOCKING_BUILD_DIR:-build-locking}
command -v clang++ > /dev/null || { echo "check-locking: needs clang++ (apt-get install clang)" >&2; exit 1; }
mkdir -p "$dir"
# The analysis is part of clang's semantic analysis: files are compiled with -fsyntax-only (about
# a third faster than making code) and empty objects stand in (scripts/syntax-only.sh); the
# libraries are archives, nothing links them.
cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$PWD/scripts/syntax-only.sh" \
  -DSTRATA_CUDA=OFF -DSTRATA_NATIVE=OFF -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF \
  -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety" > "$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log" >&2; exit 1; }
# strata_coordinator links (and so builds) every annotated library below it: storage, checkpoint,
# train; strata_web (the run board) is beside them.
cmake --build "$dir" -j"${STRATA_JOBS:-$(nproc)}" --target strata_coordinator strata_web
echo "check-locking: the annotated libraries build with -Wthread-safety, no warning"
