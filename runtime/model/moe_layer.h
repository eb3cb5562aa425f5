// MoeLayer: gate -> dispatch -> experts -> combine, forward and backward.
//
// Forward, for x [T, C]:
//   1. the gate routes every token to k experts with combine weights;
//   2. the dispatch plan applies capacity (drops go to the residual) and gives each expert a
//      contiguous block of rows;
//   3. rows are permuted into those blocks (xp), each expert runs once on its block (the grouped
//      computation), and yp holds their outputs. When this worker runs every expert on the CPU,
//      each expert instead gathers its own rows inside its task into its thread's buffer, just
//      before its GEMMs read them, and again in backward, where it also makes its rows of dyp
//      there and their combine-weight gradients: the rows are then in the core's cache instead
//      of one pass over memory behind, and xp is not used;
//   4. y[t] = sum of the token's weighted expert outputs (un-permute);
//   5. with shared experts, y[t] += shared(x[t]) for every token.
// Backward runs the same steps in reverse; the gate gets the gradient of its combine weights.
//
// Shared experts (DeepSeek-MoE, Qwen-MoE): an always-on FFN path beside the routed experts, with
// weight 1, that capacity never drops. N shared experts of width d run as ONE FfnExpert of width
// N * d: concatenating the N first matrices' rows (SwiGLU: gate rows, then up rows) and the N
// second matrices' columns gives exactly the sum of the N FFNs (their N output biases add up to
// one), as DeepSeek implements it, with one pair of GEMMs instead of N. Its parameters are dense
// parameters of the layer (DenseParameters()), the same on every worker: never routed, exchanged or
// put in a residency.
//
// All buffers are sized for max_tokens and reused: nothing is allocated per step or per token.
// They are made at construction, except the per-thread rows of the expert tasks, made by the
// first Forward that uses them on a pool of a new size.
//
// How the experts share the cores: when there are enough experts to give every thread a
// contiguous group with about the same number of rows (within 15%), each thread runs its group
// and every expert's GEMMs run single-threaded; otherwise the experts run one after another and
// each GEMM is split over the pool. The first avoids a pool synchronisation per kernel per expert
// (a few microseconds each, which add up with many small experts); the second keeps the cores
// busy when a few experts hold most of the rows. Either way the choice depends only on the
// routing and the thread count, so runs stay reproducible. With an ExpertResidency (the tiered
// store) experts are handed to threads as their parameters become resident, each run on one
// thread. The layer keeps the routing of its last
// Forward for Backward and for statistics.
//
// Expert parallelism: a layer may hold only some of its experts — [first_local_expert(),
// first_local_expert() + num_local_experts()) — and an ExpertExchange (parallel.h) that moves the
// rows of the others to the workers holding them. The layer lends the exchange its LocalExperts
// (and nothing else of itself) for each pass, to run this worker's experts on the rows they
// received. Experts keep their global ids.
//
// Ownership and threads: the layer owns its gate, experts and shared experts (an expert's
// parameters may be bound to a residency's blobs during a call, see expert_residency.h); it does
// not own the residency or the exchange attached to it. Forward, Backward and the Attach/set calls
// are made from one thread at a time (the one running the model); the layer fans its experts out
// over ctx.pool itself. Backward runs on a pool of the same size as its Forward's.
#pragma once

#include <memory>
#include <vector>

#include "kernels/ops.h"
#include "runtime/model/expert.h"
#include "runtime/model/expert_residency.h"
#include "runtime/model/gate.h"
#include "runtime/model/parallel.h"

namespace strata::model {

// What one Forward did, for metrics.
struct MoeStats {
  int64_t tokens = 0;
  std::vector<int64_t> load;   // rows dispatched to each expert
  int64_t dropped = 0;         // (token, choice) pairs dropped for capacity
  int64_t dropped_tokens = 0;  // tokens with no routed expert (only the shared ones, if any)
  int64_t capacity = 0;        // per expert (expert choice: the C each took); 0 = dropless
  double aux_loss = 0;
  double z_loss = 0;
  double sequence_aux_loss = 0;  // unweighted; 0 unless gate.sequence_aux_loss_coef > 0
  // Over the whole batch (every worker's tokens): tokens the gate routed to each expert, all k
  // choices, before capacity.
  std::vector<int64_t> routed;
  // Loss-free balancing's selection bias, when it is on.
  bool has_bias = false;
  double bias_min = 0, bias_max = 0;
};

class MoeLayer {
 public:
  // `experts` are experts [first_expert, first_expert + experts.size()) of the gate's
  // num_experts(); all of them unless an ExpertExchange is attached before Forward. The layer's
  // buffers live on `device` (the gate's and experts' parameters must live there too). On a GPU
  // the experts run on the GPU's stream as grouped GEMMs (see set_grouped_gemm) or one after
  // another. `shared`, when not null, is the layer's shared experts as one FFN (see the file
  // comment); it lives on `device` too.
  MoeLayer(int64_t d_model, int64_t max_tokens, std::unique_ptr<Gate> gate,
           std::vector<std::unique_ptr<Expert>> experts, int64_t first_expert = 0,
           Device device = Device::Cpu(), std::unique_ptr<FfnExpert> shared = nullptr);
  // Not copyable or movable: the LocalExperts it lends refer to it.
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // y [T, C] from x [T, C], T <= max_tokens.
  void Forward(ops::Context& ctx, const Tensor& x, const Tensor& y, const GateCall& call);
  // dx [T, C] (overwritten) from dy, for the x of the last Forward.
  void Backward(ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx);

  const MoeStats& stats() const { return stats_; }
  // The routing of the last Forward (valid until the next one).
  const Routing& routing() const { return routing_; }
  // The gate's, the shared experts', then the local experts'.
  std::vector<Parameter*> Parameters();
  // The dense part of the layer: the gate's parameters, then the shared experts'. Every worker
  // holds them all; their gradients are summed over workers with the model's other dense ones.
  std::vector<Parameter*> DenseParameters();
  // Expert parameters become resident through `residency` (the tiered store) for block `layer`;
  // see expert_residency.h: the layer binds the blobs it is handed to its experts' parameters for
  // each call. Null: experts own their parameters. The layer does not own the residency.
  // REQUIRES: every local expert has the same ExpertLayout.
  void AttachResidency(ExpertResidency* residency, int layer);
  ExpertResidency* residency() const { return residency_; }

  // Rows of experts on other workers go through `exchange` for block `layer` (null: every expert
  // is local). The layer does not own the exchange.
  void AttachExchange(ExpertExchange* exchange, int layer) {
    exchange_ = exchange;
    layer_ = layer;
  }
  // Floats of saved storage per row (the most any local expert keeps).
  int64_t saved_stride() const { return saved_stride_; }
  int64_t d_model() const { return C_; }
  // Where its buffers live and its experts run.
  Device device() const { return device_; }

  // Whether the last Forward ran the experts in per-thread groups (see the file comment).
  bool last_run_grouped() const { return !group_begin_.empty(); }
  // Run the local experts as grouped GEMMs (FfnExpert::GroupForward): on by default on a GPU when
  // every local expert is an FfnExpert of one shape; off on the CPU, where per-thread expert
  // groups are faster. Turning it on needs such experts and no residency.
  void set_grouped_gemm(bool on);
  bool grouped_gemm() const { return grouped_gemm_; }
  // Run the shared experts as one more task of the CPU expert groups (on the thread whose group
  // they join, with their GEMMs single-threaded) instead of as their own FFN split over the pool
  // after the routed experts. Off by default: bench_moe_layer's "shared in groups" column shows
  // whether it pays on a machine (docs/benchmarks.md). Applies only where the experts make their
  // rows in their tasks (all local, on the CPU) and without a residency; elsewhere it is ignored.
  void set_shared_in_expert_groups(bool on) { shared_in_tasks_ = on; }
  Gate& gate() { return *gate_; }
  // The shared experts as one FFN; null without them.
  FfnExpert* shared() { return shared_.get(); }
  // Expert `e` by its global id, which must be local.
  Expert& expert(int64_t e) {
    CHECK(e >= first_local_ && e < first_local_ + num_local_experts())
        << "expert " << e << " is not on this worker";
    return *experts_[e - first_local_];
  }
  int64_t num_experts() const { return gate_->num_experts(); }
  int64_t first_local_expert() const { return first_local_; }
  int64_t num_local_experts() const { return static_cast<int64_t>(experts_.size()); }

 private:
  int64_t C_;
  Device device_;
  std::unique_ptr<Gate> gate_;
  std::vector<std::unique_ptr<Expert>> experts_;  // local ones, from first_local_
  int64_t first_local_ = 0;
  int64_t saved_stride_;                 // floats of saved storage per row: max over experts
  std::vector<FfnExpert*> ffn_experts_;  // the local experts when all are FfnExperts of one shape
  bool grouped_gemm_ = false;
  bool shared_in_tasks_ = false;      // set_shared_in_expert_groups
  bool rows_in_tasks_ = false;        // how the last Forward ran (its Backward runs the same way):
  bool shared_in_tasks_now_ = false;  // RowsInTasks() and SharedInTasks() then
  std::vector<int64_t> group_offsets_;  // offsets relative to the first row, for the grouped path
  std::vector<int64_t> task_offsets_;   // the routed offsets, then one more task of T rows
  std::unique_ptr<FfnExpert> shared_;   // null without shared experts
  Tensor shared_y_, shared_saved_;      // [T, C] its output; [T, SavedPerRow()] for Backward

  Routing routing_;
  ops::DispatchPlan plan_;
  MoeStats stats_;
  Tensor slot_, row_token_;  // i32 [T*k]
  Tensor row_slot_;          // i32 [rows]: t * k + j of each row, when rows are made in the tasks
  Tensor xp_, yp_, dxp_;     // [T*k, C]; yp also holds dyp in backward (not with RowsInTasks)
  // With RowsInTasks, thread i's rows of its current expert: x rows in [0, task_rows_cap_), dy
  // rows after them. task_rows_cap_ is the most rows an expert can get (each token once); pages
  // an expert never reaches are never touched.
  std::vector<Tensor> task_rows_;
  int64_t task_rows_cap_;
  Tensor saved_;    // [T*k * saved_stride_]
  Tensor dweight_;  // [T, k]
  // Per-thread expert groups of the last Forward: thread i runs experts
  // [group_begin_[i], group_begin_[i + 1]); empty when the experts ran one after another.
  std::vector<int64_t> group_begin_;

  ExpertResidency* residency_ = nullptr;
  ExpertLayout expert_layout_;                          // of every local expert, with a residency
  std::vector<std::vector<Parameter*>> expert_params_;  // [local expert], bound per call
  ExpertExchange* exchange_ = nullptr;
  int layer_ = -1;
  std::vector<int> needed_;  // experts with rows, for the residency

  // What the layer lends its ExpertExchange: the local experts, run on rows (parallel.h).
  class Local final : public LocalExperts {
   public:
    explicit Local(MoeLayer* layer) : layer_(layer) {}
    int64_t first() const override { return layer_->first_local_; }
    int64_t count() const override { return layer_->num_local_experts(); }
    int64_t d_model() const override { return layer_->C_; }
    int64_t saved_stride() const override { return layer_->saved_stride_; }
    void Forward(ops::Context& ctx, const std::vector<int64_t>& offsets, const Tensor& x,
                 const Tensor& y, const Tensor& saved) override {
      layer_->RunLocalForward(ctx, offsets, x, y, saved, InTask{});
    }
    void Backward(ops::Context& ctx, const std::vector<int64_t>& offsets, const Tensor& x,
                  const Tensor& dy, const Tensor& dx, const Tensor& saved) override {
      layer_->RunLocalBackward(ctx, offsets, x, dy, dx, saved, InTask{});
    }

   private:
    MoeLayer* layer_;
  };
  Local local_{this};

  // What the expert tasks of RunLocalForward/Backward do besides their expert, when every expert
  // is local on the CPU (RowsInTasks). x, dy and dx are the layer's own tensors, one row per
  // token. With x, each expert first gathers its rows of x into its thread's task_rows_ (in
  // backward again: xp is never written, and the rows its GEMMs read stay in cache); with dy, each
  // expert first makes its rows of dyp there from its outputs yp, and their combine-weight
  // gradients (MoeCombineBackwardRows). With `shared`, the shared experts run as one more task
  // (index num_local_experts(), T rows for the schedule), from x (and dy, into dx).
  struct InTask {
    const Tensor* x = nullptr;
    const Tensor* dy = nullptr;
    const Tensor* dx = nullptr;
    bool shared = false;
  };
  // Local expert i (global id first_local_expert() + i) on rows [offsets[i], offsets[i + 1]) of
  // x, writing y, keeping saved[row * saved_stride()..]; LocalExperts::Forward/Backward.
  void RunLocalForward(ops::Context& ctx, const std::vector<int64_t>& offsets, const Tensor& x,
                       const Tensor& y, const Tensor& saved, const InTask& in);
  void RunLocalBackward(ops::Context& ctx, const std::vector<int64_t>& offsets, const Tensor& x,
                        const Tensor& dy, const Tensor& dx, const Tensor& saved, const InTask& in);
  // `offsets`, or with the shared experts' task, one more entry for its rows.
  const std::vector<int64_t>& TaskOffsets(const std::vector<int64_t>& offsets, const InTask& in);
  // Whether each expert makes its own rows inside its task: every expert local, on the CPU, run
  // one by one (not as one grouped GEMM).
  bool RowsInTasks() const { return exchange_ == nullptr && device_.is_cpu() && !grouped_gemm_; }
  // One task_rows_ buffer per thread of a pool of `threads` (made when the size changes).
  void EnsureTaskRows(int threads);
  // Thread `thread`'s task rows for n rows of x (`dy` false) or of dy, [n, C].
  Tensor TaskRows(int thread, bool dy, int64_t n) const;
  // Whether the shared experts run as one of those tasks (not with a residency, whose threads
  // take only the experts it hands them).
  bool SharedInTasks() const {
    return shared_in_tasks_ && shared_ != nullptr && RowsInTasks() && residency_ == nullptr;
  }

  // Per-thread groups over local experts whose rows are [offsets[i], offsets[i + 1]).
  void PlanExpertGroups(int threads, const std::vector<int64_t>& offsets);
  // Runs fn(i, thread) for every local expert i with rows, `thread` being the pool thread that runs
  // it (0 when they run in order on the caller's): through the residency when there is one, else
  // grouped or in order.
  template <typename Fn>
  void RunExperts(ops::Context& ctx, ExpertResidency::Pass pass,
                  const std::vector<int64_t>& offsets, Fn&& fn);
  // Runs fn(i, thread) for every local expert with rows, grouped or in order (see the file
  // comment).
  template <typename Fn>
  void ForEachExpert(ops::Context& ctx, const std::vector<int64_t>& offsets, Fn&& fn);
};

}  // namespace strata::model
