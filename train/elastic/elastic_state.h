// ElasticState: what an elastic worker keeps so that a later membership generation can go on
// without it (or with more), and how a new generation's workers agree on a state and move it to
// where it now lives.
//
// - Versions: a worker's state (dense parameters, its experts, their Adam moments) after step s is
//   version s; the live one is in the model (IN_MEMORY) or the store (TIERED).
// - With one expert-parallel group the worker keeps copies (KeepsCopies): IN_MEMORY, its rollback
//   copy from before every update and buddy copies of the previous elastic.replicas ranks'
//   experts after their latest two updates; TIERED, every elastic.replica_every steps, the dense
//   state in memory and the experts' copies on a CopyShelf on its SSD. With several groups each
//   expert's copies in the other groups are what a generation goes on from.
// - A new generation runs the phases of state_sync.h (SyncState): the newest step whose whole
//   state is held somewhere, the experts re-placed by measured load, each moved from a copy at
//   that step to its new owner (TIERED: store to store in bounded rounds, MoveStoredExperts).
// - When the state cannot be put together, and always with parallel.experts_per_worker, the
//   generation goes back to the newest checkpoint (PlanFromCheckpoint places the experts; the
//   trainer reads the checkpoint).
// - ElasticKeeping is the StepKeeping seam (step_seams.h) over it.
//
// Ownership and threads:
// - The trainer owns one ElasticState for an elastic worker, for the trainer's whole life, across
//   generations. The ElasticState owns the rollback and buddy copies, the shelf, the expert loads
//   and the live version; it reaches the model, optimizer, store and communicators through an
//   ElasticHost (the trainer), only during its calls, and keeps none of them.
// - Only the thread that drives the trainer calls it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/common/status.h"
#include "kernels/ops.h"
#include "proto/config.pb.h"
#include "runtime/comm/communicator.h"
#include "runtime/model/adamw.h"
#include "runtime/model/moe_layer.h"
#include "runtime/model/transformer.h"
#include "scheduler/tiered_scheduler.h"
#include "storage/copy_shelf.h"
#include "storage/tiered_store.h"
#include "train/elastic/state_sync.h"
#include "train/step_seams.h"

namespace strata::train {

// Whether a generation of this job can go on from the state its workers hold: every layout but
// parallel.experts_per_worker, which goes back to its newest checkpoint.
bool MovesLiveState(const config::JobConfig& config);
// Whether its steps keep rollback and buddy copies: one expert-parallel group, IN_MEMORY, or
// TIERED with elastic.replicas. Every other elastic job needs a checkpoint folder to fall back on.
bool KeepsCopies(const config::JobConfig& config);
// INVALID_ARGUMENT naming the settings when an elastic job of this layout has nothing to re-form
// from (no copies and no checkpoints).
[[nodiscard]] Status CheckElastic(const config::JobConfig& config);
// The expert-parallel group size of a generation of `workers`: parallel.expert_parallel (0: all
// workers) when it divides them; else, for an elastic job, the smallest larger divisor (no worker
// holds more experts than the configured layout gives it), and for any other an error.
[[nodiscard]] StatusOr<int> GroupSize(const config::ParallelConfig& parallel, int workers,
                                      bool elastic);

// A model of every expert (unbound) and a scheduler over it, adopting a worker's store: what a
// TIERED re-form moves experts between stores with.
struct StoreMover {
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<scheduler::TieredExpertScheduler> scheduler;
};

// The narrow view of the trainer an ElasticState works through. Pointers it returns are valid
// until the trainer rebuilds its model or store (a re-form), so they are asked for again at every
// use.
class ElasticHost {
 public:
  virtual ~ElasticHost() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual ops::Context& context() = 0;
  virtual int64_t step() const = 0;  // the step the trainer is at
  // This generation's model and its optimizer (null: a worker that just joined has none yet).
  virtual model::MoeTransformer* model() const = 0;
  virtual model::AdamW* optimizer() const = 0;
  // TIERED: the scheduler over the worker's store (null in memory, and once the store is handed
  // on).
  virtual scheduler::TieredExpertScheduler* scheduler() const = 0;
  virtual comm::Communicator* world() const = 0;  // all workers; null when alone
  // The placement: experts per rank of a group, and this worker's range.
  virtual const std::vector<int64_t>& experts_per_worker() const = 0;
  virtual int64_t first_expert() const = 0;
  virtual int64_t num_experts() const = 0;
  // TIERED: takes the store from the scheduler (the model stops using it), for a StoreMover.
  virtual std::unique_ptr<storage::TieredExpertStore> ReleaseStore() = 0;
  // A mover over `store` (null: a fresh one, for a worker that had none), charged to the worker's
  // budgets and known to its checkpoint shard.
  [[nodiscard]] virtual StatusOr<StoreMover> MakeStoreMover(
      std::unique_ptr<storage::TieredExpertStore> store) = 0;
};

// What a generation starts from: the state its workers hold (placement and blobs), or the newest
// checkpoint (the placement only; every worker reads its own share).
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

class ElasticState {
 public:
  // `config` and `host` outlive it.
  ElasticState(const config::JobConfig& config, ElasticHost* host);

  // The live state is now `version` (the step it is the result of).
  void SetLive(int64_t version);
  // Holds no live state (a re-form is replacing the model).
  void HoldNothing();
  // TIERED: the experts' update failed, so the store holds no whole version.
  void StoreUpdateFailed() { store_whole_ = false; }
  bool store_whole() const { return store_whole_; }
  int64_t live_version() const { return live_version_; }

  // Before the update (copies): a TIERED worker's copies, every elastic.replica_every steps; an
  // IN_MEMORY worker's rollback copy.
  [[nodiscard]] Status KeepBeforeUpdate();
  // After it: the step's batch-wide expert loads, decayed over steps (they steer the placement of
  // the next generation).
  void RecordLoads(const std::vector<model::MoeStats>& moe);
  // After the update (copies): an IN_MEMORY worker's buddy copies (collective; a TIERED
  // worker's were taken before it).
  [[nodiscard]] Status KeepAfterUpdate();
  // TIERED: the state before this step's update — the dense part in memory, this worker's experts
  // and the buddy copies of the previous elastic.replicas ranks' on its shelf (collective).
  [[nodiscard]] Status RefreshStoredCopies();

  // Re-form. What this generation starts from (collective): the state the workers hold, or the
  // newest checkpoint's placement.
  [[nodiscard]] StatusOr<SyncedState> SyncState();
  // The placement of a generation that goes back to the newest checkpoint (collective).
  [[nodiscard]] StatusOr<SyncedState> PlanFromCheckpoint();
  // The values of a synced state into the model just built for its placement (and the
  // optimizer's step count).
  [[nodiscard]] Status ImportState(const SyncedState& s);
  // The generation starts from `step`: copies of later steps (a trajectory it replaces) go, and,
  // when the layout keeps copies, the generation's first ones are made (collective).
  [[nodiscard]] Status StartGeneration(int64_t step);

  // What this worker can supply to SyncState, and its copy of item `i` at `step` (one it holds).
  Holdings HoldingsOfThisWorker() const;
  void ReadHeldItem(size_t i, int64_t step, const Holdings& all, float* dst) const;

 private:
  struct Copy {
    int64_t version = -1;
    int64_t first = 0, count = 0;  // experts held
    std::vector<float> dense, experts;
  };
  struct Buddy {
    Copy cur, prev;  // the source's experts after its latest two updates
  };

  // Blobs: every dense parameter's value, first and second moment, in DenseParameters() order;
  // an expert's: for each MoE layer in order, each parameter's value and moments.
  size_t DenseBlobFloats() const;
  size_t ExpertBlobFloats() const;
  void ReadDense(float* out) const;
  void ReadExpert(int64_t e, float* out) const;
  void TakeRollbackCopy();
  // IN_MEMORY: the experts of ranks rank-1 .. rank-R after their update, by one all-to-all
  // (collective).
  [[nodiscard]] Status RefreshBuddies();
  [[nodiscard]] Status RefreshStoredCopiesIfDue();
  // This worker's experts, out of its store onto its shelf as `version`.
  [[nodiscard]] Status CopyOwnExperts(int64_t version);
  // Floats [offset, offset + n) of expert e's blob at `version` on the shelf, into `read` or from
  // `write` (whole tensors only).
  [[nodiscard]] Status ShelfPieces(int64_t version, int64_t e, int64_t offset, int64_t n,
                                   float* read, const float* write);
  // The shelf, made on first use: an expert's blob is 3 pieces per MoE layer, its weights and
  // Adam moments, in the order of the blobs the state sync moves.
  [[nodiscard]] Status EnsureShelf();
  // TIERED: for each group of the new generation (owners[g], sources[g]), moves every expert
  // whose source is not its owner from the source's store or shelf to the owner's store in
  // bounded rounds (MoveExpertsInChunks), through a StoreMover; returns this worker's store for
  // the new placement (collective).
  [[nodiscard]] StatusOr<std::unique_ptr<storage::TieredExpertStore>> MoveStoredExperts(
      comm::Communicator* comm, int64_t step, const std::vector<std::vector<int>>& owners,
      const std::vector<CopySources>& sources, int64_t blob_floats, int64_t* moved);

  const config::JobConfig& config_;
  ElasticHost* host_;
  int64_t live_version_ = 0;    // the step the live state is the result of (-1: none)
  bool store_whole_ = true;     // TIERED: the store holds live_version_'s experts
  Copy rollback_;               // this worker's state before the latest update
  std::vector<Buddy> buddies_;  // [elastic.replicas], from ranks rank-1, rank-2, ...
  // TIERED with copies: the dense state of the refresh before rollback_'s (rollback_ holds the
  // latest one's; their experts are on the shelf), the shelf with this worker's experts and the
  // buddy copies (two versions of each expert at most), and the version of the latest refresh.
  Copy rollback_older_;
  std::unique_ptr<storage::CopyShelf> shelf_;
  int64_t copied_version_ = -1;
  std::vector<double> expert_load_;  // rows routed to each expert, decayed over steps
};

// The elastic worker's StepKeeping: the copies before the update, the live version, the expert
// loads and (IN_MEMORY) the buddy copies after it.
class ElasticKeeping final : public StepKeeping {
 public:
  struct Options {
    bool copies = false;  // keep rollback and buddy copies (a worker of several, KeepsCopies)
    bool loads = false;   // measure the expert loads (a worker of several)
  };
  ElasticKeeping(ElasticState* state, Options options) : state_(state), options_(options) {}
  [[nodiscard]] Status BeforeUpdate() override;
  void Updated(int64_t version, bool experts_updated) override;
  [[nodiscard]] Status AfterUpdate(const std::vector<model::MoeStats>& moe) override;

 private:
  ElasticState* state_;
  Options options_;
};

}  // namespace strata::train
