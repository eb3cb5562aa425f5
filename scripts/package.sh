#!/usr/bin/env bash
# Packs a build of strata into one relocatable tarball, for a GPU machine that has the NVIDIA
# driver and CUDA 13's cuBLAS, cudart and NCCL (a PyTorch install brings them) and none of
# strata's other dependencies:
#
#   bin/            strata, the GPU tests (with the workers' and the elastic drill's on a GPU),
#                   the GPU benchmarks, bench_parity, bench_generate, bench_out_of_core,
#                   bench_train (and the PyTorch baseline)
#   lib/            the shared libraries those binaries need that such a machine may lack (gRPC,
#                   protobuf, Abseil, RocksDB, Gloo, liburing, OpenBLAS, ...), found through the
#                   binaries' RUNPATH $ORIGIN/../lib; never the C library, libstdc++, the driver,
#                   cuBLAS, cudart or NCCL, which come from the machine
#   share/strata/   the default example's config and data (the tests read them from here), and
#                   the larger_than_memory, larger_than_gpu and gpu_moe configs (the benchmarks'
#                   models)
#   gpu-check.sh    scripts/gpu-check.sh: every GPU test and benchmark, one summary table
#
#   scripts/package.sh [-o OUT.tar.xz] [--build DIR]
#
# Defaults: the build folder $STRATA_BUILD_DIR or build/, and dist/strata-VERSION-ARCH.tar.xz.
# On the other machine: mkdir pkg && tar -C pkg -xJf strata-*.tar.xz && pkg/gpu-check.sh
# Needs patchelf and xz (scripts/install-deps.sh installs them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${STRATA_BUILD_DIR:-$root/build}
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out=${2:?-o needs a file name}; shift ;;
    --build) build=${2:?--build needs a folder}; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "package.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
build=$(cd "$build" 2>/dev/null && pwd) || {
  echo "package.sh: no build folder '$build': run scripts/build.sh first" >&2
  exit 2
}
for tool in patchelf xz ldd; do
  command -v "$tool" > /dev/null || {
    echo "package.sh: '$tool' is missing: run scripts/install-deps.sh" >&2
    exit 2
  }
done
[ -x "$build/bin/strata" ] || {
  echo "package.sh: $build/bin/strata is missing: run scripts/build.sh" >&2
  exit 2
}
version=$("$build/bin/strata" version | sed -n 's/^strata \([^ ]*\).*/\1/p' | head -1)
[ -n "$out" ] || out=$root/dist/strata-${version:-unknown}-$(uname -m).tar.xz
mkdir -p "$(dirname "$out")"
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/share/strata/examples/moe_lm/data" \
  "$stage/share/strata/examples/larger_than_memory" "$stage/share/strata/examples/larger_than_gpu" \
  "$stage/share/strata/examples/gpu_moe"

# The binaries: strata, every GPU test (what gpu-check.sh runs), the GPU benchmarks.
cp "$build/bin/strata" "$stage/bin/"
for t in cuda_ops_test moe_layer_gpu_test model_gpu_test train_gpu_test tiered_store_gpu_test \
         tiered_training_gpu_test \
         nccl_test data_parallel_test distributed_test elastic_test; do
  [ -x "$build/tests/$t" ] && cp "$build/tests/$t" "$stage/bin/"
done
for b in bench_moe_gpu bench_tier_gpu bench_parity bench_generate bench_out_of_core bench_train; do
  [ -x "$build/bin/$b" ] && cp "$build/bin/$b" "$stage/bin/"
done
cp "$root/bench/torch_moe_baseline.py" "$stage/bin/bench_moe_torch.py"
cp "$root/scripts/gpu-check.sh" "$stage/gpu-check.sh"

# The default example, with its data (made from Debian's fortunes when missing).
data=$root/examples/moe_lm/data/fortunes.txt
[ -s "$data" ] || python3 "$root/examples/moe_lm/prepare_data.py" --out "$data"
cp "$root/examples/moe_lm/config.textproto" "$stage/share/strata/examples/moe_lm/"
cp "$data" "$stage/share/strata/examples/moe_lm/data/"
# bench_generate's second model (its data is moe_lm's, by a relative path).
cp "$root/examples/larger_than_memory/config.textproto" \
  "$stage/share/strata/examples/larger_than_memory/"
# bench_out_of_core's GPU runs: larger_than_gpu and its scale knob (its data is moe_lm's too).
cp "$root/examples/larger_than_gpu/config.textproto" "$root/examples/larger_than_gpu/scale.py" \
  "$stage/share/strata/examples/larger_than_gpu/"
# bench_train's model of about 2B parameters (its data is moe_lm's too).
cp "$root/examples/gpu_moe/config.textproto" "$stage/share/strata/examples/gpu_moe/"

# The shared libraries, by their sonames as the loader asks for them; the machine's own: glibc,
# the compiler's runtime, the NVIDIA driver and the CUDA toolkit's libraries.
machine_own='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libresolv|libutil|libgcc_s'
machine_own+='|libstdc\+\+|libcuda|libcublas|libcublasLt|libcudart|libnccl|libnvidia|libnvrtc'
machine_own+='|libnvJitLink)\.'
for f in "$stage"/bin/*; do
  file -b "$f" | grep -q ELF || continue
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  echo "$soname" | grep -qE "$machine_own" && continue
  [ -e "$stage/lib/$soname" ] || cp -L "$path" "$stage/lib/$soname"
done
missing=$(for f in "$stage"/bin/*; do
  file -b "$f" | grep -q ELF && ldd "$f" | grep 'not found' | grep -vE 'libcu|libnccl' || true
done | sort -u)
if [ -n "$missing" ]; then
  echo "package.sh: libraries not found on this machine: $missing" >&2
  exit 1
fi

# Smaller, and each binary finds lib/ beside it, each library its neighbours.
strip --strip-unneeded "$stage"/bin/* "$stage"/lib/* 2> /dev/null || true
for f in "$stage"/bin/*; do
  file -b "$f" | grep -q ELF && patchelf --set-rpath '$ORIGIN/../lib' "$f"
done
for f in "$stage"/lib/*; do patchelf --set-rpath '$ORIGIN' "$f"; done

# xz on every core (the archive is the same size; it takes half the time on two).
XZ_OPT=${XZ_OPT:--T0} tar -C "$stage" -cJf "$out" .
echo "package.sh: $out ($(du -h "$out" | cut -f1)): $(ls "$stage/bin" | wc -l) files in bin/," \
     "$(ls "$stage/lib" | wc -l) libraries in lib/"
