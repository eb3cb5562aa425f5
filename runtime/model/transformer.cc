#include "runtime/model/transformer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/trace.h"
#include "proto/config_io.h"

namespace strata::model {

namespace {
ops::Activation ToActivation(config::ModelConfig::Activation a) {
  switch (a) {
    case config::ModelConfig::RELU:
      return ops::Activation::kRelu;
    case config::ModelConfig::SWIGLU:
      return ops::Activation::kSwiglu;
    case config::ModelConfig::GELU:
      break;
  }
  return ops::Activation::kGelu;
}
}  // namespace

// Backward scratch shared by all blocks (only one block runs at a time).
struct BlockScratch {
  Tensor dln;   // [N, C] gradient w.r.t. a norm's output
  Tensor datt;  // [N, C] gradient w.r.t. the attention output
  Tensor dqkv;  // [N, 3C]
};

class Block {
 public:
  Block(int index, const config::ModelConfig& cfg, int64_t max_batch, int64_t batch_sequences,
        ops::NormKind norm, uint64_t seed, const ExpertFactory& factory, bool unbound_experts,
        int64_t first_expert, int64_t local_experts, Device device)
      : index_(index),
        norm_(norm),
        C_(cfg.d_model()),
        NH_(cfg.n_heads()),
        T_(cfg.seq_len()),
        eps_(cfg.norm_eps()) {
    const std::string p = absl::StrCat("blocks.", index);
    const int64_t N = max_batch * T_;
    const float std = cfg.init_std();
    const float out_std = std / std::sqrt(2.0f * static_cast<float>(cfg.n_layers()));
    const bool ln = norm == ops::NormKind::kLayerNorm;
    ln1_w_ = MakeParameter(p + ".ln1.weight", {C_}, Init::kOnes, 0, false, device);
    if (ln) ln1_b_ = MakeParameter(p + ".ln1.bias", {C_}, Init::kZeros, 0, false, device);
    qkv_w_ = MakeParameter(p + ".attn.qkv.weight", {3 * C_, C_}, Init::kNormal, std, true, device);
    qkv_b_ = MakeParameter(p + ".attn.qkv.bias", {3 * C_}, Init::kZeros, 0, false, device);
    proj_w_ =
        MakeParameter(p + ".attn.proj.weight", {C_, C_}, Init::kNormal, out_std, true, device);
    qkv_w_->gemm = proj_w_->gemm = true;
    proj_b_ = MakeParameter(p + ".attn.proj.bias", {C_}, Init::kZeros, 0, false, device);
    ln2_w_ = MakeParameter(p + ".ln2.weight", {C_}, Init::kOnes, 0, false, device);
    if (ln) ln2_b_ = MakeParameter(p + ".ln2.bias", {C_}, Init::kZeros, 0, false, device);

    const ops::Activation act = ToActivation(cfg.activation());
    if (config::IsMoeLayer(cfg, index)) {
      const config::MoeConfig& m = cfg.moe();
      SoftmaxGateOptions g;
      g.d_model = C_;
      g.num_experts = m.num_experts();
      g.k = m.top_k();
      g.max_tokens = N;
      g.batch_tokens = std::max(batch_sequences, max_batch) * T_;
      g.config = m.gate();
      g.seed = seed;
      g.layer = index;
      g.init_std = std;
      g.device = device;
      std::vector<std::unique_ptr<Expert>> experts;
      if (local_experts < 0) local_experts = m.num_experts() - first_expert;
      for (int64_t e = first_expert; e < first_expert + local_experts; ++e) {
        std::string ep = absl::StrCat(p, ".moe.experts.", e);
        if (factory) {
          experts.push_back(factory(index, static_cast<int>(e), ep));
        } else {
          FfnOptions f{C_, m.d_expert(), act, m.expert_bias(), std, out_std};
          f.device = device;
          experts.push_back(std::make_unique<FfnExpert>(ep, f));
        }
        if (unbound_experts) {
          for (Parameter* p : experts.back()->Parameters()) Unbind(*p);
        }
      }
      // The shared experts, as one FFN of their total width (moe_layer.h), on every worker.
      std::unique_ptr<FfnExpert> shared;
      if (m.num_shared_experts() > 0) {
        const int64_t width = int64_t{m.num_shared_experts()} * m.shared_d_expert();
        FfnOptions f{C_, width, act, m.expert_bias(), std, out_std};
        f.device = device;
        shared = std::make_unique<FfnExpert>(p + ".moe.shared", f);
      }
      moe_ = std::make_unique<MoeLayer>(C_, N, MakeGate(p + ".moe.gate", g), std::move(experts),
                                        first_expert, device, std::move(shared));
    } else {
      FfnOptions f{C_, cfg.d_ff(), act, true, std, out_std};
      f.device = device;
      ffn_ = std::make_unique<FfnExpert>(p + ".ffn", f);
      ffn_saved_ = Tensor::Empty({N, ffn_->SavedPerRow()}, DType::kF32, device);
    }

    ln1_out_ = Tensor::Empty({N, C_}, DType::kF32, device);
    ln1_mean_ = Tensor::Empty({N}, DType::kF32, device);
    ln1_rstd_ = Tensor::Empty({N}, DType::kF32, device);
    qkv_ = Tensor::Empty({N, 3 * C_}, DType::kF32, device);
    att_ = Tensor::Empty({max_batch, NH_, T_, T_}, DType::kF32, device);
    att_out_ = Tensor::Empty({N, C_}, DType::kF32, device);
    x_mid_ = Tensor::Empty({N, C_}, DType::kF32, device);
    ln2_out_ = Tensor::Empty({N, C_}, DType::kF32, device);
    ln2_mean_ = Tensor::Empty({N}, DType::kF32, device);
    ln2_rstd_ = Tensor::Empty({N}, DType::kF32, device);
    ffn_out_ = Tensor::Empty({N, C_}, DType::kF32, device);
  }

  std::vector<Parameter*> Parameters() {
    std::vector<Parameter*> ps = DenseParameters();
    if (moe_) {
      const int64_t first = moe_->first_local_expert();
      for (int64_t e = first; e < first + moe_->num_local_experts(); ++e) {
        for (Parameter* p : moe_->expert(e).Parameters()) ps.push_back(p);
      }
    }
    return ps;
  }

  std::vector<Parameter*> DenseParameters() {
    std::vector<Parameter*> ps = {ln1_w_.get()};
    if (ln1_b_) ps.push_back(ln1_b_.get());
    for (auto* p : {qkv_w_.get(), qkv_b_.get(), proj_w_.get(), proj_b_.get(), ln2_w_.get()}) {
      ps.push_back(p);
    }
    if (ln2_b_) ps.push_back(ln2_b_.get());
    for (Parameter* p : moe_ ? moe_->DenseParameters() : ffn_->Parameters()) ps.push_back(p);
    return ps;
  }

  MoeLayer* moe() { return moe_.get(); }

  void Forward(ops::Context& ctx, const Tensor& x_in, const Tensor& x_out, int64_t B,
               const GateCall& call) {
    Run(ctx, x_in, x_out, B * T_, call, [&](const Tensor& att_out, const Tensor& qkv) {
      ops::AttentionForward(ctx, att_out, att_, qkv, B, T_, NH_);
    });
  }

  // n rows of cache slots `slots` at `positions` (MoeTransformer::Decode), attending through the
  // KV cache; saves nothing for a backward.
  void Decode(ops::Context& ctx, const Tensor& x_in, const Tensor& x_out, int64_t n,
              const Tensor& slots, const Tensor& positions, const GateCall& call) {
    Run(ctx, x_in, x_out, n, call, [&](const Tensor& att_out, const Tensor& qkv) {
      // The scores go to the training Forward's att buffer, which a Decode does not use.
      ops::AttentionDecode(ctx, att_out, qkv, k_cache_, v_cache_, slots, positions, NH_, att_);
    });
  }

  // Keys and values of `slots` sequences of up to seq_len positions; an undefined tensor frees
  // them.
  void AllocateKvCache(int64_t slots, Device device) {
    if (slots == 0) {
      k_cache_ = v_cache_ = Tensor();
      return;
    }
    k_cache_ = Tensor::Empty({slots, T_, C_}, DType::kF32, device);
    v_cache_ = Tensor::Empty({slots, T_, C_}, DType::kF32, device);
  }

  // dres holds dLoss/dx_out on entry and dLoss/dx_in on return.
  void Backward(ops::Context& ctx, const Tensor& x_in, const Tensor& dres, int64_t B,
                BlockScratch& s) {
    const int64_t N = B * T_;
    Tensor dln = s.dln.Rows(0, N), datt = s.datt.Rows(0, N), dqkv = s.dqkv.Rows(0, N);
    Tensor ln2_out = ln2_out_.Rows(0, N);
    // FFN branch.
    if (moe_) {
      moe_->Backward(ctx, ln2_out, dres, dln);
    } else {
      ffn_->Backward(ctx, ln2_out, dres, dln, ffn_saved_.Rows(0, N));
    }
    ops::NormBackward(ctx, norm_, dres, ln2_w_->grad, Grad(ln2_b_), dln, x_mid_.Rows(0, N),
                      ln2_w_->value, Rows(ln2_mean_, N), ln2_rstd_.Rows(0, N));
    // Attention branch.
    ops::LinearBackward(ctx, datt, proj_w_->grad, proj_b_->grad, dres, att_out_.Rows(0, N),
                        GemmWeight(*proj_w_), false);
    ops::AttentionBackward(ctx, dqkv, datt, qkv_.Rows(0, N), att_, B, T_, NH_);
    ops::LinearBackward(ctx, dln, qkv_w_->grad, qkv_b_->grad, dqkv, ln1_out_.Rows(0, N),
                        GemmWeight(*qkv_w_), false);
    ops::NormBackward(ctx, norm_, dres, ln1_w_->grad, Grad(ln1_b_), dln, x_in, ln1_w_->value,
                      Rows(ln1_mean_, N), ln1_rstd_.Rows(0, N));
  }

 private:
  // One block over its first n rows: attention(att_out, qkv) is the only step that differs
  // between a training or evaluation Forward and a Decode.
  template <typename Attention>
  void Run(ops::Context& ctx, const Tensor& x_in, const Tensor& x_out, int64_t N,
           const GateCall& call, Attention attention) {
    Tensor ln1_out = ln1_out_.Rows(0, N), qkv = qkv_.Rows(0, N), att_out = att_out_.Rows(0, N);
    Tensor x_mid = x_mid_.Rows(0, N), ln2_out = ln2_out_.Rows(0, N);
    Tensor ffn_out = ffn_out_.Rows(0, N);
    ops::NormForward(ctx, norm_, ln1_out, Rows(ln1_mean_, N), ln1_rstd_.Rows(0, N), x_in,
                     ln1_w_->value, Value(ln1_b_), eps_);
    ops::LinearForward(ctx, qkv, ln1_out, GemmWeight(*qkv_w_), qkv_b_->value);
    attention(att_out, qkv);
    ops::LinearForward(ctx, x_mid, att_out, GemmWeight(*proj_w_), proj_b_->value);
    ops::Accumulate(ctx, x_mid, x_in);
    ops::NormForward(ctx, norm_, ln2_out, Rows(ln2_mean_, N), ln2_rstd_.Rows(0, N), x_mid,
                     ln2_w_->value, Value(ln2_b_), eps_);
    if (moe_) {
      moe_->Forward(ctx, ln2_out, ffn_out, call);
    } else {
      ffn_->Forward(ctx, ln2_out, ffn_out, ffn_saved_.Rows(0, N));
    }
    ops::Add(ctx, x_out, x_mid, ffn_out);
  }

  // RMSNorm keeps no mean; an undefined tensor stands for it.
  Tensor Rows(const Tensor& t, int64_t n) const {
    return norm_ == ops::NormKind::kLayerNorm ? t.Rows(0, n) : Tensor();
  }
  static Tensor Value(const std::unique_ptr<Parameter>& p) { return p ? p->value : Tensor(); }
  static Tensor Grad(const std::unique_ptr<Parameter>& p) { return p ? p->grad : Tensor(); }

  int index_;
  ops::NormKind norm_;
  int64_t C_, NH_, T_;
  float eps_;
  std::unique_ptr<Parameter> ln1_w_, ln1_b_, qkv_w_, qkv_b_, proj_w_, proj_b_, ln2_w_, ln2_b_;
  std::unique_ptr<FfnExpert> ffn_;
  std::unique_ptr<MoeLayer> moe_;
  Tensor ffn_saved_;
  Tensor ln1_out_, ln1_mean_, ln1_rstd_, qkv_, att_, att_out_, x_mid_, ln2_out_, ln2_mean_,
      ln2_rstd_, ffn_out_;
  Tensor k_cache_, v_cache_;  // [slots, seq_len, C] while decoding
};

MoeTransformer::~MoeTransformer() = default;

StatusOr<std::unique_ptr<MoeTransformer>> MoeTransformer::Create(ops::Context& ctx,
                                                                 const ModelOptions& options) {
  config::JobConfig probe;
  *probe.mutable_model() = options.config;
  config::Normalize(&probe);
  RETURN_IF_ERROR(config::ValidateModelConfig(probe.model(), "model config"));
  if (options.max_batch < 1) return absl::InvalidArgumentError("max_batch must be at least 1");
  const int64_t E = probe.model().moe().num_experts();
  if (options.first_local_expert < 0 || options.first_local_expert > E ||
      (options.num_local_experts >= 0 &&
       options.first_local_expert + options.num_local_experts > E)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("local experts [%d, +%d) do not fit the %d experts of a layer",
                        options.first_local_expert, options.num_local_experts, E));
  }

  if (!options.device.is_cpu()) {
    if (options.device.index < 0 || options.device.index >= CudaDeviceCount()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "model on %s, but %s; train on the CPU device or on a machine with an NVIDIA GPU",
          options.device.ToString(), CudaDeviceDescription(options.device.index)));
    }
    RETURN_IF_ERROR(ops::CheckDeviceKernels(options.device));
    if (options.expert_factory) {
      return absl::UnimplementedError(absl::StrFormat(
          "a model on %s builds its experts itself from the config: custom experts (an "
          "expert_factory) need the CPU device",
          options.device.ToString()));
    }
  }
  std::unique_ptr<MoeTransformer> m(new MoeTransformer);
  m->cfg_ = probe.model();
  const config::ModelConfig& cfg = m->cfg_;
  m->max_batch_ = options.max_batch;
  m->device_ = options.device;
  m->norm_kind_ = cfg.norm() == config::ModelConfig::RMS_NORM ? ops::NormKind::kRmsNorm
                                                              : ops::NormKind::kLayerNorm;
  const int64_t C = cfg.d_model(), V = cfg.vocab_size(), T = cfg.seq_len();
  const int64_t N = options.max_batch * T;

  m->wte_ = MakeParameter("wte", {V, C}, Init::kNormal, cfg.init_std(), true, options.device);
  m->wpe_ = MakeParameter("wpe", {T, C}, Init::kNormal, cfg.init_std(), true, options.device);
  m->params_ = {m->wte_.get(), m->wpe_.get()};
  for (int l = 0; l < cfg.n_layers(); ++l) {
    m->blocks_.push_back(std::make_unique<Block>(
        l, cfg, options.max_batch, options.batch_sequences, m->norm_kind_, options.seed,
        options.expert_factory, options.unbound_experts, options.first_local_expert,
        options.num_local_experts, options.device));
    for (Parameter* p : m->blocks_.back()->Parameters()) m->params_.push_back(p);
    if (m->blocks_.back()->moe()) m->moe_layers_.push_back({l, m->blocks_.back()->moe()});
  }
  m->lnf_w_ = MakeParameter("lnf.weight", {C}, Init::kOnes, 0, false, options.device);
  m->params_.push_back(m->lnf_w_.get());
  if (m->norm_kind_ == ops::NormKind::kLayerNorm) {
    m->lnf_b_ = MakeParameter("lnf.bias", {C}, Init::kZeros, 0, false, options.device);
    m->params_.push_back(m->lnf_b_.get());
  }
  if (!cfg.tie_embeddings()) {
    m->lm_head_ =
        MakeParameter("lm_head", {V, C}, Init::kNormal, cfg.init_std(), true, options.device);
    m->params_.push_back(m->lm_head_.get());
  }
  (m->lm_head_ ? m->lm_head_ : m->wte_)->gemm = true;  // the logits' GEMM
  for (Parameter* p : m->params_) Initialize(ctx, *p, options.seed);
  m->bf16_ = options.bf16;
  if (options.bf16) {
    for (Parameter* p : m->params_) {
      if (p->gemm && p->value.defined()) {
        p->compute = Tensor::Empty(p->shape, DType::kBF16, options.device);
      }
    }
  }
  std::vector<Parameter*> dense = {m->wte_.get(), m->wpe_.get()};
  for (auto& b : m->blocks_) {
    for (Parameter* p : b->DenseParameters()) dense.push_back(p);
  }
  for (Parameter* p : {m->lnf_w_.get(), m->lnf_b_.get(), m->lm_head_.get()}) {
    if (p != nullptr) dense.push_back(p);
  }
  m->dense_params_ = dense;

  m->tokens_ = Tensor::Empty({N}, DType::kI32, options.device);
  m->targets_ = Tensor::Empty({N}, DType::kI32, options.device);
  for (int l = 0; l <= cfg.n_layers(); ++l)
    m->residual_.push_back(Tensor::Empty({N, C}, DType::kF32, options.device));
  m->lnf_out_ = Tensor::Empty({N, C}, DType::kF32, options.device);
  m->lnf_mean_ = Tensor::Empty({N}, DType::kF32, options.device);
  m->lnf_rstd_ = Tensor::Empty({N}, DType::kF32, options.device);
  m->logits_ = Tensor::Empty({N, V}, DType::kF32, options.device);
  m->dres_ = Tensor::Empty({N, C}, DType::kF32, options.device);
  m->dln_ = Tensor::Empty({N, C}, DType::kF32, options.device);
  m->datt_ = Tensor::Empty({N, C}, DType::kF32, options.device);
  m->dqkv_ = Tensor::Empty({N, 3 * C}, DType::kF32, options.device);
  return m;
}

Parameter* MoeTransformer::FindParameter(const std::string& name) const {
  for (Parameter* p : params_) {
    if (p->name == name) return p;
  }
  return nullptr;
}

int64_t MoeTransformer::ActiveParametersPerToken() const {
  int64_t n = CountScalars(dense_params_);
  for (const MoeLayerRef& ref : moe_layers_) {
    if (ref.layer->num_local_experts() == 0) continue;
    // Experts per token: top_k (on average, for expert choice, whose gate has E slots).
    n += CountScalars(ref.layer->expert(ref.layer->first_local_expert()).Parameters()) *
         cfg_.moe().top_k();
  }
  return n;
}

void MoeTransformer::AttachResidency(ExpertResidency* residency) {
  for (const MoeLayerRef& ref : moe_layers_) ref.layer->AttachResidency(residency, ref.block);
}

void MoeTransformer::AttachParallel(ExpertExchange* exchange, BatchReducer* reducer,
                                    GradientReadyListener* listener) {
  for (const MoeLayerRef& ref : moe_layers_) {
    ref.layer->AttachExchange(exchange, ref.block);
    ref.layer->gate().AttachReducer(reducer);
  }
  listener_ = listener;
}

std::vector<Parameter*> MoeTransformer::BlockParameters(int block) const {
  if (block >= 0) return blocks_[block]->Parameters();
  std::vector<Parameter*> ps;
  for (Parameter* p : {wte_.get(), wpe_.get(), lnf_w_.get(), lnf_b_.get(), lm_head_.get()}) {
    if (p != nullptr) ps.push_back(p);
  }
  return ps;
}

void MoeTransformer::ZeroGrad() {
  for (Parameter* p : params_) p->grad.SetZero();
}

ops::Context MoeTransformer::ModelContext(const ops::Context& caller) const {
  ops::Context c = caller;
  c.bf16 = bf16_;
  return c;
}

void MoeTransformer::RefreshComputeCopies(ops::Context& caller_ctx) {
  ops::Context ctx = ModelContext(caller_ctx);
  std::vector<Tensor> copies, values;
  for (Parameter* p : params_) {
    if (!p->compute.defined()) continue;
    copies.push_back(p->compute);
    values.push_back(p->value);
  }
  ops::RoundToBf16(ctx, copies, values);  // one kernel on a GPU
}

double MoeTransformer::Forward(ops::Context& caller_ctx, const int32_t* tokens,
                               const int32_t* targets, int64_t B, const GateCall& call) {
  CHECK(B >= 1 && B <= max_batch_) << "batch " << B << " > max_batch " << max_batch_;
  ops::Context ctx = ModelContext(caller_ctx);
  // The weights may have changed since the last pass (an update, a load): the GEMMs' bf16 copies
  // are made from them once here. A training step's update follows this pass, so the next Decode
  // makes them again.
  RefreshComputeCopies(ctx);
  decode_copies_fresh_ = false;
  const int64_t T = cfg_.seq_len(), N = B * T;
  Tensor tok = tokens_.Rows(0, N), tgt = targets_.Rows(0, N);
  tok.CopyFromHost(tokens);
  tgt.CopyFromHost(targets);
  last_B_ = B;
  last_rows_ = N;
  last_training_ = call.training;

  ops::EmbeddingForward(ctx, residual_[0].Rows(0, N), tok, wte_->value, wpe_->value, B, T);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    TraceScope span(ctx.tracer, "forward block", "compute", static_cast<int>(l));
    blocks_[l]->Forward(ctx, residual_[l].Rows(0, N), residual_[l + 1].Rows(0, N), B, call);
  }
  Tensor lnf_out = lnf_out_.Rows(0, N), logits = logits_.Rows(0, N);
  Tensor lnf_mean = norm_kind_ == ops::NormKind::kLayerNorm ? lnf_mean_.Rows(0, N) : Tensor();
  ops::NormForward(ctx, norm_kind_, lnf_out, lnf_mean, lnf_rstd_.Rows(0, N),
                   residual_.back().Rows(0, N), lnf_w_->value, lnf_b_ ? lnf_b_->value : Tensor(),
                   cfg_.norm_eps());
  const Parameter& head = lm_head_ ? *lm_head_ : *wte_;
  ops::LinearForward(ctx, logits, lnf_out, GemmWeight(head), Tensor());
  // When training, the logits are replaced by dLoss/dlogits of the mean loss in the same pass.
  const float scale = static_cast<float>(call.loss_scale / static_cast<double>(N));
  double sum = ops::CrossEntropy(ctx, call.training ? logits : Tensor(), logits, tgt, scale);
  return sum / static_cast<double>(N);
}

Tensor MoeTransformer::Decode(ops::Context& caller_ctx, const int32_t* tokens, const int32_t* slots,
                              const int32_t* positions, int64_t n) {
  const int64_t T = cfg_.seq_len();
  ops::Context ctx = ModelContext(caller_ctx);
  CHECK(n >= 1 && n <= max_batch_ * T) << n << " rows, max_batch " << max_batch_;
  const config::GateConfig& gate = cfg_.moe().gate();
  CHECK(moe_layers_.empty() ||
        (gate.type() != config::GateConfig::EXPERT_CHOICE && gate.capacity_factor_eval() <= 0))
      << "Decode needs a gate that routes each token on its own";
  for (int64_t r = 0; r < n; ++r) {
    CHECK(slots[r] >= 0 && slots[r] < max_batch_ && positions[r] >= 0 && positions[r] < T &&
          tokens[r] >= 0 && tokens[r] < cfg_.vocab_size())
        << "row " << r << ": token " << tokens[r] << " of slot " << slots[r] << " at position "
        << positions[r];
  }
  if (!decode_slots_.defined()) {
    for (auto& b : blocks_) b->AllocateKvCache(max_batch_, device_);
    decode_slots_ = Tensor::Empty({max_batch_ * T}, DType::kI32, device_);
    decode_positions_ = Tensor::Empty({max_batch_ * T}, DType::kI32, device_);
  }
  Tensor tok = tokens_.Rows(0, n), slot = decode_slots_.Rows(0, n);
  Tensor pos = decode_positions_.Rows(0, n);
  tok.CopyFromHost(tokens);
  slot.CopyFromHost(slots);
  pos.CopyFromHost(positions);
  last_B_ = 0;
  last_rows_ = n;
  last_training_ = false;
  if (!decode_copies_fresh_) {
    RefreshComputeCopies(ctx);
    decode_copies_fresh_ = true;
  }
  GateCall call{false, 0, 0};
  call.batch_tokens = n;

  ops::EmbeddingForwardAt(ctx, residual_[0].Rows(0, n), tok, pos, wte_->value, wpe_->value);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    TraceScope span(ctx.tracer, "decode block", "compute", static_cast<int>(l));
    blocks_[l]->Decode(ctx, residual_[l].Rows(0, n), residual_[l + 1].Rows(0, n), n, slot, pos,
                       call);
  }
  Tensor lnf_out = lnf_out_.Rows(0, n), logits = logits_.Rows(0, n);
  Tensor lnf_mean = norm_kind_ == ops::NormKind::kLayerNorm ? lnf_mean_.Rows(0, n) : Tensor();
  ops::NormForward(ctx, norm_kind_, lnf_out, lnf_mean, lnf_rstd_.Rows(0, n),
                   residual_.back().Rows(0, n), lnf_w_->value, lnf_b_ ? lnf_b_->value : Tensor(),
                   cfg_.norm_eps());
  ops::LinearForward(ctx, logits, lnf_out, GemmWeight(lm_head_ ? *lm_head_ : *wte_), Tensor());
  return logits;
}

void MoeTransformer::ReleaseKvCache() {
  for (auto& b : blocks_) b->AllocateKvCache(0, device_);
  decode_slots_ = decode_positions_ = Tensor();
}

void MoeTransformer::Backward(ops::Context& caller_ctx) {
  CHECK(last_training_) << "Backward needs a training Forward";
  ops::Context ctx = ModelContext(caller_ctx);
  const int64_t B = last_B_, T = cfg_.seq_len(), N = B * T;
  Parameter& head = lm_head_ ? *lm_head_ : *wte_;
  Tensor dres = dres_.Rows(0, N), dln = dln_.Rows(0, N);
  ops::LinearBackward(ctx, dln, head.grad, Tensor(), logits_.Rows(0, N), lnf_out_.Rows(0, N),
                      GemmWeight(head), false);
  dres.SetZero();
  Tensor lnf_mean = norm_kind_ == ops::NormKind::kLayerNorm ? lnf_mean_.Rows(0, N) : Tensor();
  ops::NormBackward(ctx, norm_kind_, dres, lnf_w_->grad, lnf_b_ ? lnf_b_->grad : Tensor(), dln,
                    residual_.back().Rows(0, N), lnf_w_->value, lnf_mean, lnf_rstd_.Rows(0, N));
  BlockScratch scratch{dln_, datt_, dqkv_};
  for (int l = static_cast<int>(blocks_.size()) - 1; l >= 0; --l) {
    TraceScope span(ctx.tracer, "backward block", "compute", l);
    blocks_[l]->Backward(ctx, residual_[l].Rows(0, N), dres, B, scratch);
    if (listener_ != nullptr) listener_->BlockReady(l);
  }
  ops::EmbeddingBackward(ctx, wte_->grad, wpe_->grad, dres, tokens_.Rows(0, N), B, T);
  if (listener_ != nullptr) listener_->BlockReady(-1);
}

}  // namespace strata::model
