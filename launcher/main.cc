#include <csignal>
#include <cstdio>
#include <string>

#include "core/common/fault_point.h"
#include "core/common/heap.h"
#include "kernels/blas_kernel.h"
#include "launcher/commands.h"

int main(int argc, char** argv) {
  // First of all, while OpenBLAS has chosen its kernel and nothing else has run: a kernel below
  // what this CPU runs is fixed by executing strata again, once (kernels/blas_kernel.h).
  if (strata::Status s = strata::blas::ChooseKernelAtStart(argv); !s.ok()) {
    std::fprintf(stderr, "strata: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // A peer that dies closes its sockets; writing to one must come back as an error that names the
  // peer (see runtime/comm), not kill this process with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  // Multi-MiB activations must not pile up in the heap over a long run (core/common/heap.h).
  strata::KeepLargeBlocksOffTheHeap();
  // Tests and drills arm fault points through STRATA_FAULTS (core/common/fault_point.h); a bad
  // value stops here, before anything starts, rather than leaving a drill without its fault.
  if (strata::Status s = strata::FaultPoints::Instance().EnvironmentStatus(); !s.ok()) {
    std::fprintf(stderr, "strata: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  return strata::launcher::Main(argc, argv);
}
