// The dense layers' CUDA kernels other than the GEMMs: embedding, norms, activations, element-wise
// ops, cross-entropy and the optimizer. Each mirrors kernels/cpu's function of the same name.
//
// Determinism: every reduction has a fixed shape that depends only on the sizes. Row statistics
// are block tree reductions; sums over rows (the gradients of weights and biases) are two passes
// over fixed row chunks (per-chunk column partials in scratch, then each column adds its chunks in
// chunk order); embedding gradients sum each token's positions in position order after a stable
// sort. No float atomics anywhere.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/backend.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kThreads = 256;  // block size of the element-wise and per-row kernels
constexpr int64_t kMaxGrid = int64_t{1} << 20;

// Blocks for a grid-stride loop over n elements (capped: the loops stride by the grid).
unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxGrid));
}

size_t AlignUp(size_t x) { return (x + 255) & ~size_t{255}; }

// *out = sum of in[0, n) in double, by one block in a fixed order.
template <typename T>
__global__ void SumToDoubleKernel(double* out, const T* in, int64_t n) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<double>(in[i]);
  s = BlockSum(s);
  if (threadIdx.x == 0) *out = s;
}

double ReadDouble(Backend& b, const double* d) {
  double* h = static_cast<double*>(b.HostScratch(sizeof(double)));
  STRATA_CUDA_CHECK(cudaMemcpyAsync(h, d, sizeof(double), cudaMemcpyDeviceToHost, b.stream));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(b.stream));
  return *h;
}

// ---- Column sums over rows, in two deterministic passes ----------------------------------------

// Row chunks for the column sums: enough of them to keep the GPU busy, each at least 32 rows, and
// a function of N and C only, so the order of the additions never changes between runs.
struct RowChunks {
  int64_t rows = 1;   // rows per chunk
  int64_t count = 0;  // number of chunks
};
RowChunks PlanRowChunks(int64_t N, int64_t C) {
  const int64_t want = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(C, 1));
  const int64_t k = std::max<int64_t>(1, std::min<int64_t>({want, (N + 31) / 32, 4096}));
  RowChunks p;
  p.rows = (N + k - 1) / k;
  p.count = (N + p.rows - 1) / p.rows;
  return p;
}

// Pass 1: partial[(chunk * kVec + v) * C + c] = sum over the chunk's rows, in row order, of the
// functor's v-th term for (r, c). One thread per column: loads are coalesced along the row.
template <int kVec, typename Terms>
__global__ void ColumnPartialKernel(float* partial, int64_t N, int64_t C, int64_t rows_per_chunk,
                                    Terms terms) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float acc[kVec];
  for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
  for (int64_t r = r0; r < r1; ++r) terms(r, c, acc);
  for (int v = 0; v < kVec; ++v)
    partial[(static_cast<int64_t>(blockIdx.y) * kVec + v) * C + c] = acc[v];
}

// Pass 2: out_v[c] += each chunk's partial in chunk order (as the CPU's RowPartialSums adds its
// slices' partials). Null outputs are skipped.
__global__ void ColumnFinishKernel(float* out0, float* out1, const float* partial, int64_t chunks,
                                   int kvec, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float* outs[2] = {out0, out1};
  for (int v = 0; v < kvec; ++v) {
    if (outs[v] == nullptr) continue;
    float acc = outs[v][c];
    for (int64_t p = 0; p < chunks; ++p) acc += partial[(p * kvec + v) * C + c];
    outs[v][c] = acc;
  }
}

// out0[c] += sum_r term0(r, c), out1[c] += sum_r term1(r, c) (kVec <= 2; outputs may be null).
template <int kVec, typename Terms>
void ColumnSums(Backend& b, float* out0, float* out1, int64_t N, int64_t C, Terms terms) {
  static_assert(kVec == 1 || kVec == 2, "at most two column sums at once");
  if (N == 0 || C == 0 || (out0 == nullptr && out1 == nullptr)) return;
  const RowChunks p = PlanRowChunks(N, C);
  float* partial = static_cast<float*>(b.DeviceScratch(static_cast<size_t>(p.count) * kVec *
                                                       static_cast<size_t>(C) * sizeof(float)));
  const dim3 grid(CeilDiv(C, kThreads), static_cast<unsigned>(p.count));
  ColumnPartialKernel<kVec><<<grid, kThreads, 0, b.stream>>>(partial, N, C, p.rows, terms);
  STRATA_CUDA_LAUNCH_CHECK();
  ColumnFinishKernel<<<CeilDiv(C, kThreads), kThreads, 0, b.stream>>>(out0, out1, partial, p.count,
                                                                      kVec, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

// ---- Embedding ---------------------------------------------------------------------------------

__global__ void EmbeddingForwardKernel(float* out, const int32_t* tokens, const float* wte,
                                       const float* wpe, int64_t N, int64_t T, int64_t C,
                                       const int32_t* positions) {
  STRATA_GRID_STRIDE(i, N * C) {
    const int64_t r = i / C, c = i % C;
    const int64_t p = positions != nullptr ? static_cast<int64_t>(positions[r]) : r % T;
    out[i] = wte[static_cast<int64_t>(tokens[r]) * C + c] + wpe[p * C + c];
  }
}

__global__ void IotaKernel(int32_t* x, int64_t n) {
  STRATA_GRID_STRIDE(i, n) x[i] = static_cast<int32_t>(i);
}

// One block per sorted position (x) and channel chunk (y). The block at the start of a run of
// equal tokens adds the run's rows into that token's dwte row, in position order (the sort is
// stable), so the additions are exactly the CPU's: dwte[tok][c] += d[p0][c], += d[p1][c], ...
__global__ void EmbeddingBackwardWteKernel(float* dwte, const float* dout,
                                           const uint32_t* sorted_tok, const int32_t* sorted_pos,
                                           int64_t N, int64_t C) {
  const int64_t i = blockIdx.x;
  const uint32_t tok = sorted_tok[i];
  if (i > 0 && sorted_tok[i - 1] == tok) return;  // not the first of its run
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float* e = dwte + static_cast<int64_t>(tok) * C + c;
  float acc = *e;
  for (int64_t j = i; j < N && sorted_tok[j] == tok; ++j)
    acc += dout[static_cast<int64_t>(sorted_pos[j]) * C + c];
  *e = acc;
}

// dwpe[t][c] += dout[b][t][c] for b = 0, 1, ... in order, one thread per (t, c).
__global__ void EmbeddingBackwardWpeKernel(float* dwpe, const float* dout, int64_t B, int64_t T,
                                           int64_t C) {
  STRATA_GRID_STRIDE(i, T * C) {
    float acc = dwpe[i];
    for (int64_t bb = 0; bb < B; ++bb) acc += dout[bb * T * C + i];
    dwpe[i] = acc;
  }
}

// ---- Norms (one block per row) -----------------------------------------------------------------

__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* inp,
                                       const float* weight, const float* bias, int64_t C,
                                       float eps) {
  const int64_t r = blockIdx.x;
  const float* x = inp + r * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
  const float m = BlockSum(s) / static_cast<float>(C);
  // Variance from the centred values (two passes, as the CPU), not E[x^2] - m^2.
  float q = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = x[c] - m;
    q += d * d;
  }
  const float var = BlockSum(q) / static_cast<float>(C);
  const float rs = 1.0f / sqrtf(var + eps);
  float* o = out + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    o[c] = (x[c] - m) * rs * weight[c] + (bias != nullptr ? bias[c] : 0.0f);
  if (threadIdx.x == 0) {
    if (mean != nullptr) mean[r] = m;
    if (rstd != nullptr) rstd[r] = rs;
  }
}

// dinp += rstd * (dn - mean(dn) - xhat * mean(dn * xhat)), dn = dout * weight.
__global__ void LayerNormBackwardKernel(float* dinp, const float* dout, const float* inp,
                                        const float* weight, const float* mean, const float* rstd,
                                        int64_t C) {
  const int64_t r = blockIdx.x;
  const float* x = inp + r * C;
  const float* dy = dout + r * C;
  const float m = mean[r], s = rstd[r];
  float sum_dn = 0.0f, sum_dn_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = (x[c] - m) * s;
    const float dn = dy[c] * weight[c];
    sum_dn += dn;
    sum_dn_xhat += dn * xhat;
  }
  const float mean_dn = BlockSum(sum_dn) / static_cast<float>(C);
  const float mean_dn_xhat = BlockSum(sum_dn_xhat) / static_cast<float>(C);
  float* dx = dinp + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = (x[c] - m) * s;
    const float dn = dy[c] * weight[c];
    dx[c] += s * (dn - mean_dn - xhat * mean_dn_xhat);
  }
}

// The per-(row, column) terms of LayerNorm's dweight (dout * xhat) and dbias (dout).
struct LayerNormParamTerms {
  const float* dout;
  const float* inp;
  const float* mean;
  const float* rstd;
  int64_t C;
  __device__ void operator()(int64_t r, int64_t c, float* acc) const {
    const float dy = dout[r * C + c];
    acc[0] += dy * ((inp[r * C + c] - mean[r]) * rstd[r]);
    acc[1] += dy;
  }
};

__global__ void RmsNormForwardKernel(float* out, float* rstd, const float* inp, const float* weight,
                                     int64_t C, float eps) {
  const int64_t r = blockIdx.x;
  const float* x = inp + r * C;
  float q = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) q += x[c] * x[c];
  const float ms = BlockSum(q) / static_cast<float>(C);
  const float rs = 1.0f / sqrtf(ms + eps);
  float* o = out + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = x[c] * rs * weight[c];
  if (threadIdx.x == 0 && rstd != nullptr) rstd[r] = rs;
}

// dinp += rstd * (dout * weight - xhat * mean(dout * weight * xhat)), xhat = x * rstd.
__global__ void RmsNormBackwardKernel(float* dinp, const float* dout, const float* inp,
                                      const float* weight, const float* rstd, int64_t C) {
  const int64_t r = blockIdx.x;
  const float* x = inp + r * C;
  const float* dy = dout + r * C;
  const float s = rstd[r];
  float sum_dn_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    sum_dn_xhat += dy[c] * weight[c] * (x[c] * s);
  const float mean_dn_xhat = BlockSum(sum_dn_xhat) / static_cast<float>(C);
  float* dx = dinp + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dx[c] += s * (dy[c] * weight[c] - x[c] * s * mean_dn_xhat);
}

struct RmsNormWeightTerms {
  const float* dout;
  const float* inp;
  const float* rstd;
  int64_t C;
  __device__ void operator()(int64_t r, int64_t c, float* acc) const {
    acc[0] += dout[r * C + c] * (inp[r * C + c] * rstd[r]);
  }
};

// ---- Activations -------------------------------------------------------------------------------

constexpr float kGeluScale = static_cast<float>(0.7978845608028654);  // sqrt(2 / pi)
constexpr float kGeluCubic = static_cast<float>(0.044715);
constexpr float kGeluCubic3 = static_cast<float>(3 * 0.044715);

__device__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ float Gelu(float v) {
  const float u = kGeluScale * (v + kGeluCubic * v * v * v);
  return 0.5f * v * (1.0f + tanhf(u));
}

// out[r, c] = act(x[r, c]) (SwiGLU: silu(x[r, c]) * x[r, H + c]), one thread per output; x has
// rows of width W. With a bias, the biased pre-activations are written back to x first.
__global__ void ActivationForwardKernel(Activation act, float* out, float* pre, const float* inp,
                                        const float* bias, int64_t N, int64_t H, int64_t W) {
  STRATA_GRID_STRIDE(i, N * H) {
    const int64_t r = i / H, c = i % H;
    const float* x = inp + r * W;
    float g = x[c];
    if (pre != nullptr && bias != nullptr) {
      g += bias[c];
      pre[r * W + c] = g;
    }
    switch (act) {
      case Activation::kGelu:
        out[i] = Gelu(g);
        break;
      case Activation::kRelu:
        out[i] = g > 0.0f ? g : 0.0f;
        break;
      case Activation::kSwiglu: {
        float u = x[H + c];
        if (pre != nullptr && bias != nullptr) {
          u += bias[H + c];
          pre[r * W + H + c] = u;
        }
        out[i] = g * Sigmoid(g) * u;
        break;
      }
    }
  }
}

// dinp from dout and the pre-activation; each thread reads exactly the inp elements it writes
// (before writing them), so dinp may alias inp.
__global__ void ActivationBackwardKernel(Activation act, float* dinp, const float* dout,
                                         const float* inp, int64_t N, int64_t H, int64_t W) {
  STRATA_GRID_STRIDE(i, N * H) {
    const int64_t r = i / H, c = i % H;
    const float* x = inp + r * W;
    float* dx = dinp + r * W;
    const float dy = dout[i];
    switch (act) {
      case Activation::kGelu: {
        const float v = x[c];
        const float u = kGeluScale * (v + kGeluCubic * v * v * v);
        const float th = tanhf(u);
        const float du = kGeluScale * (1.0f + kGeluCubic3 * v * v);
        dx[c] = dy * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du);
        break;
      }
      case Activation::kRelu:
        dx[c] = x[c] > 0.0f ? dy : 0.0f;
        break;
      case Activation::kSwiglu: {
        const float gv = x[c], uv = x[H + c];
        const float s = Sigmoid(gv);
        dx[c] = dy * uv * s * (1.0f + gv * (1.0f - s));
        dx[H + c] = dy * gv * s;
        break;
      }
    }
  }
}

struct RowValueTerms {
  const float* x;
  int64_t C;
  __device__ void operator()(int64_t r, int64_t c, float* acc) const { acc[0] += x[r * C + c]; }
};

// ---- Element-wise, loss, optimizer -------------------------------------------------------------

__global__ void AddKernel(float* out, const float* a, const float* bb, int64_t n) {
  STRATA_GRID_STRIDE(i, n) out[i] = a[i] + bb[i];
}

__global__ void AccumulateKernel(float* out, const float* a, int64_t n) {
  STRATA_GRID_STRIDE(i, n) out[i] += a[i];
}

// One block per row: loss[r] = logsumexp(x) - x[target]; d = exp(x - lse) * scale, minus scale at
// the target. Every read of the row happens before the barrier in the second BlockSum and each
// thread writes only the elements it reads last, so dlogits may alias logits.
__global__ void CrossEntropyKernel(float* dlogits, float* losses, const float* logits,
                                   const int32_t* targets, int64_t V, float grad_scale) {
  const int64_t r = blockIdx.x;
  const float* x = logits + r * V;
  const int64_t tgt = targets[r];
  const float x_tgt = x[tgt];
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, x[v]);
  mx = BlockMax(mx);
  float s = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += expf(x[v] - mx);
  s = BlockSum(s);
  const float lse = mx + logf(s);
  if (threadIdx.x == 0) losses[r] = lse - x_tgt;
  if (dlogits == nullptr) return;
  float* d = dlogits + r * V;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    float g = expf(x[v] - lse) * grad_scale;
    if (v == tgt) g -= grad_scale;
    d[v] = g;
  }
}

struct AdamWConsts {
  float lr, b1, b2, one_minus_b1, one_minus_b2, eps, decay, bc1, bc2, gs;
};

// The CPU's update, operation by operation, with round-to-nearest intrinsics so that nothing is
// fused into an FMA (the CPU builds optimizer.cc with -ffp-contract=off): same bits as the CPU.
__global__ void AdamWKernel(float* param, const float* grad, float* m, float* v, int64_t n,
                            AdamWConsts k) {
  STRATA_GRID_STRIDE(i, n) {
    const float g = __fmul_rn(grad[i], k.gs);
    const float mi = __fadd_rn(__fmul_rn(k.b1, m[i]), __fmul_rn(k.one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(k.b2, v[i]), __fmul_rn(__fmul_rn(k.one_minus_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float p = __fmul_rn(param[i], k.decay);
    const float num = __fmul_rn(k.lr, __fdiv_rn(mi, k.bc1));
    const float den = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, k.bc2)), k.eps);
    param[i] = __fsub_rn(p, __fdiv_rn(num, den));
  }
}

constexpr int kSumSquaresBlocks = 1024;

// Per-block partial sums of x^2 in double; the block count depends only on n.
__global__ void SumSquaresKernel(double* partial, const float* x, int64_t n) {
  double s = 0;
  STRATA_GRID_STRIDE(i, n) {
    const double xi = static_cast<double>(x[i]);
    s += xi * xi;
  }
  s = BlockSum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

#undef STRATA_GRID_STRIDE

}  // namespace

// ---- Embedding ---------------------------------------------------------------------------------

void EmbeddingForward(Backend& b, float* out, const int32_t* tokens, const float* wte,
                      const float* wpe, int64_t B, int64_t T, int64_t C, const int32_t* positions) {
  const int64_t N = B * T;
  if (N == 0 || C == 0) return;
  EmbeddingForwardKernel<<<GridFor(N * C), kThreads, 0, b.stream>>>(out, tokens, wte, wpe, N, T, C,
                                                                    positions);
  STRATA_CUDA_LAUNCH_CHECK();
}

void EmbeddingBackward(Backend& b, float* dwte, float* dwpe, const float* dout,
                       const int32_t* tokens, int64_t B, int64_t T, int64_t C, int64_t V) {
  const int64_t N = B * T;
  if (N == 0 || C == 0) return;
  if (dwpe != nullptr) {
    EmbeddingBackwardWpeKernel<<<GridFor(T * C), kThreads, 0, b.stream>>>(dwpe, dout, B, T, C);
    STRATA_CUDA_LAUNCH_CHECK();
  }
  if (dwte == nullptr) return;
  CHECK_LE(N, static_cast<int64_t>(INT_MAX)) << "too many tokens for one embedding backward";
  CHECK_LE(CeilDiv(C, kThreads), 65535u) << "embedding width too large";
  CHECK_GT(V, 0);
  // Sort the positions by token (stable, so each token's positions stay in order), over only the
  // bits a token in [0, V) can have. Tokens are non-negative, so sorting them as unsigned keeps
  // their order.
  int end_bit = 1;
  while (end_bit < 32 && (int64_t{1} << end_bit) < V) ++end_bit;
  const int n = static_cast<int>(N);
  const uint32_t* keys_in = reinterpret_cast<const uint32_t*>(tokens);
  size_t temp_bytes = 0;
  STRATA_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, static_cast<uint32_t*>(nullptr),
                                      static_cast<const int32_t*>(nullptr),
                                      static_cast<int32_t*>(nullptr), n, 0, end_bit, b.stream));
  // One scratch request (a second would invalidate the first), carved into four parts.
  const size_t arr = AlignUp(static_cast<size_t>(N) * 4);
  char* scratch = static_cast<char*>(b.DeviceScratch(3 * arr + AlignUp(temp_bytes)));
  uint32_t* sorted_tok = reinterpret_cast<uint32_t*>(scratch);
  int32_t* pos = reinterpret_cast<int32_t*>(scratch + arr);
  int32_t* sorted_pos = reinterpret_cast<int32_t*>(scratch + 2 * arr);
  void* temp = scratch + 3 * arr;
  IotaKernel<<<GridFor(N), kThreads, 0, b.stream>>>(pos, N);
  STRATA_CUDA_LAUNCH_CHECK();
  STRATA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, sorted_tok, pos,
                                                    sorted_pos, n, 0, end_bit, b.stream));
  const dim3 grid(static_cast<unsigned>(N), CeilDiv(C, kThreads));
  EmbeddingBackwardWteKernel<<<grid, kThreads, 0, b.stream>>>(dwte, dout, sorted_tok, sorted_pos, N,
                                                              C);
  STRATA_CUDA_LAUNCH_CHECK();
}

// ---- Norms -------------------------------------------------------------------------------------

void LayerNormForward(Backend& b, float* out, float* mean, float* rstd, const float* inp,
                      const float* weight, const float* bias, int64_t N, int64_t C, float eps) {
  if (N == 0 || C == 0) return;
  CHECK_LE(N, static_cast<int64_t>(INT_MAX));
  LayerNormForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, b.stream>>>(out, mean, rstd, inp,
                                                                              weight, bias, C, eps);
  STRATA_CUDA_LAUNCH_CHECK();
}

void LayerNormBackward(Backend& b, float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  CHECK_LE(N, static_cast<int64_t>(INT_MAX));
  // Parameter gradients first (they read inp and dout), as the CPU computes a row's partials
  // before writing its dinp.
  ColumnSums<2>(b, dweight, dbias, N, C, LayerNormParamTerms{dout, inp, mean, rstd, C});
  if (dinp == nullptr) return;
  LayerNormBackwardKernel<<<static_cast<unsigned>(N), kThreads, 0, b.stream>>>(
      dinp, dout, inp, weight, mean, rstd, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

void RmsNormForward(Backend& b, float* out, float* rstd, const float* inp, const float* weight,
                    int64_t N, int64_t C, float eps) {
  if (N == 0 || C == 0) return;
  CHECK_LE(N, static_cast<int64_t>(INT_MAX));
  RmsNormForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, b.stream>>>(out, rstd, inp, weight,
                                                                            C, eps);
  STRATA_CUDA_LAUNCH_CHECK();
}

void RmsNormBackward(Backend& b, float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, const float* rstd, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  CHECK_LE(N, static_cast<int64_t>(INT_MAX));
  ColumnSums<1>(b, dweight, nullptr, N, C, RmsNormWeightTerms{dout, inp, rstd, C});
  if (dinp == nullptr) return;
  RmsNormBackwardKernel<<<static_cast<unsigned>(N), kThreads, 0, b.stream>>>(dinp, dout, inp,
                                                                             weight, rstd, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

// ---- Activations -------------------------------------------------------------------------------

void ActivationForward(Backend& b, Activation act, float* out, const float* inp, int64_t N,
                       int64_t H) {
  if (N == 0 || H == 0) return;
  const int64_t W = ops::ActivationInputWidth(act, H);
  ActivationForwardKernel<<<GridFor(N * H), kThreads, 0, b.stream>>>(act, out, nullptr, inp,
                                                                     nullptr, N, H, W);
  STRATA_CUDA_LAUNCH_CHECK();
}

void BiasActivationForward(Backend& b, Activation act, float* out, float* pre, const float* bias,
                           int64_t N, int64_t H) {
  if (N == 0 || H == 0) return;
  const int64_t W = ops::ActivationInputWidth(act, H);
  // Each thread reads and rewrites only its own pre-activation(s), so pre is both input and
  // output.
  ActivationForwardKernel<<<GridFor(N * H), kThreads, 0, b.stream>>>(act, out, pre, pre, bias, N, H,
                                                                     W);
  STRATA_CUDA_LAUNCH_CHECK();
}

void ActivationBackward(Backend& b, Activation act, float* dinp, const float* dout,
                        const float* inp, int64_t N, int64_t H, float* dbias) {
  if (N == 0 || H == 0) return;
  const int64_t W = ops::ActivationInputWidth(act, H);
  ActivationBackwardKernel<<<GridFor(N * H), kThreads, 0, b.stream>>>(act, dinp, dout, inp, N, H,
                                                                      W);
  STRATA_CUDA_LAUNCH_CHECK();
  // dbias sums the finished dinp's columns (stream order puts this after the kernel above).
  if (dbias != nullptr) ColumnSums<1>(b, dbias, nullptr, N, W, RowValueTerms{dinp, W});
}

// ---- Element-wise ------------------------------------------------------------------------------

void Add(Backend& b, float* out, const float* a, const float* bb, int64_t n) {
  if (n == 0) return;
  AddKernel<<<GridFor(n), kThreads, 0, b.stream>>>(out, a, bb, n);
  STRATA_CUDA_LAUNCH_CHECK();
}

void Accumulate(Backend& b, float* out, const float* a, int64_t n) {
  if (n == 0) return;
  AccumulateKernel<<<GridFor(n), kThreads, 0, b.stream>>>(out, a, n);
  STRATA_CUDA_LAUNCH_CHECK();
}

// ---- Loss --------------------------------------------------------------------------------------

double CrossEntropy(Backend& b, float* dlogits, const float* logits, const int32_t* targets,
                    int64_t N, int64_t V, float grad_scale) {
  if (N == 0 || V == 0) return 0.0;
  CHECK_LE(N, static_cast<int64_t>(INT_MAX));
  // Per-row float losses (as the CPU keeps them), then one fixed-order sum in double.
  const size_t loss_bytes = AlignUp(static_cast<size_t>(N) * sizeof(float));
  char* scratch = static_cast<char*>(b.DeviceScratch(loss_bytes + sizeof(double)));
  float* losses = reinterpret_cast<float*>(scratch);
  double* total = reinterpret_cast<double*>(scratch + loss_bytes);
  CrossEntropyKernel<<<static_cast<unsigned>(N), kThreads, 0, b.stream>>>(dlogits, losses, logits,
                                                                          targets, V, grad_scale);
  STRATA_CUDA_LAUNCH_CHECK();
  SumToDoubleKernel<float><<<1, 1024, 0, b.stream>>>(total, losses, N);
  STRATA_CUDA_LAUNCH_CHECK();
  return ReadDouble(b, total);
}

// ---- Optimizer ---------------------------------------------------------------------------------

void AdamW(Backend& b, float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWHyper& h) {
  if (n == 0) return;
  // The constants exactly as kernels/cpu/optimizer.cc forms them (in double, then rounded).
  AdamWConsts k;
  k.lr = static_cast<float>(h.lr);
  k.b1 = static_cast<float>(h.beta1);
  k.b2 = static_cast<float>(h.beta2);
  k.one_minus_b1 = 1.0f - k.b1;
  k.one_minus_b2 = 1.0f - k.b2;
  k.eps = static_cast<float>(h.eps);
  k.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  k.bc1 = static_cast<float>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  k.bc2 = static_cast<float>(1.0 - std::pow(h.beta2, static_cast<double>(h.step)));
  k.gs = static_cast<float>(h.grad_scale);
  AdamWKernel<<<GridFor(n), kThreads, 0, b.stream>>>(param, grad, m, v, n, k);
  STRATA_CUDA_LAUNCH_CHECK();
}

double SumSquares(Backend& b, const float* x, int64_t n) {
  if (n == 0) return 0.0;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kSumSquaresBlocks));
  char* scratch = static_cast<char*>(b.DeviceScratch((blocks + 1) * sizeof(double)));
  double* partial = reinterpret_cast<double*>(scratch);
  double* total = partial + blocks;
  SumSquaresKernel<<<blocks, kThreads, 0, b.stream>>>(partial, x, n);
  STRATA_CUDA_LAUNCH_CHECK();
  SumToDoubleKernel<double><<<1, 1024, 0, b.stream>>>(total, partial, blocks);
  STRATA_CUDA_LAUNCH_CHECK();
  return ReadDouble(b, total);
}

}  // namespace strata::cuda
