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
  STRATA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
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

}  // namespace strata::cuda
