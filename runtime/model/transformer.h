// MoeTransformer: a decoder-only language model whose FFNs are (in every moe_every-th block)
// Mixture-of-Experts layers.
//
// Pre-norm blocks (GPT-2 layout): x = x + proj(attn(norm1(x))); x = x + ffn(norm2(x)), with ffn
// a dense FFN or an MoeLayer (with model.moe's shared experts, if any, as blocks.<l>.moe.shared).
// Learned position embeddings, a final norm, and an output projection tied to the token embedding
// by default.
//
// Like llm.c, the forward and backward passes are written out layer by layer over explicit
// activation buffers sized for max_batch sequences at construction; the whole step allocates
// nothing. Forward computes the mean cross-entropy and, when training, also the gradient of the
// logits in the same pass; Backward then walks the blocks in reverse.
//
// Ownership and threads: the model owns its blocks, layers and parameters (Parameters() and
// FindParameter lend pointers that live as long as the model); it does not own what is attached
// to it (residency, exchange, reducer, listener), which must outlive its passes. Forward, Backward,
// ZeroGrad and the Attach calls are made from one thread at a time; the ops fan out over ctx.pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/common/logging.h"
#include "core/common/status.h"
#include "kernels/ops.h"
#include "proto/config.pb.h"
#include "runtime/model/expert.h"
#include "runtime/model/gate.h"
#include "runtime/model/moe_layer.h"
#include "runtime/model/parameter.h"

namespace strata::model {

class Block;

struct ModelOptions {
  config::ModelConfig config;  // normalised and validated (proto/config_io.h)
  uint64_t seed = 0;
  int64_t max_batch = 1;  // sequences per Forward
  // Sequences of the whole batch a Forward's belong to (every worker's); 0: max_batch.
  int64_t batch_sequences = 0;
  // Builds the experts of MoE layers; null means FfnExpert from the config.
  ExpertFactory expert_factory;
  // Expert parameters are left unbound (their memory freed as each expert is built): a residency
  // (the tiered store) hands each MoE layer the resident blobs to bind when they are used. Their
  // initial values come from InitialValues with the same seed.
  bool unbound_experts = false;
  // Expert parallelism: build only experts [first_local_expert, first_local_expert +
  // num_local_experts) of every MoE layer (-1: all of them); the others live on other workers,
  // reached through an ExpertExchange (AttachParallel).
  int64_t first_local_expert = 0;
  int64_t num_local_experts = -1;
  // Where parameters, gradients and activations live. On a GPU every op runs there (with
  // unbound_experts the residency's blobs are device memory too); custom experts need the CPU
  // (Create says so).
  Device device = Device::Cpu();
  // Mixed precision (train.precision BF16): every weight GEMM but the router's multiplies bfloat16
  // operands with fp32 accumulation (ops::Context::bf16, which the model sets for its own ops
  // whatever the caller's Context says); each bound GEMM weight keeps a bf16 compute copy beside
  // its fp32 master value (Parameter::compute: 2 bytes a weight), made from it once before each
  // Forward. Everything else stays fp32. On the CPU the rounding is emulated (slower; for tests).
  bool bf16 = false;
};

class MoeTransformer {
 public:
  // Builds the model and initialises every parameter from options.seed.
  [[nodiscard]] static StatusOr<std::unique_ptr<MoeTransformer>> Create(
      ops::Context& ctx, const ModelOptions& options);
  ~MoeTransformer();

  // tokens and targets are [B, seq_len] with B <= max_batch. Returns the mean cross-entropy (nats
  // per token). With call.training, keeps what Backward needs (including dLoss/dlogits).
  double Forward(ops::Context& ctx, const int32_t* tokens, const int32_t* targets, int64_t B,
                 const GateCall& call);
  // Accumulates dLoss/dparam into every parameter's grad, where Loss is the mean cross-entropy
  // plus, for each MoE layer, aux_loss_coef * aux + z_loss_coef * z.
  void Backward(ops::Context& ctx);

  // The logits [B * seq_len, vocab_size] of the last Forward without call.training (a training
  // Forward replaces them by their gradient), or [n, vocab_size] of the last Decode; valid until
  // the next Forward or Decode.
  Tensor logits() const {
    CHECK(!last_training_) << "logits() after a training Forward: they hold their gradient";
    return logits_.Rows(0, last_rows_);
  }

  // ---- Incremental decoding (generation) ----
  // A KV cache per block for max_batch sequences ("slots") of up to seq_len positions, allocated
  // by the first Decode (2 * n_layers * max_batch * seq_len * d_model floats on the model's device)
  // and kept until ReleaseKvCache.
  //
  // Decode runs n rows (1 <= n <= max_batch * seq_len) through the model: row r is token
  // tokens[r] of slot slots[r] at position positions[r] < seq_len. Its key and value enter the
  // slot's cache there, and it attends to the slot's positions [0, positions[r]]; those before
  // it must hold the slot's earlier tokens, decoded by an earlier Decode or by an earlier row of
  // this one (a prompt decoded in one call). Nothing past positions[r] is read, so a slot starts
  // a new sequence by decoding from position 0. Each row costs one position: the cache is not
  // recomputed. Returns the logits [n, vocab_size] of every row, valid until the next Forward or
  // Decode: those a Forward over the slot's tokens 0..positions[r] gives at positions[r], up to
  // float rounding, given a gate that routes each token on its own (Decode CHECKs that the gate
  // is not expert choice and has no capacity at evaluation: with either, tokens compete).
  Tensor Decode(ops::Context& ctx, const int32_t* tokens, const int32_t* slots,
                const int32_t* positions, int64_t n);
  void ReleaseKvCache();

  // Makes every GEMM weight's bf16 compute copy from its value (BF16 models; nothing otherwise).
  // Forward does it each time and Decode after a Forward; a caller that changes weights and then
  // Decodes without a Forward in between calls it.
  void RefreshComputeCopies(ops::Context& ctx);

  void ZeroGrad();
  const std::vector<Parameter*>& Parameters() const { return params_; }
  // Every parameter that is not part of a routed expert (embeddings, attention, norms, gates,
  // shared experts, dense FFNs).
  const std::vector<Parameter*>& DenseParameters() const { return dense_params_; }
  // Lets every MoE layer's experts become resident through `residency` (see MoeLayer).
  void AttachResidency(ExpertResidency* residency);
  // Distributed training (parallel.h); any may be null. `exchange` reaches the experts of other
  // workers, `reducer` sums gate statistics over the batch's workers, `listener` hears in
  // Backward which blocks' gradients are final.
  void AttachParallel(ExpertExchange* exchange, BatchReducer* reducer,
                      GradientReadyListener* listener);
  // The parameters of block `block` (dense first, then local experts); block -1: the embeddings,
  // the final norm and the output head, whose gradients are final only at the end of Backward.
  std::vector<Parameter*> BlockParameters(int block) const;
  Parameter* FindParameter(const std::string& name) const;

  // The MoE layers, with the index of the block each sits in.
  struct MoeLayerRef {
    int block;
    MoeLayer* layer;
  };
  const std::vector<MoeLayerRef>& moe_layers() const { return moe_layers_; }
  const config::ModelConfig& config() const { return cfg_; }
  int64_t max_batch() const { return max_batch_; }
  // Parameters a token touches in one forward pass (dense, shared experts included, + k routed
  // experts per MoE layer).
  int64_t ActiveParametersPerToken() const;

 private:
  // The caller's Context with the model's precision.
  ops::Context ModelContext(const ops::Context& caller) const;
  MoeTransformer() = default;

  config::ModelConfig cfg_;
  int64_t max_batch_ = 0;
  ops::NormKind norm_kind_ = ops::NormKind::kLayerNorm;
  std::unique_ptr<Parameter> wte_, wpe_, lnf_w_, lnf_b_, lm_head_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<Parameter*> params_;
  std::vector<Parameter*> dense_params_;
  std::vector<MoeLayerRef> moe_layers_;
  GradientReadyListener* listener_ = nullptr;

  // Activations [max_batch * seq_len, ...] and backward scratch.
  Tensor tokens_, targets_;
  std::vector<Tensor> residual_;  // n_layers + 1 residual streams
  Tensor lnf_out_, lnf_mean_, lnf_rstd_, logits_;
  Tensor dres_, dln_, datt_, dqkv_;
  int64_t last_B_ = 0;
  int64_t last_rows_ = 0;
  bool last_training_ = false;
  bool bf16_ = false;
  bool decode_copies_fresh_ = false;  // the compute copies were made since the last Forward
  Device device_;
  // Decode's row descriptions (i32 [max_batch * seq_len]); defined while the KV cache is.
  Tensor decode_slots_, decode_positions_;
};

}  // namespace strata::model
