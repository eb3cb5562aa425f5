#include "kernels/ops.h"

#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norm.h"
#include "runtime/common/logging.h"

namespace strata::ops {
namespace {

// Every tensor argument that is defined must live on the CPU until the CUDA backend registers
// its kernels here.
void RequireCpu(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts) {
    if (t->defined()) {
      CHECK(t->device().is_cpu()) << op << ": tensor on " << t->device().ToString()
                                  << " but this build has no kernels for it";
    }
  }
}

float* F(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

ThreadPool& Pool(Context& ctx) {
  CHECK(ctx.pool != nullptr) << "ops::Context without a thread pool";
  return *ctx.pool;
}

}  // namespace

void EmbeddingForward(Context& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
                      const Tensor& wpe, int64_t B, int64_t T) {
  RequireCpu({&out, &tokens, &wte, &wpe}, "EmbeddingForward");
  const int64_t C = wte.dim(1);
  CHECK(out.numel() == B * T * C && tokens.numel() == B * T && wpe.dim(1) == C && wpe.dim(0) >= T)
      << out.ShapeString() << tokens.ShapeString() << wte.ShapeString() << wpe.ShapeString();
  cpu::embedding_forward<float>(Pool(ctx), out.f32(), tokens.i32(), wte.f32(), wpe.f32(), B, T, C);
}

void EmbeddingBackward(Context& ctx, const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                       const Tensor& tokens, int64_t B, int64_t T) {
  RequireCpu({&dwte, &dwpe, &dout, &tokens}, "EmbeddingBackward");
  const int64_t C = dwte.dim(1);
  CHECK(dout.numel() == B * T * C && tokens.numel() == B * T && dwpe.dim(1) == C);
  cpu::embedding_backward<float>(Pool(ctx), dwte.f32(), dwpe.f32(), dout.f32(), tokens.i32(), B, T,
                                 C);
}

void NormForward(Context& ctx, NormKind kind, const Tensor& out, const Tensor& mean,
                 const Tensor& rstd, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                 float eps) {
  RequireCpu({&out, &mean, &rstd, &inp, &weight, &bias}, "NormForward");
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  CHECK(out.numel() == N * C && weight.numel() == C && rstd.numel() == N);
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
  RequireCpu({&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd}, "NormBackward");
  const int64_t C = inp.dim(-1), N = inp.numel() / C;
  CHECK(dinp.numel() == N * C && dout.numel() == N * C && dweight.numel() == C);
  if (kind == NormKind::kLayerNorm) {
    cpu::layernorm_backward<float>(Pool(ctx), dinp.f32(), dweight.f32(), F(dbias), dout.f32(),
                                   inp.f32(), weight.f32(), mean.f32(), rstd.f32(), N, C);
  } else {
    cpu::rmsnorm_backward<float>(Pool(ctx), dinp.f32(), dweight.f32(), dout.f32(), inp.f32(),
                                 weight.f32(), rstd.f32(), N, C);
  }
}

void LinearForward(Context& ctx, const Tensor& out, const Tensor& inp, const Tensor& weight,
                   const Tensor& bias) {
  RequireCpu({&out, &inp, &weight, &bias}, "LinearForward");
  const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
  CHECK(inp.dim(-1) == IC && out.numel() == N * OC && (!bias.defined() || bias.numel() == OC))
      << "out " << out.ShapeString() << " inp " << inp.ShapeString() << " weight "
      << weight.ShapeString();
  cpu::linear_forward<float>(Pool(ctx), out.f32(), inp.f32(), weight.f32(), F(bias), N, IC, OC);
}

void LinearBackward(Context& ctx, const Tensor& dinp, const Tensor& dweight, const Tensor& dbias,
                    const Tensor& dout, const Tensor& inp, const Tensor& weight,
                    bool accumulate_dinp) {
  RequireCpu({&dinp, &dweight, &dbias, &dout, &inp, &weight}, "LinearBackward");
  const int64_t OC = weight.dim(0), IC = weight.dim(1), N = inp.numel() / IC;
  CHECK(dout.numel() == N * OC && (!dinp.defined() || dinp.numel() == N * IC))
      << "dout " << dout.ShapeString() << " inp " << inp.ShapeString();
  cpu::linear_backward<float>(Pool(ctx), F(dinp), F(dweight), F(dbias), dout.f32(), inp.f32(),
                              weight.f32(), N, IC, OC, accumulate_dinp);
}

void AttentionForward(Context& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
                      int64_t B, int64_t T, int64_t NH) {
  RequireCpu({&out, &att, &qkv}, "AttentionForward");
  const int64_t C = out.dim(-1);
  CHECK(qkv.numel() == B * T * 3 * C && att.numel() >= B * NH * T * T && C % NH == 0);
  cpu::attention_forward<float>(Pool(ctx), out.f32(), att.f32(), qkv.f32(), B, T, C, NH);
}

void AttentionBackward(Context& ctx, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                       const Tensor& att, int64_t B, int64_t T, int64_t NH) {
  RequireCpu({&dqkv, &dout, &qkv, &att}, "AttentionBackward");
  const int64_t C = dout.dim(-1);
  CHECK(dqkv.numel() == B * T * 3 * C && qkv.numel() == B * T * 3 * C);
  cpu::attention_backward<float>(Pool(ctx), dqkv.f32(), dout.f32(), qkv.f32(), att.f32(), B, T, C,
                                 NH);
}

void ActivationForward(Context& ctx, Activation act, const Tensor& out, const Tensor& inp) {
  RequireCpu({&out, &inp}, "ActivationForward");
  const int64_t H = out.dim(-1), N = out.numel() / H;
  CHECK_EQ(inp.numel(), N * cpu::ActivationInputWidth(act, H));
  cpu::activation_forward<float>(Pool(ctx), act, out.f32(), inp.f32(), N, H);
}

void BiasActivationForward(Context& ctx, Activation act, const Tensor& out, const Tensor& pre,
                           const Tensor& bias) {
  RequireCpu({&out, &pre, &bias}, "BiasActivationForward");
  const int64_t H = out.dim(-1), N = out.numel() / H;
  const int64_t W = cpu::ActivationInputWidth(act, H);
  CHECK(pre.numel() == N * W && bias.numel() == W)
      << "out " << out.ShapeString() << " pre " << pre.ShapeString() << " bias "
      << bias.ShapeString();
  cpu::bias_activation_forward<float>(Pool(ctx), act, out.f32(), pre.f32(), bias.f32(), N, H);
}

void ActivationBackward(Context& ctx, Activation act, const Tensor& dinp, const Tensor& dout,
                        const Tensor& inp, const Tensor& dbias) {
  RequireCpu({&dinp, &dout, &inp, &dbias}, "ActivationBackward");
  const int64_t H = dout.dim(-1), N = dout.numel() / H;
  const int64_t W = cpu::ActivationInputWidth(act, H);
  CHECK(inp.numel() == N * W && dinp.numel() == inp.numel() &&
        (!dbias.defined() || dbias.numel() == W));
  cpu::activation_backward<float>(Pool(ctx), act, dinp.f32(), dout.f32(), inp.f32(), N, H,
                                  F(dbias));
}

void Add(Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  RequireCpu({&out, &a, &b}, "Add");
  CHECK(out.numel() == a.numel() && a.numel() == b.numel());
  cpu::add<float>(Pool(ctx), out.f32(), a.f32(), b.f32(), out.numel());
}

void Accumulate(Context& ctx, const Tensor& out, const Tensor& a) {
  RequireCpu({&out, &a}, "Accumulate");
  CHECK_EQ(out.numel(), a.numel());
  cpu::accumulate<float>(Pool(ctx), out.f32(), a.f32(), out.numel());
}

double CrossEntropy(Context& ctx, const Tensor& dlogits, const Tensor& logits,
                    const Tensor& targets, float grad_scale) {
  RequireCpu({&dlogits, &logits, &targets}, "CrossEntropy");
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  CHECK(targets.numel() == N && (!dlogits.defined() || dlogits.numel() == N * V));
  return cpu::softmax_cross_entropy<float>(Pool(ctx), F(dlogits), nullptr, logits.f32(),
                                           targets.i32(), N, V, grad_scale);
}

void AdamW(Context& ctx, const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWHyper& hyper) {
  RequireCpu({&param, &grad, &m, &v}, "AdamW");
  CHECK(param.numel() == grad.numel() && m.numel() == param.numel() && v.numel() == param.numel());
  cpu::adamw_update<float>(Pool(ctx), param.f32(), grad.f32(), m.f32(), v.f32(), param.numel(),
                           hyper);
}

double SumSquares(Context& ctx, const Tensor& x) {
  RequireCpu({&x}, "SumSquares");
  return cpu::sum_squares<float>(Pool(ctx), x.f32(), x.numel());
}

void MoeRouterForward(Context& ctx, const Tensor& probs, const Tensor& lse,
                      const Tensor& topk_expert, const Tensor& topk_weight, const Tensor& logits,
                      bool renormalize) {
  RequireCpu({&probs, &lse, &topk_expert, &topk_weight, &logits}, "MoeRouterForward");
  const int64_t E = logits.dim(-1), T = logits.numel() / E;
  const int k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  CHECK(probs.numel() == T * E && lse.numel() == T && topk_weight.numel() == T * k);
  cpu::moe_router_forward<float>(Pool(ctx), probs.f32(), lse.f32(), topk_expert.i32(),
                                 topk_weight.f32(), logits.f32(), T, E, k, renormalize);
}

double MoeAuxLoss(Context& ctx, const Tensor& probs, const Tensor& topk_expert,
                  std::vector<int64_t>* top1_counts) {
  RequireCpu({&probs, &topk_expert}, "MoeAuxLoss");
  (void)ctx;
  const int64_t E = probs.dim(-1), T = probs.numel() / E;
  const int k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  top1_counts->assign(E, 0);
  return cpu::moe_aux_loss<float>(probs.f32(), topk_expert.i32(), top1_counts->data(), T, E, k);
}

double MoeZLoss(Context& ctx, const Tensor& lse) {
  RequireCpu({&lse}, "MoeZLoss");
  (void)ctx;
  return cpu::moe_z_loss<float>(lse.f32(), lse.numel());
}

void MoeRouterBackward(Context& ctx, const Tensor& dlogits, const Tensor& dweight,
                       const Tensor& probs, const Tensor& lse, const Tensor& topk_expert,
                       const std::vector<int64_t>& top1_counts, bool renormalize, float aux_coef,
                       float z_coef) {
  RequireCpu({&dlogits, &dweight, &probs, &lse, &topk_expert}, "MoeRouterBackward");
  const int64_t E = probs.dim(-1), T = probs.numel() / E;
  const int k = static_cast<int>(topk_expert.numel() / std::max<int64_t>(T, 1));
  CHECK(dlogits.numel() == T * E && dweight.numel() == T * k &&
        static_cast<int64_t>(top1_counts.size()) == E);
  cpu::moe_router_backward<float>(Pool(ctx), dlogits.f32(), dweight.f32(), probs.f32(), lse.f32(),
                                  topk_expert.i32(), top1_counts.data(), T, E, k, renormalize,
                                  aux_coef, z_coef);
}

void MoePlanDispatch(Context& ctx, const Tensor& topk_expert, const uint8_t* eligible,
                     int64_t num_experts, int64_t capacity, const Tensor& slot,
                     const Tensor& row_token, DispatchPlan* plan) {
  RequireCpu({&topk_expert, &slot, &row_token}, "MoePlanDispatch");
  (void)ctx;
  const int64_t T = topk_expert.dim(0);
  const int k = static_cast<int>(topk_expert.dim(1));
  CHECK(slot.numel() == T * k && row_token.numel() >= T * k);
  plan->counts.assign(num_experts, 0);
  plan->offsets.assign(num_experts + 1, 0);
  plan->capacity = capacity;
  plan->rows = cpu::moe_plan_dispatch(topk_expert.i32(), eligible, T, k, num_experts, capacity,
                                      slot.i32(), plan->counts.data(), plan->offsets.data(),
                                      row_token.i32(), &plan->dropped);
}

void MoePermuteForward(Context& ctx, const Tensor& xp, const Tensor& x, const Tensor& row_token) {
  RequireCpu({&xp, &x, &row_token}, "MoePermuteForward");
  const int64_t C = x.dim(-1), R = xp.numel() / C;
  CHECK(xp.dim(-1) == C && row_token.numel() >= R);
  cpu::moe_permute_forward<float>(Pool(ctx), xp.f32(), x.f32(), row_token.i32(), R, C);
}

void MoePermuteBackward(Context& ctx, const Tensor& dx, const Tensor& dxp, const Tensor& slot,
                        bool accumulate) {
  RequireCpu({&dx, &dxp, &slot}, "MoePermuteBackward");
  const int64_t C = dx.dim(-1), T = dx.numel() / C;
  const int k = static_cast<int>(slot.numel() / std::max<int64_t>(T, 1));
  cpu::moe_permute_backward<float>(Pool(ctx), dx.f32(), dxp.f32(), slot.i32(), T, k, C, accumulate);
}

void MoeCombineForward(Context& ctx, const Tensor& y, const Tensor& yp, const Tensor& weight,
                       const Tensor& slot) {
  RequireCpu({&y, &yp, &weight, &slot}, "MoeCombineForward");
  const int64_t C = y.dim(-1), T = y.numel() / C;
  const int k = static_cast<int>(slot.numel() / std::max<int64_t>(T, 1));
  CHECK(weight.numel() == T * k && yp.dim(-1) == C);
  cpu::moe_combine_forward<float>(Pool(ctx), y.f32(), yp.f32(), weight.f32(), slot.i32(), T, k, C);
}

void MoeCombineBackward(Context& ctx, const Tensor& dyp, const Tensor& dweight, const Tensor& dy,
                        const Tensor& yp, const Tensor& weight, const Tensor& slot) {
  RequireCpu({&dyp, &dweight, &dy, &yp, &weight, &slot}, "MoeCombineBackward");
  const int64_t C = dy.dim(-1), T = dy.numel() / C;
  const int k = static_cast<int>(slot.numel() / std::max<int64_t>(T, 1));
  CHECK(weight.numel() == T * k && dweight.numel() == T * k);
  cpu::moe_combine_backward<float>(Pool(ctx), dyp.f32(), dweight.f32(), dy.f32(), yp.f32(),
                                   weight.f32(), slot.i32(), T, k, C);
}

void MoeRandomRouting(Context& ctx, std::vector<uint8_t>* eligible, const Tensor& topk_weight,
                      uint64_t key, int64_t first_token) {
  RequireCpu({&topk_weight}, "MoeRandomRouting");
  (void)ctx;
  CHECK_EQ(topk_weight.dim(-1), 2) << "random routing needs top-2";
  const int64_t T = topk_weight.dim(0);
  eligible->resize(2 * T);
  cpu::moe_random_routing<float>(eligible->data(), topk_weight.f32(), key, T, first_token);
}

void MoeJitterForward(Context& ctx, const Tensor& xj, const Tensor& x, uint64_t key, double eps,
                      int64_t first_token) {
  RequireCpu({&xj, &x}, "MoeJitterForward");
  const int64_t C = x.dim(-1), T = x.numel() / C;
  cpu::moe_jitter_forward<float>(Pool(ctx), xj.f32(), x.f32(), key, T, C, eps, first_token);
}

void MoeJitterBackward(Context& ctx, const Tensor& dx, const Tensor& dxj, uint64_t key, double eps,
                       int64_t first_token) {
  RequireCpu({&dx, &dxj}, "MoeJitterBackward");
  const int64_t C = dx.dim(-1), T = dx.numel() / C;
  cpu::moe_jitter_backward<float>(Pool(ctx), dx.f32(), dxj.f32(), key, T, C, eps, first_token);
}

void MoeNoisyLogitsForward(Context& ctx, const Tensor& h, const Tensor& clean,
                           const Tensor& raw_noise, uint64_t key, int64_t first_token) {
  RequireCpu({&h, &clean, &raw_noise}, "MoeNoisyLogitsForward");
  const int64_t E = clean.dim(-1), T = clean.numel() / E;
  cpu::moe_noisy_logits_forward<float>(Pool(ctx), h.f32(), clean.f32(), raw_noise.f32(), key, T, E,
                                       first_token);
}

void MoeNoisyLogitsBackward(Context& ctx, const Tensor& draw_noise, const Tensor& dh,
                            const Tensor& raw_noise, uint64_t key, int64_t first_token) {
  RequireCpu({&draw_noise, &dh, &raw_noise}, "MoeNoisyLogitsBackward");
  const int64_t E = dh.dim(-1), T = dh.numel() / E;
  cpu::moe_noisy_logits_backward<float>(Pool(ctx), draw_noise.f32(), dh.f32(), raw_noise.f32(), key,
                                        T, E, first_token);
}

}  // namespace strata::ops
