#include "kernels/ops.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/common/logging.h"
#include "kernels/bf16.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/optimizer.h"

#ifdef STRATA_WITH_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace strata::ops {
namespace {

// Where an op runs: every defined tensor argument must be on one device. Returns the GPU index, or
// -1 for the CPU.
int DeviceOf(std::initializer_list<const Tensor*> ts, const char* op) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (first == nullptr) {
      first = t;
    } else {
      CHECK(t->device() == first->device())
          << op << ": tensors on " << first->device().ToString() << " and "
          << t->device().ToString() << "; copy them to one device first (Tensor::To)";
    }
  }
  if (first == nullptr || first->device().is_cpu()) return -1;
#ifndef STRATA_WITH_CUDA
  CHECK(false) << op << ": tensor on " << first->device().ToString()
               << " but strata was built without CUDA";
#endif
  return first->device().index;
}

// ON_GPU(statement): runs `statement` with `gpu`, the calling thread's backend for the op's GPU,
// when the op's tensors are on a GPU (the statement returns); the CPU path follows it.
#ifdef STRATA_WITH_CUDA
#define ON_GPU(...)                                \
  if (dev >= 0) {                                  \
    cuda::Backend& gpu = cuda::ThreadBackend(dev); \
    __VA_ARGS__;                                   \
  }
#else
#define ON_GPU(...) (void)dev
#endif

float* F(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

ThreadPool& Pool(Context& ctx) {
  CHECK(ctx.pool != nullptr) << "ops::Context without a thread pool";
  return *ctx.pool;
}

}  // namespace

Status CheckDeviceKernels(Device device) {
  if (device.is_cpu()) return absl::OkStatus();
#ifdef STRATA_WITH_CUDA
  std::string why;
  if (!cuda::CublasAvailable(&why)) {
    return absl::FailedPreconditionError(absl::StrCat("ops on ", device.ToString(), ": ", why));
  }
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError(
      absl::StrCat("ops on ", device.ToString(),
                   ": strata was built without CUDA; build it with the CUDA "
                   "toolkit installed (STRATA_CUDA=ON) or use the CPU device"));
#endif
}

void EmbeddingForward(Context& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
                      const Tensor& wpe, int64_t B, int64_t T) {
  const int dev = DeviceOf({&out, &tokens, &wte, &wpe}, "EmbeddingForward");
  const int64_t C = wte.dim(1);
  CHECK(out.numel() == B * T * C && tokens.numel() == B * T && wpe.dim(1) == C && wpe.dim(0) >= T)
      << out.ShapeString() << tokens.ShapeString() << wte.ShapeString() << wpe.ShapeString();
  ON_GPU(
      return cuda::EmbeddingForward(gpu, out.f32(), tokens.i32(), wte.f32(), wpe.f32(), B, T, C));
  cpu::embedding_forward<float>(Pool(ctx), out.f32(), tokens.i32(), wte.f32(), wpe.f32(), B, T, C);
}

void EmbeddingBackward(Context& ctx, const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                       const Tensor& tokens, int64_t B, int64_t T) {
  const int dev = DeviceOf({&dwte, &dwpe, &dout, &tokens}, "EmbeddingBackward");
  const int64_t C = dwte.dim(1);
  CHECK(dout.numel() == B * T * C && tokens.numel() == B * T && dwpe.dim(1) == C);
  ON_GPU(return cuda::EmbeddingBackward(gpu, dwte.f32(), dwpe.f32(), dout.f32(), tokens.i32(), B, T,
                                        C, dwte.dim(0)));
  cpu::embedding_backward<float>(Pool(ctx), dwte.f32(), dwpe.f32(), dout.f32(), tokens.i32(), B, T,
                                 C);
}

void EmbeddingForwardAt(Context& ctx, const Tensor& out, const Tensor& tokens,
                        const Tensor& positions, const Tensor& wte, const Tensor& wpe) {
  const int dev = DeviceOf({&out, &tokens, &positions, &wte, &wpe}, "EmbeddingForwardAt");
  const int64_t C = wte.dim(1), N = tokens.numel();
  CHECK(out.numel() == N * C && positions.numel() == N && wpe.dim(1) == C)
      << out.ShapeString() << tokens.ShapeString() << positions.ShapeString() << wte.ShapeString()
      << wpe.ShapeString();
  ON_GPU(return cuda::EmbeddingForward(gpu, out.f32(), tokens.i32(), wte.f32(), wpe.f32(), 1, N, C,
                                       positions.i32()));
  cpu::embedding_forward<float>(Pool(ctx), out.f32(), tokens.i32(), wte.f32(), wpe.f32(), 1, N, C,
                                positions.i32());
}

void NormForward(Context& ctx, NormKind kind, const Tensor& out, const Tensor& mean,
                 const Tensor& rstd, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                 float eps) {
  const int dev = DeviceOf({&out, &mean, &rstd, &inp, &weight, &bias}, "NormForward");
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  CHECK(out.numel() == N * C && weight.numel() == C && rstd.numel() == N);
  ON_GPU(if (kind == NormKind::kLayerNorm) {
    return cuda::LayerNormForward(gpu, out.f32(), mean.f32(), rstd.f32(), inp.f32(), weight.f32(),
                                  F(bias), N, C, eps);
  } return cuda::RmsNormForward(gpu, out.f32(), rstd.f32(), inp.f32(), weight.f32(), N, C, eps));
  if (kind == NormKind::kLayerNorm) {
    CHECK(mean.numel() == N);
    cpu::layernorm_forward<float>(Pool(ctx), out.f32(), mean.f32(), rstd.f32(), inp.f32(),
                                  weight.f32(), F(bias), N, C, eps);
  } else {
    cpu::rmsnorm_forward<float>(Pool(ctx), out.f32(), rstd.f32(), inp.f32(), weight.f32(), N, C,
                                eps);
  }
}

void NormBackward(Context& ctx, NormKind kind, const Tensor& dinp, const Tensor& dweight,
                  const Tensor& dbias, const Tensor& dout, const Tensor& inp, const Tensor& weight,
                  const Tensor& mean, const Tensor& rstd) {
  const int dev =
      DeviceOf({&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd}, "NormBackward");
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  CHECK(dinp.numel() == N * C && dout.numel() == N * C && dweight.numel() == C);
  ON_GPU(if (kind == NormKind::kLayerNorm) {
    return cuda::LayerNormBackward(gpu, dinp.f32(), dweight.f32(), F(dbias), dout.f32(), inp.f32(),
                                   weight.f32(), mean.f32(), rstd.f32(), N, C);
  } return cuda::RmsNormBackward(gpu, dinp.f32(), dweight.f32(), dout.f32(), inp.f32(),
                                 weight.f32(), rstd.f32(), N, C));
  if (kind == NormKind::kLayerNorm) {
    cpu::layernorm_backward<float>(Pool(ctx), dinp.f32(), dweight.f32(), F(dbias), dout.f32(),
                                   inp.f32(), weight.f32(), mean.f32(), rstd.f32(), N, C);
  } else {
    cpu::rmsnorm_backward<float>(Pool(ctx), dinp.f32(), dweight.f32(), dout.f32(), inp.f32(),
                                 weight.f32(), rstd.f32(), N, C);
  }
}

namespace {

// How a GEMM with `weight` multiplies (see Context::bf16).
#ifdef STRATA_WITH_CUDA
cuda::GemmMode ModeOf(const Context& ctx, const Tensor& weight) {
  if (weight.dtype() == DType::kBF16) return cuda::GemmMode::kBf16Weights;
  return ctx.bf16 ? cuda::GemmMode::kBf16 : cuda::GemmMode::kFp32;
}
#endif

void CheckWeightDType(const Context& ctx, const Tensor& weight, const char* op) {
  CHECK(weight.dtype() == DType::kF32 || (weight.dtype() == DType::kBF16 && ctx.bf16))
      << op << ": a " << DTypeName(weight.dtype()) << " weight "
      << (ctx.bf16 ? "" : "without Context::bf16");
}

// The operand a CPU bf16 GEMM multiplies, as fp32: `t` itself without ctx.bf16; with it, a copy
// of `t` rounded to bfloat16 (t fp32) or widened (t a bf16 compute copy; exact).
Tensor Operand(const Context& ctx, const Tensor& t) {
  if (!t.defined() || (!ctx.bf16 && t.dtype() == DType::kF32)) return t;
  Tensor r = Tensor::Empty(t.shape(), DType::kF32);
  float* dst = r.f32();
  if (t.dtype() == DType::kBF16) {
    const uint16_t* src = t.bf16();
    for (int64_t i = 0; i < t.numel(); ++i) dst[i] = Bf16Value(src[i]);
  } else {
    const float* src = t.f32();
    for (int64_t i = 0; i < t.numel(); ++i) dst[i] = RoundBf16(src[i]);
  }
  return r;
}

}  // namespace

void LinearForward(Context& ctx, const Tensor& out, const Tensor& inp, const Tensor& weight,
                   const Tensor& bias) {
  const int dev = DeviceOf({&out, &inp, &weight, &bias}, "LinearForward");
  const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
  CHECK(inp.dim(-1) == IC && out.numel() == N * OC && (!bias.defined() || bias.numel() == OC))
      << "out " << out.ShapeString() << " inp " << inp.ShapeString() << " weight "
      << weight.ShapeString();
  CheckWeightDType(ctx, weight, "LinearForward");
  ON_GPU(return cuda::LinearForward(gpu, out.f32(), inp.f32(), weight.raw_data(), F(bias), N, IC,
                                    OC, ModeOf(ctx, weight)));
  const Tensor x = Operand(ctx, inp), w = Operand(ctx, weight);
  cpu::linear_forward<float>(Pool(ctx), out.f32(), x.f32(), w.f32(), F(bias), N, IC, OC);
}

void LinearBackward(Context& ctx, const Tensor& dinp, const Tensor& dweight, const Tensor& dbias,
                    const Tensor& dout, const Tensor& inp, const Tensor& weight,
                    bool accumulate_dinp) {
  const int dev = DeviceOf({&dinp, &dweight, &dbias, &dout, &inp, &weight}, "LinearBackward");
  const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
  CHECK(dout.numel() == N * OC && (!dinp.defined() || dinp.numel() == N * IC))
      << "dout " << dout.ShapeString() << " inp " << inp.ShapeString();
  CheckWeightDType(ctx, weight, "LinearBackward");
  ON_GPU(return cuda::LinearBackward(gpu, F(dinp), F(dweight), F(dbias), dout.f32(), inp.f32(),
                                     weight.raw_data(), N, IC, OC, accumulate_dinp,
                                     ModeOf(ctx, weight)));
  if (!ctx.bf16) {
    cpu::linear_backward<float>(Pool(ctx), F(dinp), F(dweight), F(dbias), dout.f32(), inp.f32(),
                                weight.f32(), N, IC, OC, accumulate_dinp);
    return;
  }
  // The bias gradient from the fp32 dout, then the GEMMs on rounded copies (taken before dinp,
  // which may alias inp, is written).
  if (dbias.defined()) {
    cpu::linear_backward<float>(Pool(ctx), nullptr, nullptr, dbias.f32(), dout.f32(), nullptr,
                                nullptr, N, IC, OC, false);
  }
  if (!dinp.defined() && !dweight.defined()) return;
  const Tensor dy = Operand(ctx, dout);
  const Tensor x = dweight.defined() ? Operand(ctx, inp) : Tensor();
  const Tensor w = dinp.defined() ? Operand(ctx, weight) : Tensor();
  cpu::linear_backward<float>(Pool(ctx), F(dinp), F(dweight), nullptr, dy.f32(), F(x), F(w), N, IC,
                              OC, accumulate_dinp);
}

void RoundToBf16(Context& ctx, const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs) {
  CHECK_EQ(dsts.size(), srcs.size());
  if (dsts.empty()) return;
  for (size_t i = 0; i < dsts.size(); ++i) {
    CHECK(dsts[i].dtype() == DType::kBF16 && srcs[i].dtype() == DType::kF32 &&
          dsts[i].numel() == srcs[i].numel() && dsts[i].device() == dsts[0].device() &&
          srcs[i].device() == dsts[0].device())
        << "RoundToBf16 pair " << i << ": dst " << DTypeName(dsts[i].dtype())
        << dsts[i].ShapeString() << " on " << dsts[i].device().ToString() << ", src "
        << DTypeName(srcs[i].dtype()) << srcs[i].ShapeString() << " on "
        << srcs[i].device().ToString();
  }
  const int dev = DeviceOf({&dsts[0], &srcs[0]}, "RoundToBf16");
#ifdef STRATA_WITH_CUDA
  if (dev >= 0) {
    std::vector<void*> d(dsts.size());
    std::vector<const float*> s(srcs.size());
    std::vector<int64_t> n(srcs.size());
    for (size_t i = 0; i < dsts.size(); ++i) {
      d[i] = dsts[i].raw_data();
      s[i] = srcs[i].f32();
      n[i] = srcs[i].numel();
    }
    cuda::RoundToBf16Batch(cuda::ThreadBackend(dev), d.data(), s.data(), n.data(),
                           static_cast<int64_t>(d.size()));
    return;
  }
#endif
  (void)dev;
  for (size_t i = 0; i < dsts.size(); ++i) RoundToBf16(ctx, dsts[i], srcs[i]);
}

void RoundToBf16(Context& ctx, const Tensor& dst, const Tensor& src) {
  const int dev = DeviceOf({&dst, &src}, "RoundToBf16");
  CHECK(dst.dtype() == DType::kBF16 && src.dtype() == DType::kF32 && dst.numel() == src.numel())
      << "RoundToBf16: dst " << DTypeName(dst.dtype()) << dst.ShapeString() << ", src "
      << DTypeName(src.dtype()) << src.ShapeString();
  ON_GPU(return cuda::RoundToBf16(gpu, dst.raw_data(), src.f32(), src.numel()));
  uint16_t* d = dst.bf16();
  const float* s = src.f32();
  const int64_t n = src.numel();
  Pool(ctx).Run([&](int t, int threads) {
    for (int64_t i = n * t / threads; i < n * (t + 1) / threads; ++i) d[i] = Bf16Bits(s[i]);
  });
}

void AddBias(Context& ctx, const Tensor& out, const Tensor& bias) {
  const int dev = DeviceOf({&out, &bias}, "AddBias");
  const int64_t C = bias.numel(), N = C == 0 ? 0 : out.numel() / C;
  CHECK(out.dim(-1) == C) << "out " << out.ShapeString() << " bias " << bias.ShapeString();
  ON_GPU(return cuda::AddBias(gpu, out.f32(), bias.f32(), N, C));
  cpu::add_bias<float>(Pool(ctx), out.f32(), bias.f32(), N, C);
}

void BiasGrad(Context& ctx, const Tensor& dbias, const Tensor& dout) {
  const int dev = DeviceOf({&dbias, &dout}, "BiasGrad");
  const int64_t C = dbias.numel(), N = C == 0 ? 0 : dout.numel() / C;
  CHECK(dout.dim(-1) == C) << "dout " << dout.ShapeString() << " dbias " << dbias.ShapeString();
  ON_GPU(return cuda::BiasGrad(gpu, dbias.f32(), dout.f32(), N, C));
  (void)ctx;
  // Per column, rows in order, in double: deterministic and independent of the thread count.
  const float* g = dout.f32();
  float* db = dbias.f32();
  for (int64_t c = 0; c < C; ++c) {
    double s = 0;
    for (int64_t r = 0; r < N; ++r) s += g[r * C + c];
    db[c] += static_cast<float>(s);
  }
}

namespace {

void CheckGroups(const Tensor& inp, const std::vector<Tensor>& weights,
                 const std::vector<int64_t>& offsets, int64_t* IC, int64_t* OC) {
  const size_t G = weights.size();
  CHECK(G > 0 && offsets.size() == G + 1 && offsets[0] == 0 && offsets[G] == inp.dim(0))
      << "grouped linear: " << G << " weights, " << offsets.size() << " offsets, input "
      << inp.ShapeString();
  *OC = weights[0].dim(0);
  *IC = weights[0].dim(1);
  for (size_t g = 0; g < G; ++g) {
    CHECK(weights[g].dim(0) == *OC && weights[g].dim(1) == *IC && offsets[g] <= offsets[g + 1])
        << "group " << g << ": weight " << weights[g].ShapeString() << ", rows [" << offsets[g]
        << ", " << offsets[g + 1] << ")";
    CHECK(weights[g].dtype() == weights[0].dtype())
        << "grouped linear: weight 0 is " << DTypeName(weights[0].dtype()) << ", weight " << g
        << " " << DTypeName(weights[g].dtype());
  }
  CHECK_EQ(inp.dim(-1), *IC);
}

}  // namespace

void GroupedLinearForward(Context& ctx, const Tensor& out, const Tensor& inp,
                          const std::vector<Tensor>& weights, const std::vector<int64_t>& offsets) {
  int64_t IC = 0, OC = 0;
  CheckGroups(inp, weights, offsets, &IC, &OC);
  const int dev = DeviceOf({&out, &inp, &weights[0]}, "GroupedLinearForward");
  CHECK(out.dim(0) == inp.dim(0) && out.dim(-1) == OC) << out.ShapeString();
  const int64_t G = static_cast<int64_t>(weights.size());
  CheckWeightDType(ctx, weights[0], "GroupedLinearForward");
  std::vector<const void*> w(G);
  for (int64_t g = 0; g < G; ++g) {
    CHECK(weights[g].device() == inp.device())
        << "expert weight " << g << " on " << weights[g].device().ToString();
    w[g] = weights[g].raw_data();
  }
  ON_GPU(return cuda::GroupedLinearForward(gpu, out.f32(), inp.f32(), w.data(), offsets.data(), G,
                                           IC, OC, ModeOf(ctx, weights[0])));
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    if (r1 == r0) continue;
    const Tensor x = Operand(ctx, inp.Rows(r0, r1)), wg = Operand(ctx, weights[g]);
    cpu::linear_forward<float>(Pool(ctx), out.Rows(r0, r1).f32(), x.f32(), wg.f32(), nullptr,
                               r1 - r0, IC, OC);
  }
}

void GroupedLinearBackward(Context& ctx, const Tensor& dinp, const std::vector<Tensor>& dweights,
                           const Tensor& dout, const Tensor& inp,
                           const std::vector<Tensor>& weights, const std::vector<int64_t>& offsets,
                           bool accumulate_dinp) {
  int64_t IC = 0, OC = 0;
  CheckGroups(inp, weights, offsets, &IC, &OC);
  const int dev = DeviceOf({&dinp, &dout, &inp, &weights[0]}, "GroupedLinearBackward");
  const int64_t G = static_cast<int64_t>(weights.size());
  CHECK(static_cast<int64_t>(dweights.size()) == G && dout.dim(0) == inp.dim(0) &&
        dout.dim(-1) == OC && (!dinp.defined() || dinp.numel() == inp.numel()))
      << "dout " << dout.ShapeString() << " inp " << inp.ShapeString();
  CheckWeightDType(ctx, weights[0], "GroupedLinearBackward");
  std::vector<const void*> w(G);
  std::vector<float*> dw(G);
  for (int64_t g = 0; g < G; ++g) {
    CHECK(weights[g].device() == inp.device())
        << "expert weight " << g << " on " << weights[g].device().ToString();
    w[g] = weights[g].raw_data();
    dw[g] = F(dweights[g]);
    CHECK(!dweights[g].defined() ||
          (dweights[g].numel() == OC * IC && dweights[g].device() == inp.device()))
        << "expert gradient " << g << " " << dweights[g].ShapeString();
  }
  ON_GPU(return cuda::GroupedLinearBackward(gpu, F(dinp), dw.data(), dout.f32(), inp.f32(),
                                            w.data(), offsets.data(), G, IC, OC, accumulate_dinp,
                                            ModeOf(ctx, weights[0])));
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    if (r1 == r0) continue;
    const Tensor x = Operand(ctx, inp.Rows(r0, r1)), wg = Operand(ctx, weights[g]);
    const Tensor dy = Operand(ctx, dout.Rows(r0, r1));
    cpu::linear_backward<float>(Pool(ctx), dinp.defined() ? dinp.Rows(r0, r1).f32() : nullptr,
                                dw[g], nullptr, dy.f32(), x.f32(), wg.f32(), r1 - r0, IC, OC,
                                accumulate_dinp);
  }
}

void AttentionForward(Context& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
                      int64_t B, int64_t T, int64_t NH) {
  const int dev = DeviceOf({&out, &att, &qkv}, "AttentionForward");
  const int64_t C = out.dim(-1);
  CHECK(qkv.numel() == B * T * 3 * C && att.numel() >= B * NH * T * T && C % NH == 0);
  ON_GPU(return cuda::AttentionForward(gpu, out.f32(), att.f32(), qkv.f32(), B, T, C, NH));
  cpu::attention_forward<float>(Pool(ctx), out.f32(), att.f32(), qkv.f32(), B, T, C, NH);
}

void AttentionBackward(Context& ctx, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                       const Tensor& att, int64_t B, int64_t T, int64_t NH) {
  const int dev = DeviceOf({&dqkv, &dout, &qkv, &att}, "AttentionBackward");
  const int64_t C = dout.dim(-1);
  CHECK(dqkv.numel() == B * T * 3 * C && qkv.numel() == B * T * 3 * C);
  ON_GPU(return cuda::AttentionBackward(gpu, dqkv.f32(), dout.f32(), qkv.f32(), att.f32(), B, T, C,
                                        NH));
  cpu::attention_backward<float>(Pool(ctx), dqkv.f32(), dout.f32(), qkv.f32(), att.f32(), B, T, C,
                                 NH);
}

void AttentionDecode(Context& ctx, const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                     const Tensor& v_cache, const Tensor& slots, const Tensor& positions,
                     int64_t NH, const Tensor& scores) {
  const int dev =
      DeviceOf({&out, &qkv, &k_cache, &v_cache, &slots, &positions, &scores}, "AttentionDecode");
  const int64_t C = out.dim(-1), N = out.numel() / C;
  CHECK(qkv.numel() == N * 3 * C && k_cache.rank() == 3 && k_cache.dim(2) == C &&
        v_cache.numel() == k_cache.numel() && slots.numel() == N && positions.numel() == N &&
        C % NH == 0)
      << out.ShapeString() << qkv.ShapeString() << k_cache.ShapeString() << v_cache.ShapeString()
      << slots.ShapeString() << positions.ShapeString();
  const int64_t Tmax = k_cache.dim(1);
  CHECK(!scores.defined() || scores.numel() >= N * NH * Tmax) << scores.ShapeString();
  ON_GPU(return cuda::AttentionDecode(gpu, out.f32(), qkv.f32(), k_cache.f32(), v_cache.f32(),
                                      slots.i32(), positions.i32(), N, Tmax, C, NH, F(scores)));
  cpu::attention_decode<float>(Pool(ctx), out.f32(), qkv.f32(), k_cache.f32(), v_cache.f32(),
                               slots.i32(), positions.i32(), N, Tmax, C, NH);
}

void ActivationForward(Context& ctx, Activation act, const Tensor& out, const Tensor& inp) {
  const int dev = DeviceOf({&out, &inp}, "ActivationForward");
  const int64_t H = out.dim(-1), N = out.numel() / H;
  CHECK_EQ(inp.numel(), N * ActivationInputWidth(act, H));
  ON_GPU(return cuda::ActivationForward(gpu, act, out.f32(), inp.f32(), N, H));
  cpu::activation_forward<float>(Pool(ctx), act, out.f32(), inp.f32(), N, H);
}

void BiasActivationForward(Context& ctx, Activation act, const Tensor& out, const Tensor& pre,
                           const Tensor& bias) {
  const int dev = DeviceOf({&out, &pre, &bias}, "BiasActivationForward");
  const int64_t H = out.dim(-1), N = out.numel() / H;
  const int64_t W = ActivationInputWidth(act, H);
  CHECK(pre.numel() == N * W && bias.numel() == W)
      << "out " << out.ShapeString() << " pre " << pre.ShapeString() << " bias "
      << bias.ShapeString();
  ON_GPU(return cuda::BiasActivationForward(gpu, act, out.f32(), pre.f32(), bias.f32(), N, H));
  cpu::bias_activation_forward<float>(Pool(ctx), act, out.f32(), pre.f32(), bias.f32(), N, H);
}

void ActivationBackward(Context& ctx, Activation act, const Tensor& dinp, const Tensor& dout,
                        const Tensor& inp, const Tensor& dbias) {
  const int dev = DeviceOf({&dinp, &dout, &inp, &dbias}, "ActivationBackward");
  const int64_t H = dout.dim(-1), N = dout.numel() / H;
  const int64_t W = ActivationInputWidth(act, H);
  CHECK(inp.numel() == N * W && dinp.numel() == inp.numel() &&
        (!dbias.defined() || dbias.numel() == W));
  ON_GPU(
      return cuda::ActivationBackward(gpu, act, dinp.f32(), dout.f32(), inp.f32(), N, H, F(dbias)));
  cpu::activation_backward<float>(Pool(ctx), act, dinp.f32(), dout.f32(), inp.f32(), N, H,
                                  F(dbias));
}

void Add(Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  const int dev = DeviceOf({&out, &a, &b}, "Add");
  CHECK(out.numel() == a.numel() && a.numel() == b.numel());
  ON_GPU(return cuda::Add(gpu, out.f32(), a.f32(), b.f32(), out.numel()));
  cpu::add<float>(Pool(ctx), out.f32(), a.f32(), b.f32(), out.numel());
}

void Accumulate(Context& ctx, const Tensor& out, const Tensor& a) {
  const int dev = DeviceOf({&out, &a}, "Accumulate");
  CHECK_EQ(out.numel(), a.numel());
  ON_GPU(return cuda::Accumulate(gpu, out.f32(), a.f32(), out.numel()));
  cpu::accumulate<float>(Pool(ctx), out.f32(), a.f32(), out.numel());
}

double CrossEntropy(Context& ctx, const Tensor& dlogits, const Tensor& logits,
                    const Tensor& targets, float grad_scale) {
  const int dev = DeviceOf({&dlogits, &logits, &targets}, "CrossEntropy");
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  CHECK(targets.numel() == N && (!dlogits.defined() || dlogits.numel() == N * V));
  ON_GPU(return cuda::CrossEntropy(gpu, F(dlogits), logits.f32(), targets.i32(), N, V, grad_scale));
  return cpu::softmax_cross_entropy<float>(Pool(ctx), F(dlogits), nullptr, logits.f32(),
                                           targets.i32(), N, V, grad_scale);
}

void AdamW(Context& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWHyper& hyper) {
  const int dev = DeviceOf({&param, &grad, &m, &v}, "AdamW");
  CHECK(param.numel() == grad.numel() && m.numel() == param.numel() && v.numel() == param.numel());
  ON_GPU(return cuda::AdamW(gpu, param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(), hyper));
  cpu::adamw_update<float>(Pool(ctx), param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(),
                           hyper);
}

void AdamWHost(ThreadPool& pool, float* param, const float* grad, float* m, float* v, int64_t n,
               const AdamWHyper& hyper) {
  cpu::adamw_update<float>(pool, param, grad, m, v, n, hyper);
}

double SumSquares(Context& ctx, const Tensor& x) {
  const int dev = DeviceOf({&x}, "SumSquares");
  ON_GPU(return cuda::SumSquares(gpu, x.f32(), x.numel()));
  return cpu::sum_squares<float>(Pool(ctx), x.f32(), x.numel());
}

void MoeRouterForward(Context& ctx, const Tensor& scores, const Tensor& lse,
                      const Tensor& topk_expert, const Tensor& topk_weight, const Tensor& logits,
                      const Tensor& bias, const MoeRouterSpec& spec) {
  // DeviceOf skips undefined tensors (no bias).
  const int dev =
      DeviceOf({&scores, &lse, &topk_expert, &topk_weight, &logits, &bias}, "MoeRouterForward");
  const int64_t E = logits.dim(-1), T = logits.numel() / E;
  CHECK(scores.numel() == T * E && lse.numel() == T && topk_expert.numel() == T * spec.k &&
        topk_weight.numel() == T * spec.k && (!bias.defined() || bias.numel() == E));
  const float* b = bias.defined() ? bias.f32() : nullptr;
  ON_GPU(return cuda::MoeRouterForward(gpu, scores.f32(), lse.f32(), topk_expert.i32(),
                                       topk_weight.f32(), logits.f32(), b, T, E, spec));
  cpu::moe_router_forward<float>(Pool(ctx), scores.f32(), lse.f32(), topk_expert.i32(),
                                 topk_weight.f32(), logits.f32(), b, T, E, spec);
}

void MoeRouterForward(Context& ctx, const Tensor& probs, const Tensor& lse,
                      const Tensor& topk_expert, const Tensor& topk_weight, const Tensor& logits,
                      bool renormalize) {
  const int64_t E = logits.dim(-1), T = logits.numel() / E;
  MoeRouterSpec spec;
  spec.k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  spec.renormalize = renormalize;
  MoeRouterForward(ctx, probs, lse, topk_expert, topk_weight, logits, Tensor(), spec);
}

double MoeAuxLoss(Context& ctx, const Tensor& scores, const Tensor& topk_expert,
                  std::vector<int64_t>* top1_counts, bool normalize) {
  const int dev = DeviceOf({&scores, &topk_expert}, "MoeAuxLoss");
  (void)ctx;
  const int64_t E = scores.dim(-1), T = scores.numel() / E;
  const int k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  top1_counts->assign(E, 0);
  // Normalised (sigmoid) scores take the host path on a GPU.
  if (dev >= 0 && normalize) {
    const Tensor s = scores.To(Device::Cpu()), x = topk_expert.To(Device::Cpu());
    return cpu::moe_aux_loss<float>(s.f32(), x.i32(), top1_counts->data(), T, E, k, true);
  }
  ON_GPU(
      return cuda::MoeAuxLoss(gpu, scores.f32(), topk_expert.i32(), top1_counts->data(), T, E, k));
  return cpu::moe_aux_loss<float>(scores.f32(), topk_expert.i32(), top1_counts->data(), T, E, k,
                                  normalize);
}

double MoeSequenceAuxLoss(Context& ctx, const Tensor& scores, const Tensor& topk_expert,
                          int64_t seq_len, bool normalize, std::vector<double>* dq) {
  (void)DeviceOf({&scores, &topk_expert}, "MoeSequenceAuxLoss");
  (void)ctx;
  const int64_t E = scores.dim(-1), T = scores.numel() / E;
  const int k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  CHECK_GT(seq_len, 0);
  dq->assign(static_cast<size_t>((T + seq_len - 1) / seq_len * E), 0.0);
  const Tensor s = scores.To(Device::Cpu()), x = topk_expert.To(Device::Cpu());
  return cpu::moe_sequence_aux_loss<float>(s.f32(), x.i32(), T, E, k, seq_len, normalize,
                                           dq->data());
}

double MoeZLoss(Context& ctx, const Tensor& lse) {
  const int dev = DeviceOf({&lse}, "MoeZLoss");
  (void)ctx;
  ON_GPU(return cuda::MoeZLoss(gpu, lse.f32(), lse.numel()));
  return cpu::moe_z_loss<float>(lse.f32(), lse.numel());
}

void MoeRouterBackward(Context& ctx, const Tensor& dlogits, const Tensor& dweight,
                       const Tensor& scores, const Tensor& logits, const Tensor& lse,
                       const Tensor& topk_expert, const Tensor& score_grad, int64_t grad_rows,
                       const MoeRouterSpec& spec, float z_coef) {
  const int dev = DeviceOf({&dlogits, &dweight, &scores, &lse, &topk_expert, &logits, &score_grad},
                           "MoeRouterBackward");
  const int64_t E = scores.dim(-1), T = scores.numel() / E;
  CHECK(dlogits.numel() == T * E && dweight.numel() == T * spec.k &&
        topk_expert.numel() == T * spec.k && (!spec.sigmoid || logits.numel() == T * E));
  CHECK(!score_grad.defined() ||
        (grad_rows > 0 && score_grad.numel() >= (T + grad_rows - 1) / grad_rows * E));
  const float* lg = spec.sigmoid ? logits.f32() : nullptr;
  const float* g = score_grad.defined() ? score_grad.f32() : nullptr;
  ON_GPU(return cuda::MoeRouterBackward(gpu, dlogits.f32(), dweight.f32(), scores.f32(), lg,
                                        lse.f32(), topk_expert.i32(), g, grad_rows, T, E, spec,
                                        z_coef));
  cpu::moe_router_backward<float>(Pool(ctx), dlogits.f32(), dweight.f32(), scores.f32(), lg,
                                  lse.f32(), topk_expert.i32(), g, grad_rows, T, E, spec, z_coef);
}

void MoeRouterBackward(Context& ctx, const Tensor& dlogits, const Tensor& dweight,
                       const Tensor& probs, const Tensor& lse, const Tensor& topk_expert,
                       const std::vector<int64_t>& top1_counts, bool renormalize, float aux_coef,
                       float z_coef) {
  const int64_t E = probs.dim(-1), T = probs.numel() / E;
  CHECK_EQ(static_cast<int64_t>(top1_counts.size()), E);
  // d(aux)/d(probs[t, e]) = aux_coef * E * count_e / T^2, the same for every token: one row,
  // kept per thread and device so that a steady state allocates nothing.
  thread_local std::vector<float> host;
  thread_local Tensor row;
  host.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    host[e] = aux_coef * static_cast<float>(E) * static_cast<float>(top1_counts[e]) /
              (static_cast<float>(T) * static_cast<float>(T));
  }
  if (!row.defined() || row.numel() < E || !(row.device() == probs.device())) {
    row = Tensor::Empty({E}, DType::kF32, probs.device());
  }
  Tensor g = row.Rows(0, E);
  g.CopyFromHost(host.data());
  MoeRouterSpec spec;
  spec.k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  spec.renormalize = renormalize;
  MoeRouterBackward(ctx, dlogits, dweight, probs, Tensor(), lse, topk_expert, g,
                    std::max<int64_t>(T, 1), spec, z_coef);
}

void MoePlanDispatch(Context& ctx, const Tensor& topk_expert, const uint8_t* eligible,
                     int64_t num_experts, int64_t capacity, const Tensor& slot,
                     const Tensor& row_token, DispatchPlan* plan) {
  const int dev = DeviceOf({&topk_expert, &slot, &row_token}, "MoePlanDispatch");
  (void)ctx;
  const int64_t T = topk_expert.dim(0);
  const int k = static_cast<int>(topk_expert.dim(1));
  // row_token holds the dispatched rows: at most T * k, or what the gate bounds them by (the CPU
  // plan checks its count before writing them; the GPU's writes them as it counts).
  CHECK(slot.numel() == T * k && (dev < 0 || row_token.numel() >= T * k));
  plan->counts.assign(num_experts, 0);
  plan->offsets.assign(num_experts + 1, 0);
  plan->capacity = capacity;
  ON_GPU(plan->rows = cuda::MoePlanDispatch(gpu, topk_expert.i32(), eligible, T, k, num_experts,
                                            capacity, slot.i32(), plan->counts.data(),
                                            plan->offsets.data(), row_token.i32(), &plan->dropped);
         return );
  plan->rows = cpu::moe_plan_dispatch(topk_expert.i32(), eligible, T, k, num_experts, capacity,
                                      slot.i32(), plan->counts.data(), plan->offsets.data(),
                                      row_token.i32(), &plan->dropped, row_token.numel());
}

void MoePermuteForward(Context& ctx, const Tensor& xp, const Tensor& x, const Tensor& row_token) {
  const int dev = DeviceOf({&xp, &x, &row_token}, "MoePermuteForward");
  const int64_t C = x.dim(-1), R = xp.numel() / C;
  CHECK(xp.dim(-1) == C && row_token.numel() >= R);
  ON_GPU(return cuda::MoePermuteForward(gpu, xp.f32(), x.f32(), row_token.i32(), R, C));
  cpu::moe_permute_forward<float>(Pool(ctx), xp.f32(), x.f32(), row_token.i32(), R, C);
}

void MoePermuteBackward(Context& ctx, const Tensor& dx, const Tensor& dxp, const Tensor& slot,
                        bool accumulate) {
  const int dev = DeviceOf({&dx, &dxp, &slot}, "MoePermuteBackward");
  const int64_t C = dx.dim(-1), T = dx.numel() / C;
  const int k = static_cast<int>(slot.numel() / std::max<int64_t>(T, 1));
  ON_GPU(
      return cuda::MoePermuteBackward(gpu, dx.f32(), dxp.f32(), slot.i32(), T, k, C, accumulate));
  cpu::moe_permute_backward<float>(Pool(ctx), dx.f32(), dxp.f32(), slot.i32(), T, k, C, accumulate);
}

void MoeCombineForward(Context& ctx, const Tensor& y, const Tensor& yp, const Tensor& weight,
                       const Tensor& slot) {
  const int dev = DeviceOf({&y, &yp, &weight, &slot}, "MoeCombineForward");
  const int64_t C = y.dim(-1), T = y.numel() / C;
  const int k = static_cast<int>(slot.numel() / std::max<int64_t>(T, 1));
  CHECK(weight.numel() == T * k && yp.dim(-1) == C);
  ON_GPU(return cuda::MoeCombineForward(gpu, y.f32(), yp.f32(), weight.f32(), slot.i32(), T, k, C));
  cpu::moe_combine_forward<float>(Pool(ctx), y.f32(), yp.f32(), weight.f32(), slot.i32(), T, k, C);
}

void MoeCombineBackward(Context& ctx, const Tensor& dyp, const Tensor& dweight, const Tensor& dy,
                        const Tensor& yp, const Tensor& weight, const Tensor& slot) {
  const int dev = DeviceOf({&dyp, &dweight, &dy, &yp, &weight, &slot}, "MoeCombineBackward");
  const int64_t C = dy.dim(-1), T = dy.numel() / C;
  const int k = static_cast<int>(slot.numel() / std::max<int64_t>(T, 1));
  CHECK(weight.numel() == T * k && dweight.numel() == T * k);
  ON_GPU(return cuda::MoeCombineBackward(gpu, dyp.f32(), dweight.f32(), dy.f32(), yp.f32(),
                                         weight.f32(), slot.i32(), T, k, C));
  cpu::moe_combine_backward<float>(Pool(ctx), dyp.f32(), dweight.f32(), dy.f32(), yp.f32(),
                                   weight.f32(), slot.i32(), T, k, C);
}

void MoeCombineBackwardRows(Context& ctx, const Tensor& dyp, const Tensor& dweight,
                            const Tensor& dy, const Tensor& yp, const Tensor& weight,
                            const Tensor& row_slot) {
  const int dev =
      DeviceOf({&dyp, &dweight, &dy, &yp, &weight, &row_slot}, "MoeCombineBackwardRows");
  const int64_t C = dy.dim(-1), n = row_slot.numel();
  CHECK(weight.rank() == 2 && dy.numel() == weight.dim(0) * C)
      << "weight [T, k] and dy [T, C] for the same tokens";
  const int k = static_cast<int>(weight.dim(-1));
  CHECK(yp.numel() == n * C && dyp.numel() == n * C && dweight.numel() == weight.numel());
  ON_GPU(return cuda::MoeCombineBackwardRows(gpu, dyp.f32(), dweight.f32(), dy.f32(), yp.f32(),
                                             weight.f32(), row_slot.i32(), n, k, C));
  cpu::moe_combine_backward_rows<float>(Pool(ctx), dyp.f32(), dweight.f32(), dy.f32(), yp.f32(),
                                        weight.f32(), row_slot.i32(), n, k, C);
}

void MoeRandomRouting(Context& ctx, std::vector<uint8_t>* eligible, const Tensor& topk_weight,
                      uint64_t key, int64_t first_token) {
  const int dev = DeviceOf({&topk_weight}, "MoeRandomRouting");
  (void)ctx;
  CHECK_EQ(topk_weight.dim(-1), 2) << "random routing needs top-2";
  const int64_t T = topk_weight.dim(0);
  eligible->resize(2 * T);
  ON_GPU(
      return cuda::MoeRandomRouting(gpu, eligible->data(), topk_weight.f32(), key, T, first_token));
  cpu::moe_random_routing<float>(eligible->data(), topk_weight.f32(), key, T, first_token);
}

void MoeJitterForward(Context& ctx, const Tensor& xj, const Tensor& x, uint64_t key, double eps,
                      int64_t first_token) {
  const int dev = DeviceOf({&xj, &x}, "MoeJitterForward");
  const int64_t C = x.dim(-1), T = x.numel() / C;
  ON_GPU(return cuda::MoeJitterForward(gpu, xj.f32(), x.f32(), key, T, C, eps, first_token));
  cpu::moe_jitter_forward<float>(Pool(ctx), xj.f32(), x.f32(), key, T, C, eps, first_token);
}

void MoeJitterBackward(Context& ctx, const Tensor& dx, const Tensor& dxj, uint64_t key, double eps,
                       int64_t first_token) {
  const int dev = DeviceOf({&dx, &dxj}, "MoeJitterBackward");
  const int64_t C = dx.dim(-1), T = dx.numel() / C;
  ON_GPU(return cuda::MoeJitterBackward(gpu, dx.f32(), dxj.f32(), key, T, C, eps, first_token));
  cpu::moe_jitter_backward<float>(Pool(ctx), dx.f32(), dxj.f32(), key, T, C, eps, first_token);
}

void MoeNoisyLogitsForward(Context& ctx, const Tensor& h, const Tensor& clean,
                           const Tensor& raw_noise, uint64_t key, int64_t first_token) {
  const int dev = DeviceOf({&h, &clean, &raw_noise}, "MoeNoisyLogitsForward");
  const int64_t E = clean.dim(-1), T = clean.numel() / E;
  ON_GPU(return cuda::MoeNoisyLogitsForward(gpu, h.f32(), clean.f32(), raw_noise.f32(), key, T, E,
                                            first_token));
  cpu::moe_noisy_logits_forward<float>(Pool(ctx), h.f32(), clean.f32(), raw_noise.f32(), key, T, E,
                                       first_token);
}

void MoeNoisyLogitsBackward(Context& ctx, const Tensor& draw_noise, const Tensor& dh,
                            const Tensor& raw_noise, uint64_t key, int64_t first_token) {
  const int dev = DeviceOf({&draw_noise, &dh, &raw_noise}, "MoeNoisyLogitsBackward");
  const int64_t E = dh.dim(-1), T = dh.numel() / E;
  ON_GPU(return cuda::MoeNoisyLogitsBackward(gpu, draw_noise.f32(), dh.f32(), raw_noise.f32(), key,
                                             T, E, first_token));
  cpu::moe_noisy_logits_backward<float>(Pool(ctx), draw_noise.f32(), dh.f32(), raw_noise.f32(), key,
                                        T, E, first_token);
}

}  // namespace strata::ops
