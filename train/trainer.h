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

#include <atomic>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/manager.h"
#include "core/common/json.h"
#include "core/common/status.h"
#include "core/common/thread_pool.h"
#include "core/common/trace.h"
#include "proto/config.pb.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"
#include "runtime/data/dataset.h"
#include "runtime/model/adamw.h"
#include "runtime/model/transformer.h"
#include "scheduler/data_parallel.h"
#include "scheduler/expert_parallel.h"
#include "scheduler/tiered_scheduler.h"
#include "storage/copy_shelf.h"
#include "storage/private_folder.h"
#include "train/metrics.h"
#include "train/state_sync.h"
#include "train/step_seams.h"

namespace strata::train {

// This process as one of several workers (`strata worker`); world_size 1 is a single process.
struct WorkerOptions {
  int rank = 0;
  int world_size = 1;
  std::shared_ptr<comm::Store> store;  // rendezvous of the communicators
  std::string hostname = "127.0.0.1";  // the address peers reach this worker at
  // Called on rank 0, on the thread in Create or Reform, once every worker has connected all its
  // communicators (the store is no longer needed): `strata worker` empties its rendezvous folder,
  // so a later job can use it.
  std::function<void()> after_rendezvous;
  // A job whose membership may change (`strata worker --coordinator`): every step keeps what a
  // later generation needs to go on without this worker or with more — with one expert-parallel
  // group, a copy of this worker's state from before the update and buddy copies of other
  // workers' experts (elastic.replicas; TIERED: on its SSD, every elastic.replica_every steps);
  // with several, every group's copy of each expert. Where those cannot make up the state, and
  // always with experts_per_worker, the job goes back to its newest checkpoint (which it must
  // have unless it keeps buddy copies: Create refuses it without). See elastic.cc.
  bool elastic = false;
  // This generation is not the job's first: the workers agree on the newest step whose whole state
  // they still hold, re-place the experts, and move state to where it now lives (a worker that
  // just joined gets all of its state this way).
  bool rejoin = false;
  int64_t generation = 0;  // the membership generation, for metrics
  // A coordinator's job: every worker's id, by rank. Their checkpoint shards are named by it
  // (ShardNameOfWorker), stable across generations; empty: shards are named by rank (r<rank>).
  std::vector<std::string> member_ids;
  // True once a newer generation has formed: connecting this one's communicators gives up. The
  // Trainer calls it on the thread in Create or Reform while each connect runs on a thread of its
  // own, which it leaves behind when this turns true (a Gloo connect cannot be interrupted; the
  // thread may outlive the Trainer). A `store` that consults it too (RunElasticWorker's) calls it
  // from that thread, so it must be thread-safe and own what it reads (by value or shared_ptr).
  std::function<bool()> superseded;
};

// A worker's share of a step's global batch: its first sequence and how many. Every step's
// samples are split over the workers from the step alone (rank r of W takes sequences
// [B r / W, B (r + 1) / W)), so any membership sees each sample of a step exactly once.
std::pair<int64_t, int64_t> BatchShare(int64_t global_batch, int workers, int rank);

struct TrainOptions {
  config::JobConfig config;  // loaded with config::LoadJobConfig (validated, paths resolved)
  std::string metrics_path;  // JSONL, one object per step; empty for none
  bool progress = true;      // progress line on stderr
  model::ExpertFactory expert_factory;  // null: FFN experts from the config
  storage::Env* env = nullptr;          // null: storage::Env::Default(); must outlive the Trainer
  // Tests wrap the SSD tier's block I/O to inject faults. Called when a tier is opened; the BlockIo
  // it returns may be used from several threads at once (SSD stages, the checkpoint writer).
  std::function<std::unique_ptr<storage::BlockIo>(std::unique_ptr<storage::BlockIo>)> wrap_io;
  // Continue from the newest valid checkpoint in config.checkpoint.dir.
  bool resume = false;
  // Move what config.checkpoint.dir holds aside (to DIR.old-<time>) and train afresh.
  bool start_over = false;
  // Chrome trace-event JSON of compute, SSD I/O, copies, optimizer and checkpoint spans, written
  // when Run returns; empty for none.
  std::string trace_path;
  // Distributed training: the step's batch is split over the workers (see ParallelConfig).
  WorkerOptions worker;
  // Called after every step (its metrics written), on the thread in Run; an error stops training
  // with it.
  std::function<Status(const StepResult&)> on_step;
  // On rank 0 (the worker that writes checkpoints), called on the thread in Run (and in Reform, for
  // a commit the previous generation did not report) — not on the checkpoint writer thread — when a
  // checkpoint of `step` is about to be written (committed false), and once Run finds a checkpoint
  // committed (true): after a later step or at the end of training, so the report may lag the
  // commit.
  std::function<void(int64_t step, bool committed)> on_checkpoint;
  // When Run returns, every parameter this worker holds is written to DIR/<name>.f32 (raw
  // little-endian float32; dense parameters by rank 0 only, experts — in memory or from the
  // tiered store — by the leader of their copies, the lowest rank; copy g of an expert, the one of
  // expert-parallel group g > 0, into DIR/copy<g>/<name>.f32). Empty: nothing is written.
  std::string export_params_dir;
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
                        int64_t newer_generation = std::numeric_limits<int64_t>::max())
      ABSL_LOCKS_EXCLUDED(comm_mu_);
  // Re-forms this worker, in place, for a new generation: new communicators under w.store, the
  // state agreed on (see WorkerOptions::rejoin) or the newest checkpoint, the experts re-placed
  // by measured load (in groups re-planned for the new count, see GroupSize). On success Run goes
  // on from step(), which may be behind the step that was cut short. On
  // failure the trainer holds no generation: only another Reform (or the destructor) may follow.
  [[nodiscard]] Status Reform(const WorkerOptions& w);
  // Experts each rank of the current generation holds (contiguous ranges in rank order).
  const std::vector<int64_t>& experts_per_worker() const { return experts_per_worker_; }

 private:
  Trainer() = default;
  void PrintProgress(const StepResult& r, const EvalResult* eval, bool final_line);

  // TIERED: the budgets (once per worker: the stores it makes in turn all charge them), the
  // scheduler's options, and the scheduler over model_ — with a new store, or adopting `store`
  // (one a re-form handed on, see TieredExpertScheduler::ReleaseStore).
  [[nodiscard]] Status EnsureBudgets(const model::MoeTransformer& model);
  [[nodiscard]] StatusOr<scheduler::TieredOptions> TieredOptionsOf();
  // A TIERED job without checkpoint.dir and storage.ssd_dir keeps its SSD tier in temp_ssd_dir_,
  // a PrivateFolder under $TMPDIR (else /tmp), made on first need.
  bool NeedsTempSsdFolder() const;
  [[nodiscard]] Status EnsureTempSsdFolder();
  [[nodiscard]] Status SetUpTiered(std::unique_ptr<storage::TieredExpertStore> store = nullptr);
  [[nodiscard]] Status SetUpWorkers();
  // Runs `connect` (a Connect*Gloo call) so that WorkerOptions::superseded can abandon it.
  // Stores a newly connected communicator in *slot under comm_mu_ (aborting it at once when
  // AbortCollectives ran since the generation's ResetParallel).
  void AdoptCommunicator(std::unique_ptr<comm::Communicator> c,
                         std::unique_ptr<comm::Communicator>* slot);
  [[nodiscard]] StatusOr<std::unique_ptr<comm::Communicator>> ConnectUnlessSuperseded(
      std::function<StatusOr<std::unique_ptr<comm::Communicator>>()> connect) const;
  // Builds model_ (with this worker's `first`, `count` experts when distributed), the exchange and
  // the data-parallel reducer around it, and the optimizer.
  [[nodiscard]] Status BuildModel(int64_t first, int64_t count);
  // The expert state seam for the model just built: the tiered store (TIERED; `store` as in
  // SetUpTiered) or the model itself.
  [[nodiscard]] Status SetUpExpertState(
      std::unique_ptr<storage::TieredExpertStore> store = nullptr);
  // Elastic (elastic.cc): what a generation starts from — the state its workers hold (placement
  // and blobs), or the newest checkpoint (the placement only; every worker reads its own share).
  struct SyncedState {
    int64_t step = 0;
    std::vector<int64_t> counts;  // experts per rank of an expert-parallel group
    std::vector<float> dense;     // this worker's dense parameters with moments
    std::vector<float> experts;   // its experts' blobs, in expert order (IN_MEMORY)
    // TIERED: the store holding this worker's experts of the new placement (and, until the new
    // scheduler adopts it, the ones it gave away).
    std::unique_ptr<storage::TieredExpertStore> store;
    bool from_checkpoint = false;
  };
  [[nodiscard]] StatusOr<SyncedState> SyncState();
  // Whether this job's steps keep rollback and buddy copies: one expert-parallel group, IN_MEMORY,
  // or TIERED with elastic.replicas. Every other job needs a checkpoint folder to fall back on.
  bool KeepsCopies() const;
  // Whether a generation can go on from the state its workers hold (every layout but
  // experts_per_worker: with one expert-parallel group, IN_MEMORY with its copies and TIERED with
  // its stores and copies; with several, from each expert's copies in the other groups).
  bool MovesLiveState() const;
  // TIERED, phase 6: for each group of the new generation (owners[g], sources[g]), moves every
  // expert whose source is not its owner from the source's store or shelf to the owner's store in
  // bounded rounds (state_sync.h, MoveExpertsInChunks), through a scheduler over a model of every
  // expert; returns this worker's store for the new placement (collective).
  [[nodiscard]] StatusOr<std::unique_ptr<storage::TieredExpertStore>> MoveStoredExperts(
      comm::Communicator* comm, int64_t step, const std::vector<std::vector<int>>& owners,
      const std::vector<CopySources>& sources, int64_t blob_floats, int64_t* moved);
  // The checkpoint folder of a new generation: opened again (IN_MEMORY, or a TIERED generation
  // that goes back to a checkpoint), or kept open across it by a worker that still has its
  // manager (a TIERED worker's store shares its shard's SSD tier): ContinueCheckpoints, in the
  // order the committer's role needs (OpenWorkerCheckpoints).
  [[nodiscard]] Status OpenCheckpointsOfGeneration();
  [[nodiscard]] Status ContinueCheckpoints();
  // Whether every worker's `mine` is OK (collective): this worker's error, or `others_failed`
  // ("rank 0 could not open ...") when another one failed.
  [[nodiscard]] Status AllWorkersOk(Status mine, const std::string& others_failed);
  // A TIERED generation that goes back to a checkpoint: the live store goes and the shard is
  // opened afresh, for a store the checkpoint fills (collective for every worker of a TIERED job,
  // survivors and joiners alike; nothing for IN_MEMORY).
  [[nodiscard]] Status ReopenForCheckpoint();
  // The expert-parallel group size of a generation of `workers` (see GroupSize in elastic.cc).
  [[nodiscard]] StatusOr<int> GroupSize(int workers) const;
  // The placement of a generation that goes back to the newest checkpoint (collective).
  [[nodiscard]] StatusOr<SyncedState> PlanFromCheckpoint();
  // Every worker reads its share of the newest checkpoint all of them find intact — or, with none
  // committed, all start over from step 0 (collective).
  [[nodiscard]] Status GoBackToCheckpoint();
  // What this worker can supply to SyncState, and its copy of item `i` at `step` (one it holds).
  Holdings HoldingsOfThisWorker() const;
  void ReadHeldItem(size_t i, int64_t step, const Holdings& all, float* dst) const;
  // The values of a synced state, into the model just built for its placement.
  [[nodiscard]] Status ImportState(const SyncedState& s);
  // The synced state's values (or the checkpoint's), and the copies kept from then on.
  [[nodiscard]] Status StartFrom(const SyncedState& s);
  [[nodiscard]] Status CheckElastic() const;
  // Opens config.checkpoint.dir (`continuing`: a worker that became rank 0 of a running job).
  [[nodiscard]] Status OpenCheckpoints(bool continuing);
  // Every worker opens its own shard of config.checkpoint.dir (or continues in it, when it kept
  // its manager across a re-form), rank 0 (the committer) first.
  [[nodiscard]] Status OpenWorkerCheckpoints(bool continuing);
  // What this worker's shard of a checkpoint holds.
  checkpoint::CheckpointShare CheckpointShareOfThisWorker() const;
  // The checkpoint shard of every rank of this generation (set by OpenWorkerCheckpoints).
  std::vector<std::string> shard_names_;
  // Distributed checkpoints: every worker writes its own shard (CheckpointShareOfThisWorker) and
  // rank 0 commits; resuming, every worker reads what it now holds from the shards that have it,
  // whatever the number of workers that wrote them.
  [[nodiscard]] Status ResumeDistributed();
  // Rebuilds the model, its seams and expert state for a synced state's placement, and starts
  // from it.
  [[nodiscard]] Status AdoptState(SyncedState& s);
  // Blobs: every dense parameter's value, first and second moment, in DenseParameters() order;
  // an expert's: for each MoE layer in order, each parameter's value and moments.
  size_t DenseBlobFloats() const;
  size_t ExpertBlobFloats() const;
  void ReadDense(float* out) const;
  void ReadExpert(int64_t e, float* out) const;
  void TakeRollbackCopy();
  [[nodiscard]] Status RefreshBuddies();
  // TIERED with copies: the state before this step's update — the dense part in memory, this
  // worker's experts and the buddy copies of the previous elastic.replicas ranks' experts on its
  // shelf — when elastic.replica_every steps have passed since the last copies (collective).
  [[nodiscard]] Status RefreshStoredCopiesIfDue();
  [[nodiscard]] Status RefreshStoredCopies();
  // This worker's experts, out of its store onto its shelf as `version`.
  [[nodiscard]] Status CopyOwnExperts(int64_t version);
  // Floats [offset, offset + n) of expert e's blob at `version` on the shelf, into `read` or from
  // `write` (whole tensors only).
  [[nodiscard]] Status ShelfPieces(int64_t version, int64_t e, int64_t offset, int64_t n,
                                   float* read, const float* write);
  // The shelf, made on first use: an expert's blob is 3 pieces per MoE layer, its weights and
  // Adam moments, in the order of the blobs the state sync moves.
  [[nodiscard]] Status EnsureShelf();
  // Drops this generation's reducers and communicators; `generation` is the one to come.
  void ResetParallel(int64_t generation);
  [[nodiscard]] Status ExportParameters() const;
  bool distributed() const { return options_.worker.world_size > 1; }
  [[nodiscard]] Status RunLoop();

  TrainOptions options_;
  std::unique_ptr<Tracer> tracer_;  // outlives every thread that records into it
  std::unique_ptr<ThreadPool> pool_;
  ops::Context ctx_;
  std::unique_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<model::MoeTransformer> model_;
  std::unique_ptr<model::AdamW> optimizer_;
  // TIERED (declared in destruction order: the scheduler and its store go first, then the budgets
  // they charge, then the temporary SSD folder).
  std::unique_ptr<storage::PrivateFolder> temp_ssd_dir_;
  std::unique_ptr<MemoryBudget> device_budget_, host_budget_;
  uint64_t dense_state_bytes_ = 0;  // charged to device_budget_ for good
  std::unique_ptr<checkpoint::CheckpointManager>
      checkpoints_;  // uses the budgets' SSD tier; goes last
  std::unique_ptr<scheduler::TieredExpertScheduler> scheduler_;
  // Distributed (declared so that the exchanges go before the communicators they use).
  std::unique_ptr<comm::Communicator> world_comm_, ep_comm_, replica_comm_;
  std::unique_ptr<scheduler::ExpertParallel> exchange_;
  std::unique_ptr<scheduler::DataParallel> data_parallel_;
  int64_t local_batch_ = 0;            // sequences per step on this worker
  int64_t first_sequence_ = 0;         // this worker's first sequence within the step's batch
  bool expert_replica_leader_ = true;  // counts its experts in the global gradient norm
  std::unique_ptr<model::ParameterSlices> dense_slices_;  // for the dense gradient norm
  // The step's seams (step_seams.h). BuildModel chooses the gradient sync and the keeping for the
  // model and communicators it builds; Create chooses the expert state once the store exists.
  std::unique_ptr<GradientSync> gradients_;
  std::unique_ptr<ExpertState> experts_;
  std::unique_ptr<StepKeeping> keeping_;  // NoKeeping, or ElasticKeeping for an elastic worker
  // The rollback copy before the update; the expert loads and the buddy copies after it
  // (elastic.cc says why).
  class ElasticKeeping final : public StepKeeping {
   public:
    // `copies`: keep the rollback and buddy copies (KeepsCopies); else only the expert loads.
    ElasticKeeping(Trainer& trainer, bool copies);
    [[nodiscard]] Status BeforeUpdate() override;
    [[nodiscard]] Status AfterUpdate(const std::vector<model::MoeStats>& moe) override;

   private:
    Trainer& t_;
    bool copies_;
  };

  std::unique_ptr<MetricsWriter> metrics_;
  std::vector<int32_t> inputs_, targets_;
  int64_t step_ = 0;
  int64_t resumed_from_ = 0;
  int64_t reported_checkpoint_ = 0;  // the newest committed checkpoint told to on_checkpoint
  void ReportCommittedCheckpoint();
  // Elastic state. comm_mu_ orders AbortCollectives (any thread) against the training thread's
  // changes of the communicators: world_comm_, ep_comm_ and replica_comm_ are replaced only under
  // it, and read by the training thread (their only writer) without it.
  mutable absl::Mutex comm_mu_;
  // Why the collectives were aborted, until ResetParallel.
  std::optional<std::string> aborted_why_ ABSL_GUARDED_BY(comm_mu_);
  int64_t comm_generation_ ABSL_GUARDED_BY(comm_mu_) = 0;  // the generation of the communicators
  // Set by AbortCollectives so that the checkpoint manager of this generation stops waiting for
  // reports of a checkpoint that can no longer commit.
  std::shared_ptr<std::atomic<bool>> checkpoint_abandoned_ ABSL_GUARDED_BY(comm_mu_);
  std::vector<int64_t> experts_per_worker_;
  int64_t first_expert_ = 0, num_experts_ = 0;  // this worker's range
  Device device_;                               // where the model lives (train.device)
  int64_t live_version_ = 0;                    // the step the model's state is the result of
  bool store_whole_ = true;  // TIERED: the store holds live_version_'s experts (no failed update)
  struct Copy {
    int64_t version = -1;
    int64_t first = 0, count = 0;  // experts held
    std::vector<float> dense, experts;
  };
  Copy rollback_;  // this worker's state before the latest update
  struct Buddy {
    Copy cur, prev;  // the source's experts after its latest two updates
  };
  std::vector<Buddy> buddies_;  // [elastic.replicas], from ranks rank-1, rank-2, ...
  // TIERED with copies: the dense state of the refresh before rollback_'s (rollback_ holds the
  // latest one's; their experts are on the shelf), the shelf with this worker's experts and the
  // buddy copies (two versions of each expert at most), and the version of the latest refresh.
  Copy rollback_older_;
  std::unique_ptr<storage::CopyShelf> shelf_;
  int64_t copied_version_ = -1;
  std::vector<double> expert_load_;  // rows routed to each expert, decayed over steps
  std::vector<StepResult> history_;
  std::vector<std::pair<int64_t, EvalResult>> evals_;
  double started_ = 0;
  double smoothed_step_seconds_ = 0;
  bool tty_ = false;
  double last_eval_loss_ = -1;
  double last_eval_bpb_ = -1;
};

}  // namespace strata::train
