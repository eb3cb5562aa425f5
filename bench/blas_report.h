// What the CPU benchmarks print beside their ratios: the OpenBLAS kernel their GEMMs ran on, and
// this machine's sgemm GFLOP/s on that kernel and on the best kernel the CPU runs. A ratio against
// sgemm reads 1.0 on a slow kernel too; these lines show the absolute speed it hides. Both rates
// are measured in child processes (kernels/blas_kernel.h, MeasureSgemmInChild), so the
// benchmark's own memory (its peak RSS) is untouched. The benchmark's main must call
// ChooseBlasKernelAtStart first.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_format.h"
#include "core/common/json.h"
#include "kernels/blas_kernel.h"

namespace strata::bench {

// First in a benchmark's main(): the kernel choice of kernels/blas_kernel.h (which may execute the
// benchmark again), and the sgemm probe's child. A bad STRATA_BLAS_KERNEL exits with status 2.
inline void ChooseBlasKernelAtStart(const char* program, char** argv) {
  if (Status s = blas::ChooseKernelAtStart(argv); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, std::string(s.message()).c_str());
    std::exit(2);
  }
}

struct BlasReport {
  int threads = 1;
  blas::Choice choice;
  std::string kernel;        // in use
  std::string best_kernel;   // the best this CPU runs and this OpenBLAS holds ("" if not known)
  double gflops = NAN;       // sgemm on `threads` threads, kernel in use; NaN: not measured
  double best_gflops = NAN;  // the same on best_kernel

  // GFLOP/s over the best kernel's sgemm; NaN when that was not measured.
  double OfBest(double rate) const { return rate / best_gflops; }
};

// About 0.1 s per kernel on 2 cores: four 1024^3 sgemms on each thread, in a child process.
inline BlasReport MeasureBlas(int threads) {
  BlasReport r;
  r.threads = threads;
  r.choice = blas::Current();
  const blas::Library lib = blas::DetectLibrary();
  r.kernel = lib.corename;
  r.best_kernel = lib.dynamic_arch ? blas::BestKernel(blas::DetectCpu(), lib.kernels) : "";
  // A kernel of the best's tier (Zen beside Haswell, SkylakeX beside Cooperlake) is the best.
  if (!r.best_kernel.empty() && blas::KernelTier(r.kernel) == blas::KernelTier(r.best_kernel)) {
    r.best_kernel = r.kernel;
  }
  std::string ran;
  if (const double g = blas::MeasureSgemmInChild("", threads, 1024, &ran); g > 0) r.gflops = g;
  if (r.best_kernel == r.kernel) {
    r.best_gflops = r.gflops;
  } else if (!r.best_kernel.empty()) {
    if (const double g = blas::MeasureSgemmInChild(r.best_kernel, threads, 1024, &ran); g > 0) {
      r.best_gflops = g;
    }
  }
  return r;
}

// "# blas: ..." (and "# warning: ..."), then "# sgemm: ..." lines.
inline void PrintBlasReport(const BlasReport& r) {
  auto rate = [](double g) {
    return std::isnan(g) ? std::string("not measured (the probe failed or computed a wrong result)")
                         : absl::StrFormat("%.1f GFLOP/s", g);
  };
  std::printf("# blas: %s\n", r.choice.describe.c_str());
  if (!r.choice.warning.empty()) std::printf("# warning: %s\n", r.choice.warning.c_str());
  std::printf("# sgemm 1024^3, one single-threaded GEMM on each of %d threads: %s on %s", r.threads,
              rate(r.gflops).c_str(), r.kernel.c_str());
  if (r.best_kernel.empty()) {
    std::printf("; the best kernel for this CPU is not known here\n");
  } else if (r.best_kernel == r.kernel) {
    std::printf(", the best kernel this CPU runs\n");
  } else {
    std::printf("; %s on %s, the best kernel this CPU runs (in use / best = %.2f)\n",
                rate(r.best_gflops).c_str(), r.best_kernel.c_str(), r.gflops / r.best_gflops);
  }
}

inline void AddBlasFields(JsonWriter& j, const BlasReport& r) {
  j.Field("blas_kernel", r.kernel)
      .Field("blas_best_kernel", r.best_kernel)
      .Field("sgemm_gflops", r.gflops)
      .Field("sgemm_best_gflops", r.best_gflops);
}

}  // namespace strata::bench
