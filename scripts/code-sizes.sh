#!/usr/bin/env bash
# The largest files and functions of strata's library code, longest first
#
#   scripts/code-sizes.sh [N]     (from anywhere; N rows of each list, default 15)
#
# Files are counted in lines (wc -l) over the library folders, headers and sources alike, and
# functions in lines from the line of their name to their closing brace, as Universal Ctags reports
# them (its `end:` field). tests/, bench/ and examples/ are left out: the lists are for the layers.
# Lambdas are part of the function that holds them.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-15}
command -v ctags > /dev/null || { echo "code-sizes: needs Universal Ctags (apt-get install universal-ctags)" >&2; exit 1; }

folders=$(for d in core kernels proto storage runtime scheduler checkpoint train coordinator launcher; do
  [[ -d $d ]] && echo "$d"; done)
files=$(find $folders -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) | sort)

echo "# largest files (lines)"
wc -l $files | grep -v ' total$' | sort -rn | sed -n "1,${rows}p"
echo
echo "# largest functions (lines, file:line, name)"
ctags --langmap=C++:+.cu.cuh --c++-kinds=f --fields=+ne --extras=+q -o - $files 2> /dev/null |
  awk -F'\t' '{
    line = 0; end = 0; scope = ""
    for (i = 4; i <= NF; ++i) {
      if ($i ~ /^line:/) line = substr($i, 6)
      else if ($i ~ /^end:/) end = substr($i, 5)
      else if ($i ~ /^(class|struct|namespace):/) { scope = $i; sub(/^[a-z]+:/, "", scope) }
    }
    if (end == 0 || line == 0) next
    key = $2 ":" line
    if (key in seen) next
    seen[key] = 1
    name = $1
    printf "%6d  %s  %s\n", end - line + 1, key, name
  }' | sort -rn | sed -n "1,${rows}p"
