// bench_moe_gpu: one MoE layer, forward + backward, on the GPU, against dense cuBLAS on the same
// routed FLOPs and the naive PyTorch layer on CUDA.
//
// For each shape (tokens, d_model, d_hidden, experts, k), plain softmax top-k gate (renormalized
// when k > 1), dropless, GELU FFN experts without biases, every tensor on Device::Cuda(0):
//   strata  the op sequence of runtime/model/moe_layer.cc, gate.cc and expert.cc with the experts
//           as grouped GEMMs. Forward: gate LinearForward -> MoeRouterForward -> MoeAuxLoss ->
//           MoePlanDispatch (capacity 0) -> MoePermuteForward -> GroupedLinearForward (w1) ->
//           ActivationForward (GELU) -> GroupedLinearForward (w2) -> MoeCombineForward. Backward:
//           MoeCombineBackward -> GroupedLinearBackward (w2) -> ActivationBackward ->
//           GroupedLinearBackward (w1) -> MoePermuteBackward -> MoeRouterBackward -> gate
//           LinearBackward. --bf16 sets ctx.bf16: bf16 expert GEMM operands with fp32
//           accumulation, the experts' weights as bf16 compute copies made from the fp32
//           weights at the start of every step (RoundToBf16, timed), the router in fp32.
//   dense   the six GEMMs of one dense FFN over all R = tokens * k routed rows, one cuBLAS call
//           each on the legacy default stream: h = x W1^T, y = h W2^T, dW2 += dy^T h, dh = dy W2,
//           dW1 += dh^T x, dx = dh W1. cublasSgemm in fp32 (default math mode: no TF32), or with
//           --bf16 cublasGemmEx with bf16 A and B (converted once, before timing), fp32 C and
//           CUBLAS_COMPUTE_32F. Then the router's three GEMMs over the tokens, in fp32 as strata
//           runs them: logits = x Wg^T, dWg += dlogits^T x, dx += dlogits Wg. Nothing else: no
//           softmax, permutation, activation or combine. The limit a grouped layer can approach;
//           ratio = strata / dense (target <= 1.3 where experts get >= 1,024 rows, <= 1.5 bf16).
//   torch   the naive PyTorch layer (a Python loop over experts, index_select / index_add; see
//           torch_moe_baseline.py) with --device cuda, in the python3 on PATH (--python), after
//           this process has freed its GPU memory; speedup = torch / strata (target >= 5 at 64
//           experts). Its experts have biases (fused into the GEMMs by torch).
//   grouped (--bf16) PyTorch's own grouped GEMM, the one its MoE training uses: the same layer with
//           the experts' weights stacked and cast to bf16 every step, each expert's rows padded to
//           a multiple of 8 (torchtitan's alignment), and torch._grouped_mm for both matrices,
//           autograd for backward (torch_moe_baseline.py --grouped); vs_grouped = grouped / strata
//           (target >= 1.0, aim 1.2). Needs PyTorch >= 2.8 and, for its kernels, sm_90.
//
// Routed FLOPs, the expert GEMMs only: each of the six GEMMs over R = tokens * k rows (dropless:
// every choice is dispatched) is 2 * R * d_model * d_hidden, so one forward + backward is
//   FLOP = 12 * tokens * k * d_model * d_hidden
// (the gate's 6 * tokens * d_model * experts is left out). TFLOP/s = FLOP / strata time.
//
// Timing: each iteration is bracketed by cudaDeviceSynchronize; a cudaEvent is recorded on the
// legacy default stream after the first, and another after the second (so the time includes the
// layer's host work and its synchronizing ops: MoeAuxLoss and MoePlanDispatch return host values,
// whatever stream the ops use). strata and dense alternate iteration by iteration after --warmup
// untimed iterations of each; each column is the median of --iters iterations.
//
// Every run checks the layer's output on sampled tokens against a per-token double-precision
// recomputation (with the bf16 rounding of the expert GEMM inputs under --bf16), that the chosen
// experts are the top k, that dispatch kept every choice, and that dx is finite (#wrong). Any
// failed CUDA or cuBLAS call prints what failed and exits 1. Without a GPU it prints one line and
// exits 0.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "core/common/json.h"
#include "core/common/rng.h"
#include "core/common/thread_pool.h"
#include "core/device/device.h"
#include "kernels/bf16.h"
#include "kernels/ops.h"

namespace strata::bench {
namespace {

// ---- Errors ----------------------------------------------------------------------------------
void CudaOk(cudaError_t err, const char* what, int line) {
  if (err == cudaSuccess) return;
  std::fflush(stdout);
  std::fprintf(stderr, "bench_moe_gpu: %s failed: %s (%s) [bench_moe_gpu.cc:%d]\n", what,
               cudaGetErrorName(err), cudaGetErrorString(err), line);
  std::exit(1);
}
void CublasOk(cublasStatus_t st, const char* what, int line) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  std::fflush(stdout);
  std::fprintf(stderr, "bench_moe_gpu: %s failed: %s (%s) [bench_moe_gpu.cc:%d]\n", what,
               cublasGetStatusName(st), cublasGetStatusString(st), line);
  std::exit(1);
}
#define CUDA_OK(expr) CudaOk((expr), #expr, __LINE__)
#define CUBLAS_OK(expr) CublasOk((expr), #expr, __LINE__)

// ---- Data: counter-based uniform draws, so any element can be regenerated on the host ----------
// Element i of stream `key`: uniform in [-a, a) (standard deviation a / sqrt(3)).
float Draw(uint64_t key, uint64_t i, float a) {
  return a * (static_cast<float>(rng::Bits(key, i) >> 40) * 0x1p-23f - 1.0f);
}
float UniformFor(double stddev) { return static_cast<float>(stddev * std::sqrt(3.0)); }

// Streams of the layer's tensors and the dense baseline's.
constexpr uint64_t kKeyX = 1, kKeyDy = 2, kKeyGate = 3, kKeyDense = 100;
uint64_t KeyW1(int64_t e) { return 1000 + 2 * static_cast<uint64_t>(e); }
uint64_t KeyW2(int64_t e) { return 1001 + 2 * static_cast<uint64_t>(e); }

using ops::Bf16Bits;
using ops::RoundBf16;

// Fills n elements at device address dst with Draw(key, i, a), as float or as bfloat16 bits.
void FillDevice(ThreadPool& pool, void* dst, int64_t n, uint64_t key, float a, bool bf16) {
  const int64_t chunk = int64_t{1} << 24;
  std::vector<float> f(bf16 ? 0 : std::min(n, chunk));
  std::vector<uint16_t> h(bf16 ? std::min(n, chunk) : 0);
  const size_t elem = bf16 ? 2 : 4;
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t m = std::min(chunk, n - off);
    pool.ParallelFor(m, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float v = Draw(key, static_cast<uint64_t>(off + i), a);
        if (bf16) {
          h[i] = Bf16Bits(v);
        } else {
          f[i] = v;
        }
      }
    });
    const void* src = bf16 ? static_cast<const void*>(h.data()) : f.data();
    CUDA_OK(
        cudaMemcpy(static_cast<char*>(dst) + off * elem, src, m * elem, cudaMemcpyHostToDevice));
  }
}

// ---- Options and rows -------------------------------------------------------------------------
struct LayerShape {
  int64_t tokens, d_model, d_hidden, experts;
  int k;
  int64_t routed() const { return tokens * k; }
  double flop() const { return 12.0 * routed() * d_model * d_hidden; }
};

struct Options {
  bool json = false, bf16 = false, torch = true;
  int iters = 20, warmup = 3;
  std::string python = "python3";
  std::vector<LayerShape> shapes = {{16384, 2048, 2048, 2, 2},
                                    {4096, 1024, 4096, 64, 2},
                                    {8192, 2048, 8192, 8, 2},
                                    {4096, 1024, 256, 256, 8},
                                    {32768, 4096, 1536, 64, 6}};
};

struct Row {
  LayerShape s{};
  double ms = NAN, dense_ms = NAN, torch_ms = NAN, torch_peak_mb = NAN, grouped_ms = NAN;
  int64_t rows = 0, min_rows = 0, max_rows = 0, dropped = 0;
  int wrong = 0, checked = 0;
  std::string torch_note, grouped_note, wrong_note;
};

// ---- Timing -----------------------------------------------------------------------------------
class Timer {
 public:
  Timer() {
    CUDA_OK(cudaEventCreate(&start_));
    CUDA_OK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // Milliseconds from an idle device to the end of everything fn enqueued, on any stream.
  template <typename Fn>
  double Ms(Fn&& fn) {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaEventRecord(start_, 0));
    fn();
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaEventRecord(stop_, 0));
    CUDA_OK(cudaEventSynchronize(stop_));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// ---- Baseline (a): one dense FFN's six GEMMs over all routed rows -------------------------------
class DenseFfn {
 public:
  DenseFfn(const LayerShape& s, bool bf16, ThreadPool& pool)
      : R_(s.routed()),
        C_(s.d_model),
        H_(s.d_hidden),
        T_(s.tokens),
        E_(s.experts),
        bf16_(bf16),
        pool_(pool) {
    CUBLAS_OK(cublasCreate(&handle_));
    CUBLAS_OK(cublasSetStream(handle_, nullptr));
    CUBLAS_OK(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
    // GEMM inputs: bf16 with --bf16 (h and dh as separate bf16 copies), else fp32 (the outputs h
    // and dh are read back as inputs).
    x_ = Alloc(R_ * C_, bf16, 0, 1.0);
    w1_ = Alloc(H_ * C_, bf16, 1, 1.0 / std::sqrt(double(C_)));
    w2_ = Alloc(C_ * H_, bf16, 2, 1.0 / std::sqrt(double(H_)));
    dy_ = Alloc(R_ * C_, bf16, 3, 1.0);
    if (bf16) {
      hin_ = Alloc(R_ * H_, true, 4, 1.0);
      dhin_ = Alloc(R_ * H_, true, 5, 1.0);
    }
    // fp32 outputs (h random in the fp32 path, where it is also an input before it is written).
    h_ = Alloc(R_ * H_, false, bf16 ? -1 : 6, 1.0);
    dh_ = Alloc(R_ * H_, false, -1, 0);
    y_ = Alloc(R_ * C_, false, -1, 0);
    dx_ = Alloc(R_ * C_, false, -1, 0);
    dw1_ = Alloc(H_ * C_, false, -1, 0);
    dw2_ = Alloc(C_ * H_, false, -1, 0);
    // The router's operands, fp32.
    xt_ = Alloc(T_ * C_, false, 7, 1.0);
    wg_ = Alloc(E_ * C_, false, 8, 1.0 / std::sqrt(double(C_)));
    logits_ = Alloc(T_ * E_, false, 9, 1.0);  // also read as dlogits
    dwg_ = Alloc(E_ * C_, false, -1, 0);
    dxt_ = Alloc(T_ * C_, false, -1, 0);
    CUDA_OK(cudaDeviceSynchronize());
  }
  ~DenseFfn() {
    for (void* p : owned_) cudaFree(p);
    cublasDestroy(handle_);
  }
  DenseFfn(const DenseFfn&) = delete;
  DenseFfn& operator=(const DenseFfn&) = delete;

  // One forward + backward: the six GEMMs, enqueued on the legacy default stream.
  void Run() {
    const void* h = bf16_ ? hin_ : h_;
    const void* dh = bf16_ ? dhin_ : dh_;
    Gemm(false, true, R_, H_, C_, x_, C_, w1_, C_, 0.f, h_, H_);     // h = x W1^T
    Gemm(false, true, R_, C_, H_, h, H_, w2_, H_, 0.f, y_, C_);      // y = h W2^T
    Gemm(true, false, C_, H_, R_, dy_, C_, h, H_, 1.f, dw2_, H_);    // dW2 += dy^T h
    Gemm(false, false, R_, H_, C_, dy_, C_, w2_, H_, 0.f, dh_, H_);  // dh = dy W2
    Gemm(true, false, H_, C_, R_, dh, H_, x_, C_, 1.f, dw1_, C_);    // dW1 += dh^T x
    Gemm(false, false, R_, C_, H_, dh, H_, w1_, C_, 0.f, dx_, C_);   // dx = dh W1
    // The router, fp32 whatever the experts' precision.
    Gemm(false, true, T_, E_, C_, xt_, C_, wg_, C_, 0.f, logits_, E_, true);    // logits
    Gemm(true, false, E_, C_, T_, logits_, E_, xt_, C_, 1.f, dwg_, C_, true);   // dWg
    Gemm(false, false, T_, C_, E_, logits_, E_, wg_, C_, 1.f, dxt_, C_, true);  // dx +=
  }

 private:
  // n elements (bf16 or fp32) of device memory, drawn from stream kKeyDense + id with standard
  // deviation `stddev`, or zeros when id < 0.
  void* Alloc(int64_t n, bool bf16, int id, double stddev) {
    const size_t bytes = static_cast<size_t>(n) * (bf16 ? 2 : 4);
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, bytes));
    owned_.push_back(p);
    if (id >= 0) {
      FillDevice(pool_, p, n, kKeyDense + static_cast<uint64_t>(id), UniformFor(stddev), bf16);
    } else {
      CUDA_OK(cudaMemset(p, 0, bytes));
    }
    return p;
  }

  // Row-major C [M, N] = op(A) op(B) (+ beta C), op(A) [M, K], op(B) [K, N], lda/ldb/ldc the
  // row-major leading dimensions. cuBLAS is column-major, where a row-major matrix reads as its
  // transpose, so it computes C^T = op(B)^T op(A)^T: the operands swap, the transposes stay.
  void Gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
            const void* B, int64_t ldb, float beta, void* Cm, int64_t ldc, bool fp32 = false) {
    const float one = 1.f;
    const cublasOperation_t op_b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (bf16_ && !fp32) {
      CUBLAS_OK(cublasGemmEx(handle_, op_b, op_a, int(N), int(M), int(K), &one, B, CUDA_R_16BF,
                             int(ldb), A, CUDA_R_16BF, int(lda), &beta, Cm, CUDA_R_32F, int(ldc),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else {
      CUBLAS_OK(cublasSgemm(handle_, op_b, op_a, int(N), int(M), int(K), &one,
                            static_cast<const float*>(B), int(ldb), static_cast<const float*>(A),
                            int(lda), &beta, static_cast<float*>(Cm), int(ldc)));
    }
  }

  const int64_t R_, C_, H_, T_, E_;
  const bool bf16_;
  ThreadPool& pool_;
  cublasHandle_t handle_ = nullptr;
  std::vector<void*> owned_;
  void *x_ = nullptr, *w1_ = nullptr, *w2_ = nullptr, *dy_ = nullptr, *hin_ = nullptr,
       *dhin_ = nullptr, *h_ = nullptr, *dh_ = nullptr, *y_ = nullptr, *dx_ = nullptr,
       *dw1_ = nullptr, *dw2_ = nullptr, *xt_ = nullptr, *wg_ = nullptr, *logits_ = nullptr,
       *dwg_ = nullptr, *dxt_ = nullptr;
};

// ---- strata: the MoE layer's ops on Device::Cuda(0) ---------------------------------------------
class GpuMoeLayer {
 public:
  GpuMoeLayer(const LayerShape& s, ops::Context& ctx) : s_(s), ctx_(ctx), router_ctx_(ctx) {
    router_ctx_.bf16 = false;  // the router's GEMMs stay fp32, as in gate.cc
    const Device gpu = Device::Cuda(0);
    const int64_t T = s.tokens, C = s.d_model, H = s.d_hidden, E = s.experts, k = s.k;
    const int64_t R = s.routed();  // dropless: at most T * k rows
    auto f32 = [&](strata::Shape shape) { return Tensor::Empty(shape, DType::kF32, gpu); };
    x_ = f32({T, C});
    y_ = f32({T, C});
    dy_ = f32({T, C});
    dx_ = f32({T, C});
    wg_ = f32({E, C});
    dwg_ = f32({E, C});
    logits_ = f32({T, E});
    probs_ = f32({T, E});
    dlogits_ = f32({T, E});
    lse_ = f32({T});
    expert_ = Tensor::Empty({T, k}, DType::kI32, gpu);
    weight_ = f32({T, k});
    dweight_ = f32({T, k});
    slot_ = Tensor::Empty({T, k}, DType::kI32, gpu);
    row_token_ = Tensor::Empty({R}, DType::kI32, gpu);
    xp_ = f32({R, C});
    pre_ = f32({R, H});
    act_ = f32({R, H});
    dact_ = f32({R, H});
    yp_ = f32({R, C});
    dxp_ = f32({R, C});
    w1_all_ = f32({E * H, C});
    w2_all_ = f32({E * C, H});
    dw1_all_ = f32({E * H, C});
    dw2_all_ = f32({E * C, H});
    if (ctx.bf16) {
      // The experts' bf16 compute copies (Parameter::compute), made once per step in Step().
      w1_16_all_ = Tensor::Empty({E * H, C}, DType::kBF16, gpu);
      w2_16_all_ = Tensor::Empty({E * C, H}, DType::kBF16, gpu);
    }
    for (int64_t e = 0; e < E; ++e) {
      if (ctx.bf16) {
        w1_16_.push_back(w1_16_all_.View(e * H * C, {H, C}));
        w2_16_.push_back(w2_16_all_.View(e * C * H, {C, H}));
      }
      w1_.push_back(w1_all_.View(e * H * C, {H, C}));
      w2_.push_back(w2_all_.View(e * C * H, {C, H}));
      dw1_.push_back(dw1_all_.View(e * H * C, {H, C}));
      dw2_.push_back(dw2_all_.View(e * C * H, {C, H}));
      FillDevice(*ctx.pool, w1_[e].raw_data(), H * C, KeyW1(e), W1Uniform(), false);
      FillDevice(*ctx.pool, w2_[e].raw_data(), C * H, KeyW2(e), W2Uniform(), false);
    }
    FillDevice(*ctx.pool, x_.raw_data(), T * C, kKeyX, XUniform(), false);
    FillDevice(*ctx.pool, dy_.raw_data(), T * C, kKeyDy, XUniform(), false);
    FillDevice(*ctx.pool, wg_.raw_data(), E * C, kKeyGate, GateUniform(), false);
    dwg_.SetZero();
    dw1_all_.SetZero();
    dw2_all_.SetZero();
    CUDA_OK(cudaDeviceSynchronize());
  }

  // Standard deviations: x, dy 1; gate rows 1/sqrt(C) (logits about N(0, 1)); w1 1/sqrt(C), w2
  // 1/sqrt(H) (activations about unit scale).
  float XUniform() const { return UniformFor(1.0); }
  float GateUniform() const { return UniformFor(1.0 / std::sqrt(double(s_.d_model))); }
  float W1Uniform() const { return UniformFor(1.0 / std::sqrt(double(s_.d_model))); }
  float W2Uniform() const { return UniformFor(1.0 / std::sqrt(double(s_.d_hidden))); }
  bool renormalize() const { return s_.k > 1; }

  void Forward() {
    Tensor none;
    ops::LinearForward(router_ctx_, logits_, x_, wg_, none);
    ops::MoeRouterForward(ctx_, probs_, lse_, expert_, weight_, logits_, renormalize());
    aux_loss_ = ops::MoeAuxLoss(ctx_, probs_, expert_, &top1_counts_);
    ops::MoePlanDispatch(ctx_, expert_, /*eligible=*/nullptr, s_.experts, /*capacity=*/0, slot_,
                         row_token_, &plan_);
    const int64_t R = plan_.rows;
    Tensor xp = xp_.Rows(0, R), pre = pre_.Rows(0, R), act = act_.Rows(0, R), yp = yp_.Rows(0, R);
    ops::MoePermuteForward(ctx_, xp, x_, row_token_);
    ops::GroupedLinearForward(ctx_, pre, xp, W1(), plan_.offsets);
    ops::ActivationForward(ctx_, ops::Activation::kGelu, act, pre);
    ops::GroupedLinearForward(ctx_, yp, act, W2(), plan_.offsets);
    ops::MoeCombineForward(ctx_, y_, yp, weight_, slot_);
  }

  void Backward() {
    Tensor none;
    const int64_t R = plan_.rows;
    Tensor xp = xp_.Rows(0, R), pre = pre_.Rows(0, R), act = act_.Rows(0, R),
           dact = dact_.Rows(0, R), yp = yp_.Rows(0, R), dxp = dxp_.Rows(0, R);
    // dyp overwrites yp in place, as in MoeLayer::Backward.
    ops::MoeCombineBackward(ctx_, yp, dweight_, dy_, yp, weight_, slot_);
    ops::GroupedLinearBackward(ctx_, dact, dw2_, yp, act, W2(), plan_.offsets, false);
    // d(pre) overwrites pre, as in FfnExpert::Backward.
    ops::ActivationBackward(ctx_, ops::Activation::kGelu, pre, dact, pre);
    ops::GroupedLinearBackward(ctx_, dxp, dw1_, pre, xp, W1(), plan_.offsets, false);
    ops::MoePermuteBackward(ctx_, dx_, dxp, slot_, /*accumulate=*/false);
    ops::MoeRouterBackward(ctx_, dlogits_, dweight_, probs_, lse_, expert_, top1_counts_,
                           renormalize(), /*aux_coef=*/0.01f, /*z_coef=*/0.f);
    ops::LinearBackward(router_ctx_, dx_, dwg_, none, dlogits_, x_, wg_,
                        /*accumulate_dinp=*/true);
  }

  // One training step's layer work: with bf16, the compute copies made from the fp32 weights
  // first (what a BF16 model does once per step, after the update), one pass over each.
  void Step() {
    if (ctx_.bf16) {
      ops::RoundToBf16(ctx_, w1_16_all_, w1_all_);
      ops::RoundToBf16(ctx_, w2_16_all_, w2_all_);
    }
    Forward();
    Backward();
  }

  const ops::DispatchPlan& plan() const { return plan_; }

  // Checks the last forward's output on `samples` tokens against a double-precision recomputation
  // from the regenerated inputs, the chosen experts against the recomputed top k, the plan, and
  // dx for non-finite values. Adds to row->checked and row->wrong, with a note on the first
  // failure.
  void Check(int samples, Row* row) {
    const int64_t T = s_.tokens, C = s_.d_model, H = s_.d_hidden, E = s_.experts;
    const int k = s_.k;
    const bool bf16 = ctx_.bf16;
    auto fail = [&](const std::string& what) {
      ++row->wrong;
      if (row->wrong_note.empty()) row->wrong_note = what;
    };
    CUDA_OK(cudaDeviceSynchronize());
    ++row->checked;
    if (plan_.rows != T * k || plan_.dropped != 0) {
      fail(absl::StrCat("dispatch kept ", plan_.rows, " of ", T * k, " choices (", plan_.dropped,
                        " dropped)"));
    }
    std::vector<int32_t> expert(T * k);
    CUDA_OK(
        cudaMemcpy(expert.data(), expert_.raw_data(), expert.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<float> dx(T * C);
    CUDA_OK(cudaMemcpy(dx.data(), dx_.raw_data(), dx.size() * 4, cudaMemcpyDeviceToHost));
    ++row->checked;
    const int64_t bad =
        std::count_if(dx.begin(), dx.end(), [](float v) { return !std::isfinite(v); });
    if (bad > 0) fail(absl::StrCat(bad, " non-finite elements in dx"));

    // The sampled tokens, their x rows, the recomputed router, and their expected outputs.
    std::vector<int64_t> tokens;
    for (int64_t t = 0; t < T && static_cast<int>(tokens.size()) < samples;
         t += std::max<int64_t>(1, T / samples)) {
      tokens.push_back(t);
    }
    const size_t n = tokens.size();
    std::vector<std::vector<float>> xs(n, std::vector<float>(C));
    std::vector<std::vector<double>> ref(n, std::vector<double>(C, 0.0));
    std::map<int64_t, std::vector<std::pair<size_t, double>>> uses;  // expert -> (sample, weight)
    for (size_t i = 0; i < n; ++i) {
      const int64_t t = tokens[i];
      for (int64_t c = 0; c < C; ++c) xs[i][c] = Draw(kKeyX, t * C + c, XUniform());
      std::vector<double> logit(E);
      double mx = -1e300;
      for (int64_t e = 0; e < E; ++e) {
        double v = 0;
        for (int64_t c = 0; c < C; ++c)
          v += double(Draw(kKeyGate, e * C + c, GateUniform())) * xs[i][c];
        logit[e] = v;
        mx = std::max(mx, v);
      }
      double wsum = 0;
      for (int j = 0; j < k; ++j) {
        const int e = expert[t * k + j];
        if (e < 0 || e >= E) {
          fail(absl::StrCat("token ", t, " routed to expert ", e));
          continue;
        }
        int64_t above = 0;  // experts clearly more probable than the chosen one
        for (int64_t o = 0; o < E; ++o) above += logit[o] > logit[e] + 1e-2;
        if (above >= k) fail(absl::StrCat("token ", t, ": expert ", e, " is not in the top ", k));
        wsum += std::exp(logit[e] - mx);
      }
      for (int j = 0; j < k; ++j) {
        const int e = expert[t * k + j];
        if (e < 0 || e >= E) continue;
        double w = std::exp(logit[e] - mx);
        if (renormalize()) {
          w /= wsum;
        } else {
          double z = 0;
          for (double v : logit) z += std::exp(v - mx);
          w /= z;
        }
        uses[e].push_back({i, w});
      }
    }
    // Each used expert's FFN once, regenerating its weights (bf16-rounded as the GEMMs see them).
    auto in = [&](float v) { return bf16 ? RoundBf16(v) : v; };
    std::vector<float> w1(H * C), w2(C * H), act(H), xin(C);
    for (const auto& [e, list] : uses) {
      for (int64_t i = 0; i < H * C; ++i) w1[i] = in(Draw(KeyW1(e), i, W1Uniform()));
      for (int64_t i = 0; i < C * H; ++i) w2[i] = in(Draw(KeyW2(e), i, W2Uniform()));
      for (const auto& [i, w] : list) {
        for (int64_t c = 0; c < C; ++c) xin[c] = in(xs[i][c]);
        for (int64_t h = 0; h < H; ++h) {
          double v = 0;
          for (int64_t c = 0; c < C; ++c) v += double(w1[h * C + c]) * xin[c];
          const double g =
              0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
          act[h] = in(static_cast<float>(g));
        }
        for (int64_t c = 0; c < C; ++c) {
          double v = 0;
          for (int64_t h = 0; h < H; ++h) v += double(w2[c * H + h]) * act[h];
          ref[i][c] += w * v;
        }
      }
    }
    std::vector<float> y(C);
    for (size_t i = 0; i < n; ++i) {
      CUDA_OK(cudaMemcpy(y.data(), y_.f32() + tokens[i] * C, C * 4, cudaMemcpyDeviceToHost));
      double err = 0, norm = 0;
      for (int64_t c = 0; c < C; ++c) {
        err = std::max(err, std::abs(ref[i][c] - y[c]));  // NaN-safe below
        norm = std::max(norm, std::abs(ref[i][c]));
      }
      ++row->checked;
      bool finite = true;
      for (float v : y) finite &= std::isfinite(v);
      if (!finite || !(err <= 2e-3 * (1 + norm))) {
        fail(absl::StrFormat("token %d: output off by %.3g (reference max |y| %.3g)", tokens[i],
                             err, norm));
      }
    }
  }

 private:
  const LayerShape s_;
  ops::Context& ctx_;
  Tensor x_, y_, dy_, dx_, wg_, dwg_, logits_, probs_, dlogits_, lse_, expert_, weight_, dweight_,
      slot_, row_token_, xp_, pre_, act_, dact_, yp_, dxp_, w1_all_, w2_all_, dw1_all_, dw2_all_;
  std::vector<Tensor> w1_, w2_, dw1_, dw2_;
  Tensor w1_16_all_, w2_16_all_;  // bf16 compute copies (--bf16)
  std::vector<Tensor> w1_16_, w2_16_;
  ops::Context router_ctx_;
  std::vector<int64_t> top1_counts_;
  ops::DispatchPlan plan_;
  double aux_loss_ = 0;

  const std::vector<Tensor>& W1() const { return ctx_.bf16 ? w1_16_ : w1_; }
  const std::vector<Tensor>& W2() const { return ctx_.bf16 ? w2_16_ : w2_; }
};

// ---- Baseline (b): the naive PyTorch layer, in its own process ----------------------------------
std::string TorchScript() {
  const std::string next_to_binary = ExecutableDir() + "/bench_moe_torch.py";
  if (access(next_to_binary.c_str(), R_OK) == 0) return next_to_binary;
#ifdef STRATA_SOURCE_DIR
  const std::string in_source = std::string(STRATA_SOURCE_DIR) + "/bench/torch_moe_baseline.py";
  if (access(in_source.c_str(), R_OK) == 0) return in_source;
#endif
  return "";
}

// The string value of "key" in a flat JSON object as Python's json.dumps writes it, or "".
std::string JsonString(const std::string& json, const std::string& key) {
  const std::string open = "\"" + key + "\": \"";
  size_t pos = json.find(open);
  if (pos == std::string::npos) return "";
  pos += open.size();
  std::string out;
  for (; pos < json.size() && json[pos] != '"'; ++pos) {
    if (json[pos] == '\\' && pos + 1 < json.size()) ++pos;
    out += json[pos];
  }
  return out;
}

// Runs the PyTorch baseline for s; fills torch_ms and torch_peak_mb, or torch_note with why not.
// Returns false when the baseline cannot run at all (no torch, no CUDA torch), so later shapes
// skip it.
// grouped: torch._grouped_mm in bf16 (--grouped) instead of the loop, into grouped_ms and
// grouped_note.
bool RunTorch(const LayerShape& s, const Options& o, Row* row, bool grouped = false) {
  double& ms = grouped ? row->grouped_ms : row->torch_ms;
  std::string& note = grouped ? row->grouped_note : row->torch_note;
  const std::string script = TorchScript();
  if (script.empty()) {
    note = "bench_moe_torch.py is not next to the binary";
    return false;
  }
  int status = 0;
  const std::string out = Capture(
      absl::StrFormat("%s %s --device cuda --tokens %d --d_model %d --d_hidden %d "
                      "--experts %d --k %d --iters %d --warmup %d%s%s 2>&1",
                      o.python, script, s.tokens, s.d_model, s.d_hidden, s.experts, s.k, o.iters,
                      std::max(1, o.warmup), o.bf16 ? " --bf16" : "", grouped ? " --grouped" : ""),
      &status);
  ms = JsonNumber(out, "ms");
  if (!grouped) row->torch_peak_mb = JsonNumber(out, "peak_cuda_mb");
  if (std::isfinite(ms)) return true;
  const std::string error = JsonString(out, "error");
  if (!error.empty()) {
    note = error;
    return false;
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
    note = o.python + " not found";
    return false;
  }
  // A failure of this shape (out of memory, say): the last line of its output.
  std::string last;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(out, '\n'))) {
    if (!line.empty()) last = line;
  }
  note = absl::StrCat("the PyTorch run failed (exit status ",
                      WIFEXITED(status) ? WEXITSTATUS(status) : -1, ")", last.empty() ? "" : ": ",
                      last);
  return true;
}

// ---- One shape --------------------------------------------------------------------------------
void MeasureGpu(const LayerShape& s, const Options& o, ThreadPool& pool, Row* row) {
  ops::Context ctx{&pool};
  ctx.bf16 = o.bf16;
  GpuMoeLayer layer(s, ctx);
  DenseFfn dense(s, o.bf16, pool);
  Timer timer;
  for (int i = 0; i < o.warmup; ++i) {
    timer.Ms([&] { layer.Step(); });
    timer.Ms([&] { dense.Run(); });
  }
  std::vector<double> strata_ms, dense_ms;
  for (int i = 0; i < o.iters; ++i) {
    strata_ms.push_back(timer.Ms([&] { layer.Step(); }));
    dense_ms.push_back(timer.Ms([&] { dense.Run(); }));
  }
  row->ms = MedianOf(strata_ms);
  row->dense_ms = MedianOf(dense_ms);
  const ops::DispatchPlan& plan = layer.plan();
  row->rows = plan.rows;
  row->dropped = plan.dropped;
  if (!plan.counts.empty()) {
    row->min_rows = *std::min_element(plan.counts.begin(), plan.counts.end());
    row->max_rows = *std::max_element(plan.counts.begin(), plan.counts.end());
  }
  layer.Check(/*samples=*/8, row);
}

// torch_unavailable: why the PyTorch baseline cannot run at all, once a shape has found out.
Row MeasureShape(const LayerShape& s, const Options& o, ThreadPool& pool,
                 std::string* torch_unavailable, std::string* grouped_unavailable) {
  Row row;
  row.s = s;
  // Frees its tensors before PyTorch runs (this thread's grow-only scratch and the CUDA context
  // stay).
  MeasureGpu(s, o, pool, &row);
  if (!o.torch) {
    row.torch_note = "--no-torch";
  } else if (!torch_unavailable->empty()) {
    row.torch_note = *torch_unavailable;
  } else if (!RunTorch(s, o, &row)) {
    *torch_unavailable = row.torch_note;
  }
  if (!o.bf16) {
    row.grouped_note = "fp32 (torch._grouped_mm is bf16)";
  } else if (!o.torch) {
    row.grouped_note = "--no-torch";
  } else if (!torch_unavailable->empty()) {
    row.grouped_note = *torch_unavailable;
  } else if (!grouped_unavailable->empty()) {
    row.grouped_note = *grouped_unavailable;
  } else if (!RunTorch(s, o, &row, /*grouped=*/true)) {
    *grouped_unavailable = row.grouped_note;
  }
  return row;
}

bool ParseShapes(const std::string& text, std::vector<LayerShape>* out) {
  out->clear();
  const std::vector<std::string> parts =
      absl::StrSplit(text, absl::ByAnyChar(";/ "), absl::SkipEmpty());
  for (const std::string& part : parts) {
    const std::vector<std::string> f = absl::StrSplit(part, ',');
    LayerShape s{};
    int64_t k = 0;
    if (f.size() != 5 || !absl::SimpleAtoi(f[0], &s.tokens) ||
        !absl::SimpleAtoi(f[1], &s.d_model) || !absl::SimpleAtoi(f[2], &s.d_hidden) ||
        !absl::SimpleAtoi(f[3], &s.experts) || !absl::SimpleAtoi(f[4], &k) || s.tokens < 1 ||
        s.d_model < 1 || s.d_hidden < 1 || s.experts < 1 || k < 1 || k > s.experts) {
      return false;
    }
    s.k = static_cast<int>(k);
    out->push_back(s);
  }
  return !out->empty();
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto count = [&](int* out, int min) {
      if (i + 1 >= argc || !absl::SimpleAtoi(argv[++i], out) || *out < min) {
        std::fprintf(stderr, "bench_moe_gpu: %s needs an integer >= %d\n", a.c_str(), min);
        std::exit(2);
      }
    };
    if (a == "--json") {
      o.json = true;
    } else if (a == "--bf16") {
      o.bf16 = true;
    } else if (a == "--no-torch") {
      o.torch = false;
    } else if (a == "--iters") {
      count(&o.iters, 1);
    } else if (a == "--warmup") {
      count(&o.warmup, 0);
    } else if (a == "--python" && i + 1 < argc) {
      o.python = argv[++i];
    } else if (a == "--shapes" && i + 1 < argc) {
      if (!ParseShapes(argv[++i], &o.shapes)) {
        std::fprintf(stderr,
                     "bench_moe_gpu: --shapes wants TOKENS,D_MODEL,D_HIDDEN,EXPERTS,K[;...] "
                     "with 1 <= K <= EXPERTS\n");
        return 2;
      }
    } else {
      std::fprintf(a == "--help" || a == "-h" ? stdout : stderr,
                   "usage: bench_moe_gpu [--shapes T,C,H,E,K[;T,C,H,E,K...]] [--iters N (20)] "
                   "[--warmup N (3)] [--bf16] [--json] [--no-torch] [--python PATH (python3)]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }

  if (CudaDeviceCount() == 0) {
    const std::string why = CudaDeviceDescription(0);  // why there is none
    if (o.json) {
      JsonWriter j;
      j.BeginObject().Field("skipped", why).EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("bench_moe_gpu: skipped: %s\n", why.c_str());
    }
    return 0;
  }
  CUDA_OK(cudaSetDevice(0));
  const std::string device = CudaDeviceDescription(0);
  ThreadPool pool(std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency()))));

  if (!o.json) {
    std::printf(
        "# bench_moe_gpu: MoE layer forward+backward on the GPU: softmax top-k gate, "
        "dropless, GELU FFN experts as grouped GEMMs, %s expert GEMMs\n",
        o.bf16 ? "bf16 (fp32 accumulation)" : "fp32");
    std::printf("# device: %s\n", device.c_str());
    std::printf("# host: %s\n", HostDescription().c_str());
    std::printf(
        "# medians of %d iterations after %d warm-up; TFLOP/s counts the expert GEMMs "
        "only: 12 * tokens * k * d_model * d_hidden\n",
        o.iters, o.warmup);
    std::printf(
        "# ratio = strata / (dense cuBLAS on the routed rows + the router's GEMMs) (target <= "
        "1.3); speedup = torch loop / strata (target >= 5 at 64 experts); vs_grouped = "
        "torch._grouped_mm layer / strata (--bf16; target >= 1.0)\n");
    std::printf("%6s %7s %8s %7s %2s | %9s | %8s %6s | %8s %7s | %10s %10s | %7s | %6s\n", "tokens",
                "d_model", "d_hidden", "experts", "k", "strata_ms", "dense_ms", "ratio", "torch_ms",
                "speedup", "grouped_ms", "vs_grouped", "TFLOP/s", "#wrong");
    std::fflush(stdout);
  }
  std::string torch_unavailable, grouped_unavailable;
  int failures = 0;
  for (const LayerShape& s : o.shapes) {
    const Row r = MeasureShape(s, o, pool, &torch_unavailable, &grouped_unavailable);
    failures += r.wrong;
    const double ratio = r.ms / r.dense_ms;
    const double speedup = r.torch_ms / r.ms;
    const double tflops = s.flop() / (r.ms * 1e9);
    const double dense_tflops = s.flop() / (r.dense_ms * 1e9);
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("tokens", s.tokens)
          .Field("d_model", s.d_model)
          .Field("d_hidden", s.d_hidden)
          .Field("experts", s.experts)
          .Field("k", s.k)
          .Field("bf16", o.bf16)
          .Field("device", device)
          .Field("iters", o.iters)
          .Field("ms", r.ms)
          .Field("tflops", tflops)
          .Field("dense_ms", r.dense_ms)
          .Field("dense_tflops", dense_tflops)
          .Field("time_over_dense", ratio)
          .Field("torch_ms", r.torch_ms)
          .Field("speedup_over_torch", speedup)
          .Field("torch_peak_cuda_mb", r.torch_peak_mb)
          .Field("torch_note", r.torch_note)
          .Field("grouped_ms", r.grouped_ms)
          .Field("speedup_over_grouped", r.grouped_ms / r.ms)
          .Field("grouped_note", r.grouped_note)
          .Field("routed_rows", r.rows)
          .Field("min_expert_rows", r.min_rows)
          .Field("max_expert_rows", r.max_rows)
          .Field("checked", r.checked)
          .Field("wrong", r.wrong)
          .Field("wrong_note", r.wrong_note)
          .EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf(
          "%6lld %7lld %8lld %7lld %2d | %9.3f | %8.3f %6.3f | %8.3f %7.2f | %10.3f %10.2f | %7.1f "
          "| %6d\n",
          (long long)s.tokens, (long long)s.d_model, (long long)s.d_hidden, (long long)s.experts,
          s.k, r.ms, r.dense_ms, ratio, r.torch_ms, speedup, r.grouped_ms, r.grouped_ms / r.ms,
          tflops, r.wrong);
      std::printf(
          "#   routed rows %lld, per expert %lld..%lld; dense cuBLAS %.1f TFLOP/s (expert FLOPs "
          "over its time)\n",
          (long long)r.rows, (long long)r.min_rows, (long long)r.max_rows, dense_tflops);
      if (!std::isfinite(r.torch_ms)) {
        std::printf("#   torch baseline: unavailable (%s)\n", r.torch_note.c_str());
      }
      if (o.bf16 && !std::isfinite(r.grouped_ms)) {
        std::printf("#   torch._grouped_mm baseline: unavailable (%s)\n", r.grouped_note.c_str());
      }
      if (r.wrong > 0) std::printf("#   wrong: %s\n", r.wrong_note.c_str());
    }
    std::fflush(stdout);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
