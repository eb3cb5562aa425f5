// Backend: a cuBLAS handle and grow-only scratch per (thread, GPU), all on one compute stream per
// GPU.
//
// Why one stream per GPU: ops are called from the trainer's thread and from pool threads (the
// gradient-norm slices, expert groups); with one stream, work a thread enqueues after another
// thread's runs after it, so cross-thread handoffs need no events. Why handles and scratch per
// thread: a cuBLAS handle and a scratch area must not be used by two threads at once.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "kernels/cuda/backend.h"

namespace strata::cuda {
namespace {

// Scratch grows to the largest request seen, rounded up so that slowly growing requests do not
// reallocate every call.
void* Grow(void** p, size_t* have, size_t want, bool pinned_host) {
  if (want <= *have && *p != nullptr) return *p;
  const size_t bytes = std::max<size_t>(want + want / 4, 1 << 20);
  if (*p != nullptr) {
    if (pinned_host) {
      STRATA_CUDA_CHECK(cudaFreeHost(*p));
    } else {
      STRATA_CUDA_CHECK(cudaFree(*p));  // cudaFree waits for the device: no kernel still uses it
    }
  }
  if (pinned_host) {
    STRATA_CUDA_CHECK(cudaHostAlloc(p, bytes, cudaHostAllocPortable));
  } else {
    STRATA_CUDA_CHECK(cudaMalloc(p, bytes));
  }
  *have = bytes;
  return *p;
}

// The compute stream of `device`, created on first use and kept for the life of the process.
// A blocking stream: it is ordered with the legacy default stream that Tensor::CopyFrom and
// SetZero use, so a copy of an op's output after the op sees its result without an explicit
// synchronisation. (The tiered store's copy streams are non-blocking and ordered by events.)
cudaStream_t ComputeStream(int device) {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  cudaStream_t& s = streams[device];
  if (s == nullptr) STRATA_CUDA_CHECK(cudaStreamCreate(&s));
  return s;
}

constexpr int kArgBytes = 2048;  // well under the 4 KiB kernel-parameter limit
struct ArgBlock {
  alignas(8) unsigned char bytes[kArgBytes];
};

__global__ void CopyArgBytesKernel(unsigned char* dst, ArgBlock src, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src.bytes[i];
}

}  // namespace

void Backend::UploadSmall(void* dst, const void* src, size_t bytes) {
  for (size_t off = 0; off < bytes; off += kArgBytes) {
    ArgBlock block;
    const int n = static_cast<int>(std::min<size_t>(kArgBytes, bytes - off));
    std::memcpy(block.bytes, static_cast<const unsigned char*>(src) + off, n);
    CopyArgBytesKernel<<<1, 256, 0, stream>>>(static_cast<unsigned char*>(dst) + off, block, n);
    STRATA_CUDA_LAUNCH_CHECK();
  }
}

Backend::Backend(int dev) : device(dev) {
  STRATA_CUDA_CHECK(cudaSetDevice(device));
  stream = ComputeStream(device);
  STRATA_CUBLAS_CHECK(Cublas().Create(&cublas));
  STRATA_CUBLAS_CHECK(Cublas().SetStream(cublas, stream));
  // fp32 stays fp32: no TF32 tensor-core rounding unless an op asks for a lower precision itself.
  STRATA_CUBLAS_CHECK(Cublas().SetMathMode(cublas, CUBLAS_DEFAULT_MATH));
}

Backend::~Backend() {
  cudaSetDevice(device);
  cudaStreamSynchronize(stream);
  if (dev_scratch_ != nullptr) cudaFree(dev_scratch_);
  if (dev_scratch2_ != nullptr) cudaFree(dev_scratch2_);
  if (host_scratch_ != nullptr) cudaFreeHost(host_scratch_);
  Cublas().Destroy(cublas);  // the stream is shared and lives on
}

void* Backend::DeviceScratch(size_t bytes) {
  return Grow(&dev_scratch_, &dev_scratch_bytes_, bytes, false);
}
void* Backend::DeviceScratch2(size_t bytes) {
  return Grow(&dev_scratch2_, &dev_scratch2_bytes_, bytes, false);
}
void* Backend::HostScratch(size_t bytes) {
  if (bytes > host_scratch_bytes_ && host_scratch_ != nullptr) {
    // The old block may still be the target of a copy in flight.
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return Grow(&host_scratch_, &host_scratch_bytes_, bytes, true);
}

Backend& ThreadBackend(int device) {
  thread_local std::map<int, std::unique_ptr<Backend>> backends;
  auto& b = backends[device];
  if (b == nullptr) b = std::make_unique<Backend>(device);
  int current = -1;
  STRATA_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) STRATA_CUDA_CHECK(cudaSetDevice(device));
  return *b;
}

void Synchronize(Backend& b) { STRATA_CUDA_CHECK(cudaStreamSynchronize(b.stream)); }

}  // namespace strata::cuda
