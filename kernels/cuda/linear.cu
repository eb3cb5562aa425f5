// Fully connected layer on the GPU: the GEMMs through cuBLAS in fp32 (CUBLAS_COMPUTE_32F, no
// TF32, so results stay close to the fp32 CPU reference) or, in the bf16 modes, on bfloat16
// operands with fp32 accumulation into fp32 outputs; bias add and bias gradient (always fp32) by
// small kernels here.
//
// Tensors are row-major; cuBLAS is column-major. A row-major [R, C] matrix read as column-major
// is its transpose [C, R] with leading dimension C, so each product is computed transposed:
// row-major Y = A B is column-major Y^T = B^T A^T, with no copies.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/cuda/backend.h"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;

// C (m x n, column-major) = alpha op(A) op(B) + beta C in fp32, all dimensions checked to fit
// cuBLAS's int.
void Gemm(Backend& b, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
          float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
          float* C, int64_t ldc) {
  for (int64_t d : {m, n, k, lda, ldb, ldc}) CHECK_LE(d, static_cast<int64_t>(INT_MAX));
  STRATA_CUBLAS_CHECK(Cublas().GemmEx(
      b.cublas, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A,
      CUDA_R_32F, static_cast<int>(lda), B, CUDA_R_32F, static_cast<int>(ldb), &beta, C, CUDA_R_32F,
      static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// C (m x n, column-major, fp32) = alpha op(A) op(B) + beta C with bfloat16 A and B, fp32
// accumulation.
void GemmBf16(Backend& b, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
              int64_t k, float alpha, const __nv_bfloat16* A, int64_t lda, const __nv_bfloat16* B,
              int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t d : {m, n, k, lda, ldb, ldc}) CHECK_LE(d, static_cast<int64_t>(INT_MAX));
  STRATA_CUBLAS_CHECK(Cublas().GemmEx(
      b.cublas, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A,
      CUDA_R_16BF, static_cast<int>(lda), B, CUDA_R_16BF, static_cast<int>(ldb), &beta, C,
      CUDA_R_32F, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

__global__ void RoundToBf16Kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

// One array of a batched rounding; blockIdx.y picks the job.
struct RoundJob {
  const float* src;
  __nv_bfloat16* dst;
  int64_t n;
};

__global__ void RoundToBf16BatchKernel(const RoundJob* jobs) {
  const RoundJob j = jobs[blockIdx.y];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < j.n;
       i += stride) {
    j.dst[i] = __float2bfloat16_rn(j.src[i]);
  }
}

size_t Align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Bump allocation of bf16 operands in DeviceScratch2 (stream-ordered, valid for this call).
class Bf16Scratch {
 public:
  Bf16Scratch(Backend& b, size_t elements)
      : base_(static_cast<char*>(
            b.DeviceScratch2(Align256(elements * sizeof(__nv_bfloat16)) + 3 * 256))) {}
  __nv_bfloat16* Take(int64_t n) {
    auto* p = reinterpret_cast<__nv_bfloat16*>(base_ + used_);
    used_ += Align256(static_cast<size_t>(n) * sizeof(__nv_bfloat16));
    return p;
  }

 private:
  char* base_;
  size_t used_ = 0;
};

// The bf16 operand for a weight: the compute copy itself, or the fp32 weight rounded into scratch.
const __nv_bfloat16* WeightBf16(Backend& b, Bf16Scratch& s, const void* weight, int64_t n,
                                GemmMode mode) {
  if (mode == GemmMode::kBf16Weights) return static_cast<const __nv_bfloat16*>(weight);
  __nv_bfloat16* w = s.Take(n);
  RoundToBf16(b, w, static_cast<const float*>(weight), n);
  return w;
}

__global__ void AddBiasKernel(float* out, const float* bias, int64_t N, int64_t C) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] += bias[i % C];
}

// dbias in two deterministic passes over fixed row chunks (a function of N and C only, so the
// order of additions never changes between runs). Pass 1: partial[chunk][c] = the chunk's rows
// summed in order, one thread per column (coalesced along a row).
__global__ void ColumnPartialKernel(float* partial, const float* x, int64_t N, int64_t C,
                                    int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += x[r * C + c];
  partial[static_cast<int64_t>(blockIdx.y) * C + c] = acc;
}

// Pass 2: out[c] += each chunk's partial, in chunk order.
__global__ void ColumnFinishKernel(float* out, const float* partial, int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = out[c];
  for (int64_t p = 0; p < chunks; ++p) acc += partial[p * C + c];
  out[c] = acc;
}

// out[c] += sum over the N rows of x [N, C].
void AccumulateColumnSums(Backend& b, float* out, const float* x, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  // Enough chunks to keep the GPU busy, each at least 32 rows.
  const int64_t want = std::max<int64_t>(1, (int64_t{1} << 20) / C);
  const int64_t k = std::max<int64_t>(1, std::min<int64_t>({want, (N + 31) / 32, 4096}));
  const int64_t rows = (N + k - 1) / k;
  const int64_t chunks = (N + rows - 1) / rows;
  float* partial = static_cast<float*>(
      b.DeviceScratch(static_cast<size_t>(chunks) * static_cast<size_t>(C) * sizeof(float)));
  const dim3 grid(CeilDiv(C, kThreads), static_cast<unsigned>(chunks));
  ColumnPartialKernel<<<grid, kThreads, 0, b.stream>>>(partial, x, N, C, rows);
  STRATA_CUDA_LAUNCH_CHECK();
  ColumnFinishKernel<<<CeilDiv(C, kThreads), kThreads, 0, b.stream>>>(out, partial, chunks, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

}  // namespace

void RoundToBf16(Backend& b, void* dst, const float* src, int64_t n) {
  if (n == 0) return;
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20));
  RoundToBf16Kernel<<<blocks, kThreads, 0, b.stream>>>(static_cast<__nv_bfloat16*>(dst), src, n);
  STRATA_CUDA_LAUNCH_CHECK();
}

void RoundToBf16Batch(Backend& b, void* const* dst, const float* const* src, const int64_t* n,
                      int64_t count) {
  constexpr int64_t kMaxJobs = 65535;  // gridDim.y
  for (int64_t first = 0; first < count; first += kMaxJobs) {
    const int64_t jobs = std::min(kMaxJobs, count - first);
    std::vector<RoundJob> table(static_cast<size_t>(jobs));
    int64_t longest = 0;
    for (int64_t j = 0; j < jobs; ++j) {
      table[j] =
          RoundJob{src[first + j], static_cast<__nv_bfloat16*>(dst[first + j]), n[first + j]};
      longest = std::max(longest, n[first + j]);
    }
    if (longest == 0) continue;
    const size_t bytes = table.size() * sizeof(RoundJob);
    auto* d_table = static_cast<RoundJob*>(b.DeviceScratch2(bytes));
    b.UploadSmall(d_table, table.data(), bytes);
    const dim3 grid(
        static_cast<unsigned>(std::min<int64_t>((longest + kThreads - 1) / kThreads, 1024)),
        static_cast<unsigned>(jobs));
    RoundToBf16BatchKernel<<<grid, kThreads, 0, b.stream>>>(d_table);
    STRATA_CUDA_LAUNCH_CHECK();
  }
}

void LinearForward(Backend& b, float* out, const float* inp, const void* weight, const float* bias,
                   int64_t N, int64_t IC, int64_t OC, GemmMode mode) {
  if (N == 0 || OC == 0) return;
  if (IC == 0) {
    // An empty inner dimension: the product is zero (not left to cuBLAS's k = 0 handling).
    STRATA_CUDA_CHECK(
        cudaMemsetAsync(out, 0, static_cast<size_t>(N * OC) * sizeof(float), b.stream));
  } else if (mode == GemmMode::kFp32) {
    // out^T [OC, N] = W [OC, IC] inp^T [IC, N]; W read column-major is W^T, so op(W) = T.
    Gemm(b, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, 1.0f, static_cast<const float*>(weight), IC, inp,
         IC, 0.0f, out, OC);
  } else {
    Bf16Scratch s(b, N * IC + (mode == GemmMode::kBf16 ? OC * IC : 0));
    __nv_bfloat16* x = s.Take(N * IC);
    RoundToBf16(b, x, inp, N * IC);
    const __nv_bfloat16* w = WeightBf16(b, s, weight, OC * IC, mode);
    GemmBf16(b, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, 1.0f, w, IC, x, IC, 0.0f, out, OC);
  }
  if (bias != nullptr) AddBias(b, out, bias, N, OC);
}

void AddBias(Backend& b, float* out, const float* bias, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  const int64_t blocks = std::min<int64_t>((N * C + kThreads - 1) / kThreads, int64_t{1} << 20);
  AddBiasKernel<<<static_cast<unsigned>(blocks), kThreads, 0, b.stream>>>(out, bias, N, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

void BiasGrad(Backend& b, float* dbias, const float* dout, int64_t N, int64_t C) {
  AccumulateColumnSums(b, dbias, dout, N, C);
}

void LinearBackward(Backend& b, float* dinp, float* dweight, float* dbias, const float* dout,
                    const float* inp, const void* weight, int64_t N, int64_t IC, int64_t OC,
                    bool accumulate_dinp, GemmMode mode) {
  if (N == 0) return;  // every output is empty or gets nothing added
  // The bias gradient from the fp32 dout (before any bf16 scratch is taken: it uses scratch too).
  if (dbias != nullptr) AccumulateColumnSums(b, dbias, dout, N, OC);
  const bool gemm_dw = dweight != nullptr && IC > 0 && OC > 0;
  const bool gemm_dinp = dinp != nullptr && IC > 0 && OC > 0;
  if (mode == GemmMode::kFp32) {
    const auto* w = static_cast<const float*>(weight);
    // Parameter gradients first: they read inp, which dinp may alias (stream order keeps them
    // before the dinp GEMM).
    if (gemm_dw) {
      // dweight^T [IC, OC] += inp^T [IC, N] dout [N, OC]; dout read column-major is dout^T.
      Gemm(b, CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, 1.0f, inp, IC, dout, OC, 1.0f, dweight, IC);
    }
    if (gemm_dinp) {
      // dinp^T [IC, N] (+)= W^T [IC, OC] dout^T [OC, N]; both read column-major as they are.
      Gemm(b, CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, 1.0f, w, IC, dout, OC,
           accumulate_dinp ? 1.0f : 0.0f, dinp, IC);
    }
  } else if (gemm_dw || gemm_dinp) {
    // The same products on bf16 operands; inp is rounded before dinp (which may alias it) is
    // written.
    Bf16Scratch s(
        b, N * OC + (gemm_dw ? N * IC : 0) + (gemm_dinp && mode == GemmMode::kBf16 ? OC * IC : 0));
    __nv_bfloat16* dy = s.Take(N * OC);
    RoundToBf16(b, dy, dout, N * OC);
    if (gemm_dw) {
      __nv_bfloat16* x = s.Take(N * IC);
      RoundToBf16(b, x, inp, N * IC);
      GemmBf16(b, CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, 1.0f, x, IC, dy, OC, 1.0f, dweight, IC);
    }
    if (gemm_dinp) {
      const __nv_bfloat16* w = WeightBf16(b, s, weight, OC * IC, mode);
      GemmBf16(b, CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, 1.0f, w, IC, dy, OC,
               accumulate_dinp ? 1.0f : 0.0f, dinp, IC);
    }
  }
  if (dinp != nullptr && IC > 0 && OC == 0 && !accumulate_dinp) {
    STRATA_CUDA_CHECK(
        cudaMemsetAsync(dinp, 0, static_cast<size_t>(N * IC) * sizeof(float), b.stream));
  }
}

}  // namespace strata::cuda
