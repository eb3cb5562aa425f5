// How the workers of a new membership generation agree on a state and move it to where it now
// lives: six phases over the generation's communicator, which ElasticState::SyncState calls in
// order (elastic_state.h says which versions every step keeps).
//
// The state:
// - Items: item 0 (kDenseItem) is the dense parameters with their Adam moments, item 1 + e
//   (ExpertItem(e)) expert e's parameters with theirs; each a blob of floats.
// - A worker can supply some versions of some items (a version is the step the state is the
//   result of): its live model, its copy from before the latest update, and buddy copies of other
//   workers' experts.
//
// The phases:
// 1. GatherHoldings: every worker all-gathers what every worker holds.
// 2. AgreeOnStep: the newest version whose every item some worker holds (pure).
// 3. ReplanExperts: rank 0's measured expert loads are broadcast and the experts re-placed in
//    contiguous ranges (scheduler::ReplanRanges).
// 4. LocateCopies: where each item's copy at the agreed step comes from (pure).
// 5. MoveDenseState: a broadcast from the dense root, when any worker lacks the dense state.
// 6. MoveExperts: one all-to-all-v from each expert's source to its new owner, every blob in
//    memory at once (IN_MEMORY); or MoveExpertsInChunks: the same moves in rounds of at most
//    chunk_floats floats out of and into each worker, read from and written to where the copies
//    live (TIERED stores), so no worker buffers more than a chunk of the expert set.
//
// Threads and ownership:
// - The collective phases (1, 3, 5, 6) are called by every worker of the generation, in the same
//   order, each from the one thread that uses `comm` at the time (runtime/comm/communicator.h).
//   `comm` is borrowed for the call; null stands for a generation of one worker (rank 0 of 1),
//   which communicates nothing.
// - The pure phases (2, 4) may be called from any thread. Every worker gets the same
//   GatherHoldings result, so they and ReplanExperts compute the same answer everywhere.
// - A phase reads this worker's copies only through the ReadItem (ReadChunk, WriteChunk) it is
//   given, during the call, on the calling thread, and returns values its caller owns.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "runtime/comm/communicator.h"

namespace strata::train {

inline constexpr size_t kDenseItem = 0;
inline size_t ExpertItem(int64_t e) { return 1 + static_cast<size_t>(e); }

// Where a worker keeps a version of an item.
enum class HoldingSlot : int {
  kLive = 0,             // its model
  kRollback = 1,         // its copy from before the latest update
  kBuddyLatest = 2,      // a buddy copy after its source's latest update
  kBuddyPrevious = 3,    // a buddy copy after the update before
  kRollbackPrevious = 4  // its copy from before the update before (TIERED, see elastic_state.h)
};
inline constexpr int kHoldingSlots = 5;

// Which versions of which items each of `workers` workers can supply, and the blob sizes of its
// model (0 for a worker that holds no state). A value type: a worker fills one of one worker for
// itself, and GatherHoldings returns the generation's. Const methods may run on several threads at
// once; a setter needs the object to itself.
class Holdings {
 public:
  Holdings(int workers, int64_t num_experts);

  int workers() const { return workers_; }
  int64_t num_experts() const { return num_experts_; }
  size_t items() const { return 1 + static_cast<size_t>(num_experts_); }

  void SetBlobFloats(int w, int64_t dense_floats, int64_t expert_floats);
  void Set(int w, size_t item, HoldingSlot slot, int64_t version);
  // Experts [first, first + count) in `slot`.
  void SetExperts(int w, int64_t first, int64_t count, HoldingSlot slot, int64_t version);

  // -1: worker w has nothing in that slot.
  int64_t version(int w, size_t item, HoldingSlot slot) const;
  // Worker w holds `version` of `item` in some slot.
  bool Holds(int w, size_t item, int64_t version) const;
  // The largest blob sizes any worker reports (0: no worker holds any state).
  int64_t dense_floats() const;
  int64_t expert_floats() const;

 private:
  // Worker w's row: [dense floats, expert floats], then per item its kHoldingSlots versions.
  static constexpr size_t kRowHeader = 2;
  size_t row_size() const { return kRowHeader + items() * kHoldingSlots; }
  size_t index(int w, size_t item, HoldingSlot slot) const;
  friend StatusOr<Holdings> GatherHoldings(comm::Communicator* comm, const Holdings& mine);

  int workers_;
  int64_t num_experts_;
  std::vector<int64_t> rows_;  // [workers * row_size()]
};

// Phase 1 (collective). `mine` is this worker's (of one worker); the result has every worker's,
// in rank order. The communicator's errors are returned as they are.
[[nodiscard]] StatusOr<Holdings> GatherHoldings(comm::Communicator* comm, const Holdings& mine);

struct AgreedStep {
  int64_t step = -1;   // the newest version of which every item is held somewhere; -1: none
  int64_t newest = 0;  // the newest version any worker holds (0 when none holds any)
  // step < 0: what cannot be put together, for messages — the items no worker holds at the oldest
  // version any holds ("expert 2, experts 4-7 went with the failed workers and their buddy
  // copies": runs of three or more as ranges), or that no worker holds any state at all.
  std::string lost;
};

// Phase 2 (pure).
AgreedStep AgreeOnStep(const Holdings& all);

struct ExpertPlan {
  std::vector<int64_t> counts;  // [group size] experts of each rank of a group, in rank order
  std::vector<int> owner;       // [E] each expert's new owner in group 0 (ranks [0, group size))
  int planner_moved = 0;        // experts whose owner (live or rollback holder) changes
};

// Phase 3 (collective). `measured_load` is this worker's measured load of each expert; rank 0's
// is broadcast and used by every worker (equal loads when rank 0's has not num_experts entries,
// e.g. rank 0 just joined). The experts are placed over the ranks of an expert-parallel group of
// `group_size` workers (0: all of them; each group g of ranks [g G, (g + 1) G) holds a copy, its
// rank g G + i the experts of group 0's rank i). An expert's current position is that of the
// lowest rank holding its live or rollback copy within its group.
[[nodiscard]] StatusOr<ExpertPlan> ReplanExperts(comm::Communicator* comm, const Holdings& all,
                                                 const std::vector<double>& measured_load,
                                                 int group_size = 0);

struct CopySources {
  std::vector<int> expert;  // [E] the rank whose copy of the expert at the step goes to its owner
  int dense_root = -1;      // the lowest rank holding the dense state at the step
  bool anyone_lacks_dense = false;
};

// Phase 4 (pure). An expert's source is its new owner when that holds it at `step` (it keeps its
// copy), else the lowest rank holding it. REQUIRES: every item is held at `step` (AgreeOnStep).
CopySources LocateCopies(const Holdings& all, int64_t step, const std::vector<int>& owner);

// Copies this worker's blob of `item` at the agreed step into `dst` (dense_floats or
// expert_floats of them). Called only for items this worker holds at that step.
using ReadItem = std::function<void(size_t item, float* dst)>;

// Phase 5 (collective when anyone lacks the dense state). Returns the dense blob at the step:
// this worker's own copy when nobody lacks it, else the dense root's.
[[nodiscard]] StatusOr<std::vector<float>> MoveDenseState(comm::Communicator* comm,
                                                          const Holdings& all, int64_t step,
                                                          const CopySources& sources,
                                                          const ReadItem& read);

struct MovedExperts {
  std::vector<float> blobs;  // this worker's experts' blobs, in expert order
  int64_t moved = 0;         // experts (of all workers) whose source is not their owner
};

// Phase 6 (collective). Each expert's blob goes from sources.expert[e] to owner[e]; an owner
// that is its own source reads its copy.
[[nodiscard]] StatusOr<MovedExperts> MoveExperts(comm::Communicator* comm,
                                                 const std::vector<int>& owner,
                                                 const CopySources& sources, int64_t expert_floats,
                                                 const ReadItem& read);

// One piece of one expert's move: floats [offset, offset + n) of its blob, from rank `from` to
// rank `to`.
struct ExpertPiece {
  int64_t expert = 0;
  int from = 0, to = 0;
  int64_t offset = 0, n = 0;
};
// The rounds of a chunked move: in each, every worker sends at most chunk_floats floats of pieces
// and receives at most chunk_floats.
struct ExpertChunkPlan {
  std::vector<std::vector<ExpertPiece>> rounds;
  int64_t moved = 0;  // experts whose source is not their owner
};

// The schedule MoveExpertsInChunks follows (pure: a function of its arguments alone, so every
// worker computes the same rounds). Experts whose source is their owner have no pieces. Each round
// takes, in expert order, as much of each unfinished move as its source can still send and its
// owner still receive in that round (so pieces are cut wherever a chunk fills, and a blob larger
// than a chunk spans several rounds). REQUIRES: chunk_floats >= 1, expert_floats >= 0, and one
// source per owner entry.
ExpertChunkPlan PlanExpertChunks(const std::vector<int>& owner, const CopySources& sources,
                                 int64_t expert_floats, int64_t chunk_floats);

// Copies floats [offset, offset + n) of this worker's blob of `item` at the agreed step into
// `dst`. Called only for items this worker is the source of.
using ReadChunk = std::function<Status(size_t item, int64_t offset, int64_t n, float* dst)>;
// Makes `src` floats [offset, offset + n) of this worker's blob of `item` (it is the item's new
// owner). Every float of a moved blob is written exactly once, in no particular order of pieces.
using WriteChunk = std::function<Status(size_t item, int64_t offset, int64_t n, const float* src)>;

// Phase 6 for state that does not fit in memory at once (collective; returns the experts moved,
// of all workers). Moves each expert whose source is not its owner from sources.expert[e] to
// owner[e], following PlanExpertChunks: one AllToAllV per round, and one more at the end. An
// owner that is its own source does nothing: its copy stays where it is, neither read nor
// written. A worker buffers at most chunk_floats + world_size floats each way (its pieces of the
// round and one status word per peer); `read` and `write` are called on the calling thread,
// between the collectives. Null `comm`: one worker, nothing moves.
//
// Failures. Each round's exchange carries a status word from every worker to every other: whether
// its reads of this round and its writes of the round before succeeded (the round at the end
// carries only that). When a read or write fails, the worker still exchanges the round (with
// zeros for what it could not read), and after that exchange every worker stops, writes nothing of
// it, and returns an error: the failing worker its own, wrapped with where it happened; the others
// ABORTED naming the ranks that failed. So every worker returns an error after the same round and
// none waits for a peer that has given up; the blobs written before are then partly moved (the
// generation cannot go on from them). A failed collective is returned as it is, wrapped; its
// peers fail their own collective within the communicator's timeout, or at once when it was
// aborted.
[[nodiscard]] StatusOr<int64_t> MoveExpertsInChunks(comm::Communicator* comm,
                                                    const std::vector<int>& owner,
                                                    const CopySources& sources,
                                                    int64_t expert_floats, int64_t chunk_floats,
                                                    const ReadChunk& read, const WriteChunk& write);

}  // namespace strata::train
