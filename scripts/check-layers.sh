#!/usr/bin/env bash
# The layering check: strata's folders are its layers, bottom up
#
#   core < kernels < proto < storage < runtime < scheduler < checkpoint < train < coordinator
#        < launcher < examples
#
# and a file may include its own layer and the layers below it, never one above (docs/DESIGN.md).
# Reads every `#include "..."` in those folders and fails, printing file:line, the include and both
# layers, on an include of a higher layer. It also fails when a file outside kernels/ includes a
# backend (kernels/cpu/, kernels/cuda/): the rest of strata sees kernels through kernels/ops.h,
# kernels/vocabulary.h and kernels/blas_kernel.h. Inside train/, the trainer sits above its parts:
# only trainer.cc and the elastic worker (elastic_worker.*) include train/trainer.h, so the seams,
# the elastic unit (train/elastic/) and the trainer's other units never reach back up into it.
# tests/ and bench/ sit on top of everything (a backend's tests include its headers) and are not
# checked. Includes of other projects (absl/, google/, ...) are ignored.
#
#   scripts/check-layers.sh        (from anywhere; exits 0 when the tree is layered, 1 otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."

layers=(core kernels proto web storage runtime scheduler checkpoint train coordinator launcher examples)
present=()
for layer in "${layers[@]}"; do [[ -d $layer ]] && present+=("$layer"); done
files=$(find "${present[@]}" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) | sort)

awk -v order="${layers[*]}" '
  BEGIN { n = split(order, names, " "); for (i = 1; i <= n; ++i) rank[names[i]] = i; bad = 0 }
  match($0, /^[ \t]*#[ \t]*include[ \t]*"[^"]+"/) {
    inc = $0; sub(/^[^"]*"/, "", inc); sub(/".*$/, "", inc)
    split(FILENAME, from, "/"); split(inc, to, "/")
    if (!(to[1] in rank)) next
    if (rank[to[1]] > rank[from[1]]) {
      printf "%s:%d: #include \"%s\": layer %s includes layer %s, which is above it\n",
             FILENAME, FNR, inc, from[1], to[1]
      bad = 1
    }
    if (inc == "train/trainer.h" && from[1] == "train" && FILENAME != "train/trainer.cc" &&
        FILENAME !~ /^train\/elastic_worker\.(h|cc)$/) {
      printf "%s:%d: #include \"%s\": a part of the trainer includes the trainer; %s\n",
             FILENAME, FNR, inc, "give it what it needs (see ElasticHost in train/elastic/)"
      bad = 1
    }
    if (from[1] != "kernels" && to[1] == "kernels" && (to[2] == "cpu" || to[2] == "cuda")) {
      printf "%s:%d: #include \"%s\": layer %s includes the kernels backend kernels/%s/; use kernels/ops.h, kernels/vocabulary.h or kernels/blas_kernel.h\n",
             FILENAME, FNR, inc, from[1], to[2]
      bad = 1
    }
  }
  END {
    if (bad) { print "check-layers: the tree is not layered (see docs/DESIGN.md, \"Layers\")" > "/dev/stderr"; exit 1 }
  }' $files
echo "check-layers: $(echo "$files" | wc -l) files, every include is of its own layer or one below"
