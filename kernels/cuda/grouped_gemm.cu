// The experts' GEMMs: G row blocks of one activation matrix, each times its own expert's weight,
// through cuBLAS.
//
// Row-major [rows, IC] x [OC, IC]^T is done as the column-major product out^T = W x^T (a row-major
// matrix is its own transpose in column-major), so nothing is transposed in memory. Every
// non-empty group is one problem of the grouped call (groups of one GEMM each: the row counts
// differ); empty groups are left out, which also means a group with no rows contributes nothing
// to its weight gradient, as on the CPU.
//
// fp32: a single cublasGemmGroupedBatchedEx call (CUBLAS_COMPUTE_32F, no TF32) for the forward,
// and a single one for the whole backward (the dinp and dW problems write disjoint matrices, so
// they can share a call). bf16 modes: inputs (and dout in backward) are rounded to bfloat16
// (round to nearest even) and multiplied with fp32 accumulation into fp32 outputs; the weights
// are the experts' bf16 compute copies (GemmMode::kBf16Weights) or fp32 rounded group by group
// into one scratch buffer (kBf16: experts from the tiered store). The grouped API does not take
// bf16 A/B with an fp32 C (its type table lists bf16 -> bf16 only), and a bf16 output would round
// the result and the accumulated dW, so the bf16 path is a loop of cublasGemmEx, one per group,
// which does take that combination.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cuda/backend.h"

namespace strata::cuda {
namespace {

int ToInt(int64_t v, const char* what) {
  CHECK(v >= 0 && v <= std::numeric_limits<int>::max()) << what << "=" << v;
  return static_cast<int>(v);
}

// Column-major GEMMs C = alpha op(A) op(B) + beta C, one group of one problem each. The scalar and
// dimension arrays stay on the host (cuBLAS reads them during the call); the pointer arrays go to
// the device.
struct Problems {
  std::vector<cublasOperation_t> transa, transb;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;
  std::vector<const void*> a, b;
  std::vector<void*> c;

  void Add(cublasOperation_t ta, cublasOperation_t tb, int m_, int n_, int k_, const void* a_,
           int lda_, const void* b_, int ldb_, float beta_, void* c_, int ldc_) {
    transa.push_back(ta);
    transb.push_back(tb);
    m.push_back(m_);
    n.push_back(n_);
    k.push_back(k_);
    a.push_back(a_);
    lda.push_back(lda_);
    b.push_back(b_);
    ldb.push_back(ldb_);
    alpha.push_back(1.f);
    beta.push_back(beta_);
    c.push_back(c_);
    ldc.push_back(ldc_);
    group_size.push_back(1);
  }
  size_t size() const { return m.size(); }
};

// All problems in one fp32 grouped call.
void RunGroupedFp32(Backend& b, const Problems& p) {
  const size_t P = p.size();
  if (P == 0) return;
  // Device arrays of device pointers: [A ... | B ... | C ...].
  std::vector<void*> ptrs(3 * P);
  for (size_t i = 0; i < P; ++i) {
    ptrs[i] = const_cast<void*>(p.a[i]);
    ptrs[P + i] = const_cast<void*>(p.b[i]);
    ptrs[2 * P + i] = p.c[i];
  }
  auto** d_ptrs = static_cast<void**>(b.DeviceScratch2(ptrs.size() * sizeof(void*)));
  b.UploadSmall(d_ptrs, ptrs.data(), ptrs.size() * sizeof(void*));
  STRATA_CUBLAS_CHECK(Cublas().GemmGroupedBatchedEx(
      b.cublas, p.transa.data(), p.transb.data(), p.m.data(), p.n.data(), p.k.data(),
      p.alpha.data(), d_ptrs, CUDA_R_32F, p.lda.data(), d_ptrs + P, CUDA_R_32F, p.ldb.data(),
      p.beta.data(), d_ptrs + 2 * P, CUDA_R_32F, p.ldc.data(), static_cast<int>(P),
      p.group_size.data(), CUBLAS_COMPUTE_32F));
}

// One bf16 x bf16 -> fp32 GEMM (fp32 accumulation).
void GemmBf16(Backend& b, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
              const __nv_bfloat16* A, int lda, const __nv_bfloat16* B, int ldb, float beta,
              float* C, int ldc) {
  const float alpha = 1.f;
  STRATA_CUBLAS_CHECK(Cublas().GemmEx(b.cublas, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B,
                                      CUDA_R_16BF, ldb, &beta, C, CUDA_R_32F, ldc,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Rows of group g, checked.
int64_t GroupRows(const int64_t* offsets, int64_t g) {
  const int64_t rows = offsets[g + 1] - offsets[g];
  CHECK(offsets[g] >= 0 && rows >= 0)
      << "group " << g << ": offsets " << offsets[g] << ", " << offsets[g + 1];
  return rows;
}

size_t Align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Group g's bf16 weight: its compute copy, or its fp32 weight rounded into `buffer`.
const __nv_bfloat16* GroupWeight(Backend& b, const void* const* weights, int64_t g, int64_t n,
                                 GemmMode mode, __nv_bfloat16* buffer) {
  if (mode == GemmMode::kBf16Weights) return static_cast<const __nv_bfloat16*>(weights[g]);
  RoundToBf16(b, buffer, static_cast<const float*>(weights[g]), n);
  return buffer;
}

}  // namespace

void GroupedLinearForward(Backend& b, float* out, const float* inp, const void* const* weights,
                          const int64_t* offsets, int64_t G, int64_t IC, int64_t OC,
                          GemmMode mode) {
  const int ic = ToInt(IC, "IC"), oc = ToInt(OC, "OC");
  CHECK(ic > 0 && oc > 0) << "IC=" << IC << " OC=" << OC;
  int64_t used = 0;
  for (int64_t g = 0; g < G; ++g) used += GroupRows(offsets, g) > 0 ? 1 : 0;
  if (used == 0) return;

  if (mode == GemmMode::kFp32) {
    Problems p;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = GroupRows(offsets, g);
      if (rows == 0) continue;
      // out_g^T [OC, rows] = W_g [OC, IC] x inp_g^T [IC, rows].
      p.Add(CUBLAS_OP_T, CUBLAS_OP_N, oc, ToInt(rows, "rows"), ic, weights[g], ic,
            inp + offsets[g] * IC, ic, 0.f, out + offsets[g] * OC, oc);
    }
    RunGroupedFp32(b, p);
    return;
  }

  // bf16: the rounded input for every row, and (kBf16) one weight buffer reused group after group
  // (the stream orders each rounding after the previous group's GEMM has read the buffer).
  const int64_t R = offsets[G];
  const size_t inp_bytes = Align256(R * IC * sizeof(__nv_bfloat16));
  const size_t w_bytes = mode == GemmMode::kBf16 ? Align256(OC * IC * sizeof(__nv_bfloat16)) : 0;
  char* scratch = static_cast<char*>(b.DeviceScratch(inp_bytes + w_bytes));
  auto* inp16 = reinterpret_cast<__nv_bfloat16*>(scratch);
  auto* w16 = reinterpret_cast<__nv_bfloat16*>(scratch + inp_bytes);
  RoundToBf16(b, inp16, inp, R * IC);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = GroupRows(offsets, g);
    if (rows == 0) continue;
    const __nv_bfloat16* w = GroupWeight(b, weights, g, OC * IC, mode, w16);
    GemmBf16(b, CUBLAS_OP_T, CUBLAS_OP_N, oc, ToInt(rows, "rows"), ic, w, ic,
             inp16 + offsets[g] * IC, ic, 0.f, out + offsets[g] * OC, oc);
  }
}

void GroupedLinearBackward(Backend& b, float* dinp, float* const* dweights, const float* dout,
                           const float* inp, const void* const* weights, const int64_t* offsets,
                           int64_t G, int64_t IC, int64_t OC, bool accumulate_dinp, GemmMode mode) {
  const int ic = ToInt(IC, "IC"), oc = ToInt(OC, "OC");
  CHECK(ic > 0 && oc > 0) << "IC=" << IC << " OC=" << OC;
  bool any_dinp = false, any_dw = false;
  for (int64_t g = 0; g < G; ++g) {
    if (GroupRows(offsets, g) == 0) continue;
    any_dinp = any_dinp || dinp != nullptr;
    any_dw = any_dw || (dweights != nullptr && dweights[g] != nullptr);
  }
  if (!any_dinp && !any_dw) return;
  if (dweights != nullptr) {
    // The problems of one grouped call must write disjoint matrices.
    std::vector<const float*> dw(dweights, dweights + G);
    dw.erase(std::remove(dw.begin(), dw.end(), nullptr), dw.end());
    std::sort(dw.begin(), dw.end());
    CHECK(std::adjacent_find(dw.begin(), dw.end()) == dw.end())
        << "GroupedLinearBackward: two groups share a weight gradient";
  }
  const float dinp_beta = accumulate_dinp ? 1.f : 0.f;

  if (mode == GemmMode::kFp32) {
    // The problems of one grouped call run in no particular order. When dinp overlaps inp (a
    // layer computing its input gradient in place, as the CPU kernel allows), every dW problem
    // must read inp before any dinp problem writes it: two calls, dW first, ordered by the stream.
    const int64_t R = offsets[G];
    const bool alias = dinp != nullptr && dinp < inp + R * IC && inp < dinp + R * IC;
    Problems p, dinp_after;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = GroupRows(offsets, g);
      if (rows == 0) continue;
      const int r = ToInt(rows, "rows");
      const float* dout_g = dout + offsets[g] * OC;
      if (dinp != nullptr) {
        Problems& q = alias ? dinp_after : p;
        // dinp_g^T [IC, rows] = W_g^T [IC, OC] x dout_g^T [OC, rows].
        q.Add(CUBLAS_OP_N, CUBLAS_OP_N, ic, r, oc, weights[g], ic, dout_g, oc, dinp_beta,
              dinp + offsets[g] * IC, ic);
      }
      if (dweights != nullptr && dweights[g] != nullptr) {
        // dW_g^T [IC, OC] += inp_g^T [IC, rows] x dout_g [rows, OC].
        p.Add(CUBLAS_OP_N, CUBLAS_OP_T, ic, oc, r, inp + offsets[g] * IC, ic, dout_g, oc, 1.f,
              dweights[g], ic);
      }
    }
    RunGroupedFp32(b, p);
    RunGroupedFp32(b, dinp_after);
    return;
  }

  // bf16: rounded dout always, rounded inp for dW, (kBf16) one rounded weight buffer for dinp
  // reused group after group (stream-ordered, as in the forward).
  const int64_t R = offsets[G];
  const size_t dout_bytes = Align256(R * OC * sizeof(__nv_bfloat16));
  const size_t inp_bytes = any_dw ? Align256(R * IC * sizeof(__nv_bfloat16)) : 0;
  const size_t w_bytes =
      any_dinp && mode == GemmMode::kBf16 ? Align256(OC * IC * sizeof(__nv_bfloat16)) : 0;
  char* scratch = static_cast<char*>(b.DeviceScratch(dout_bytes + inp_bytes + w_bytes));
  auto* dout16 = reinterpret_cast<__nv_bfloat16*>(scratch);
  auto* inp16 = reinterpret_cast<__nv_bfloat16*>(scratch + dout_bytes);
  auto* w16 = reinterpret_cast<__nv_bfloat16*>(scratch + dout_bytes + inp_bytes);
  RoundToBf16(b, dout16, dout, R * OC);
  if (any_dw) RoundToBf16(b, inp16, inp, R * IC);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = GroupRows(offsets, g);
    if (rows == 0) continue;
    const int r = ToInt(rows, "rows");
    const __nv_bfloat16* dout_g = dout16 + offsets[g] * OC;
    if (dinp != nullptr) {
      const __nv_bfloat16* w = GroupWeight(b, weights, g, OC * IC, mode, w16);
      GemmBf16(b, CUBLAS_OP_N, CUBLAS_OP_N, ic, r, oc, w, ic, dout_g, oc, dinp_beta,
               dinp + offsets[g] * IC, ic);
    }
    if (dweights != nullptr && dweights[g] != nullptr) {
      GemmBf16(b, CUBLAS_OP_N, CUBLAS_OP_T, ic, oc, r, inp16 + offsets[g] * IC, ic, dout_g, oc, 1.f,
               dweights[g], ic);
    }
  }
}

}  // namespace strata::cuda
