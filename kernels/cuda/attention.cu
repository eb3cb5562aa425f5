// Causal multi-head attention on the GPU, the semantics of kernels/cpu/attention.cc: qkv [B, T, 3C]
// holds per token the C query, C key and C value channels, head h using channels
// [h*hs, (h+1)*hs) of each; att [B, NH, T, T] saves the softmax probabilities, zero above the
// diagonal (backward's P^T dO reads the whole matrix).
//
// The products are cuBLAS strided-batched fp32 GEMMs (CUBLAS_COMPUTE_32F, no TF32) over the NH
// heads of one batch row: a head's Q, K and V are strided views of qkv (leading dimension 3C,
// heads hs apart), so nothing is copied; batch rows are separate calls because the (batch, head)
// offsets do not form a single stride. The causal softmax and its backward are one warp per row.
// Tensors are row-major and cuBLAS column-major: each row-major product Y = A B is computed as the
// column-major Y^T = B^T A^T.
#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/backend.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// batch x [C_i (m x n, column-major) = alpha op(A_i) op(B_i) + beta C_i], X_i = X + i * strideX.
void BatchedGemm(Backend& b, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                 int64_t k, float alpha, const float* A, int64_t lda, int64_t stride_a,
                 const float* B, int64_t ldb, int64_t stride_b, float beta, float* C, int64_t ldc,
                 int64_t stride_c, int64_t batch) {
  for (int64_t d : {m, n, k, lda, ldb, ldc, batch}) CHECK_LE(d, static_cast<int64_t>(INT_MAX));
  STRATA_CUBLAS_CHECK(Cublas().GemmStridedBatchedEx(
      b.cublas, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A,
      CUDA_R_32F, static_cast<int>(lda), static_cast<long long>(stride_a), B, CUDA_R_32F,
      static_cast<int>(ldb), static_cast<long long>(stride_b), &beta, C, CUDA_R_32F,
      static_cast<int>(ldc), static_cast<long long>(stride_c), static_cast<int>(batch),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// In place over `rows` rows of T scores (row index mod T is the query position r): softmax over
// j <= r, zero above. One warp per row; a warp's lanes share the row, so a warp past the end
// returns as a whole and the full-mask shuffles stay valid.
__global__ void CausalSoftmaxKernel(float* att, int64_t rows, int64_t T) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = row % T;
  float* p = att + row * T;
  float mx = -INFINITY;
  for (int64_t j = lane; j <= r; j += 32) mx = fmaxf(mx, p[j]);
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (int64_t j = lane; j <= r; j += 32) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  // As the CPU: multiply by the reciprocal of the sum.
  const float inv = 1.0f / WarpSum(sum);
  for (int64_t j = lane; j <= r; j += 32) p[j] *= inv;
  for (int64_t j = r + 1 + lane; j < T; j += 32) p[j] = 0.0f;
}

// In place on dp: dS = P * (dP - rowsum(P * dP)) * scale for j <= r, zero above. One warp per
// row, as the forward.
__global__ void CausalSoftmaxBackwardKernel(float* dp, const float* att, int64_t rows, int64_t T,
                                            float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = row % T;
  const float* p = att + row * T;
  float* d = dp + row * T;
  float dot = 0.0f;
  for (int64_t j = lane; j <= r; j += 32) dot += p[j] * d[j];
  dot = WarpSum(dot);
  for (int64_t j = lane; j <= r; j += 32) d[j] = p[j] * (d[j] - dot) * scale;
  for (int64_t j = r + 1 + lane; j < T; j += 32) d[j] = 0.0f;
}

// Every row's key and value into its (slot, position) of the caches.
__global__ void KvCacheWriteKernel(float* k_cache, float* v_cache, const float* qkv,
                                   const int32_t* slots, const int32_t* positions, int64_t N,
                                   int64_t Tmax, int64_t C) {
  STRATA_GRID_STRIDE(i, N * C) {
    const int64_t r = i / C, c = i % C;
    const int64_t at = (static_cast<int64_t>(slots[r]) * Tmax + positions[r]) * C + c;
    k_cache[at] = qkv[r * 3 * C + C + c];
    v_cache[at] = qkv[r * 3 * C + 2 * C + c];
  }
}

// One block per (row, head): a warp per key for the scores (scale * q.k, into `scores`, Tmax per
// block), the softmax over positions [0, positions[row]] as CausalSoftmaxKernel's, then a thread
// per channel for the weighted sum of the values.
__global__ void AttentionDecodeKernel(float* out, float* scores, const float* qkv,
                                      const float* k_cache, const float* v_cache,
                                      const int32_t* slots, const int32_t* positions, int64_t NH,
                                      int64_t Tmax, int64_t C, float scale) {
  const int64_t task = blockIdx.x;
  const int64_t r = task / NH, h = task % NH, hs = C / NH;
  const int64_t n = static_cast<int64_t>(positions[r]) + 1;
  const float* q = qkv + r * 3 * C + h * hs;
  const int64_t base = static_cast<int64_t>(slots[r]) * Tmax * C + h * hs;
  float* s = scores + task * Tmax;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t j = warp; j < n; j += warps) {
    const float* k = k_cache + base + j * C;
    float d = 0.0f;
    for (int64_t c = lane; c < hs; c += 32) d += q[c] * k[c];
    d = WarpSum(d);
    if (lane == 0) s[j] = scale * d;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, s[j]);
  mx = BlockMax(mx);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float e = expf(s[j] - mx);
    s[j] = e;
    sum += e;
  }
  const float inv = 1.0f / BlockSum(sum);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s[j] *= inv;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < hs; c += blockDim.x) {
    const float* v = v_cache + base + c;
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc += s[j] * v[j * C];
    out[r * C + h * hs + c] = acc;
  }
}

unsigned RowBlocks(int64_t rows) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  CHECK_LE(blocks, static_cast<int64_t>(INT_MAX));
  return static_cast<unsigned>(blocks);
}

}  // namespace

void AttentionForward(Backend& b, float* out, float* att, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH) {
  if (B == 0 || T == 0 || C == 0) return;
  CHECK_GT(NH, 0);
  CHECK_EQ(C % NH, 0) << "channels must split evenly into heads";
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const int64_t TT = T * T;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));  // as the CPU, in float
  for (int64_t bb = 0; bb < B; ++bb) {
    const float* q = qkv + bb * T * C3;
    const float* k = q + C;
    // S = scale * Q K^T, as column-major S^T = K Q^T: op(K^T view) = T, Q^T view as is.
    BatchedGemm(b, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, scale, k, C3, hs, q, C3, hs, 0.0f,
                att + bb * NH * TT, T, TT, NH);
  }
  CausalSoftmaxKernel<<<RowBlocks(B * NH * T), kThreads, 0, b.stream>>>(att, B * NH * T, T);
  STRATA_CUDA_LAUNCH_CHECK();
  for (int64_t bb = 0; bb < B; ++bb) {
    const float* v = qkv + bb * T * C3 + 2 * C;
    // out_bh = P V, as column-major out^T = V^T P^T: both views as they are.
    BatchedGemm(b, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, v, C3, hs, att + bb * NH * TT, T, TT,
                0.0f, out + bb * T * C, C, hs, NH);
  }
}

void AttentionBackward(Backend& b, float* dqkv, const float* dout, const float* qkv,
                       const float* att, int64_t B, int64_t T, int64_t C, int64_t NH) {
  if (B == 0 || T == 0 || C == 0) return;
  CHECK_GT(NH, 0);
  CHECK_EQ(C % NH, 0) << "channels must split evenly into heads";
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const int64_t TT = T * T;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  // dP / dS for the NH heads of one batch row at a time, reused across batch rows (stream order).
  float* dp = static_cast<float*>(b.DeviceScratch(static_cast<size_t>(NH * TT) * sizeof(float)));
  for (int64_t bb = 0; bb < B; ++bb) {
    const float* q = qkv + bb * T * C3;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* dq = dqkv + bb * T * C3;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    const float* p = att + bb * NH * TT;
    const float* dO = dout + bb * T * C;
    // dP = dO V^T, as column-major dP^T = V dO^T.
    BatchedGemm(b, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 1.0f, v, C3, hs, dO, C, hs, 0.0f, dp, T, TT,
                NH);
    // dV = P^T dO, as column-major dV^T = dO^T P.
    BatchedGemm(b, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, dO, C, hs, p, T, TT, 0.0f, dv, C3, hs,
                NH);
    CausalSoftmaxBackwardKernel<<<RowBlocks(NH * T), kThreads, 0, b.stream>>>(dp, p, NH * T, T,
                                                                              scale);
    STRATA_CUDA_LAUNCH_CHECK();
    // dQ = dS K, as column-major dQ^T = K^T dS^T.
    BatchedGemm(b, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, k, C3, hs, dp, T, TT, 0.0f, dq, C3, hs,
                NH);
    // dK = dS^T Q, as column-major dK^T = Q^T dS.
    BatchedGemm(b, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, q, C3, hs, dp, T, TT, 0.0f, dk, C3, hs,
                NH);
  }
}

void AttentionDecode(Backend& b, float* out, const float* qkv, float* k_cache, float* v_cache,
                     const int32_t* slots, const int32_t* positions, int64_t N, int64_t Tmax,
                     int64_t C, int64_t NH, float* scores) {
  if (N == 0 || C == 0) return;
  CHECK_GT(NH, 0);
  CHECK_EQ(C % NH, 0) << "channels must split evenly into heads";
  CHECK_LE(N * NH, static_cast<int64_t>(INT_MAX));
  const float scale = 1.0f / sqrtf(static_cast<float>(C / NH));  // as the CPU, in float
  const int64_t total = N * C;
  const int64_t grid = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  KvCacheWriteKernel<<<static_cast<unsigned>(grid), kThreads, 0, b.stream>>>(
      k_cache, v_cache, qkv, slots, positions, N, Tmax, C);
  STRATA_CUDA_LAUNCH_CHECK();
  if (scores == nullptr) {
    scores =
        static_cast<float*>(b.DeviceScratch(static_cast<size_t>(N * NH * Tmax) * sizeof(float)));
  }
  constexpr int kDecodeThreads = 128;
  AttentionDecodeKernel<<<static_cast<unsigned>(N * NH), kDecodeThreads, 0, b.stream>>>(
      out, scores, qkv, k_cache, v_cache, slots, positions, NH, Tmax, C, scale);
  STRATA_CUDA_LAUNCH_CHECK();
}

}  // namespace strata::cuda
