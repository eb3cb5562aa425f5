// Gates: which experts each token goes to, and with what weight.
//
// A Gate turns token rows x [T, C] into a Routing: for each token its k experts (in order of
// preference) and the weights with which their outputs are combined. It also reports its
// auxiliary losses and, in Backward, adds their gradient to its own. The MoE layer does the rest
// (capacity, dispatch, experts, combine), so a new gate implements only this interface.
//
// SoftmaxGate implements the four gates of GateConfig.type; all of them are a linear router
// followed by scores and top-k (kernels/vocabulary.h MoeRouterSpec: softmax or sigmoid scores,
// a selection bias, group-limited choice, normalised and scaled weights), and differ in three
// places:
//   SWITCH      k = 1; the router input is multiplied by U(1-eps, 1+eps) while training.
//   GSHARD      k = 2, weights renormalised; the second expert is kept while training with
//               probability min(1, 2 * w2) (random routing).
//   NOISY_TOP_K the logits get N(0,1) * softplus(x W_noise) while training (Shazeer et al.).
// Random draws are keyed by (seed, step, layer), so they do not depend on threads or workers.
//
// Loss-free balancing (GateConfig.bias_update_rate > 0) keeps its per-expert selection bias as a
// Parameter ("<prefix>.router_bias") whose gradient stays zero: AdamW leaves it as it is (zero
// moments give a zero update, and it is not decayed), while it is saved, restored, broadcast and
// rolled back with the dense state like any other parameter. UpdateBias moves it once a step
// from the loads of the step's training Forwards, summed over the batch's workers, so every
// worker computes the same bias.
//
// Ownership and threads: a gate is owned by its MoE layer and owns its parameters (Parameters()
// pointers live as long as the gate) and its buffers. A Routing it fills points into those
// buffers: valid until its next Forward. Not synchronised: the thread running the layer calls
// Forward, Backward and AttachReducer, one at a time; the ops fan out over ctx.pool. The reducer
// is not owned, must outlive the gate's passes (or be detached with null), and is called from
// that same thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "proto/config.pb.h"
#include "runtime/model/parallel.h"
#include "runtime/model/parameter.h"

namespace strata::model {

// What differs between calls of one layer.
struct GateCall {
  bool training = true;
  uint64_t step = 0;  // keys the random draws of this call
  // Index of this call's first token within the whole batch (a data-parallel worker's share
  // starts past the others'), so random draws match a single process's.
  int64_t first_token = 0;
  // Multiplies every loss gradient of the call (cross-entropy, aux and z): a data-parallel worker
  // whose share of the batch is not 1 / workers weighs its tokens by workers * share, so that
  // the average over workers is the whole batch's gradient.
  double loss_scale = 1.0;
  // Tokens per sequence (the call's tokens are whole sequences, one after another), for the
  // sequence-wise balancing loss; 0: the call is one sequence.
  int64_t sequence_length = 0;
  // Tokens of the whole batch (every worker's), for expert choice; 0: the call's own.
  int64_t batch_tokens = 0;
};

struct Routing {
  int64_t tokens = 0;
  int k = 0;
  Tensor expert;                      // i32 [T, k], preference order
  Tensor weight;                      // f32 [T, k] combine weights
  const uint8_t* eligible = nullptr;  // [T, k] or null: 0 = the gate does not dispatch it
  double aux_loss = 0;                // unweighted load-balancing loss
  double z_loss = 0;                  // unweighted router z-loss
  double sequence_aux_loss = 0;       // unweighted sequence-wise balancing loss (0 when off)
};

class Gate {
 public:
  virtual ~Gate() = default;
  virtual int k() const = 0;
  virtual int64_t num_experts() const = 0;
  // Capacity factor for this call (0 = dropless).
  virtual double CapacityFactor(bool training) const = 0;
  // Routes x [T, C]; `out` stays valid until the next Forward.
  virtual void Forward(ops::Context& ctx, const Tensor& x, const GateCall& call, Routing* out) = 0;
  // dweight [T, k] is dLoss/d(out->weight) of the last Forward (0 for choices not dispatched).
  // Accumulates dLoss/dx into dx and the parameter gradients, including the auxiliary losses'
  // (weighted by their coefficients).
  virtual void Backward(ops::Context& ctx, const Tensor& x, const Tensor& dweight,
                        const Tensor& dx) = 0;
  virtual std::vector<Parameter*> Parameters() = 0;
  // When a step's batch is split over workers, the load-balancing loss (a product of two batch
  // means) is computed from statistics summed over all of them, so it — and its gradient — equal
  // a single process's on the whole batch. Null: this worker holds the whole batch.
  virtual void AttachReducer(BatchReducer* reducer) = 0;
  // Tokens the last Forward routed to each expert (all k choices, before capacity), summed over
  // the batch's workers when a reducer is attached. [E]
  virtual const std::vector<int64_t>& BatchLoad() const = 0;
  // Loss-free balancing: moves the selection bias by the loads of the step's training Forwards
  // and starts the next step's count; nothing when it is off. Called once per step, after the
  // optimizer, by the thread running the step.
  virtual void UpdateBias(ops::Context& ctx) = 0;
  // The selection bias's smallest and largest entries; false when loss-free balancing is off.
  virtual bool BiasRange(double* lo, double* hi) const = 0;
  // The most (token, slot) pairs a Forward of up to `max_tokens` tokens dispatches: the rows the
  // layer's permuted buffers need.
  virtual int64_t MaxDispatchRows(int64_t max_tokens) const { return max_tokens * k(); }
  // The tokens each expert took in the last Forward when the gate itself caps them (expert
  // choice: its C, over the whole batch); 0 for gates whose capacity the layer applies.
  virtual int64_t ChosenCapacity() const { return 0; }
};

struct SoftmaxGateOptions {
  int64_t d_model = 0;
  int64_t num_experts = 0;
  int k = 2;
  int64_t max_tokens = 0;
  config::GateConfig config;
  uint64_t seed = 0;
  int layer = 0;
  float init_std = 0.02f;
  // Tokens of the whole batch a Forward's tokens belong to (every worker's), at most; 0: the
  // Forward holds the whole batch (max_tokens). Expert choice sizes its rows by it.
  int64_t batch_tokens = 0;
  Device device = Device::Cpu();  // where its parameters and buffers live
};

class SoftmaxGate : public Gate {
 public:
  SoftmaxGate(const std::string& name_prefix, const SoftmaxGateOptions& options);

  int k() const override { return k_; }
  int64_t num_experts() const override { return E_; }
  double CapacityFactor(bool training) const override;
  void Forward(ops::Context& ctx, const Tensor& x, const GateCall& call, Routing* out) override;
  void Backward(ops::Context& ctx, const Tensor& x, const Tensor& dweight,
                const Tensor& dx) override;
  std::vector<Parameter*> Parameters() override;
  void AttachReducer(BatchReducer* reducer) override { reducer_ = reducer; }
  const std::vector<int64_t>& BatchLoad() const override { return batch_load_; }
  void UpdateBias(ops::Context& ctx) override;
  bool BiasRange(double* lo, double* hi) const override;

  Parameter& router() { return *w_gate_; }
  Parameter* noise_router() { return w_noise_.get(); }
  Parameter* selection_bias() { return bias_.get(); }
  // How the router turns logits into choices and weights, as it runs outside training (the
  // training-only jitter, noise and random routing aside): scores, k, renormalisation, scaling,
  // groups. An export describes the router with it.
  ops::MoeRouterSpec Spec() const;
  // The last Forward's chosen experts [T, k] and sequence-wise balancing loss (for tests).
  Tensor last_experts() const { return expert_.Rows(0, last_tokens_); }
  double last_sequence_aux_loss() const { return last_sequence_aux_loss_; }
  // Keys of the random draws of a call, for references that reproduce them.
  static uint64_t JitterKey(uint64_t seed, uint64_t step, int layer);
  static uint64_t NoiseKey(uint64_t seed, uint64_t step, int layer);
  static uint64_t RoutingKey(uint64_t seed, uint64_t step, int layer);

 private:
  bool renormalize() const;

  config::GateConfig cfg_;
  int64_t C_, E_;
  int k_;
  uint64_t seed_;
  int layer_;
  std::unique_ptr<Parameter> w_gate_;   // [E, C]
  std::unique_ptr<Parameter> w_noise_;  // [E, C], NOISY_TOP_K only
  std::unique_ptr<Parameter> bias_;     // [E], loss-free balancing only

  // Buffers for up to max_tokens rows, reused every call.
  Tensor xj_, dxj_;  // jittered router input and its gradient (SWITCH)
  Tensor logits_, raw_noise_, probs_, lse_, dlogits_, draw_noise_;
  Tensor expert_, weight_;
  std::vector<uint8_t> eligible_;
  std::vector<int64_t> top1_counts_;  // over the whole batch (all workers)
  std::vector<double> batch_stats_;   // [3E + 1]: top-1 counts, probability sums, tokens, loads
  std::vector<int64_t> batch_load_;   // [E] the last Forward's, over the whole batch
  std::vector<double> step_load_;     // [E] the loads of step load_step_'s training Forwards
  uint64_t load_step_ = 0;
  std::vector<double> seq_dq_;    // d(sequence aux)/dq per sequence, [sequences, E]
  std::vector<float> host_grad_;  // the balancing losses' dq rows, before upload
  Tensor score_grad_;             // [max sequences, E] the same on the gate's device
  BatchReducer* reducer_ = nullptr;
  // State of the last Forward, for Backward.
  int64_t last_tokens_ = 0;
  int64_t last_first_token_ = 0;
  double last_batch_tokens_ = 0;  // tokens of the whole batch the aux loss averaged over
  double last_loss_scale_ = 1.0;
  double last_sequence_length_ = 0;
  double last_sequence_aux_loss_ = 0;
  bool last_jitter_ = false, last_noise_ = false;
  uint64_t last_step_ = 0;
};

// Expert choice (GateConfig EXPERT_CHOICE, Zhou et al. 2022): softmax scores; each expert takes
// the C tokens of the whole batch that score it highest (ties: the earlier token), C =
// MoeCapacity(capacity_factor or 1, batch tokens, top_k, E). Its Routing has k() = E slots per
// token, slot j for expert j, dispatched (eligible) only where expert j took the token, weighted
// by the token's score. When a reducer spans several workers, the scores of the whole batch are
// summed into one matrix (each worker fills its rows at call.first_token), so every worker makes
// the single process's choice and keeps its own rows. The z-loss applies; there is no aux loss.
// The choice itself is host code: on a GPU the scores come to the host each call and the
// combine weights go back, and the dispatch plan takes the choice up from the host (synchronising
// copies each layer and call); the router GEMM, softmax and backward run on the GPU, the backward
// with its E slots. Ownership and threads as SoftmaxGate.
class ExpertChoiceGate : public Gate {
 public:
  ExpertChoiceGate(const std::string& name_prefix, const SoftmaxGateOptions& options);

  int k() const override { return static_cast<int>(E_); }
  int64_t num_experts() const override { return E_; }
  // The gate limits each expert itself: the layer's plan drops nothing.
  double CapacityFactor(bool) const override { return 0; }
  void Forward(ops::Context& ctx, const Tensor& x, const GateCall& call, Routing* out) override;
  void Backward(ops::Context& ctx, const Tensor& x, const Tensor& dweight,
                const Tensor& dx) override;
  std::vector<Parameter*> Parameters() override { return {w_gate_.get()}; }
  void AttachReducer(BatchReducer* reducer) override { reducer_ = reducer; }
  const std::vector<int64_t>& BatchLoad() const override { return batch_load_; }
  void UpdateBias(ops::Context&) override {}
  bool BiasRange(double*, double*) const override { return false; }
  int64_t ChosenCapacity() const override { return last_capacity_; }
  // E experts x their capacity of the largest batch (training or evaluation), at most every
  // token in every slot.
  int64_t MaxDispatchRows(int64_t max_tokens) const override;

  Parameter& router() { return *w_gate_; }
  // Tokens each expert takes of a batch of `tokens` (training or evaluation capacity factor).
  int64_t Capacity(int64_t tokens, bool training) const;

 private:
  config::GateConfig cfg_;
  int64_t C_, E_;
  int top_k_;
  int64_t batch_tokens_;
  std::unique_ptr<Parameter> w_gate_;  // [E, C]
  Tensor logits_, probs_, lse_, top1_, top1_weight_, dlogits_;
  Tensor expert_, weight_;            // [T, E]: slot j is expert j
  std::vector<uint8_t> eligible_;     // [T, E]
  std::vector<double> batch_scores_;  // [batch tokens, E]: the call's rows, or the batch's
  std::vector<int32_t> order_;        // token order of one expert's column
  int64_t last_capacity_ = 0;         // C of the last Forward
  std::vector<float> host_probs_, host_weight_;  // [T, E] host copies, for a gate on a GPU
  std::vector<int64_t> batch_load_;
  BatchReducer* reducer_ = nullptr;
  int64_t last_tokens_ = 0;
  double last_loss_scale_ = 1.0;
};

// The gate a GateConfig describes, for a layer of `num_experts` experts of width d_model.
std::unique_ptr<Gate> MakeGate(const std::string& name_prefix, const SoftmaxGateOptions& options);

}  // namespace strata::model
