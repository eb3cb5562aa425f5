// The CUDA runtime calls behind device.h, in one place. Defined in cuda_device.cc when strata is
// built with CUDA; device.cc defines the CPU-only versions (which report that no GPU exists).
// Any thread may call them; each makes the GPU it works on current only for the call. Memory from
// CudaMalloc / CudaHostAlloc belongs to the caller (Buffer), who frees it with CudaFree /
// CudaFreeHost.
#pragma once

#include <cstddef>

#include "core/common/status.h"

namespace strata::internal {

[[nodiscard]] Status CudaMalloc(int device, size_t bytes, void** out);
void CudaFree(int device, void* data);
// Pinned host memory; *out is null (and the status OK) when there is no GPU to pin it for.
[[nodiscard]] Status CudaHostAlloc(size_t bytes, void** out);
void CudaFreeHost(void* data);
// Synchronous; any direction (unified addressing).
void CudaCopy(void* dst, const void* src, size_t bytes);
void CudaZero(int device, void* data, size_t bytes);

}  // namespace strata::internal
