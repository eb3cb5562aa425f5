#include "train/step_seams.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace strata::train {

model::AdamWOptions AdamWOptionsOf(const config::TrainConfig& train) {
  model::AdamWOptions o;
  o.beta1 = train.beta1();
  o.beta2 = train.beta2();
  o.eps = train.adam_eps();
  o.weight_decay = train.weight_decay();
  return o;
}

TieredExperts::TieredExperts(scheduler::TieredExpertScheduler* scheduler,
                             const config::TrainConfig& train, const Options& options,
                             Tracer* tracer)
    : scheduler_(scheduler),
      adamw_(AdamWOptionsOf(train)),
      options_(options),
      workers_(static_cast<double>(options.workers)),
      tracer_(tracer) {}

Status TieredExperts::status() const { return scheduler_->status(); }

Status TieredExperts::SumOverCopies() const {
  if (options_.replicas == nullptr || options_.replicas->world_size() == 1) {
    return absl::OkStatus();
  }
  TraceScope span(tracer_, "expert gradients over copies", "comm");
  return scheduler_->SumGradientsOver(*options_.replicas);
}

double TieredExperts::GradSumSquares() const {
  // The store's expert gradients are the sums over the rows every worker sent (over every copy,
  // once SumOverCopies has run), not yet divided by the workers (see scheduler/data_parallel.h).
  // The copies hold the same sums: only their leader counts them.
  if (!options_.counts_norm) return 0;
  return scheduler_->ExpertGradSumSquares() / (workers_ * workers_);
}

Status TieredExperts::Update(double lr, double grad_scale, int64_t step) {
  TraceScope span(tracer_, "expert optimizer", "optimizer");
  // Behind the next step's forward, layer by layer (storage.overlap_optimizer). The average of the
  // summed gradients divides by the number of workers.
  RETURN_IF_ERROR(scheduler_->StepExperts(adamw_, lr, grad_scale / workers_, step));
  scheduler_->EndStep();
  return absl::OkStatus();
}

bool TieredExperts::TakeStats(storage::StoreStats* out) {
  *out = scheduler_->store().TakeStats();
  return true;
}

Status TieredExperts::Finish() { return scheduler_->FinishExpertStep(); }

void TieredExperts::Quiesce() { scheduler_->Quiesce(); }

StatusOr<BatchFigures> LocalGradients::Finish(int64_t, double loss, double z_loss,
                                              const ExpertState& experts) {
  RETURN_IF_ERROR(experts.SumOverCopies());  // one process: one copy, nothing to do
  // The dense AdamW's sum covers every gradient the model holds; the store's come on top.
  return BatchFigures{loss, z_loss, optimizer_->GradSumSquares(*ctx_) + experts.GradSumSquares()};
}

DataParallelGradients::DataParallelGradients(Options o)
    : o_(std::move(o)),
      share_(static_cast<double>(o_.local_batch) / static_cast<double>(o_.global_batch)),
      // A share other than 1 / workers weighs this worker's tokens by workers * share.
      loss_scale_(static_cast<double>(o_.workers) * static_cast<double>(o_.local_batch) /
                  static_cast<double>(o_.global_batch)) {}

Status DataParallelGradients::status(int64_t step) const {
  Status s;
  if (o_.exchange) s = o_.exchange->status();
  if (s.ok()) s = o_.data_parallel->status();
  if (s.ok()) return s;
  return Status(s.code(), absl::StrFormat("step %d: %s", step, s.message()));
}

StatusOr<BatchFigures> DataParallelGradients::Finish(int64_t step, double loss, double z_loss,
                                                     const ExpertState& experts) {
  RETURN_IF_ERROR(status(step));
  if (!o_.data_parallel->FinishGradients().ok()) return status(step);
  // The communicators are free again: the store's experts are summed over their copies.
  if (Status s = experts.SumOverCopies(); !s.ok()) {
    return Status(s.code(), absl::StrFormat("step %d: %s", step, s.message()));
  }
  // The loss, the z-loss and the experts' share of the gradient norm, summed over the workers in
  // one go: every worker's loss is the mean over its own tokens, weighed here by its share of the
  // batch; each expert is counted by one worker (its replicas' leader).
  double expert_sq = 0;
  for (const model::Parameter* p : o_.counted_experts) {
    if (!p->grad.device().is_cpu()) {
      expert_sq += ops::SumSquares(*o_.ctx, p->grad);
      continue;
    }
    const float* g = p->grad.f32();
    for (int64_t i = 0; i < p->grad.numel(); ++i) expert_sq += double{g[i]} * g[i];
  }
  double sums[3] = {loss * share_, z_loss * share_, expert_sq + experts.GradSumSquares()};
  RETURN_IF_ERROR(SumOverWorkers(step, sums, 3));
  // The dense gradients are the batch's on every worker already.
  return BatchFigures{sums[0], sums[1],
                      model::GradSumSquares(*o_.ctx, *o_.dense_slices, &norm_partials_) + sums[2]};
}

Status DataParallelGradients::SumOverWorkers(int64_t step, double* data, size_t n) {
  o_.data_parallel->Sum(data, n);
  return status(step);
}

double DataParallelGradients::TakeCommSeconds() {
  double seconds = o_.data_parallel->TakeCommSeconds();
  if (o_.exchange) seconds += o_.exchange->TakeTimes().comm_seconds;
  return seconds;
}

}  // namespace strata::train
