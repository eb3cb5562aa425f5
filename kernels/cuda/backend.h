// The Backend's definition and helpers shared by the CUDA kernels (.cu files only).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/common/logging.h"
#include "kernels/cuda/cublas.h"
#include "kernels/cuda/cuda_ops.h"

namespace strata::cuda {

// CHECK-fails with the CUDA error's name and text and the failing expression.
#define STRATA_CUDA_CHECK(expr)                                                                    \
  do {                                                                                             \
    const cudaError_t strata_cuda_err_ = (expr);                                                   \
    CHECK(strata_cuda_err_ == cudaSuccess) << #expr << ": " << cudaGetErrorName(strata_cuda_err_)  \
                                           << " (" << cudaGetErrorString(strata_cuda_err_) << ")"; \
  } while (0)

#define STRATA_CUBLAS_CHECK(expr)                                             \
  do {                                                                        \
    const cublasStatus_t strata_cublas_st_ = (expr);                          \
    CHECK(strata_cublas_st_ == CUBLAS_STATUS_SUCCESS)                         \
        << #expr << ": " << Cublas().GetStatusName(strata_cublas_st_) << " (" \
        << Cublas().GetStatusString(strata_cublas_st_) << ")";                \
  } while (0)

// Checks the launch of the kernel just enqueued (configuration errors show up here; faults inside
// the kernel show up at the next synchronising call).
#define STRATA_CUDA_LAUNCH_CHECK() STRATA_CUDA_CHECK(cudaGetLastError())

// One thread's resources on one GPU (see ThreadBackend in cuda_ops.h): not thread-safe, used only
// by the thread that owns it. Destroying it waits for the stream and frees the scratch; the stream
// itself is the GPU's and lives on.
struct Backend {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;

  // Grow-only scratch, valid until the next call that asks for scratch of the same kind. Device
  // scratch is stream-ordered: reusing it in the next kernel on the same stream is safe.
  void* DeviceScratch(size_t bytes);
  // Pinned host scratch, for values copied back from the device (wait for the stream before
  // reading them).
  void* HostScratch(size_t bytes);
  // A second device scratch area, for kernels that need two at once.
  void* DeviceScratch2(size_t bytes);
  // Copies a small host array (pointer arrays, per-call constants) to device memory in stream
  // order, through kernel arguments: the bytes travel with the launch, so nothing waits and no
  // host buffer has to outlive the call (a pinned staging buffer could be overwritten by a later
  // call before the stream reached the copy).
  void UploadSmall(void* dst, const void* src, size_t bytes);

  Backend(int device);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

 private:
  void* dev_scratch_ = nullptr;
  size_t dev_scratch_bytes_ = 0;
  void* dev_scratch2_ = nullptr;
  size_t dev_scratch2_bytes_ = 0;
  void* host_scratch_ = nullptr;
  size_t host_scratch_bytes_ = 0;
};

inline unsigned CeilDiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// The counter-based generator of core/common/rng.h, on the device: the same bits for the same
// (key, counter), so GPU gates draw exactly what the CPU reference draws.
__host__ __device__ inline uint64_t RngMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
__host__ __device__ inline uint64_t RngBits(uint64_t key, uint64_t counter) {
  return RngMix64(key ^ RngMix64(counter));
}
__host__ __device__ inline double RngUniform(uint64_t key, uint64_t counter) {
  return static_cast<double>(RngBits(key, counter) >> 11) * 0x1.0p-53;
}
__host__ __device__ inline double RngUniformOpenZero(uint64_t key, uint64_t counter) {
  return (static_cast<double>(RngBits(key, counter) >> 11) + 1.0) * 0x1.0p-53;
}
__device__ inline double RngNormal(uint64_t key, uint64_t counter) {
  const double u1 = RngUniformOpenZero(key, 2 * counter);
  const double u2 = RngUniform(key, 2 * counter + 1);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

}  // namespace strata::cuda
