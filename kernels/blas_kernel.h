// Which OpenBLAS kernel the CPU backend's GEMMs run on, and choosing the fastest one at start.
//
// Design decision: OpenBLAS (a DYNAMIC_ARCH build, as Debian ships it) picks its kernel once, when
// the library loads, from a table of CPU models. A model newer than the table gets an old kernel
// (Debian 12's 0.3.21 runs an AVX-512 BF16 Xeon on Prescott, SSE3 only), which slows every GEMM
// several times while every benchmark ratio against sgemm still reads 1.0. The kernel cannot be
// changed once loaded, so strata decides in main(), before anything else runs: it reads what the
// CPU offers (cpuid, and xgetbv for what the OS saves) and what OpenBLAS chose, and when the
// choice is below the best kernel the CPU can run it sets OPENBLAS_CORETYPE and executes itself
// again, once. Workers that `strata launch` starts inherit the setting and do not re-execute.
//
// The user decides over strata: an OPENBLAS_CORETYPE that strata did not set is kept (with a
// warning when it is below the best), and STRATA_BLAS_KERNEL chooses the policy:
//   auto  (default) fix OpenBLAS's own choice; keep a user's OPENBLAS_CORETYPE
//   best  the best kernel the CPU runs, even over a user's OPENBLAS_CORETYPE
//   keep  never change anything; only report (and warn)
//
// Debuggers and tools that follow one process (valgrind without --trace-children) lose it at the
// re-execution: run them with STRATA_BLAS_KERNEL=keep, or OPENBLAS_CORETYPE set.
//
// Threads: ChooseKernelAtStart runs first in main(), before strata starts a thread of its own (only
// OpenBLAS's idle thread pool exists then). The rest reads the environment and the library and may
// be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/status.h"

namespace strata::blas {

// What the CPU offers for GEMMs, as the running OS lets a program use it: an AVX or AVX-512 flag
// counts only when the OS saves that register state (xgetbv).
struct CpuFeatures {
  bool sse3 = false;
  bool ssse3 = false;
  bool sse4_1 = false;
  bool sse4_2 = false;
  // AMD's own extensions, which OpenBLAS's kernels for older AMD CPUs use: SSE4a (Barcelona,
  // Bobcat), FMA4 and XOP (Bulldozer to Excavator), 3DNow! (Opteron, Athlon).
  bool sse4a = false;
  bool fma4 = false;
  bool xop = false;
  bool three_dnow = false;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512 = false;  // F, CD, BW, DQ and VL: what OpenBLAS's SkylakeX kernel needs
  bool avx512_bf16 = false;
  bool amx = false;  // AMX-TILE and AMX-BF16 (OpenBLAS's SapphireRapids kernel, for sbgemm)
};

// The cpuid and xgetbv words the features come from (x86-64).
struct CpuRegisters {
  uint32_t leaf1_ecx = 0;    // SSE3 (bit 0), SSSE3 (9), FMA (12), SSE4.1 (19), SSE4.2 (20),
                             // OSXSAVE (27), AVX (28)
  uint32_t ext1_ecx = 0;     // leaf 0x80000001: SSE4a (6), XOP (11), FMA4 (16)
  uint32_t ext1_edx = 0;     // leaf 0x80000001: 3DNow! (31)
  uint32_t leaf7_ebx = 0;    // AVX2 (5), AVX-512 F (16), DQ (17), CD (28), BW (30), VL (31)
  uint32_t leaf7_edx = 0;    // AMX-BF16 (22), AMX-TILE (24)
  uint32_t leaf7_1_eax = 0;  // AVX512_BF16 (5)
  uint64_t xcr0 = 0;         // the state the OS saves: SSE|AVX 0x6, opmask|ZMM 0xe0, AMX 0x60000
};
CpuFeatures CpuFeaturesFromRegisters(const CpuRegisters& r);
// This CPU's features (cpuid and xgetbv on x86-64; none elsewhere).
CpuFeatures DetectCpu();

// The OpenBLAS that this process runs, as it reports itself.
struct Library {
  std::string config;         // openblas_get_config(), e.g. "OpenBLAS 0.3.21 ... DYNAMIC_ARCH ..."
  std::string corename;       // openblas_get_corename(), e.g. "Haswell"
  bool dynamic_arch = false;  // built with every kernel, so OPENBLAS_CORETYPE can switch them
  // The kernels strata would choose that the library holds (in a DYNAMIC_ARCH build), e.g.
  // {"Cooperlake", "SkylakeX", "Haswell", "Sandybridge", "Prescott"}.
  std::vector<std::string> kernels;
};
Library DetectLibrary();

// "OpenBLAS 0.3.21" from a config string.
std::string LibraryVersion(std::string_view config);

// How fast a kernel's sgemm is, by the widest vectors it uses: 0 unknown (not x86-64, or a name
// strata does not know), 1 SSE, 2 AVX, 3 AVX2 with FMA, 4 AVX-512. Cooperlake shares SkylakeX's
// tier: their sgemm is the same (they differ in sbgemm, which strata does not call).
int KernelTier(std::string_view corename);
// What a kernel needs of the CPU, in words ("AVX-512 BF16"); "" for an unknown name.
std::string KernelIsa(std::string_view corename);

// The best kernel among `available` that `cpu` can run, or "" when none is known.
std::string BestKernel(const CpuFeatures& cpu, const std::vector<std::string>& available);

enum class Policy { kAuto, kBest, kKeep };
// STRATA_BLAS_KERNEL's value ("" means auto); an unknown value is an error naming the variable.
StatusOr<Policy> ParsePolicy(std::string_view value);

// The environment as strata reads it at start.
struct Environment {
  std::string coretype;       // OPENBLAS_CORETYPE ("" when unset or empty)
  std::string set_by_strata;  // STRATA_OPENBLAS_CORETYPE_SET: "<kernel set>,<kernel before>"
  Policy policy = Policy::kAuto;
};

// What to do at start, and what to tell the user.
struct Choice {
  std::string reexec_with;  // non-empty: set OPENBLAS_CORETYPE to this and execute again
  std::string describe;     // one line: library, kernel in use, and why
  std::string warning;      // non-empty when the kernel is below the CPU's best and stays so
};
// The decision, a pure function of what the CPU offers, what the library chose and the
// environment (tested with made-up CPUs in tests/kernels/blas_kernel_test.cc).
Choice Choose(const CpuFeatures& cpu, const Library& lib, const Environment& env);

// Reads the environment: STRATA_BLAS_KERNEL, OPENBLAS_CORETYPE and strata's own marker.
StatusOr<Environment> ReadEnvironment();

// Called first in main() of `strata`, of the CPU benchmarks and of programs that embed strata. May
// execute the program again (execv of /proc/self/exe with the same argv and OPENBLAS_CORETYPE
// set); returns an error only for a bad STRATA_BLAS_KERNEL, which the caller prints before exiting
// with status 2. In the child that MeasureSgemmInChild starts, measures sgemm and exits.
Status ChooseKernelAtStart(char** argv);

// The choice for this process as it runs now (what `strata version` prints).
Choice Current();

// Whether an sgemm gives a row of its result the same bits whatever the number of rows in the call
// (probed with 64 rows of two shapes, k x n = 32 x 8 and 256 x 64, against calls of 1 to 63 of
// those rows; about a millisecond). A worker computes its share of a batch in calls with fewer
// rows than one process computing the whole batch, so only then does a distributed run match one
// process up to the order of its reductions. Some OpenBLAS kernels round a row differently by row
// count (0.3.21's Haswell, Zen and Prescott do; SkylakeX, Cooperlake and Sandybridge do not):
// there the two match only to rounding, and a routing choice at a near-tie (expert choice at an
// expert's capacity, above all) can go the other way.
bool SgemmRowsIndependentOfRowCount();

// sgemm GFLOP/s the way strata runs GEMMs: `threads` threads at once, each a single-threaded
// n x n x n sgemm on its own matrices, best of three timed repetitions, summed over the threads.
// Each thread checks one element of its result against a double-precision sum; -1 if one is
// wrong.
double MeasureSgemm(int threads, int n = 1024);

// The same in a child process of this program (so that this process's memory is untouched), on
// `kernel` ("" for the kernel this process runs). Sets *ran to the kernel the child ran. Returns
// -1 when the child could not run, ran another kernel than asked, or computed a wrong result, and
// when this program's main() did not call ChooseKernelAtStart (the child would run it in full).
double MeasureSgemmInChild(const std::string& kernel, int threads, int n, std::string* ran);

}  // namespace strata::blas
