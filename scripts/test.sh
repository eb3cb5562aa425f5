#!/usr/bin/env bash
# Installs what is missing, builds strata (Release), and runs the whole test suite with ctest.
#
#   scripts/test.sh                 everything
#   scripts/test.sh -R Moe          only tests whose name matches (any ctest arguments pass through)
#
# Environment: as scripts/build.sh (STRATA_BUILD_DIR, STRATA_CMAKE_ARGS, STRATA_JOBS).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/build.sh
ctest --test-dir "${STRATA_BUILD_DIR:-build}" --output-on-failure -j"${STRATA_JOBS:-$(nproc)}" "$@"
