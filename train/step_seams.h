// The seams of one training step: what differs between the trainer's modes, so that
// Trainer::Step reads as DESIGN.md's list (data, forward, backward, gradient sync, update, step
// boundary) with no test of the mode inside it.
//
// The seams:
// - GradientSync: how the step's gradients and figures become the whole batch's. LocalGradients
//   (one process: the batch is this process's; the norm is the dense AdamW's sum of squares plus
//   the store's) or DataParallelGradients (a worker: the dense buckets finished, one sum over the
//   workers of the loss, the z-loss and the experts' share of the norm, then the dense norm).
// - ExpertState: where the experts' weights, gradients and Adam moments live. InMemoryExperts
//   (the model's parameters, updated by the dense AdamW) or TieredExperts (the tiered store: its
//   status, each expert's gradient summed over its copies, its gradients' norm, the experts'
//   AdamW step on the host tier, the store's step figures).
// - StepKeeping: what a step keeps around its update for a later membership generation.
//   NoKeeping, or ElasticKeeping (elastic/elastic_state.h): the live version, an elastic worker's
//   measured expert loads, and its rollback and buddy copies when its layout keeps them.
//
// When they are chosen:
// - The trainer chooses each once per model: the gradient sync and the keeping in BuildModel, for
//   the model and communicators it has just built; the expert state once the store exists
//   (SetUpExpertState).
// - A new membership generation builds all three anew with the model (a TIERED worker's store
//   with them), so none outlives what it points to.
//
// Ownership and threads:
// - The trainer owns the seams; a seam owns none of what it is given (model, optimizer, reducers,
//   store), all of which the trainer keeps alive longer.
// - Only the thread that drives the step (the trainer's) calls a seam.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/common/status.h"
#include "core/common/trace.h"
#include "kernels/ops.h"
#include "proto/config.pb.h"
#include "runtime/comm/communicator.h"
#include "runtime/model/adamw.h"
#include "runtime/model/moe_layer.h"
#include "runtime/model/parameter.h"
#include "scheduler/data_parallel.h"
#include "scheduler/expert_parallel.h"
#include "scheduler/tiered_scheduler.h"
#include "storage/tiered_store.h"

namespace strata::train {

// The AdamW hyper-parameters of train (every parameter's, dense or expert).
model::AdamWOptions AdamWOptionsOf(const config::TrainConfig& train);

// A step's figures for the whole batch, after the gradient sync.
struct BatchFigures {
  double loss = 0;              // mean cross-entropy per token
  double z_loss = 0;            // the MoE layers' z-losses, summed over the layers
  double grad_sum_squares = 0;  // of every gradient, before clipping
};

class ExpertState {
 public:
  virtual ~ExpertState() = default;
  // The store's first error of this step (in memory: none).
  [[nodiscard]] virtual Status status() const = 0;
  // After backward, before GradSumSquares: makes each expert's gradient its sum over every copy
  // of the expert (in memory: DataParallel's expert buckets have done it; tiered with expert
  // replicas: a few experts at a time from the store, over the replicas' communicator). A
  // collective among the copies when there are several. Const: it changes the borrowed store, not
  // the seam. By default the experts have one copy and there is nothing to do.
  [[nodiscard]] virtual Status SumOverCopies() const { return absl::OkStatus(); }
  // Sum of squares of the expert gradients the dense AdamW does not hold, as averaged over the
  // workers, counted by one copy of each expert only (in memory: 0, the dense AdamW holds them).
  virtual double GradSumSquares() const = 0;
  // The experts' update of AdamW step `step` (1-based), after the dense parameters' with the same
  // learning rate and clipping scale, and the end of the store's step.
  [[nodiscard]] virtual Status Update(double lr, double grad_scale, int64_t step) = 0;
  // The store's figures of the step now ended, into *out; false (and *out untouched) in memory.
  virtual bool TakeStats(storage::StoreStats* out) = 0;
  // At the end of training: waits for the experts' update in flight and returns its error (in
  // memory: nothing to do).
  [[nodiscard]] virtual Status Finish() = 0;
  // Stops the store's background work, also after a failure (in memory: nothing to do).
  virtual void Quiesce() = 0;
};

class InMemoryExperts final : public ExpertState {
 public:
  Status status() const override { return absl::OkStatus(); }
  double GradSumSquares() const override { return 0; }
  Status Update(double, double, int64_t) override { return absl::OkStatus(); }
  bool TakeStats(storage::StoreStats*) override { return false; }
  Status Finish() override { return absl::OkStatus(); }
  void Quiesce() override {}
};

class TieredExperts final : public ExpertState {
 public:
  struct Options {
    // The workers the store's gradients are averaged over (1 for one process).
    int workers = 1;
    // The workers holding a copy of this worker's experts (this one included), one per
    // expert-parallel group; null or of size 1 when the experts have one copy. Borrowed.
    comm::Communicator* replicas = nullptr;
    // Whether this copy counts its experts in the gradient norm: the copies' leader does, so that
    // each expert is counted once over the job.
    bool counts_norm = true;
  };
  TieredExperts(scheduler::TieredExpertScheduler* scheduler, const config::TrainConfig& train,
                const Options& options, Tracer* tracer);
  Status status() const override;
  Status SumOverCopies() const override;
  double GradSumSquares() const override;
  Status Update(double lr, double grad_scale, int64_t step) override;
  bool TakeStats(storage::StoreStats* out) override;
  Status Finish() override;
  void Quiesce() override;

 private:
  scheduler::TieredExpertScheduler* scheduler_;
  model::AdamWOptions adamw_;
  Options options_;
  double workers_;
  Tracer* tracer_;
};

class GradientSync {
 public:
  virtual ~GradientSync() = default;
  // The weight of this process's mean per-token loss in the batch's (GateCall::loss_scale).
  virtual double loss_scale() const = 0;
  // The batch's loss from this process's, when it is known before backward (one process: it is
  // the batch's; a worker: none, the sum over the workers travels with the gradients).
  virtual std::optional<double> BatchLossBeforeBackward(double loss) const = 0;
  // The first error of this worker's collectives (one process: none); `step` (1-based) names the
  // step in the message.
  [[nodiscard]] virtual Status status(int64_t step) const = 0;
  // After backward, with this process's mean loss and z-loss sum: the whole batch's figures. It
  // has the experts' gradients summed over their copies (ExpertState::SumOverCopies) first.
  [[nodiscard]] virtual StatusOr<BatchFigures> Finish(int64_t step, double loss, double z_loss,
                                                      const ExpertState& experts) = 0;
  // Sums `n` values over the workers in place (one process: they are the sums already).
  [[nodiscard]] virtual Status SumOverWorkers(int64_t step, double* data, size_t n) = 0;
  // Seconds the communication threads were busy since the last call (one process: 0).
  virtual double TakeCommSeconds() = 0;
};

class LocalGradients final : public GradientSync {
 public:
  // `optimizer`: the dense AdamW (with the experts too when they are in memory).
  LocalGradients(ops::Context* ctx, const model::AdamW* optimizer)
      : ctx_(ctx), optimizer_(optimizer) {}
  double loss_scale() const override { return 1.0; }
  std::optional<double> BatchLossBeforeBackward(double loss) const override { return loss; }
  Status status(int64_t) const override { return absl::OkStatus(); }
  StatusOr<BatchFigures> Finish(int64_t step, double loss, double z_loss,
                                const ExpertState& experts) override;
  Status SumOverWorkers(int64_t, double*, size_t) override { return absl::OkStatus(); }
  double TakeCommSeconds() override { return 0; }

 private:
  ops::Context* ctx_;
  const model::AdamW* optimizer_;
};

class DataParallelGradients final : public GradientSync {
 public:
  struct Options {
    ops::Context* ctx = nullptr;
    scheduler::DataParallel* data_parallel = nullptr;  // attached to the model
    scheduler::ExpertParallel* exchange = nullptr;     // null without expert parallelism
    const model::ParameterSlices* dense_slices = nullptr;
    // The expert parameters this worker counts in the norm: those the dense AdamW updates (none
    // when the store holds them), on the leader of its expert replicas only.
    std::vector<const model::Parameter*> counted_experts;
    int workers = 1;
    int64_t local_batch = 0, global_batch = 0;  // this worker's sequences of the step's
  };
  explicit DataParallelGradients(Options o);
  double loss_scale() const override { return loss_scale_; }
  std::optional<double> BatchLossBeforeBackward(double) const override { return std::nullopt; }
  Status status(int64_t step) const override;
  StatusOr<BatchFigures> Finish(int64_t step, double loss, double z_loss,
                                const ExpertState& experts) override;
  Status SumOverWorkers(int64_t step, double* data, size_t n) override;
  double TakeCommSeconds() override;

 private:
  Options o_;
  double share_;       // this worker's share of the batch's sequences
  double loss_scale_;  // workers * share: 1 when the batch splits evenly
  std::vector<double> norm_partials_;
};

class StepKeeping {
 public:
  virtual ~StepKeeping() = default;
  // Just before the update (the model still holds the state of the step before).
  [[nodiscard]] virtual Status BeforeUpdate() = 0;
  // Once the update has run: the model's state is now `version` (the step it is the result of);
  // `experts_updated` is false when the experts' update failed (the step then fails).
  virtual void Updated(int64_t version, bool experts_updated) = 0;
  // After the update, with the step's per-layer MoE figures.
  [[nodiscard]] virtual Status AfterUpdate(const std::vector<model::MoeStats>& moe) = 0;
};

class NoKeeping final : public StepKeeping {
 public:
  Status BeforeUpdate() override { return absl::OkStatus(); }
  void Updated(int64_t, bool) override {}
  Status AfterUpdate(const std::vector<model::MoeStats>&) override { return absl::OkStatus(); }
};

}  // namespace strata::train
