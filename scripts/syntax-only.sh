#!/usr/bin/env bash
# A compiler launcher (CMAKE_CXX_COMPILER_LAUNCHER) for builds that only check the code, such as
# scripts/check-locking.sh's: runs `COMPILER ARGS...` with -fsyntax-only, then writes an empty
# object where ARGS asked for one (-o OBJECT), so archives still build. Nothing built this way
# can be linked into a working program.
set -euo pipefail
out=""
args=("$@")
for ((i = 0; i < ${#args[@]} - 1; ++i)); do
  if [ "${args[i]}" = "-o" ]; then out=${args[i + 1]}; fi
done
"$@" -fsyntax-only
if [ -n "$out" ]; then "$1" -c -x c++ /dev/null -o "$out"; fi
