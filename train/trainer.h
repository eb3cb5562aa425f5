// Trainer: one process training an MoE Transformer, step by step as in DESIGN.md
//
// One step:
// - Fetch the step's samples (a pure function of seed, step and global batch); forward with the
//   loss; backward; gradient sync; global-norm clipping; AdamW at the scheduled learning rate.
// - What differs between one process, a worker, the tiered store and an elastic job sits behind
//   the seams of step_seams.h, chosen when the trainer is built.
// - On schedule it evaluates on the held-out split. Each step appends its line to the metrics file
//   (metrics.h) and refreshes the progress line.
//
// Ownership and threads:
// - The Trainer owns its model, optimizer, store, checkpoint manager and communicators, and their
//   threads (the pool's, the communication threads, the store's stages, the expert optimizer
//   thread, the checkpoint writer). It stops them when it is destroyed, all but a connect left
//   behind (see WorkerOptions::superseded).
// - It is not thread-safe: one thread at a time calls its members (in practice the thread that
//   runs it), except AbortCollectives, which any thread may call at any time.
// - What it hands out lives as long as the Trainer, except that Reform may rebuild the model, its
//   optimizer and its seams: model(), optimizer_for_test() and what they lend are valid until the
//   next Reform.
// - The TrainOptions callbacks run on the thread calling the Trainer: on_step in Run,
//   on_checkpoint in Run and Reform, after_rendezvous in Create or Reform, expert_factory wherever
//   a model is built (also in Run, for rank 0's checkpoints). `superseded` may also run elsewhere
//   (see WorkerOptions).
#pragma once

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/manager.h"
#include "core/common/status.h"
#include "core/common/thread_pool.h"
#include "core/common/trace.h"
#include "proto/config.pb.h"
#include "runtime/data/dataset.h"
#include "runtime/model/adamw.h"
#include "runtime/model/transformer.h"
#include "scheduler/data_parallel.h"
#include "scheduler/expert_parallel.h"
#include "scheduler/tiered_scheduler.h"
#include "train/elastic/elastic_state.h"
#include "train/metrics.h"
#include "train/options.h"
#include "train/step_seams.h"
#include "train/tier_resources.h"
#include "train/worker_comms.h"

namespace strata::train {

class Trainer {
 public:
  [[nodiscard]] static StatusOr<std::unique_ptr<Trainer>> Create(const TrainOptions& options);
  ~Trainer();

  // Trains until config.train.steps, with evaluations, metrics and progress. Fails (and stops)
  // when the loss stops being finite or the metrics file cannot be written.
  [[nodiscard]] Status Run();
  // One training step.
  [[nodiscard]] StatusOr<StepResult> Step();
  // Loss on config.train.eval_batches held-out batches.
  EvalResult Evaluate();

  // The learning rate of (0-based) step s under the configured schedule.
  static double LearningRate(const config::TrainConfig& train, int64_t s);

  int64_t step() const { return step_; }
  model::MoeTransformer& model() { return *model_; }
  model::AdamW* optimizer_for_test() { return optimizer_.get(); }
  ops::Context& context() { return ctx_; }
  const data::TokenDataset& dataset() const { return *dataset_; }
  const std::vector<StepResult>& history() const { return history_; }
  const std::vector<std::pair<int64_t, EvalResult>>& evals() const { return evals_; }
  // TIERED: the scheduler and its store (null in memory).
  scheduler::TieredExpertScheduler* tiered() { return scheduler_.get(); }
  // The checkpoint folder's manager (null without checkpoints).
  checkpoint::CheckpointManager* checkpoints() { return checkpoints_.get(); }
  // The trace being recorded (null without TrainOptions::trace_path).
  Tracer* tracer() { return tracer_.get(); }
  // The step a resumed run started from (0 for a fresh run).
  int64_t resumed_from() const { return resumed_from_; }

  // Elastic jobs. Unblocks the collectives in flight with ABORTED (from any thread, e.g. when a
  // new membership generation forms): the step fails and Run returns, so the caller can Reform.
  // With `newer_generation`, only when this trainer is in an older generation: a late call for the
  // generation it has already re-formed into does nothing.
  void AbortCollectives(const std::string& why,
                        int64_t newer_generation = std::numeric_limits<int64_t>::max()) {
    comms_.Abort(why, newer_generation);
  }
  // Re-forms this worker, in place, for a new generation: new communicators under w.store, the
  // state agreed on (see WorkerOptions::rejoin) or the newest checkpoint, the experts re-placed
  // by measured load (in groups re-planned for the new count, see GroupSize). On success Run goes
  // on from step(), which may be behind the step that was cut short. On failure the trainer holds
  // no generation: only another Reform (or the destructor) may follow.
  [[nodiscard]] Status Reform(const WorkerOptions& w);
  // Experts each rank of the current generation holds (contiguous ranges in rank order).
  const std::vector<int64_t>& experts_per_worker() const { return experts_per_worker_; }

 private:
  class Host;  // the ElasticHost over this trainer (trainer.cc)
  explicit Trainer(const TrainOptions& options);

  // TIERED: a store's options, and the scheduler over model_ with a new store or adopting `store`
  // (one a re-form handed on, see TieredExpertScheduler::ReleaseStore).
  [[nodiscard]] StatusOr<scheduler::TieredOptions> TieredOptionsOf();
  [[nodiscard]] Status SetUpTiered(std::unique_ptr<storage::TieredExpertStore> store = nullptr);
  [[nodiscard]] Status SetUpWorkers();
  // A model of this job with experts [first, first + count) (count < 0: all of them).
  model::ModelOptions ModelOptionsOf(int64_t first, int64_t count, bool unbound_experts) const;
  // Builds model_ (with this worker's `first`, `count` experts when distributed), the exchange and
  // the data-parallel reducer around it, the optimizer, and the step's gradient sync and keeping.
  [[nodiscard]] Status BuildModel(int64_t first, int64_t count);
  // The expert state seam for the model just built: the tiered store (TIERED; `store` as in
  // SetUpTiered) or the model itself.
  [[nodiscard]] Status SetUpExpertState(
      std::unique_ptr<storage::TieredExpertStore> store = nullptr);
  // Opens config.checkpoint.dir (`continuing`: a worker that became rank 0 of a running job).
  [[nodiscard]] Status OpenCheckpoints(bool continuing);
  // Every worker opens its own shard of config.checkpoint.dir (or continues in it, when it kept
  // its manager across a re-form), rank 0 (the committer) first.
  [[nodiscard]] Status OpenWorkerCheckpoints(bool continuing);
  // The checkpoint folder of a new generation: opened again (IN_MEMORY, or a TIERED generation
  // that goes back to a checkpoint), or kept open across it by a worker that still has its
  // manager (a TIERED worker's store shares its shard's SSD tier): ContinueCheckpoints.
  [[nodiscard]] Status OpenCheckpointsOfGeneration();
  [[nodiscard]] Status ContinueCheckpoints();
  // A TIERED generation that goes back to a checkpoint: the live store goes and the shard is
  // opened afresh, for a store the checkpoint fills (collective for every worker of a TIERED job).
  [[nodiscard]] Status ReopenForCheckpoint();
  // What this worker's shard of a checkpoint holds.
  checkpoint::CheckpointShare CheckpointShareOfThisWorker() const;
  // From the newest checkpoint (every worker of a distributed job reads what it now holds from
  // the shards that have it, whatever the number of workers that wrote them: collective).
  [[nodiscard]] Status Resume();
  // options_.init_from's weights into the model (and the tiered store's experts). Collective in a
  // distributed job, with or without the flag: the workers check that they read the same file.
  [[nodiscard]] Status InitFrom();
  // Every worker reads its share of the newest checkpoint all of them find intact — or, with none
  // committed, all start over from step 0 (collective).
  [[nodiscard]] Status GoBackToCheckpoint();
  // Rebuilds the model, its seams and expert state for a synced state's placement, and starts
  // from it: its values (or the checkpoint's), and the copies kept from then on.
  [[nodiscard]] Status AdoptState(SyncedState& s);
  [[nodiscard]] Status StartFrom(const SyncedState& s);
  // Drops this generation's seams, reducers and communicators; `generation` is the one to come.
  void ResetParallel(int64_t generation);
  bool distributed() const { return options_.worker.world_size > 1; }
  [[nodiscard]] Status RunLoop();
  void ReportCommittedCheckpoint();

  TrainOptions options_;
  std::unique_ptr<Tracer> tracer_;  // outlives every thread that records into it
  std::unique_ptr<ThreadPool> pool_;
  ops::Context ctx_;
  std::unique_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<model::MoeTransformer> model_;
  std::unique_ptr<model::AdamW> optimizer_;
  // TIERED, in destruction order: the scheduler and its store first, then the checkpoint manager
  // (which shares their SSD tier), then the budgets they charge and the temporary SSD folder.
  TierResources tiers_;
  std::unique_ptr<checkpoint::CheckpointManager> checkpoints_;
  std::unique_ptr<scheduler::TieredExpertScheduler> scheduler_;
  // Distributed (declared so that the exchanges go before the communicators they use).
  WorkerComms comms_;
  std::unique_ptr<scheduler::ExpertParallel> exchange_;
  std::unique_ptr<scheduler::DataParallel> data_parallel_;
  int64_t local_batch_ = 0;            // sequences per step on this worker
  int64_t first_sequence_ = 0;         // this worker's first sequence within the step's batch
  bool expert_replica_leader_ = true;  // counts its experts in the global gradient norm
  std::unique_ptr<model::ParameterSlices> dense_slices_;  // for the dense gradient norm
  std::vector<std::string> shard_names_;  // the checkpoint shard of every rank (distributed)
  // The step's seams (step_seams.h). BuildModel chooses the gradient sync and the keeping for the
  // model and communicators it builds; SetUpExpertState the expert state once the store exists.
  std::unique_ptr<GradientSync> gradients_;
  std::unique_ptr<ExpertState> experts_;
  std::unique_ptr<StepKeeping> keeping_;  // NoKeeping, or ElasticKeeping for an elastic worker
  // An elastic worker's copies, loads and live version, and its view of this trainer.
  std::unique_ptr<Host> host_;
  std::unique_ptr<ElasticState> elastic_;
  std::vector<int64_t> experts_per_worker_;
  int64_t first_expert_ = 0, num_experts_ = 0;  // this worker's range
  Device device_;                               // where the model lives (train.device)

  std::unique_ptr<MetricsWriter> metrics_;
  // A worker's (distributed or elastic) identity in its metrics lines, set for each generation;
  // none for one process.
  std::optional<WorkerStepFields> worker_fields_;
  std::vector<int32_t> inputs_, targets_;
  int64_t step_ = 0;
  int64_t resumed_from_ = 0;
  int64_t reported_checkpoint_ = 0;  // the newest committed checkpoint told to on_checkpoint
  std::vector<StepResult> history_;
  std::vector<std::pair<int64_t, EvalResult>> evals_;
  ProgressLine progress_;
};

}  // namespace strata::train
