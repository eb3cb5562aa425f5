// ElasticState's copies (elastic_state.h): the rollback copy, the buddy copies of an IN_MEMORY
// worker, and a TIERED worker's copies on its shelf.
#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_format.h"
#include "core/common/logging.h"
#include "core/common/trace.h"
#include "train/elastic/blob_layout.h"
#include "train/elastic/elastic_state.h"
#include "train/worker_comms.h"

namespace strata::train {

using elastic_internal::ChunkOfTensors;
using elastic_internal::kBlobKinds;

void ElasticState::TakeRollbackCopy() {
  TraceScope span(host_->context().tracer, "rollback copy", "copy");
  const size_t S = ExpertBlobFloats();
  rollback_.version = host_->step();
  rollback_.first = host_->first_expert();
  rollback_.count = host_->num_experts();
  rollback_.dense.resize(DenseBlobFloats());
  ReadDense(rollback_.dense.data());
  rollback_.experts.resize(S * static_cast<size_t>(rollback_.count));
  for (int64_t i = 0; i < rollback_.count; ++i) {
    ReadExpert(rollback_.first + i, &rollback_.experts[i * S]);
  }
}

Status ElasticState::RefreshBuddies() {
  const int W = host_->world_size(), rank = host_->rank();
  const std::vector<int64_t>& counts = host_->experts_per_worker();
  const int64_t first = host_->first_expert(), count = host_->num_experts();
  const int R = std::min(config_.elastic().replicas(), W - 1);
  buddies_.resize(R);
  if (R == 0) return absl::OkStatus();
  const size_t S = ExpertBlobFloats();
  std::vector<int64_t> firsts(W + 1, 0);
  for (int w = 0; w < W; ++w) firsts[w + 1] = firsts[w] + counts[w];
  // This worker's experts go to ranks rank+1 .. rank+R; the blobs of ranks rank-1 .. rank-R come
  // back (R < W, so those are distinct).
  std::vector<float> mine(S * static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ReadExpert(first + i, &mine[i * S]);
  std::vector<int64_t> send_counts(W, 0), recv_counts(W, 0);
  for (int j = 1; j <= R; ++j) {
    send_counts[(rank + j) % W] = static_cast<int64_t>(mine.size());
    recv_counts[(rank - j + W) % W] = counts[(rank - j + W) % W] * S;
  }
  std::vector<float> send, recv;
  for (int d = 0; d < W; ++d) {
    if (send_counts[d] > 0) send.insert(send.end(), mine.begin(), mine.end());
  }
  int64_t total = 0;
  for (int64_t c : recv_counts) total += c;
  recv.resize(total);
  Status s = host_->world()->AllToAllV(send.data(), send_counts, recv.data(), recv_counts);
  if (!s.ok()) {
    return Status(s.code(), absl::StrFormat("step %d: refreshing buddy copies: %s",
                                            host_->step() + 1, s.message()));
  }
  int64_t at = 0;
  for (int src = 0; src < W; ++src) {
    if (recv_counts[src] == 0) continue;
    const int j = (rank - src + W) % W;  // src = rank - j
    Buddy& b = buddies_[j - 1];
    std::swap(b.prev, b.cur);
    b.cur.version = live_version_;
    b.cur.first = firsts[src];
    b.cur.count = counts[src];
    b.cur.experts.assign(recv.begin() + at, recv.begin() + at + recv_counts[src]);
    at += recv_counts[src];
  }
  return absl::OkStatus();
}

Status ElasticState::EnsureShelf() {
  if (shelf_) return absl::OkStatus();
  const config::StorageConfig& st = config_.storage();
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
  so.piece_bytes = host_->scheduler()->expert_floats() * sizeof(float);
  so.pieces = 3 * host_->scheduler()->moe_layers();
  ASSIGN_OR_RETURN(shelf_, storage::CopyShelf::Create(so));
  STRATA_LOG(INFO) << "worker " << host_->rank() << " of " << host_->world_size()
                   << ": buddy copies in " << shelf_->dir()
                   << (st.ssd_dir().empty() ? " (set storage.ssd_dir to keep them elsewhere)" : "");
  return absl::OkStatus();
}

Status ElasticState::RefreshStoredCopiesIfDue() {
  const int64_t every = std::max(1, config_.elastic().replica_every());
  if (copied_version_ >= 0 && host_->step() - copied_version_ < every) return absl::OkStatus();
  return RefreshStoredCopies();
}

Status ElasticState::RefreshStoredCopies() {
  TraceScope span(host_->context().tracer, "buddy copies", "copy");
  const int W = host_->world_size(), rank = host_->rank();
  const std::vector<int64_t>& counts = host_->experts_per_worker();
  const int64_t v = host_->step();
  auto failed = [&](const Status& s) {
    return Status(s.code(), absl::StrFormat("step %d: copying the state of step %d for the buddy "
                                            "copies: %s",
                                            host_->step() + 1, v, s.message()));
  };
  // A worker alone has nobody to go on without it: its live state is all a joiner needs.
  const int R = std::min(config_.elastic().replicas(), W - 1);
  if (R < 1) return absl::OkStatus();
  const int64_t E = config_.model().moe().num_experts();
  const int64_t F = static_cast<int64_t>(host_->scheduler()->expert_floats());
  std::vector<int> holder(E, -1);
  // This worker's own copies, out of its store (nobody starts the rounds while another worker
  // cannot take part in them).
  Status ready = [&]() -> Status {
    if (static_cast<int>(counts.size()) != W) {
      return absl::InternalError(
          absl::StrFormat("the placement has %d ranges for %d workers", counts.size(), W));
    }
    for (int w = 0, e = 0; w < W; ++w) {
      for (int64_t k = 0; k < counts[w] && e < E; ++k) holder[e++] = w;
    }
    // The copies are of the state the store holds once the update in flight is done.
    RETURN_IF_ERROR(host_->scheduler()->FinishExpertStep());
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
  if (W > 1)
    ready = AllWorkersOk(*host_->world(), ready, "another worker could not copy its experts");
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
    StatusOr<int64_t> moved =
        MoveExpertsInChunks(host_->world(), buddy, sources, blob, ChunkOfTensors(F), read, write);
    if (!moved.ok()) return failed(moved.status());
  }
  copied_version_ = v;
  return absl::OkStatus();
}

Status ElasticState::ShelfPieces(int64_t version, int64_t e, int64_t offset, int64_t n, float* read,
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

Status ElasticState::CopyOwnExperts(int64_t version) {
  scheduler::TieredExpertScheduler& tiered = *host_->scheduler();
  const int64_t first = host_->first_expert(), count = host_->num_experts();
  const int64_t F = static_cast<int64_t>(tiered.expert_floats());
  const int pieces = shelf_->pieces();
  // A few tensors at a time: read out of the store (the next ones brought to the host behind
  // them) and written to the shelf together.
  // At most half the host slots in flight, so that the prefetches do not evict each other.
  const int slots = tiered.store().host_slots();
  const int batch = static_cast<int>(std::min<int64_t>(
      {pieces, ChunkOfTensors(F) / F, slots < 0 ? pieces : std::max(1, slots / 2)}));
  std::vector<float> buf(static_cast<size_t>(batch) * F);
  auto key = [&](int64_t i, int p) {
    return tiered.Key(p / 3, static_cast<int>(i), kBlobKinds[p % 3]);
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t e = first + i;
    shelf_->KeepNewest(e, 1);
    for (int p0 = 0; p0 < pieces; p0 += batch) {
      const int m = std::min(batch, pieces - p0);
      // The next batch (of this expert or the next) is fetched while this one is copied.
      std::vector<storage::TensorKey> next;
      for (int k = 0; k < m; ++k) {
        const int p = p0 + batch + k;
        if (p < pieces) {
          next.push_back(key(i, p));
        } else if (i + 1 < count && p - pieces < pieces) {
          next.push_back(key(i + 1, p - pieces));
        }
      }
      tiered.store().PrefetchHost(next);
      for (int k = 0; k < m; ++k) {
        const int p = p0 + k;
        RETURN_IF_ERROR(tiered.ReadExpertRange(p / 3, static_cast<int>(i), kBlobKinds[p % 3], 0, F,
                                               &buf[static_cast<size_t>(k) * F]));
      }
      RETURN_IF_ERROR(shelf_->Write(version, e, p0, m, buf.data()));
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::train
