#include "runtime/model/gate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/common/rng.h"

namespace strata::model {
namespace {
enum : uint64_t { kJitterStream = 1, kNoiseStream = 2, kRoutingStream = 3 };

// The router's GEMMs run in fp32 whatever the model's precision: scores, their softmax and the
// choice they make stay fp32 (ops::Context::bf16).
ops::Context RouterContext(const ops::Context& ctx) {
  ops::Context c = ctx;
  c.bf16 = false;
  return c;
}
}  // namespace

uint64_t SoftmaxGate::JitterKey(uint64_t seed, uint64_t step, int layer) {
  return rng::Key(seed, step, static_cast<uint64_t>(layer), kJitterStream);
}
uint64_t SoftmaxGate::NoiseKey(uint64_t seed, uint64_t step, int layer) {
  return rng::Key(seed, step, static_cast<uint64_t>(layer), kNoiseStream);
}
uint64_t SoftmaxGate::RoutingKey(uint64_t seed, uint64_t step, int layer) {
  return rng::Key(seed, step, static_cast<uint64_t>(layer), kRoutingStream);
}

SoftmaxGate::SoftmaxGate(const std::string& prefix, const SoftmaxGateOptions& o)
    : cfg_(o.config), C_(o.d_model), E_(o.num_experts), k_(o.k), seed_(o.seed), layer_(o.layer) {
  w_gate_ = MakeParameter(prefix + ".router", {E_, C_}, Init::kNormal, o.init_std, true, o.device);
  const int64_t T = o.max_tokens;
  if (cfg_.type() == config::GateConfig::NOISY_TOP_K) {
    w_noise_ = MakeParameter(prefix + ".noise_router", {E_, C_}, Init::kNormal, o.init_std, true,
                             o.device);
    raw_noise_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
    draw_noise_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  }
  if (cfg_.type() == config::GateConfig::SWITCH) {
    xj_ = Tensor::Empty({T, C_}, DType::kF32, o.device);
    dxj_ = Tensor::Empty({T, C_}, DType::kF32, o.device);
  }
  if (cfg_.bias_update_rate() > 0) {
    bias_ = MakeParameter(prefix + ".router_bias", {E_}, Init::kZeros, 0.0f, false, o.device);
    step_load_.assign(E_, 0.0);
  }
  // One row of balancing-loss gradient per sequence (at most one per token), or one for all.
  const int64_t grad_rows = cfg_.sequence_aux_loss_coef() > 0 ? std::max<int64_t>(T, 1) : 1;
  host_grad_.assign(grad_rows * E_, 0.0f);
  score_grad_ = Tensor::Empty({grad_rows, E_}, DType::kF32, o.device);
  logits_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  probs_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  lse_ = Tensor::Empty({T}, DType::kF32, o.device);
  dlogits_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  expert_ = Tensor::Empty({T, k_}, DType::kI32, o.device);
  weight_ = Tensor::Empty({T, k_}, DType::kF32, o.device);
}

bool SoftmaxGate::renormalize() const {
  return cfg_.type() == config::GateConfig::GSHARD || (cfg_.renormalize() && k_ > 1);
}

ops::MoeRouterSpec SoftmaxGate::Spec() const {
  ops::MoeRouterSpec spec;
  spec.k = k_;
  spec.sigmoid = cfg_.score_function() == config::GateConfig::SIGMOID;
  spec.renormalize = renormalize();
  spec.scaling = cfg_.routed_scaling();
  spec.num_groups = cfg_.num_groups();
  spec.topk_groups = cfg_.topk_groups();
  return spec;
}

double SoftmaxGate::CapacityFactor(bool training) const {
  return training ? cfg_.capacity_factor_train() : cfg_.capacity_factor_eval();
}

std::vector<Parameter*> SoftmaxGate::Parameters() {
  std::vector<Parameter*> ps = {w_gate_.get()};
  if (w_noise_) ps.push_back(w_noise_.get());
  if (bias_) ps.push_back(bias_.get());
  return ps;
}

void SoftmaxGate::Forward(ops::Context& ctx, const Tensor& x, const GateCall& call, Routing* out) {
  ops::Context router_ctx = RouterContext(ctx);
  const int64_t T = x.dim(0);
  CHECK_LE(T, logits_.dim(0)) << "more tokens than the gate was sized for";
  last_tokens_ = T;
  last_step_ = call.step;
  last_first_token_ = call.first_token;
  last_loss_scale_ = call.loss_scale;
  last_jitter_ =
      call.training && cfg_.type() == config::GateConfig::SWITCH && cfg_.jitter_eps() > 0;
  last_noise_ = call.training && cfg_.type() == config::GateConfig::NOISY_TOP_K;
  Tensor none;

  Tensor router_in = x;
  if (last_jitter_) {
    router_in = xj_.Rows(0, T);
    ops::MoeJitterForward(ctx, router_in, x, JitterKey(seed_, call.step, layer_), cfg_.jitter_eps(),
                          call.first_token);
  }
  Tensor logits = logits_.Rows(0, T);
  ops::LinearForward(router_ctx, logits, router_in, w_gate_->value, none);
  if (last_noise_) {
    Tensor raw = raw_noise_.Rows(0, T);
    ops::LinearForward(router_ctx, raw, router_in, w_noise_->value, none);
    ops::MoeNoisyLogitsForward(ctx, logits, logits, raw, NoiseKey(seed_, call.step, layer_),
                               call.first_token);
  }
  Tensor probs = probs_.Rows(0, T), lse = lse_.Rows(0, T);
  Tensor expert = expert_.Rows(0, T), weight = weight_.Rows(0, T);
  const ops::MoeRouterSpec spec = Spec();
  ops::MoeRouterForward(ctx, probs, lse, expert, weight, logits, bias_ ? bias_->value : Tensor(),
                        spec);

  out->tokens = T;
  out->k = k_;
  out->expert = expert;
  out->weight = weight;
  out->eligible = nullptr;
  if (call.training && cfg_.type() == config::GateConfig::GSHARD && cfg_.random_routing()) {
    ops::MoeRandomRouting(ctx, &eligible_, weight, RoutingKey(seed_, call.step, layer_),
                          call.first_token);
    out->eligible = eligible_.data();
  }
  out->aux_loss = ops::MoeAuxLoss(ctx, probs, expert, &top1_counts_, spec.sigmoid);
  out->z_loss = ops::MoeZLoss(ctx, lse);
  out->sequence_aux_loss = 0;
  last_sequence_length_ = 0;
  if (cfg_.sequence_aux_loss_coef() > 0) {
    const int64_t S = call.sequence_length > 0 ? call.sequence_length : std::max<int64_t>(T, 1);
    out->sequence_aux_loss = ops::MoeSequenceAuxLoss(ctx, probs, expert, S, spec.sigmoid, &seq_dq_);
    last_sequence_length_ = static_cast<double>(S);
  }
  last_sequence_aux_loss_ = out->sequence_aux_loss;
  last_batch_tokens_ = static_cast<double>(T);
  // Tokens routed to each expert, any choice (the load loss-free balancing and the metrics see).
  batch_load_.assign(E_, 0);
  {
    const Tensor host_expert = expert.To(Device::Cpu());
    const int32_t* ids = host_expert.i32();
    for (int64_t i = 0; i < T * k_; ++i) ++batch_load_[ids[i]];
  }
  if (reducer_ != nullptr && reducer_->parts() > 1) {
    // aux = E * sum_e (count_e / T) * (sum_t p_te / T) over the whole batch.
    batch_stats_.assign(3 * E_ + 1, 0.0);
    const Tensor host_probs = probs.To(Device::Cpu());
    const float* p = host_probs.f32();
    for (int64_t e = 0; e < E_; ++e) batch_stats_[e] = static_cast<double>(top1_counts_[e]);
    for (int64_t t = 0; t < T; ++t) {
      // q: the scores, divided by their sum for sigmoid scores (as MoeAuxLoss does).
      double inv = 1.0;
      if (spec.sigmoid) {
        double sum = 0;
        for (int64_t e = 0; e < E_; ++e) sum += static_cast<double>(p[t * E_ + e]);
        inv = 1.0 / sum;
      }
      for (int64_t e = 0; e < E_; ++e) {
        batch_stats_[E_ + e] += static_cast<double>(p[t * E_ + e]) * inv;
      }
    }
    batch_stats_[2 * E_] = static_cast<double>(T);
    for (int64_t e = 0; e < E_; ++e) {
      batch_stats_[2 * E_ + 1 + e] = static_cast<double>(batch_load_[e]);
    }
    reducer_->Sum(batch_stats_.data(), batch_stats_.size());
    const double tokens = std::max(1.0, batch_stats_[2 * E_]);
    double aux = 0;
    for (int64_t e = 0; e < E_; ++e) {
      top1_counts_[e] = std::llround(batch_stats_[e]);
      batch_load_[e] = std::llround(batch_stats_[2 * E_ + 1 + e]);
      aux += batch_stats_[e] / tokens * (batch_stats_[E_ + e] / tokens);
    }
    out->aux_loss = static_cast<double>(E_) * aux;
    last_batch_tokens_ = tokens;
  }
  // Loss-free balancing counts the step's training loads (a second Forward of the same step adds
  // the same loads again, which leaves every sign of mean - load as it was).
  if (bias_ && call.training) {
    if (call.step != load_step_) {
      std::fill(step_load_.begin(), step_load_.end(), 0.0);
      load_step_ = call.step;
    }
    for (int64_t e = 0; e < E_; ++e) step_load_[e] += static_cast<double>(batch_load_[e]);
  }
}

void SoftmaxGate::Backward(ops::Context& ctx, const Tensor& x, const Tensor& dweight,
                           const Tensor& dx) {
  ops::Context router_ctx = RouterContext(ctx);
  const int64_t T = last_tokens_;
  CHECK_EQ(x.dim(0), T);
  Tensor none;
  Tensor dlogits = dlogits_.Rows(0, T);
  // The balancing losses' gradient w.r.t. the (normalised) scores q, one row per sequence (or
  // one for the call). The aux loss's is coef * E * count_e / (T * T_batch) for every token,
  // with batch-wide counts: the batch gradient times the number of workers, which the gradient
  // average divides back out. The sequence loss's is its coefficient times dq of the sequence.
  const double seq_coef = last_loss_scale_ * cfg_.sequence_aux_loss_coef();
  const int64_t S = last_sequence_length_ > 0 ? static_cast<int64_t>(last_sequence_length_)
                                              : std::max<int64_t>(T, 1);
  const int64_t rows = last_sequence_length_ > 0 ? (T + S - 1) / S : 1;
  const double aux_scale = last_loss_scale_ * cfg_.aux_loss_coef() * static_cast<double>(E_) /
                           (static_cast<double>(T) * std::max(1.0, last_batch_tokens_));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < E_; ++e) {
      double g = aux_scale * static_cast<double>(top1_counts_[e]);
      if (last_sequence_length_ > 0) g += seq_coef * seq_dq_[r * E_ + e];
      host_grad_[r * E_ + e] = static_cast<float>(g);
    }
  }
  Tensor score_grad = score_grad_.Rows(0, rows);
  score_grad.CopyFromHost(host_grad_.data());
  ops::MoeRouterBackward(ctx, dlogits, dweight, probs_.Rows(0, T), logits_.Rows(0, T),
                         lse_.Rows(0, T), expert_.Rows(0, T), score_grad, S, Spec(),
                         static_cast<float>(last_loss_scale_ * cfg_.z_loss_coef()));
  // With jitter the router saw xj, and its input gradient is scaled back onto x.
  Tensor router_in = last_jitter_ ? xj_.Rows(0, T) : x;
  Tensor drouter_in = last_jitter_ ? dxj_.Rows(0, T) : dx;
  const bool accumulate = !last_jitter_;  // dx already holds the experts' gradient
  if (last_noise_) {
    Tensor draw = draw_noise_.Rows(0, T);
    ops::MoeNoisyLogitsBackward(ctx, draw, dlogits, raw_noise_.Rows(0, T),
                                NoiseKey(seed_, last_step_, layer_), last_first_token_);
    ops::LinearBackward(router_ctx, drouter_in, w_noise_->grad, none, draw, router_in,
                        w_noise_->value, accumulate);
    ops::LinearBackward(router_ctx, drouter_in, w_gate_->grad, none, dlogits, router_in,
                        w_gate_->value,
                        /*accumulate_dinp=*/true);
  } else {
    ops::LinearBackward(router_ctx, drouter_in, w_gate_->grad, none, dlogits, router_in,
                        w_gate_->value, accumulate);
  }
  if (last_jitter_) {
    ops::MoeJitterBackward(ctx, dx, drouter_in, JitterKey(seed_, last_step_, layer_),
                           cfg_.jitter_eps(), last_first_token_);
  }
}

void SoftmaxGate::UpdateBias(ops::Context& ctx) {
  (void)ctx;
  if (!bias_) return;
  // bias_e += rate * sign(mean load - load_e): underloaded experts become likelier choices.
  double mean = 0;
  for (double l : step_load_) mean += l;
  mean /= static_cast<double>(E_);
  Tensor host = bias_->value.To(Device::Cpu());
  float* b = host.f32();
  const float rate = cfg_.bias_update_rate();
  for (int64_t e = 0; e < E_; ++e) {
    const double d = mean - step_load_[e];
    b[e] += d > 0 ? rate : d < 0 ? -rate : 0.0f;
  }
  if (!bias_->value.device().is_cpu()) bias_->value.CopyFrom(host);
  std::fill(step_load_.begin(), step_load_.end(), 0.0);
}

bool SoftmaxGate::BiasRange(double* lo, double* hi) const {
  if (!bias_) return false;
  const Tensor host = bias_->value.To(Device::Cpu());
  const float* b = host.f32();
  *lo = *hi = E_ > 0 ? b[0] : 0.0;
  for (int64_t e = 1; e < E_; ++e) {
    *lo = std::min<double>(*lo, b[e]);
    *hi = std::max<double>(*hi, b[e]);
  }
  return true;
}

ExpertChoiceGate::ExpertChoiceGate(const std::string& prefix, const SoftmaxGateOptions& o)
    : cfg_(o.config),
      C_(o.d_model),
      E_(o.num_experts),
      top_k_(o.k),
      batch_tokens_(std::max(o.batch_tokens, o.max_tokens)) {
  w_gate_ = MakeParameter(prefix + ".router", {E_, C_}, Init::kNormal, o.init_std, true, o.device);
  const int64_t T = o.max_tokens;
  logits_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  probs_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  dlogits_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  lse_ = Tensor::Empty({T}, DType::kF32, o.device);
  top1_ = Tensor::Empty({T, 1}, DType::kI32, o.device);
  top1_weight_ = Tensor::Empty({T, 1}, DType::kF32, o.device);
  expert_ = Tensor::Empty({T, E_}, DType::kI32, o.device);
  weight_ = Tensor::Empty({T, E_}, DType::kF32, o.device);
  eligible_.assign(T * E_, 0);
  // Slot j is expert j for every token.
  Tensor ids = expert_.To(Device::Cpu());
  for (int64_t i = 0; i < T * E_; ++i) ids.i32()[i] = static_cast<int32_t>(i % E_);
  if (!expert_.device().is_cpu()) expert_.CopyFrom(ids);
  batch_load_.assign(E_, 0);
}

int64_t ExpertChoiceGate::MaxDispatchRows(int64_t max_tokens) const {
  const int64_t c = std::max(Capacity(batch_tokens_, true), Capacity(batch_tokens_, false));
  return E_ * std::min(max_tokens, c);
}

int64_t ExpertChoiceGate::Capacity(int64_t tokens, bool training) const {
  const double cf = training ? cfg_.capacity_factor_train() : cfg_.capacity_factor_eval();
  return std::min(tokens, ops::MoeCapacity(cf > 0 ? cf : 1.0, tokens, top_k_, E_));
}

void ExpertChoiceGate::Forward(ops::Context& ctx, const Tensor& x, const GateCall& call,
                               Routing* out) {
  ops::Context router_ctx = RouterContext(ctx);
  const int64_t T = x.dim(0);
  CHECK_LE(T, logits_.dim(0)) << "more tokens than the gate was sized for";
  last_tokens_ = T;
  last_loss_scale_ = call.loss_scale;
  Tensor none;
  Tensor logits = logits_.Rows(0, T), probs = probs_.Rows(0, T), lse = lse_.Rows(0, T);
  ops::LinearForward(router_ctx, logits, x, w_gate_->value, none);
  // Softmax scores and logsumexp (the top-1 it also picks is not used).
  ops::MoeRouterSpec softmax;
  softmax.k = 1;
  ops::MoeRouterForward(ctx, probs, lse, top1_.Rows(0, T), top1_weight_.Rows(0, T), logits,
                        Tensor(), softmax);
  // The scores on the host (copied there from a GPU into a buffer kept across calls).
  const float* p = probs.device().is_cpu() ? probs.f32() : nullptr;
  if (p == nullptr) {
    host_probs_.resize(T * E_);
    probs.CopyToHost(host_probs_.data());
    p = host_probs_.data();
  }
  // The batch's scores: this call's, or every worker's summed into one matrix (each entry has
  // one addend, so the sum is exact and every worker sees the same numbers). A call that does
  // not say where it sits in a batch it fits in is chosen over alone.
  int64_t batch = T, first = 0;
  const bool whole_batch = reducer_ != nullptr && reducer_->parts() > 1 && call.batch_tokens > 0 &&
                           call.first_token >= 0 && call.first_token + T <= call.batch_tokens;
  if (whole_batch) {
    batch = call.batch_tokens;
    first = call.first_token;
  }
  batch_scores_.assign(batch * E_, 0.0);
  for (int64_t i = 0; i < T * E_; ++i) batch_scores_[first * E_ + i] = p[i];
  // After a failed collective the sum is unspecified (the step fails afterwards): the choice
  // below only reads it, whatever it holds.
  if (whole_batch) reducer_->Sum(batch_scores_.data(), batch_scores_.size());
  const double* scores = batch_scores_.data();
  // Each expert takes its C best tokens of the batch (ties: the earlier token; NaN last).
  const int64_t C = Capacity(batch, call.training);
  last_capacity_ = C;
  std::fill(eligible_.begin(), eligible_.begin() + T * E_, 0);
  order_.resize(batch);
  for (int64_t e = 0; e < E_; ++e) {
    std::iota(order_.begin(), order_.end(), 0);
    std::partial_sort(order_.begin(), order_.begin() + C, order_.end(), [&](int32_t a, int32_t b) {
      double va = scores[a * E_ + e], vb = scores[b * E_ + e];
      if (std::isnan(va)) va = -INFINITY;
      if (std::isnan(vb)) vb = -INFINITY;
      return va > vb || (va == vb && a < b);
    });
    batch_load_[e] = C;
    for (int64_t i = 0; i < C; ++i) {
      const int64_t t = order_[i] - first;
      if (t >= 0 && t < T) eligible_[t * E_ + e] = 1;
    }
  }
  Tensor weight = weight_.Rows(0, T);
  float* w = weight.device().is_cpu() ? weight.f32() : nullptr;
  if (w == nullptr) {
    host_weight_.resize(T * E_);
    w = host_weight_.data();
  }
  for (int64_t i = 0; i < T * E_; ++i) w[i] = eligible_[i] ? p[i] : 0.0f;
  if (!weight.device().is_cpu()) weight.CopyFromHost(w);
  out->tokens = T;
  out->k = static_cast<int>(E_);
  out->expert = expert_.Rows(0, T);
  out->weight = weight;
  out->eligible = eligible_.data();
  out->aux_loss = 0;
  out->z_loss = ops::MoeZLoss(ctx, lse);
  out->sequence_aux_loss = 0;
}

void ExpertChoiceGate::Backward(ops::Context& ctx, const Tensor& x, const Tensor& dweight,
                                const Tensor& dx) {
  ops::Context router_ctx = RouterContext(ctx);
  const int64_t T = last_tokens_;
  CHECK_EQ(x.dim(0), T);
  // w[t, e] = p[t, e] where expert e took token t: the router's backward with the k = E slots,
  // no normalisation (dweight is 0 where nothing was dispatched).
  ops::MoeRouterSpec spec;
  spec.k = static_cast<int>(E_);
  Tensor dlogits = dlogits_.Rows(0, T), none;
  ops::MoeRouterBackward(ctx, dlogits, dweight, probs_.Rows(0, T), logits_.Rows(0, T),
                         lse_.Rows(0, T), expert_.Rows(0, T), Tensor(), 1, spec,
                         static_cast<float>(last_loss_scale_ * cfg_.z_loss_coef()));
  ops::LinearBackward(router_ctx, dx, w_gate_->grad, none, dlogits, x, w_gate_->value,
                      /*accumulate_dinp=*/true);
}

std::unique_ptr<Gate> MakeGate(const std::string& name_prefix, const SoftmaxGateOptions& options) {
  if (options.config.type() == config::GateConfig::EXPERT_CHOICE) {
    return std::make_unique<ExpertChoiceGate>(name_prefix, options);
  }
  return std::make_unique<SoftmaxGate>(name_prefix, options);
}

}  // namespace strata::model
