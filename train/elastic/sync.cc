// ElasticState's part of a re-form (elastic_state.h): what this worker holds, the state sync of
// state_sync.h over it, the moves of a TIERED worker's experts between stores, and the placement
// of a generation that goes back to a checkpoint.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/logging.h"
#include "scheduler/replan.h"
#include "train/elastic/blob_layout.h"
#include "train/elastic/elastic_state.h"
#include "train/worker_comms.h"

namespace strata::train {
namespace {

using elastic_internal::ChunkOfTensors;
using elastic_internal::kBlobKinds;

std::string Ranges(const std::vector<int64_t>& counts) {
  std::string out;
  int64_t first = 0;
  for (size_t w = 0; w < counts.size(); ++w) {
    absl::StrAppendFormat(&out, "%sw%d:[%d,%d)", w ? " " : "", w, first, first + counts[w]);
    first += counts[w];
  }
  return out;
}

}  // namespace

Holdings ElasticState::HoldingsOfThisWorker() const {
  Holdings mine(1, config_.model().moe().num_experts());
  const bool has_model = host_->model() != nullptr;
  const int64_t first = host_->first_expert(), count = host_->num_experts();
  // A worker that just joined holds nothing.
  if (has_model) {
    mine.SetBlobFloats(0, static_cast<int64_t>(DenseBlobFloats()),
                       static_cast<int64_t>(ExpertBlobFloats()));
    if (rollback_.version >= 0) {
      mine.Set(0, kDenseItem, HoldingSlot::kRollback, rollback_.version);
    }
  }
  if (has_model) {
    mine.Set(0, kDenseItem, HoldingSlot::kLive, live_version_);
    // A TIERED worker's experts are its store's, whole unless the last update failed (and gone
    // with it when a re-form failed after handing it on).
    const bool tiered = config_.storage().mode() == config::StorageConfig::TIERED;
    if (!tiered || (host_->scheduler() != nullptr && store_whole_)) {
      mine.SetExperts(0, first, count, HoldingSlot::kLive, live_version_);
    }
  }
  if (rollback_.version >= 0) {
    mine.SetExperts(0, rollback_.first, rollback_.count, HoldingSlot::kRollback, rollback_.version);
  }
  for (const Buddy& b : buddies_) {
    for (const Copy* c : {&b.cur, &b.prev}) {
      if (c->version < 0) continue;
      mine.SetExperts(0, c->first, c->count,
                      c == &b.cur ? HoldingSlot::kBuddyLatest : HoldingSlot::kBuddyPrevious,
                      c->version);
    }
  }
  // TIERED: the dense state of the refresh before, and the copies on the shelf whose every
  // tensor is written (this worker's experts as its rollback copies, the others as buddy copies).
  if (rollback_older_.version >= 0) {
    mine.Set(0, kDenseItem, HoldingSlot::kRollbackPrevious, rollback_older_.version);
  }
  for (int64_t e = 0; shelf_ && e < config_.model().moe().num_experts(); ++e) {
    const bool own = has_model && e >= first && e < first + count;
    const std::vector<int64_t> versions = shelf_->Versions(e);
    for (size_t k = 0; k < versions.size() && k < 2; ++k) {
      const HoldingSlot slot =
          own ? (k == 0 ? HoldingSlot::kRollback : HoldingSlot::kRollbackPrevious)
              : (k == 0 ? HoldingSlot::kBuddyLatest : HoldingSlot::kBuddyPrevious);
      mine.Set(0, ExpertItem(e), slot, versions[k]);
    }
  }
  return mine;
}

void ElasticState::ReadHeldItem(size_t i, int64_t step, const Holdings& all, float* dst) const {
  const int64_t e = static_cast<int64_t>(i) - 1;
  const int64_t first = host_->first_expert(), count = host_->num_experts();
  if (host_->model() && live_version_ == step &&
      (i == kDenseItem || (e >= first && e < first + count))) {
    if (i == kDenseItem) {
      ReadDense(dst);
    } else {
      ReadExpert(e, dst);
    }
    return;
  }
  // Where this worker's copy of item `i` at `step` is (null: it has none).
  const int64_t S = all.expert_floats();
  const float* src = nullptr;
  if (i == kDenseItem) {
    if (rollback_.version == step) src = rollback_.dense.data();
    if (rollback_older_.version == step) src = rollback_older_.dense.data();
  } else if (rollback_.version == step && e >= rollback_.first &&
             e < rollback_.first + rollback_.count) {
    src = &rollback_.experts[(e - rollback_.first) * S];
  } else {
    for (const Buddy& b : buddies_) {
      for (const Copy* c : {&b.cur, &b.prev}) {
        if (src == nullptr && c->version == step && e >= c->first && e < c->first + c->count) {
          src = &c->experts[(e - c->first) * S];
        }
      }
    }
  }
  CHECK(src != nullptr) << "item " << i << " of step " << step << " is not held here";
  std::memcpy(dst, src, (i == kDenseItem ? all.dense_floats() : S) * sizeof(float));
}

StatusOr<SyncedState> ElasticState::SyncState() {
  const config::JobConfig& cfg = config_;
  const int W = host_->world_size(), rank = host_->rank();
  // A job goes on from the state its workers hold (with one expert-parallel group: IN_MEMORY with
  // rollback and buddy copies, TIERED with its stores and copies; with several, each expert's
  // copies in the other groups); experts_per_worker goes back to its newest checkpoint
  // (CheckElastic made sure there is a checkpoint folder).
  if (!MovesLiveState(cfg)) return PlanFromCheckpoint();
  comm::Communicator* comm = W > 1 ? host_->world() : nullptr;
  ASSIGN_OR_RETURN(const Holdings all, GatherHoldings(comm, HoldingsOfThisWorker()));
  const AgreedStep agreed = AgreeOnStep(all);
  if (agreed.step < 0 && !cfg.checkpoint().dir().empty()) {
    // Lost with the failed workers and their buddy copies: every worker goes back to the newest
    // checkpoint and reads its own share of it.
    if (rank == 0) {
      STRATA_LOG(WARNING) << absl::StrFormat("%s; going back to the latest checkpoint in %s",
                                             agreed.lost, cfg.checkpoint().dir());
    }
    return PlanFromCheckpoint();
  }
  if (agreed.step < 0) {
    return absl::DataLossError(absl::StrFormat(
        "the job's state cannot be put together from the workers left: %s (newest step %d), and "
        "there is no checkpoint to go back to; raise elastic.replicas or set checkpoint.dir and "
        "checkpoint.every",
        agreed.lost, agreed.newest));
  }
  const int64_t s0 = agreed.step;
  // The experts are placed over a group of the generation's group size; every group gets a copy
  // of each, from the lowest rank holding it at s0 (a member of the group that holds it keeps it).
  ASSIGN_OR_RETURN(const int G, GroupSize(cfg.parallel(), W, /*elastic=*/true));
  ASSIGN_OR_RETURN(const ExpertPlan plan, ReplanExperts(comm, all, expert_load_, G));
  std::vector<std::vector<int>> owners(W / G, plan.owner);
  std::vector<CopySources> sources;
  for (int g = 0; g < W / G; ++g) {
    for (int& o : owners[g]) o += g * G;
    sources.push_back(LocateCopies(all, s0, owners[g]));
  }
  const ReadItem read = [&](size_t i, float* dst) { ReadHeldItem(i, s0, all, dst); };
  SyncedState out;
  out.step = s0;
  out.counts = plan.counts;
  ASSIGN_OR_RETURN(out.dense, MoveDenseState(comm, all, s0, sources[0], read));
  int64_t moved = 0;
  if (cfg.storage().mode() == config::StorageConfig::TIERED) {
    ASSIGN_OR_RETURN(out.store,
                     MoveStoredExperts(comm, s0, owners, sources, all.expert_floats(), &moved));
  } else {
    // One exchange per group: this worker receives its blobs in its own group's.
    for (int g = 0; g < W / G; ++g) {
      ASSIGN_OR_RETURN(MovedExperts experts,
                       MoveExperts(comm, owners[g], sources[g], all.expert_floats(), read));
      if (rank / G == g) out.experts = std::move(experts.blobs);
      moved += experts.moved;
    }
  }
  if (rank == 0) {
    // Expert copies (over the groups) whose state at the step comes from a rollback or buddy copy,
    // not from a live model or store.
    int64_t from_copies = 0;
    for (const CopySources& from : sources) {
      for (int64_t e = 0; e < cfg.model().moe().num_experts(); ++e) {
        from_copies += all.version(from.expert[e], ExpertItem(e), HoldingSlot::kLive) != s0;
      }
    }
    STRATA_LOG(INFO) << absl::StrFormat(
        "generation of %d workers starts from step %d (this worker was at step %d): experts "
        "%s, %d moved (%d by the planner), %d from copies",
        W, s0, host_->model() ? live_version_ : -1, Ranges(plan.counts), moved, plan.planner_moved,
        from_copies);
  }
  return out;
}

StatusOr<std::unique_ptr<storage::TieredExpertStore>> ElasticState::MoveStoredExperts(
    comm::Communicator* comm, int64_t step, const std::vector<std::vector<int>>& owners,
    const std::vector<CopySources>& sources, int64_t blob_floats, int64_t* moved) {
  const config::JobConfig& cfg = config_;
  const int64_t E = cfg.model().moe().num_experts();
  // This worker's copy of an expert at the step is in its store when the store holds the live
  // state of that step, else on its shelf (a rollback or buddy copy).
  const bool live_at_step = host_->scheduler() != nullptr && store_whole_ && live_version_ == step;
  auto in_store = [&, first = host_->first_expert(), count = host_->num_experts()](int64_t e) {
    return live_at_step && e >= first && e < first + count;
  };
  // This worker's store (a joiner has none yet) goes, for the moves, to a scheduler over a model
  // that holds every expert unbound: any expert can then be read (a never-written one from its
  // initial value) and written. The model's own dense parameters are a second copy of the dense
  // state for the duration.
  std::unique_ptr<storage::TieredExpertStore> store;
  if (host_->scheduler()) store = host_->ReleaseStore();
  StoreMover every;
  scheduler::TieredExpertScheduler* mover = nullptr;
  Status ready = [&]() -> Status {
    ASSIGN_OR_RETURN(every, host_->MakeStoreMover(std::move(store)));
    mover = every.scheduler.get();
    const int64_t floats = 3 * static_cast<int64_t>(mover->expert_floats()) * mover->moe_layers();
    if (blob_floats != floats) {
      return absl::InternalError(
          absl::StrFormat("the workers' expert blobs have %d floats; this model's experts have %d",
                          blob_floats, floats));
    }
    // An expert this worker keeps whose copy at the step is on its shelf (its store holds a later
    // update, or none) goes back to that copy, a tensor at a time.
    const int64_t F = static_cast<int64_t>(mover->expert_floats());
    std::vector<float> piece(F);
    for (int64_t e = 0; e < E; ++e) {
      bool restore = false;
      for (size_t g = 0; g < owners.size(); ++g) {
        restore |= owners[g][e] == host_->rank() && sources[g].expert[e] == owners[g][e];
      }
      if (!restore || in_store(e)) continue;
      if (shelf_ == nullptr) {
        return absl::InternalError(absl::StrFormat(
            "expert %d of step %d is neither in this worker's store nor on a shelf", e, step));
      }
      for (int p = 0; p < 3 * mover->moe_layers(); ++p) {
        RETURN_IF_ERROR(ShelfPieces(step, e, p * F, F, piece.data(), nullptr));
        RETURN_IF_ERROR(mover->WriteExpertRange(p / 3, static_cast<int>(e), kBlobKinds[p % 3], 0, F,
                                                piece.data()));
      }
    }
    return absl::OkStatus();
  }();
  // Nobody starts the rounds while another worker cannot take part (its store is lost then: the
  // next re-form finds its experts missing and goes back to a checkpoint).
  if (comm != nullptr) {
    RETURN_IF_ERROR(AllWorkersOk(*comm, ready,
                                 "another worker could not prepare its store for the "
                                 "expert moves"));
  }
  RETURN_IF_ERROR(ready);
  // A blob is, for each MoE layer, the weights and both Adam moments, one tensor each.
  const int64_t F = static_cast<int64_t>(mover->expert_floats());
  // Calls fn(moe layer, kind, offset in the tensor, floats, offset in the piece) for the tensors
  // the piece [offset, offset + n) of a blob spans.
  auto each_tensor = [&](int64_t offset, int64_t n, const auto& fn) -> Status {
    for (int64_t done = 0; done < n;) {
      const int64_t t = (offset + done) / F, at = (offset + done) % F;
      const int64_t m = std::min(n - done, F - at);
      RETURN_IF_ERROR(fn(static_cast<int>(t / 3), kBlobKinds[t % 3], at, m, done));
      done += m;
    }
    return absl::OkStatus();
  };
  const ReadChunk read = [&](size_t item, int64_t offset, int64_t n, float* dst) {
    const int e = static_cast<int>(item) - 1;
    if (!in_store(e)) return ShelfPieces(step, e, offset, n, dst, nullptr);
    return each_tensor(offset, n,
                       [&](int li, storage::TensorKind kind, int64_t at, int64_t m, int64_t done) {
                         return mover->ReadExpertRange(li, e, kind, at, m, dst + done);
                       });
  };
  const WriteChunk write = [&](size_t item, int64_t offset, int64_t n, const float* src) {
    const int e = static_cast<int>(item) - 1;
    return each_tensor(offset, n,
                       [&](int li, storage::TensorKind kind, int64_t at, int64_t m, int64_t done) {
                         return mover->WriteExpertRange(li, e, kind, at, m, src + done);
                       });
  };
  // One round of moves per group: its members receive their experts in theirs.
  *moved = 0;
  for (size_t g = 0; g < owners.size(); ++g) {
    ASSIGN_OR_RETURN(const int64_t n, MoveExpertsInChunks(comm, owners[g], sources[g], blob_floats,
                                                          ChunkOfTensors(F), read, write));
    *moved += n;
  }
  return mover->ReleaseStore();
}

StatusOr<SyncedState> ElasticState::PlanFromCheckpoint() {
  const config::JobConfig& cfg = config_;
  const int W = host_->world_size();
  ASSIGN_OR_RETURN(const int G, GroupSize(cfg.parallel(), W, /*elastic=*/true));
  SyncedState out;
  out.from_checkpoint = true;
  const config::ParallelConfig& par = cfg.parallel();
  if (par.experts_per_worker_size() == G && G > 1) {
    // The configured placement, for groups of the size it was written for.
    out.counts.assign(par.experts_per_worker().begin(), par.experts_per_worker().end());
    return out;
  }
  // Contiguous ranges over a group, balanced by rank 0's measured loads (equal loads when rank 0
  // has none, e.g. it just joined); nothing is held, so nothing counts as staying put.
  const int64_t E = cfg.model().moe().num_experts();
  std::vector<double> load(E, 0.0);
  if (host_->rank() == 0 && static_cast<int64_t>(expert_load_.size()) == E) {
    load = expert_load_;
  }
  if (W > 1)
    RETURN_IF_ERROR(host_->world()->Broadcast(load.data(), load.size() * sizeof(double), 0));
  out.counts = scheduler::ReplanRanges(std::vector<int>(E, -1), load, G).counts;
  return out;
}

}  // namespace strata::train
