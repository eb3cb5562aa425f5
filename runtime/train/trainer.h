// Trainer: one process training an MoE Transformer, step by step as in DESIGN.md.
//
// One step: fetch the step's samples (a pure function of seed, step and global batch), forward
// with the loss, backward, global-norm clipping, AdamW with the scheduled learning rate. On
// schedule it evaluates on the held-out split. Each step appends one JSON object to the metrics
// file and refreshes the progress line.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "proto/config.pb.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"
#include "runtime/common/json.h"
#include "runtime/common/status.h"
#include "runtime/common/thread_pool.h"
#include "runtime/common/trace.h"
#include "runtime/data/dataset.h"
#include "runtime/model/adamw.h"
#include "runtime/model/transformer.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/metrics.h"
#include "scheduler/data_parallel.h"
#include "scheduler/expert_parallel.h"
#include "scheduler/tiered_scheduler.h"

namespace strata::train {

// This process as one of several workers (`strata worker`); world_size 1 is a single process.
struct WorkerOptions {
  int rank = 0;
  int world_size = 1;
  std::shared_ptr<comm::Store> store;  // rendezvous of the communicators
  std::string hostname = "127.0.0.1";  // the address peers reach this worker at
  // Called on rank 0 once every worker has connected all its communicators (the store is no
  // longer needed): `strata worker` empties its rendezvous folder, so a later job can use it.
  std::function<void()> after_rendezvous;
};

struct StepResult;

struct TrainOptions {
  config::JobConfig config;  // loaded with config::LoadJobConfig (validated, paths resolved)
  std::string metrics_path;  // JSONL, one object per step; empty for none
  bool progress = true;      // progress line on stderr
  model::ExpertFactory expert_factory;  // null: FFN experts from the config
  storage::Env* env = nullptr;          // null: storage::Env::Default()
  // Tests wrap the SSD tier's block I/O to inject faults.
  std::function<std::unique_ptr<storage::BlockIo>(std::unique_ptr<storage::BlockIo>)> wrap_io;
  // Continue from the newest valid checkpoint in config.checkpoint.dir.
  bool resume = false;
  // Tests: delay between a checkpoint's extents and its commit.
  int checkpoint_commit_delay_ms = 0;
  // Tests: the checkpoint writer stops for good after committing this step (0: never).
  int64_t checkpoint_hold_after_step = 0;
  // Chrome trace-event JSON of compute, SSD I/O, copies, optimizer and checkpoint spans, written
  // when Run returns; empty for none.
  std::string trace_path;
  // Distributed training: the step's batch is split over the workers (see ParallelConfig).
  WorkerOptions worker;
  // Called after every step (its metrics written); an error stops training with it.
  std::function<Status(const StepResult&)> on_step;
  // When Run returns, every parameter this worker holds is written to DIR/<name>.f32 (raw
  // little-endian float32; dense parameters by rank 0 only, experts by the worker that holds
  // them — rank 0 of its expert replicas). Empty: nothing is written.
  std::string export_params_dir;
};

struct StepResult {
  int64_t step = 0;      // 1-based: steps completed after this one
  double loss = 0;       // mean cross-entropy, nats per token
  double aux_loss = 0;   // mean over MoE layers of the unweighted load-balancing loss
  double z_loss = 0;     // mean over MoE layers of the unweighted router z-loss
  double grad_norm = 0;  // before clipping
  double lr = 0;
  double seconds = 0;
  int64_t tokens = 0;
  double comm_seconds = 0;           // distributed: time the communication threads were busy
  std::vector<model::MoeStats> moe;  // per MoE layer, in model.moe_layers() order
  bool tiered = false;
  storage::StoreStats store;  // TIERED: this step's tier figures
};

struct EvalResult {
  double loss = 0;           // nats per token
  double bits_per_byte = 0;  // loss / ln 2 for byte-level data, NaN otherwise
  int64_t tokens = 0;
};

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
  CheckpointManager* checkpoints() { return checkpoints_.get(); }
  // The trace being recorded (null without TrainOptions::trace_path).
  Tracer* tracer() { return tracer_.get(); }
  // The step a resumed run started from (0 for a fresh run).
  int64_t resumed_from() const { return resumed_from_; }

 private:
  Trainer() = default;
  void PrintProgress(const StepResult& r, const EvalResult* eval, bool final_line);

  [[nodiscard]] Status SetUpTiered();
  [[nodiscard]] Status SetUpWorkers();
  // Sum over all workers (identity for one process); fails the step on a communication error.
  [[nodiscard]] Status SumOverWorkers(double* data, size_t n);
  [[nodiscard]] Status ParallelStatus() const;
  [[nodiscard]] Status ExportParameters() const;
  bool distributed() const { return options_.worker.world_size > 1; }
  [[nodiscard]] Status RunLoop();
  void WriteStepMetrics(JsonWriter& j, const StepResult& r) const;

  TrainOptions options_;
  std::unique_ptr<Tracer> tracer_;  // outlives every thread that records into it
  std::unique_ptr<ThreadPool> pool_;
  ops::Context ctx_;
  std::unique_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<model::MoeTransformer> model_;
  std::unique_ptr<model::AdamW> optimizer_;
  // TIERED (declared in destruction order: the scheduler and its store go first, then the budgets
  // they charge, then the temporary SSD folder).
  std::string temp_ssd_dir_;
  std::unique_ptr<MemoryBudget> device_budget_, host_budget_;
  std::unique_ptr<CheckpointManager> checkpoints_;  // uses the budgets' SSD tier; goes last
  std::unique_ptr<scheduler::TieredExpertScheduler> scheduler_;
  // Distributed (declared so that the exchanges go before the communicators they use).
  std::unique_ptr<comm::Communicator> world_comm_, ep_comm_, replica_comm_;
  std::unique_ptr<scheduler::ExpertParallel> exchange_;
  std::unique_ptr<scheduler::DataParallel> data_parallel_;
  int64_t local_batch_ = 0;            // sequences per step on this worker
  int64_t first_sequence_ = 0;         // this worker's first sequence within the step's batch
  bool expert_replica_leader_ = true;  // counts its experts in the global gradient norm
  std::unique_ptr<model::ParameterSlices> dense_slices_;  // for the dense gradient norm
  std::vector<double> norm_partials_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::vector<int32_t> inputs_, targets_;
  int64_t step_ = 0;
  int64_t resumed_from_ = 0;
  std::vector<StepResult> history_;
  std::vector<std::pair<int64_t, EvalResult>> evals_;
  double started_ = 0;
  double smoothed_step_seconds_ = 0;
  bool tty_ = false;
  double last_eval_loss_ = -1;
  double last_eval_bpb_ = -1;
};

}  // namespace strata::train
