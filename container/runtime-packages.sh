#!/usr/bin/env bash
# Prints, one per line, the Debian packages an installed strata needs at run time: the packages
# that hold the shared libraries its programs and libstrata.so load (ldd, then dpkg -S), plus
# gnuplot-nox for `strata plot` and tini (the image's process 1, which hands signals on). Run it where strata was built (the -dev packages pull in the
# runtime ones it names). Libraries from outside Debian's packages (the CUDA toolkit under
# /usr/local/cuda) are left out; --foreign prints their paths instead of the packages.
#
#   container/runtime-packages.sh [--foreign] PREFIX      (PREFIX: what `cmake --install` wrote)
set -euo pipefail
foreign=0
if [ "${1:-}" = "--foreign" ]; then foreign=1; shift; fi
prefix=${1:?usage: runtime-packages.sh [--foreign] PREFIX (the folder cmake --install wrote)}
[ -x "$prefix/bin/strata" ] || { echo "runtime-packages.sh: no $prefix/bin/strata" >&2; exit 2; }
files=("$prefix/bin/strata")
for f in "$prefix"/lib/libstrata.so*; do [ -f "$f" ] && files+=("$f"); done
declare -A packages=([gnuplot-nox]=1 [tini]=1) others=()
for f in "${files[@]}"; do
  # ldd's whole output first (under pipefail a reader that stops early kills ldd with SIGPIPE).
  libs=$(ldd "$f")
  if grep -q "not found" <<<"$libs"; then
    echo "runtime-packages.sh: $f needs libraries this machine lacks:" >&2
    grep "not found" <<<"$libs" >&2
    exit 1
  fi
  while read -r lib; do
    case "$lib" in "$prefix"/*) continue ;; esac  # strata's own
    real=$(readlink -f "$lib")
    # /lib is /usr/lib on Debian 12 (merged /usr); dpkg knows one of the two names.
    # dpkg -S prints "package:arch: path" (diversions as lines of their own, left out); no owner
    # (grep finds no line: not a failure under pipefail) is a library from outside Debian.
    owner=$( (dpkg -S "$lib" 2>/dev/null || dpkg -S "$real" 2>/dev/null ||
              dpkg -S "/usr$lib" 2>/dev/null || dpkg -S "/usr$real" 2>/dev/null || true) |
            { grep -v '^diversion ' || true; } | head -n1)
    if [ -z "$owner" ]; then
      others[$lib]=1
      continue
    fi
    packages[${owner%%:*}]=1
  done < <(awk '/=> \// {print $3} /^\t\/[^ ]+ \(/ {print $1}' <<<"$libs")
done
if [ "$foreign" = 1 ]; then
  # A CUDA build opens cuBLAS with dlopen on its first GPU op (kernels/cuda/cublas.h), so ldd does
  # not list it: carry the cuBLAS (and the cuBLASLt it loads) that sit beside the CUDA runtime.
  for lib in "${!others[@]}"; do
    case "$lib" in
      */libcudart.so.*)
        major=${lib##*/libcudart.so.}; major=${major%%.*}
        for extra in libcublas libcublasLt; do
          found=$(dirname "$(readlink -f "$lib")")/$extra.so.$major
          [ -e "$found" ] || found=$(dirname "$lib")/$extra.so.$major
          [ -e "$found" ] || { echo "runtime-packages.sh: no $extra.so.$major beside $lib" >&2; exit 1; }
          others[$found]=1
        done ;;
    esac
  done
  [ ${#others[@]} -eq 0 ] || printf '%s\n' "${!others[@]}" | sort
else
  printf '%s\n' "${!packages[@]}" | sort
fi
