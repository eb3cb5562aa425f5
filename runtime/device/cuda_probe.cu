// Compiled only when strata is built with CUDA: asks the runtime how many GPUs are usable. A
// machine with the toolkit but no driver or GPU (CI) answers 0 instead of failing.
#include <cuda_runtime.h>

#include "runtime/device/device.h"

namespace strata {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  return count;
}

}  // namespace strata
