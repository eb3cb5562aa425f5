// What the CPU benchmarks print beside their ratios: the OpenBLAS kernel their GEMMs ran on, and
// this machine's sgemm GFLOP/s on that kernel and on the best kernel the CPU runs (measured in a
// child process on that kernel). A ratio against sgemm reads 1.0 on a slow kernel too; these lines
// show the absolute speed it hides. The benchmark's main must call ChooseBlasKernelAtStart first.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/common/json.h"
#include "kernels/blas_kernel.h"

namespace strata::bench {

struct BlasReport {
  int threads = 1;
  blas::Choice choice;
  std::string kernel;       // in use
  std::string best_kernel;  // the best this CPU runs (the kernel in use when it cannot be known)
  double gflops = -1;       // sgemm on `threads` threads, kernel in use; negative: wrong result
  double best_gflops = -1;  // the same on best_kernel
};

// About 0.1 s per kernel: four 1024^3 sgemms on each thread.
inline BlasReport MeasureBlas(int threads) {
  BlasReport r;
  r.threads = threads;
  r.choice = blas::Current();
  r.kernel = blas::DetectLibrary().corename;
  r.gflops = blas::MeasureSgemm(threads);
  r.best_gflops = blas::MeasureBestSgemm(threads, &r.best_kernel);
  return r;
}

// "# blas: ..." (and "# warning: ..."), then "# sgemm: ..." lines.
inline void PrintBlasReport(const BlasReport& r) {
  std::printf("# blas: %s\n", r.choice.describe.c_str());
  if (!r.choice.warning.empty()) std::printf("# warning: %s\n", r.choice.warning.c_str());
  std::printf(
      "# sgemm 1024^3, one single-threaded GEMM on each of %d threads: %.1f GFLOP/s on %s; %.1f "
      "GFLOP/s on %s, the best kernel this CPU runs (in use / best = %.2f)\n",
      r.threads, r.gflops, r.kernel.c_str(), r.best_gflops, r.best_kernel.c_str(),
      r.best_gflops > 0 ? r.gflops / r.best_gflops : 0.0);
}

// First in a benchmark's main(): the kernel choice of kernels/blas_kernel.h (which may execute the
// benchmark again), and the sgemm probe's child. A bad STRATA_BLAS_KERNEL exits with status 2.
inline void ChooseBlasKernelAtStart(const char* program, char** argv) {
  if (Status s = blas::ChooseKernelAtStart(argv); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, std::string(s.message()).c_str());
    std::exit(2);
  }
}

inline void AddBlasFields(JsonWriter& j, const BlasReport& r) {
  j.Field("blas_kernel", r.kernel)
      .Field("blas_best_kernel", r.best_kernel)
      .Field("sgemm_gflops", r.gflops)
      .Field("sgemm_best_gflops", r.best_gflops);
}

}  // namespace strata::bench
