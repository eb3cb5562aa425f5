// Warp and block reductions shared by the CUDA kernels (device code; .cu files only).
//
// Butterfly reductions: every lane ends with the same bits, and the order of additions depends
// only on the block shape, so results are the same run to run.
#pragma once

#include <cmath>

namespace strata::cuda {

// for (i = global thread index; i < n; i += total threads), with 64-bit indices.
#define STRATA_GRID_STRIDE(i, n)                                                         \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T>
__device__ inline T WarpSum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ inline float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block, returned to every thread. All threads must call it; blockDim.x is a
// multiple of 32. The leading barrier lets consecutive calls reuse the shared array.
template <typename T>
__device__ inline T BlockSum(T v) {
  __shared__ T warp_vals[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  return WarpSum(lane < nwarps ? warp_vals[lane] : T(0));
}

__device__ inline float BlockMax(float v) {
  __shared__ float warp_vals[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  return WarpMax(lane < nwarps ? warp_vals[lane] : -INFINITY);
}

}  // namespace strata::cuda
