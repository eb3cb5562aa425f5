// Trainer across membership generations: what every step keeps so that a later generation can go
// on without a worker (or with more), and how the workers of a new generation agree on a state
// and move it to where it now lives.
//
// Versions. A worker's state (dense parameters, its experts, their Adam moments) after step s is
// version s. A job with one expert-parallel group keeps (KeepsCopies):
//   - live: the model (IN_MEMORY) or the store (TIERED), version live_version_;
//   - IN_MEMORY, every step: rollback_, this worker's state from before the step's update (version
//     live - 1), because a failure can cut a step short after some workers applied its update and
//     before others did; buddies_, the experts of the `elastic.replicas` previous ranks after
//     their latest two updates (two, for the same reason), refreshed by one all-to-all after every
//     update;
//   - TIERED, every elastic.replica_every steps (RefreshStoredCopies, at the start of the update,
//     so the expert update keeps running behind the next forward): the state from before the
//     update — the dense part in memory (rollback_, and rollback_older_ of the refresh before),
//     this worker's experts and the buddy copies of the previous `elastic.replicas` ranks' experts
//     on its CopyShelf (storage/copy_shelf.h: its own SSD folder, outside the store's budgets),
//     two versions of each, moved in bounded rounds like a re-form's. A failure then goes back at
//     most replica_every steps (the coordinator allows it: config::CopiesLagSteps).
// With several expert-parallel groups every group holds a copy of every expert: those copies are
// what a generation goes on from, without rollback or buddy copies.
// A new generation all-gathers which versions of which state every worker holds, takes the newest
// step s0 whose whole state (the dense part and every expert) is held somewhere, re-places the
// experts in contiguous ranges over a group of its group size (GroupSize), balanced by measured
// load with as few moves as possible (scheduler/replan.h), and gives each group a copy of each
// expert's blob from the lowest rank holding it at s0 (a worker that already holds it keeps it).
// Workers lacking the dense state at s0 get it by broadcast. Training goes on from s0: a step cut
// short is redone, with the same samples. Those phases are train/state_sync.h; SyncState says
// what this worker holds and reads its copies for them. A TIERED worker keeps its store and its
// checkpoint shard (whose SSD tier the store shares) across the re-form; each expert that changes
// owner moves from store (or shelf) to store in bounded rounds, and an owner whose store is past
// s0 restores from its shelf (MoveStoredExperts). When the state cannot be put together — and
// always for experts_per_worker — the generation goes back to the newest checkpoint: it places the
// experts for its own worker count (PlanFromCheckpoint) and every worker reads its own share from
// the shards that hold it (GoBackToCheckpoint), or all start over from step 0 when none is
// committed; a TIERED worker's store then goes, and its shard is opened again for a store the
// checkpoint fills.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/logging.h"
#include "scheduler/replan.h"
#include "train/state_sync.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

// The tensors of an expert's blob, per MoE layer: the weights and both Adam moments.
constexpr storage::TensorKind kBlobKinds[] = {
    storage::TensorKind::kWeights, storage::TensorKind::kAdamM, storage::TensorKind::kAdamV};

// Rounds of whole tensors of `tensor_floats`, one or as many as fit in 4 MiB, out of and into each
// worker (a piece of a tensor costs a whole one's trip through a host slot).
int64_t ChunkOfTensors(int64_t tensor_floats) {
  return tensor_floats * std::max<int64_t>(1, (int64_t{1} << 20) / tensor_floats);
}

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

void Trainer::AbortCollectives(const std::string& why, int64_t newer_generation) {
  absl::MutexLock lock(&comm_mu_);
  if (newer_generation <= comm_generation_) return;  // late: that generation is this one
  aborted_why_ = why;
  // A committer waiting for the reports of a worker that is gone would wait past the re-form.
  if (checkpoint_abandoned_) *checkpoint_abandoned_ = true;
  for (comm::Communicator* c : {world_comm_.get(), ep_comm_.get(), replica_comm_.get()}) {
    if (c != nullptr) c->Abort(why);
  }
}

bool Trainer::MovesLiveState() const {
  return options_.config.parallel().experts_per_worker_size() == 0;
}

bool Trainer::KeepsCopies() const {
  // With one expert-parallel group, an IN_MEMORY worker keeps at least its rollback copy; a TIERED
  // one keeps its copies with its buddy copies, on its SSD. With several, each expert's copies in
  // the other groups are what a generation goes on from.
  return MovesLiveState() && options_.config.parallel().expert_parallel() == 0 &&
         (options_.config.storage().mode() == config::StorageConfig::IN_MEMORY ||
          options_.config.elastic().replicas() > 0);
}

Status Trainer::CheckElastic() const {
  const config::JobConfig& cfg = options_.config;
  if (KeepsCopies()) return absl::OkStatus();
  // Every other layout re-forms from the newest checkpoint, so there must be checkpoints.
  if (cfg.checkpoint().dir().empty() || cfg.checkpoint().every() <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "an elastic job with %s goes back to its newest checkpoint when its workers' copies "
        "cannot make up its state; set checkpoint.dir and checkpoint.every (or train with "
        "parallel.expert_parallel: 0, no parallel.experts_per_worker and elastic.replicas of 1 "
        "or more, which keeps buddy copies)",
        cfg.parallel().expert_parallel() != 0
            ? absl::StrFormat("parallel.expert_parallel: %d", cfg.parallel().expert_parallel())
        : cfg.parallel().experts_per_worker_size() > 0
            ? std::string("parallel.experts_per_worker")
            : std::string("storage.mode: TIERED and elastic.replicas: 0")));
  }
  return absl::OkStatus();
}

StatusOr<int> Trainer::GroupSize(int workers) const {
  const config::ParallelConfig& par = options_.config.parallel();
  const int want = par.expert_parallel();
  if (want == 0 || want >= workers) return workers;
  if (workers % want == 0) return want;
  if (!options_.worker.elastic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parallel.expert_parallel = %d does not divide the %d workers; choose a divisor of %d "
        "(or 0 for all workers)",
        want, workers, workers));
  }
  // An elastic generation whose count the configured groups do not divide takes the smallest
  // larger groups that do: no worker holds more experts than the configured layout gives it.
  int g = want + 1;
  while (workers % g != 0) ++g;
  return g;
}

size_t Trainer::DenseBlobFloats() const {
  const model::MoeTransformer& m = *model_;
  return 3 * static_cast<size_t>(model::CountScalars(m.DenseParameters()));
}

size_t Trainer::ExpertBlobFloats() const {
  const model::MoeTransformer& m = *model_;
  size_t n = 0;
  for (const auto& ref : m.moe_layers()) {
    if (ref.layer->num_local_experts() == 0) return 0;
    n += 3 * static_cast<size_t>(model::CountScalars(
                 ref.layer->expert(ref.layer->first_local_expert()).Parameters()));
  }
  return n;
}

namespace {

// value, first moment, second moment of each parameter, in order; `write` copies the other way.
void CopyParams(const std::vector<model::Parameter*>& ps, const model::AdamW& opt,
                const std::map<const model::Parameter*, size_t>& index, float* blob, bool write) {
  for (model::Parameter* p : ps) {
    const size_t n = static_cast<size_t>(p->value.numel());
    const size_t i = index.at(p);
    for (float* t : {p->value.f32(), opt.first_moment(i).f32(), opt.second_moment(i).f32()}) {
      if (write) {
        std::memcpy(t, blob, n * sizeof(float));
      } else {
        std::memcpy(blob, t, n * sizeof(float));
      }
      blob += n;
    }
  }
}

std::map<const model::Parameter*, size_t> IndexOf(const model::AdamW& opt) {
  std::map<const model::Parameter*, size_t> index;
  for (size_t i = 0; i < opt.params().size(); ++i) index[opt.params()[i]] = i;
  return index;
}

// An expert's blob from (write: into) a model and its optimizer.
void CopyExpert(model::MoeTransformer& model, const model::AdamW& opt, int64_t e, float* blob,
                bool write) {
  const auto index = IndexOf(opt);
  for (const auto& ref : model.moe_layers()) {
    std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
    CopyParams(ps, opt, index, blob, write);
    for (const model::Parameter* p : ps) blob += 3 * static_cast<size_t>(p->value.numel());
  }
}

}  // namespace

void Trainer::ReadDense(float* out) const {
  CopyParams(model_->DenseParameters(), *optimizer_, IndexOf(*optimizer_), out, false);
}

void Trainer::ReadExpert(int64_t e, float* out) const {
  CopyExpert(*model_, *optimizer_, e, out, false);
}

void Trainer::TakeRollbackCopy() {
  TraceScope span(ctx_.tracer, "rollback copy", "copy");
  const size_t S = ExpertBlobFloats();
  rollback_.version = step_;
  rollback_.first = first_expert_;
  rollback_.count = num_experts_;
  rollback_.dense.resize(DenseBlobFloats());
  ReadDense(rollback_.dense.data());
  rollback_.experts.resize(S * static_cast<size_t>(num_experts_));
  for (int64_t i = 0; i < num_experts_; ++i)
    ReadExpert(first_expert_ + i, &rollback_.experts[i * S]);
}

Status Trainer::RefreshBuddies() {
  const int W = options_.worker.world_size, rank = options_.worker.rank;
  const int R = std::min(options_.config.elastic().replicas(), W - 1);
  buddies_.resize(R);
  if (R == 0) return absl::OkStatus();
  const size_t S = ExpertBlobFloats();
  std::vector<int64_t> firsts(W + 1, 0);
  for (int w = 0; w < W; ++w) firsts[w + 1] = firsts[w] + experts_per_worker_[w];
  // This worker's experts go to ranks rank+1 .. rank+R; the blobs of ranks rank-1 .. rank-R come
  // back (R < W, so those are distinct).
  std::vector<float> mine(S * static_cast<size_t>(num_experts_));
  for (int64_t i = 0; i < num_experts_; ++i) ReadExpert(first_expert_ + i, &mine[i * S]);
  std::vector<int64_t> send_counts(W, 0), recv_counts(W, 0);
  for (int j = 1; j <= R; ++j) {
    send_counts[(rank + j) % W] = static_cast<int64_t>(mine.size());
    recv_counts[(rank - j + W) % W] = experts_per_worker_[(rank - j + W) % W] * S;
  }
  std::vector<float> send, recv;
  for (int d = 0; d < W; ++d) {
    if (send_counts[d] > 0) send.insert(send.end(), mine.begin(), mine.end());
  }
  int64_t total = 0;
  for (int64_t c : recv_counts) total += c;
  recv.resize(total);
  Status s = world_comm_->AllToAllV(send.data(), send_counts, recv.data(), recv_counts);
  if (!s.ok()) {
    return Status(s.code(),
                  absl::StrFormat("step %d: refreshing buddy copies: %s", step_ + 1, s.message()));
  }
  int64_t at = 0;
  for (int src = 0; src < W; ++src) {
    if (recv_counts[src] == 0) continue;
    const int j = (rank - src + W) % W;  // src = rank - j
    Buddy& b = buddies_[j - 1];
    std::swap(b.prev, b.cur);
    b.cur.version = live_version_;
    b.cur.first = firsts[src];
    b.cur.count = experts_per_worker_[src];
    b.cur.experts.assign(recv.begin() + at, recv.begin() + at + recv_counts[src]);
    at += recv_counts[src];
  }
  return absl::OkStatus();
}

Status Trainer::EnsureShelf() {
  if (shelf_) return absl::OkStatus();
  const config::StorageConfig& st = options_.config.storage();
  storage::CopyShelf::Options so;
  if (!st.ssd_dir().empty()) {
    so.parent_dir = st.ssd_dir();
    std::error_code ec;
    std::filesystem::create_directories(so.parent_dir, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrFormat(
          "cannot create storage.ssd_dir '%s' for the buddy copies: %s; point it at a writable "
          "folder",
          so.parent_dir, ec.message()));
    }
  } else {
    const char* base = std::getenv("TMPDIR");
    so.parent_dir = base && *base ? base : "/tmp";
  }
  so.piece_bytes = scheduler_->expert_floats() * sizeof(float);
  so.pieces = 3 * scheduler_->moe_layers();
  ASSIGN_OR_RETURN(shelf_, storage::CopyShelf::Create(so));
  STRATA_LOG(INFO) << "worker " << options_.worker.rank << " of " << options_.worker.world_size
                   << ": buddy copies in " << shelf_->dir()
                   << (st.ssd_dir().empty() ? " (set storage.ssd_dir to keep them elsewhere)" : "");
  return absl::OkStatus();
}

Status Trainer::RefreshStoredCopiesIfDue() {
  const int64_t every = std::max(1, options_.config.elastic().replica_every());
  if (copied_version_ >= 0 && step_ - copied_version_ < every) return absl::OkStatus();
  return RefreshStoredCopies();
}

Status Trainer::RefreshStoredCopies() {
  TraceScope span(ctx_.tracer, "buddy copies", "copy");
  const int W = options_.worker.world_size, rank = options_.worker.rank;
  const int64_t v = step_;
  auto failed = [&](const Status& s) {
    return Status(s.code(), absl::StrFormat("step %d: copying the state of step %d for the buddy "
                                            "copies: %s",
                                            step_ + 1, v, s.message()));
  };
  // A worker alone has nobody to go on without it: its live state is all a joiner needs.
  const int R = std::min(options_.config.elastic().replicas(), W - 1);
  if (R < 1) return absl::OkStatus();
  const int64_t E = options_.config.model().moe().num_experts();
  const int64_t F = static_cast<int64_t>(scheduler_->expert_floats());
  std::vector<int> holder(E, -1);
  // This worker's own copies, out of its store (nobody starts the rounds while another worker
  // cannot take part in them).
  Status ready = [&]() -> Status {
    if (static_cast<int>(experts_per_worker_.size()) != W) {
      return absl::InternalError(absl::StrFormat("the placement has %d ranges for %d workers",
                                                 experts_per_worker_.size(), W));
    }
    for (int w = 0, e = 0; w < W; ++w) {
      for (int64_t k = 0; k < experts_per_worker_[w] && e < E; ++k) holder[e++] = w;
    }
    // The copies are of the state the store holds once the update in flight is done.
    RETURN_IF_ERROR(scheduler_->FinishExpertStep());
    RETURN_IF_ERROR(EnsureShelf());
    // Dense: in memory, the latest two refreshes.
    std::swap(rollback_older_, rollback_);
    rollback_.version = v;
    rollback_.dense.resize(DenseBlobFloats());
    ReadDense(rollback_.dense.data());
    // This worker's experts: out of the store into its shelf, whole tensors at a time (each expert
    // keeps its copy of the refresh before, for a refresh cut short).
    return CopyOwnExperts(v);
  }();
  if (W > 1) ready = AllWorkersOk(ready, "another worker could not copy its experts");
  if (!ready.ok()) return failed(ready);
  // Copies of experts this worker neither holds nor is a buddy of (of an earlier placement) go
  // once this generation has made its own: a refresh of it before this one, which every worker
  // finished before the step that followed it.
  for (int64_t e = 0; copied_version_ >= 0 && e < E; ++e) {
    const int j = (rank - holder[e] + W) % W;  // this worker is holder + j
    if (j > R) shelf_->KeepNewest(e, 0);
  }
  // Buddy copies: the experts of ranks rank-1 .. rank-R come from their shelves into this one,
  // one buddy distance at a time, in bounded rounds (the moves of a re-form, with every expert's
  // "owner" its holder's buddy).
  const int pieces = shelf_->pieces();
  const int64_t blob = F * pieces;
  const ReadChunk read = [&](size_t item, int64_t offset, int64_t n, float* dst) -> Status {
    return ShelfPieces(v, static_cast<int64_t>(item) - 1, offset, n, dst, nullptr);
  };
  const WriteChunk write = [&](size_t item, int64_t offset, int64_t n, const float* src) -> Status {
    return ShelfPieces(v, static_cast<int64_t>(item) - 1, offset, n, nullptr, src);
  };
  for (int j = 1; j <= R; ++j) {
    CopySources sources;
    sources.expert = holder;
    std::vector<int> buddy(E);
    for (int64_t e = 0; e < E; ++e) {
      buddy[e] = (holder[e] + j) % W;
      if (buddy[e] == rank) shelf_->KeepNewest(e, 1);
    }
    StatusOr<int64_t> moved = MoveExpertsInChunks(world_comm_.get(), buddy, sources, blob,
                                                  ChunkOfTensors(F), read, write);
    if (!moved.ok()) return failed(moved.status());
  }
  copied_version_ = v;
  return absl::OkStatus();
}

Status Trainer::ShelfPieces(int64_t version, int64_t e, int64_t offset, int64_t n, float* read,
                            const float* write) {
  const int64_t F = static_cast<int64_t>(shelf_ ? shelf_->piece_bytes() / sizeof(float) : 0);
  // Rounds carry whole tensors (ChunkOfTensors), so a piece of a blob is whole pieces of the
  // shelf's.
  if (F == 0 || offset % F != 0 || n % F != 0) {
    return absl::InternalError(
        absl::StrFormat("floats [%d, %d) of expert %d's copy are not whole tensors of %d floats",
                        offset, offset + n, e, F));
  }
  const int first = static_cast<int>(offset / F), count = static_cast<int>(n / F);
  if (read != nullptr) return shelf_->Read(version, e, first, count, read);
  return shelf_->Write(version, e, first, count, write);
}

Status Trainer::CopyOwnExperts(int64_t version) {
  const int64_t F = static_cast<int64_t>(scheduler_->expert_floats());
  const int pieces = shelf_->pieces();
  // A few tensors at a time: read out of the store (the next ones brought to the host behind
  // them) and written to the shelf together.
  // At most half the host slots in flight, so that the prefetches do not evict each other.
  const int slots = scheduler_->store().host_slots();
  const int batch = static_cast<int>(std::min<int64_t>(
      {pieces, ChunkOfTensors(F) / F, slots < 0 ? pieces : std::max(1, slots / 2)}));
  std::vector<float> buf(static_cast<size_t>(batch) * F);
  auto key = [&](int64_t i, int p) {
    return scheduler_->Key(p / 3, static_cast<int>(i), kBlobKinds[p % 3]);
  };
  for (int64_t i = 0; i < num_experts_; ++i) {
    const int64_t e = first_expert_ + i;
    shelf_->KeepNewest(e, 1);
    for (int p0 = 0; p0 < pieces; p0 += batch) {
      const int m = std::min(batch, pieces - p0);
      // The next batch (of this expert or the next) is fetched while this one is copied.
      std::vector<storage::TensorKey> next;
      for (int k = 0; k < m; ++k) {
        const int p = p0 + batch + k;
        if (p < pieces) {
          next.push_back(key(i, p));
        } else if (i + 1 < num_experts_ && p - pieces < pieces) {
          next.push_back(key(i + 1, p - pieces));
        }
      }
      scheduler_->store().PrefetchHost(next);
      for (int k = 0; k < m; ++k) {
        const int p = p0 + k;
        RETURN_IF_ERROR(scheduler_->ReadExpertRange(p / 3, static_cast<int>(i), kBlobKinds[p % 3],
                                                    0, F, &buf[static_cast<size_t>(k) * F]));
      }
      RETURN_IF_ERROR(shelf_->Write(version, e, p0, m, buf.data()));
    }
  }
  return absl::OkStatus();
}

Holdings Trainer::HoldingsOfThisWorker() const {
  Holdings mine(1, options_.config.model().moe().num_experts());
  // A worker that just joined holds nothing.
  if (model_ != nullptr) {
    mine.SetBlobFloats(0, static_cast<int64_t>(DenseBlobFloats()),
                       static_cast<int64_t>(ExpertBlobFloats()));
    if (rollback_.version >= 0) {
      mine.Set(0, kDenseItem, HoldingSlot::kRollback, rollback_.version);
    }
  }
  if (model_) {
    mine.Set(0, kDenseItem, HoldingSlot::kLive, live_version_);
    // A TIERED worker's experts are its store's, whole unless the last update failed (and gone
    // with it when a re-form failed after handing it on).
    const bool tiered = options_.config.storage().mode() == config::StorageConfig::TIERED;
    if (!tiered || (scheduler_ != nullptr && store_whole_)) {
      mine.SetExperts(0, first_expert_, num_experts_, HoldingSlot::kLive, live_version_);
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
  for (int64_t e = 0; shelf_ && e < options_.config.model().moe().num_experts(); ++e) {
    const bool own = model_ && e >= first_expert_ && e < first_expert_ + num_experts_;
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

void Trainer::ReadHeldItem(size_t i, int64_t step, const Holdings& all, float* dst) const {
  const int64_t e = static_cast<int64_t>(i) - 1;
  if (model_ && live_version_ == step &&
      (i == kDenseItem || (e >= first_expert_ && e < first_expert_ + num_experts_))) {
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

StatusOr<Trainer::SyncedState> Trainer::SyncState() {
  const config::JobConfig& cfg = options_.config;
  const int W = options_.worker.world_size, rank = options_.worker.rank;
  // A job goes on from the state its workers hold (with one expert-parallel group: IN_MEMORY with
  // rollback and buddy copies, TIERED with its stores and copies; with several, each expert's
  // copies in the other groups); experts_per_worker goes back to its newest checkpoint
  // (CheckElastic made sure there is a checkpoint folder).
  if (!MovesLiveState()) return PlanFromCheckpoint();
  comm::Communicator* comm = W > 1 ? world_comm_.get() : nullptr;
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
  ASSIGN_OR_RETURN(const int G, GroupSize(W));
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
        W, s0, model_ ? live_version_ : -1, Ranges(plan.counts), moved, plan.planner_moved,
        from_copies);
  }
  return out;
}

StatusOr<std::unique_ptr<storage::TieredExpertStore>> Trainer::MoveStoredExperts(
    comm::Communicator* comm, int64_t step, const std::vector<std::vector<int>>& owners,
    const std::vector<CopySources>& sources, int64_t blob_floats, int64_t* moved) {
  const config::JobConfig& cfg = options_.config;
  const int64_t E = cfg.model().moe().num_experts();
  // This worker's copy of an expert at the step is in its store when the store holds the live
  // state of that step, else on its shelf (a rollback or buddy copy).
  const bool live_at_step = scheduler_ != nullptr && store_whole_ && live_version_ == step;
  auto in_store = [&, first = first_expert_, count = num_experts_](int64_t e) {
    return live_at_step && e >= first && e < first + count;
  };
  // This worker's store (a joiner has none yet) goes, for the moves, to a scheduler over a model
  // that holds every expert unbound: any expert can then be read (a never-written one from its
  // initial value) and written. The model's own dense parameters are a second copy of the dense
  // state for the duration.
  std::unique_ptr<storage::TieredExpertStore> store;
  if (scheduler_) {
    if (model_) model_->AttachResidency(nullptr);
    experts_.reset();
    store = scheduler_->ReleaseStore();
    scheduler_.reset();
  }
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.seed = cfg.seed();
  mo.max_batch = 1;
  mo.expert_factory = options_.expert_factory;
  mo.unbound_experts = true;
  mo.first_local_expert = 0;
  mo.num_local_experts = E;
  mo.device = device_;
  std::unique_ptr<model::MoeTransformer> every;
  std::unique_ptr<scheduler::TieredExpertScheduler> mover;
  Status ready = [&]() -> Status {
    ASSIGN_OR_RETURN(every, model::MoeTransformer::Create(ctx_, mo));
    RETURN_IF_ERROR(EnsureBudgets(*every));
    ASSIGN_OR_RETURN(const scheduler::TieredOptions to, TieredOptionsOf());
    const bool fresh = store == nullptr;
    ASSIGN_OR_RETURN(mover, scheduler::TieredExpertScheduler::Create(*every, to, std::move(store)));
    // A store made here may sit beside checkpoints of this worker's shard (an id it had before).
    if (fresh && checkpoints_) checkpoints_->AdoptStore(mover.get());
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
        restore |= owners[g][e] == options_.worker.rank && sources[g].expert[e] == owners[g][e];
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
    RETURN_IF_ERROR(AllWorkersOk(ready,
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

Status Trainer::ImportState(const SyncedState& s) {
  // A TIERED worker's experts are in the store it adopted already.
  const size_t S = scheduler_ ? 0 : ExpertBlobFloats();
  if (s.dense.size() != DenseBlobFloats() || s.experts.size() != S * num_experts_) {
    return absl::InternalError(absl::StrFormat(
        "state handed over for a different model: %d dense and %d expert floats, this model needs "
        "%d and %d",
        s.dense.size(), s.experts.size(), DenseBlobFloats(), S * num_experts_));
  }
  const auto index = IndexOf(*optimizer_);
  CopyParams(model_->DenseParameters(), *optimizer_, index, const_cast<float*>(s.dense.data()),
             true);
  for (int64_t i = 0; S > 0 && i < num_experts_; ++i) {
    CopyExpert(*model_, *optimizer_, first_expert_ + i, const_cast<float*>(&s.experts[i * S]),
               true);
  }
  optimizer_->set_steps(s.step);
  step_ = s.step;
  return absl::OkStatus();
}

Status Trainer::StartFrom(const SyncedState& s) {
  if (s.from_checkpoint) {
    RETURN_IF_ERROR(GoBackToCheckpoint());
  } else {
    RETURN_IF_ERROR(ImportState(s));
  }
  live_version_ = step_;
  buddies_.clear();
  // A TIERED worker's copies of steps up to the one the generation starts from — its experts' and
  // its dense state's — are the job's history, whatever the placement was: they stay until the
  // generation's own copies are whole everywhere (the second refresh of the generation drops what
  // it no longer needs), so a failure during the first one still finds a whole state. Later ones
  // were of a trajectory the generation replaces. An IN_MEMORY worker's rollback copy was of its
  // old range.
  if (shelf_) {
    for (int64_t e = 0; e < options_.config.model().moe().num_experts(); ++e) {
      shelf_->DropNewerThan(e, step_);
    }
  }
  if (scheduler_ == nullptr || rollback_.version > step_) rollback_ = Copy();
  if (rollback_older_.version > step_) rollback_older_ = Copy();
  copied_version_ = -1;
  while (!history_.empty() && history_.back().step > step_) history_.pop_back();
  // The new generation is protected from its first step on.
  if (!KeepsCopies()) return absl::OkStatus();
  return scheduler_ ? RefreshStoredCopies() : RefreshBuddies();
}

void Trainer::ResetParallel(int64_t generation) {
  if (model_) model_->AttachParallel(nullptr, nullptr, nullptr);
  // The seams built over this generation's reducers go with them; BuildModel makes new ones.
  gradients_.reset();
  keeping_.reset();
  exchange_.reset();
  data_parallel_.reset();
  absl::MutexLock lock(&comm_mu_);
  aborted_why_.reset();
  comm_generation_ = generation;
  replica_comm_.reset();
  ep_comm_.reset();
  world_comm_.reset();
}

void Trainer::AdoptCommunicator(std::unique_ptr<comm::Communicator> c,
                                std::unique_ptr<comm::Communicator>* slot) {
  absl::MutexLock lock(&comm_mu_);
  // A newer generation that formed while this one connected aborts what is connected already;
  // a communicator that connects after that abort is born aborted.
  if (aborted_why_) c->Abort(*aborted_why_);
  *slot = std::move(c);
}

Status Trainer::Reform(const WorkerOptions& w) {
  RETURN_IF_ERROR(CheckElastic());
  // The previous generation's communicators are finished (aborted or failed); their threads stop.
  AbortCollectives("a new generation forms");
  // A TIERED worker whose last re-form failed after handing its store on has none left.
  const bool tiered = scheduler_ != nullptr;
  if (tiered) {
    // A TIERED worker's store shares its checkpoint shard's SSD tier, so the shard stays open
    // (ContinueCheckpoints). The old generation's checkpoint in flight ends first: its writer
    // reads the scheduler that is about to hand its store on. The expert update in flight needs
    // no collective; once it is done the store holds the state of live_version_ — unless it
    // failed, and then no whole state.
    if (checkpoints_) {
      checkpoints_->Abandon();
      if (Status c = checkpoints_->Wait(); !c.ok()) {
        STRATA_LOG(WARNING) << "the checkpoint in flight when generation " << w.generation
                            << " formed is given up: " << c.message();
      }
    }
    store_whole_ = store_whole_ && scheduler_->FinishExpertStep().ok();
  } else {
    // Each worker writes the shard of its rank, which may change: the shards are opened again once
    // every worker has let go of its old one (a checkpoint being written is abandoned: the new
    // generation saves again at its own schedule).
    checkpoints_.reset();
  }
  ResetParallel(w.generation);
  options_.worker = w;
  options_.worker.rejoin = true;
  if (distributed()) RETURN_IF_ERROR(SetUpWorkers());
  RETURN_IF_ERROR(OpenCheckpointsOfGeneration());
  // A TIERED worker whose store was handed on and then lost (a move or the new model failed)
  // lets go of its shard too: its manager's references were the store's.
  auto lost_store = [&](Status s) {
    if (tiered && scheduler_ == nullptr) checkpoints_.reset();
    return s;
  };
  StatusOr<SyncedState> synced = SyncState();
  if (!synced.ok()) return lost_store(synced.status());
  SyncedState& s = *synced;
  if (s.from_checkpoint) RETURN_IF_ERROR(ReopenForCheckpoint());
  std::tie(first_sequence_, local_batch_) =
      BatchShare(options_.config.train().global_batch(), w.world_size, w.rank);
  if (Status a = AdoptState(s); !a.ok()) return lost_store(a);
  // A checkpoint whose commit the previous generation never got to report (its step was cut
  // short) may be the one this generation went back to: the coordinator hears of it before the
  // generation says where it starts (again, if a report to the previous generation was refused).
  reported_checkpoint_ = 0;
  ReportCommittedCheckpoint();
  return absl::OkStatus();
}

Status Trainer::OpenCheckpointsOfGeneration() {
  // The lowest surviving rank becomes rank 0, the committer (the folder's lock went with the
  // process that held it, or the previous committer gives it up).
  if (distributed()) return OpenWorkerCheckpoints(/*continuing=*/true);
  if (checkpoints_) return ContinueCheckpoints();
  if (options_.config.checkpoint().dir().empty()) return absl::OkStatus();
  return OpenCheckpoints(/*continuing=*/true);
}

Status Trainer::ReopenForCheckpoint() {
  if (options_.config.storage().mode() != config::StorageConfig::TIERED) return absl::OkStatus();
  // The shard's space that no checkpoint lists (the live store's) is free again once it is opened
  // afresh; the store goes first.
  if (model_ && scheduler_) model_->AttachResidency(nullptr);
  experts_.reset();
  scheduler_.reset();
  checkpoints_.reset();
  if (distributed()) RETURN_IF_ERROR(world_comm_->Barrier());
  return OpenCheckpointsOfGeneration();
}

Status Trainer::ContinueCheckpoints() {
  std::shared_ptr<std::atomic<bool>> abandoned;
  {
    // A newer generation may have aborted this one's collectives already.
    absl::MutexLock lock(&comm_mu_);
    abandoned = std::make_shared<std::atomic<bool>>(aborted_why_.has_value());
    checkpoint_abandoned_ = abandoned;
  }
  return checkpoints_->Continue(options_.worker.generation, options_.worker.rank == 0, abandoned,
                                scheduler_.get());
}

Status Trainer::AdoptState(SyncedState& s) {
  // Until the state is in, this worker holds none (a failure below leaves it holding nothing).
  live_version_ = -1;
  store_whole_ = false;
  experts_per_worker_ = s.counts;
  ASSIGN_OR_RETURN(scheduler::ExpertPlacement placement,
                   scheduler::ExpertPlacement::FromCounts(experts_per_worker_));
  const int rank = options_.worker.rank, G = static_cast<int>(s.counts.size());
  expert_replica_leader_ = rank < G;
  // The seams point into what goes next; BuildModel chooses new ones.
  gradients_.reset();
  keeping_.reset();
  optimizer_.reset();
  dense_slices_.reset();
  if (model_) model_->AttachParallel(nullptr, nullptr, nullptr);
  if (model_ && scheduler_) model_->AttachResidency(nullptr);
  experts_.reset();
  scheduler_.reset();
  exchange_.reset();
  data_parallel_.reset();
  model_.reset();
  RETURN_IF_ERROR(BuildModel(placement.first(rank % G), placement.count(rank % G)));
  RETURN_IF_ERROR(SetUpExpertState(std::move(s.store)));
  return StartFrom(s);
}

StatusOr<Trainer::SyncedState> Trainer::PlanFromCheckpoint() {
  const config::JobConfig& cfg = options_.config;
  const int W = options_.worker.world_size;
  ASSIGN_OR_RETURN(const int G, GroupSize(W));
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
  if (options_.worker.rank == 0 && static_cast<int64_t>(expert_load_.size()) == E) {
    load = expert_load_;
  }
  if (W > 1) RETURN_IF_ERROR(world_comm_->Broadcast(load.data(), load.size() * sizeof(double), 0));
  out.counts = scheduler::ReplanRanges(std::vector<int>(E, -1), load, G).counts;
  return out;
}

Status Trainer::GoBackToCheckpoint() {
  // Every worker decides alike: all resume, or all start over (no checkpoint committed yet).
  const std::string& dir = options_.config.checkpoint().dir();
  RETURN_IF_ERROR(checkpoints_->Wait());  // a checkpoint being written counts once committed
  double empty = checkpoints_->Steps().empty() ? 1.0 : 0.0;
  if (distributed()) RETURN_IF_ERROR(world_comm_->AllReduce(&empty, 1));
  if (empty == options_.worker.world_size) {
    // No checkpoint yet: the job goes back to its beginning, which every run shares — the model
    // as the seed initialises it (just built), with fresh optimizer state.
    if (options_.worker.rank == 0) {
      STRATA_LOG(WARNING) << "no checkpoint is committed in " << dir
                          << " yet; the job goes back to step 0";
    }
    step_ = 0;
    return absl::OkStatus();
  }
  if (empty > 0) {
    return absl::InternalError(absl::StrFormat(
        "the workers of generation %d do not see the same checkpoints in %s (%d see none)",
        options_.worker.generation, dir, static_cast<int>(empty)));
  }
  if (distributed()) return ResumeDistributed();
  ASSIGN_OR_RETURN(
      step_, checkpoints_->Resume(options_.config, *model_, *optimizer_, scheduler_.get(), ctx_));
  return absl::OkStatus();
}

Status Trainer::ResumeDistributed() {
  // Every worker reads what it holds from the shards that have it; all take the newest
  // checkpoint that every worker found intact.
  checkpoint::ResumeAgreement agree = [this](bool ok_here) -> StatusOr<bool> {
    double ok = ok_here ? 1.0 : 0.0;
    RETURN_IF_ERROR(world_comm_->AllReduce(&ok, 1));
    return ok == options_.worker.world_size;
  };
  ASSIGN_OR_RETURN(step_, checkpoints_->Resume(options_.config, *model_, *optimizer_,
                                               scheduler_.get(), ctx_, agree));
  resumed_from_ = step_;
  return absl::OkStatus();
}

// The elastic worker's StepKeeping: the rollback copy before the update; the expert loads and
// the buddy copies after it.
Trainer::ElasticKeeping::ElasticKeeping(Trainer& trainer, bool copies)
    : t_(trainer), copies_(copies) {}

Status Trainer::ElasticKeeping::BeforeUpdate() {
  if (!copies_) return absl::OkStatus();
  // A TIERED worker's copies are of the state before the update, on its SSD, every
  // elastic.replica_every steps; an IN_MEMORY worker's rollback copy is taken every step.
  if (t_.scheduler_ != nullptr) return t_.RefreshStoredCopiesIfDue();
  t_.TakeRollbackCopy();
  return absl::OkStatus();
}

Status Trainer::ElasticKeeping::AfterUpdate(const std::vector<model::MoeStats>& moe) {
  // Loads steer the placement of the next generation; every worker sees the batch-wide counts.
  const int64_t E = t_.options_.config.model().moe().num_experts();
  t_.expert_load_.resize(E, 0.0);
  for (double& l : t_.expert_load_) l *= 0.9;
  for (const model::MoeStats& m : moe) {
    for (int64_t e = 0; e < E && e < static_cast<int64_t>(m.load.size()); ++e) {
      t_.expert_load_[e] += static_cast<double>(m.load[e]);
    }
  }
  if (!copies_ || t_.scheduler_ != nullptr) return absl::OkStatus();
  TraceScope span(t_.ctx_.tracer, "buddy copies", "comm");
  return t_.RefreshBuddies();
}

}  // namespace strata::train
