// The phases of a new generation's state sync (state_sync.h). Holdings travel as one row of
// int64 per worker, so one all-gather tells every worker everything the pure phases need, and
// each worker computes the same agreed step, placement and sources without further messages.
#include "train/elastic/state_sync.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/logging.h"
#include "scheduler/replan.h"

namespace strata::train {
namespace {

int RankOf(const comm::Communicator* comm) { return comm ? comm->rank() : 0; }
int WorldOf(const comm::Communicator* comm) { return comm ? comm->world_size() : 1; }

}  // namespace

Holdings::Holdings(int workers, int64_t num_experts)
    : workers_(workers), num_experts_(num_experts) {
  CHECK_GE(workers, 1);
  CHECK_GE(num_experts, 0);
  rows_.assign(static_cast<size_t>(workers) * row_size(), -1);
  for (int w = 0; w < workers; ++w) SetBlobFloats(w, 0, 0);
}

size_t Holdings::index(int w, size_t item, HoldingSlot slot) const {
  CHECK(w >= 0 && w < workers_ && item < items()) << "worker " << w << ", item " << item;
  return static_cast<size_t>(w) * row_size() + kRowHeader + item * kHoldingSlots +
         static_cast<size_t>(slot);
}

void Holdings::SetBlobFloats(int w, int64_t dense_floats, int64_t expert_floats) {
  CHECK(w >= 0 && w < workers_) << "worker " << w;
  rows_[static_cast<size_t>(w) * row_size()] = dense_floats;
  rows_[static_cast<size_t>(w) * row_size() + 1] = expert_floats;
}

void Holdings::Set(int w, size_t item, HoldingSlot slot, int64_t version) {
  rows_[index(w, item, slot)] = version;
}

void Holdings::SetExperts(int w, int64_t first, int64_t count, HoldingSlot slot, int64_t version) {
  for (int64_t e = first; e < first + count; ++e) Set(w, ExpertItem(e), slot, version);
}

int64_t Holdings::version(int w, size_t item, HoldingSlot slot) const {
  return rows_[index(w, item, slot)];
}

bool Holdings::Holds(int w, size_t item, int64_t v) const {
  for (int k = 0; k < kHoldingSlots; ++k) {
    if (version(w, item, static_cast<HoldingSlot>(k)) == v) return true;
  }
  return false;
}

int64_t Holdings::dense_floats() const {
  int64_t n = 0;
  for (int w = 0; w < workers_; ++w) n = std::max(n, rows_[static_cast<size_t>(w) * row_size()]);
  return n;
}

int64_t Holdings::expert_floats() const {
  int64_t n = 0;
  for (int w = 0; w < workers_; ++w) {
    n = std::max(n, rows_[static_cast<size_t>(w) * row_size() + 1]);
  }
  return n;
}

StatusOr<Holdings> GatherHoldings(comm::Communicator* comm, const Holdings& mine) {
  CHECK_EQ(mine.workers(), 1);
  const int W = WorldOf(comm);
  if (W == 1) return mine;  // a generation of one worker has only itself to ask
  Holdings all(W, mine.num_experts());
  RETURN_IF_ERROR(
      comm->AllGather(mine.rows_.data(), mine.row_size() * sizeof(int64_t), all.rows_.data()));
  return all;
}

AgreedStep AgreeOnStep(const Holdings& all) {
  const int W = all.workers();
  std::vector<int64_t> versions;
  for (int w = 0; w < W; ++w) {
    for (size_t i = 0; i < all.items(); ++i) {
      for (int k = 0; k < kHoldingSlots; ++k) {
        const int64_t v = all.version(w, i, static_cast<HoldingSlot>(k));
        if (v >= 0) versions.push_back(v);
      }
    }
  }
  std::sort(versions.rbegin(), versions.rend());
  versions.erase(std::unique(versions.begin(), versions.end()), versions.end());
  AgreedStep out;
  out.newest = versions.empty() ? 0 : versions.front();
  std::string missing;
  for (int64_t v : versions) {
    missing.clear();
    std::vector<int64_t> experts;  // missing at v, ascending
    bool dense = false;
    for (size_t i = 0; i < all.items(); ++i) {
      bool found = false;
      for (int w = 0; w < W && !found; ++w) found = all.Holds(w, i, v);
      if (found) continue;
      if (i == kDenseItem) {
        dense = true;
      } else {
        experts.push_back(static_cast<int64_t>(i) - 1);
      }
    }
    if (!dense && experts.empty()) {
      out.step = v;
      return out;
    }
    // "the dense parameters, expert 1, expert 3, experts 5-9": runs of three or more as ranges.
    if (dense) missing = "the dense parameters";
    for (size_t a = 0; a < experts.size();) {
      size_t b = a;
      while (b + 1 < experts.size() && experts[b + 1] == experts[b] + 1) ++b;
      const std::string sep = missing.empty() ? "" : ", ";
      if (b - a >= 2) {
        absl::StrAppend(&missing, sep, "experts ", experts[a], "-", experts[b]);
      } else {
        for (size_t k = a; k <= b; ++k) {
          absl::StrAppend(&missing, missing.empty() ? "" : ", ", "expert ", experts[k]);
        }
      }
      a = b + 1;
    }
  }
  out.lost = all.dense_floats() == 0
                 ? std::string(
                       "no worker of this generation holds any of the job's state (every worker "
                       "that trained it is gone)")
                 : absl::StrCat(missing, " went with the failed workers and their buddy copies");
  return out;
}

StatusOr<ExpertPlan> ReplanExperts(comm::Communicator* comm, const Holdings& all,
                                   const std::vector<double>& measured_load, int group_size) {
  const int W = all.workers();
  CHECK_EQ(WorldOf(comm), W);
  const int G = group_size > 0 ? group_size : W;
  CHECK_EQ(W % G, 0) << "groups of " << G << " do not divide " << W << " workers";
  const int64_t E = all.num_experts();
  // The new placement, from rank 0's measured loads (a joiner has none: equal loads).
  std::vector<double> load(E, 0.0);
  if (RankOf(comm) == 0 && static_cast<int64_t>(measured_load.size()) == E) load = measured_load;
  if (W > 1) RETURN_IF_ERROR(comm->Broadcast(load.data(), load.size() * sizeof(double), 0));
  std::vector<int> current(E, -1);
  for (int64_t e = 0; e < E; ++e) {
    for (int w = 0; w < W && current[e] < 0; ++w) {
      if (all.version(w, ExpertItem(e), HoldingSlot::kLive) >= 0 ||
          all.version(w, ExpertItem(e), HoldingSlot::kRollback) >= 0) {
        current[e] = w % G;
      }
    }
  }
  const scheduler::RangePlan plan = scheduler::ReplanRanges(current, load, G);
  ExpertPlan out;
  out.counts = plan.counts;
  out.planner_moved = plan.moved;
  out.owner.resize(E);
  for (int w = 0, e = 0; w < G; ++w) {
    for (int64_t i = 0; i < plan.counts[w]; ++i) out.owner[e++] = w;
  }
  return out;
}

CopySources LocateCopies(const Holdings& all, int64_t step, const std::vector<int>& owner) {
  const int W = all.workers();
  const int64_t E = all.num_experts();
  CHECK_EQ(static_cast<int64_t>(owner.size()), E);
  CopySources out;
  out.expert.assign(E, -1);
  for (int64_t e = 0; e < E; ++e) {
    if (all.Holds(owner[e], ExpertItem(e), step)) {
      out.expert[e] = owner[e];
    } else {
      for (int w = 0; w < W && out.expert[e] < 0; ++w) {
        if (all.Holds(w, ExpertItem(e), step)) out.expert[e] = w;
      }
    }
  }
  for (int w = 0; w < W; ++w) {
    if (all.Holds(w, kDenseItem, step)) {
      if (out.dense_root < 0) out.dense_root = w;
    } else {
      out.anyone_lacks_dense = true;
    }
  }
  return out;
}

StatusOr<std::vector<float>> MoveDenseState(comm::Communicator* comm, const Holdings& all,
                                            int64_t step, const CopySources& sources,
                                            const ReadItem& read) {
  const int64_t D = all.dense_floats();
  std::vector<float> dense(D);
  if (all.Holds(RankOf(comm), kDenseItem, step)) read(kDenseItem, dense.data());
  if (sources.anyone_lacks_dense) {
    RETURN_IF_ERROR(comm->Broadcast(dense.data(), D * sizeof(float), sources.dense_root));
  }
  return dense;
}

StatusOr<MovedExperts> MoveExperts(comm::Communicator* comm, const std::vector<int>& owner,
                                   const CopySources& sources, int64_t expert_floats,
                                   const ReadItem& read) {
  const int W = WorldOf(comm), rank = RankOf(comm);
  const int64_t E = static_cast<int64_t>(owner.size()), S = expert_floats;
  const std::vector<int>& source = sources.expert;
  CHECK_EQ(static_cast<int64_t>(source.size()), E);
  std::vector<int64_t> send_counts(W, 0), recv_counts(W, 0);
  for (int64_t e = 0; e < E; ++e) {
    if (source[e] == owner[e]) continue;
    if (source[e] == rank) send_counts[owner[e]] += S;
    if (owner[e] == rank) recv_counts[source[e]] += S;
  }
  std::vector<float> send, recv;
  for (int d = 0; d < W; ++d) {
    for (int64_t e = 0; e < E; ++e) {
      if (source[e] == rank && owner[e] == d && d != rank) {
        send.resize(send.size() + S);
        read(ExpertItem(e), &send[send.size() - S]);
      }
    }
  }
  int64_t incoming = 0;
  for (int64_t c : recv_counts) incoming += c;
  recv.resize(incoming);
  if (W > 1) {
    RETURN_IF_ERROR(comm->AllToAllV(send.data(), send_counts, recv.data(), recv_counts));
  }
  std::vector<int64_t> offset(W, 0);
  for (int w = 1; w < W; ++w) offset[w] = offset[w - 1] + recv_counts[w - 1];
  MovedExperts out;
  for (int64_t e = 0; e < E; ++e) {
    if (owner[e] != rank) continue;
    out.blobs.resize(out.blobs.size() + S);
    float* dst = &out.blobs[out.blobs.size() - S];
    if (source[e] == rank) {
      read(ExpertItem(e), dst);
    } else {
      std::memcpy(dst, &recv[offset[source[e]]], S * sizeof(float));
      offset[source[e]] += S;
    }
  }
  for (int64_t e = 0; e < E; ++e) out.moved += source[e] != owner[e];
  return out;
}

ExpertChunkPlan PlanExpertChunks(const std::vector<int>& owner, const CopySources& sources,
                                 int64_t expert_floats, int64_t chunk_floats) {
  CHECK_GE(chunk_floats, 1);
  CHECK_GE(expert_floats, 0);
  const std::vector<int>& source = sources.expert;
  CHECK_EQ(source.size(), owner.size());
  struct Move {
    int64_t expert;
    int from, to;
    int64_t done = 0;  // floats scheduled so far
  };
  ExpertChunkPlan plan;
  std::vector<Move> moves;
  int workers = 0;
  for (size_t e = 0; e < owner.size(); ++e) {
    CHECK(owner[e] >= 0 && source[e] >= 0) << "expert " << e << " has no owner or source";
    workers = std::max({workers, owner[e] + 1, source[e] + 1});
    if (source[e] == owner[e]) continue;
    ++plan.moved;
    if (expert_floats > 0) moves.push_back(Move{static_cast<int64_t>(e), source[e], owner[e]});
  }
  std::vector<int64_t> send_room(workers), recv_room(workers);
  size_t first = 0;  // the moves before it are scheduled whole
  while (first < moves.size()) {
    std::fill(send_room.begin(), send_room.end(), chunk_floats);
    std::fill(recv_room.begin(), recv_room.end(), chunk_floats);
    std::vector<ExpertPiece>& round = plan.rounds.emplace_back();
    for (size_t i = first; i < moves.size(); ++i) {
      Move& m = moves[i];
      const int64_t n = std::min({expert_floats - m.done, send_room[m.from], recv_room[m.to]});
      if (n <= 0) continue;
      round.push_back(ExpertPiece{m.expert, m.from, m.to, m.done, n});
      m.done += n;
      send_room[m.from] -= n;
      recv_room[m.to] -= n;
    }
    while (first < moves.size() && moves[first].done == expert_floats) ++first;
  }
  return plan;
}

namespace {

std::string RoundName(size_t k, size_t rounds) {
  return k < rounds ? absl::StrFormat("round %d of %d", k + 1, rounds)
                    : absl::StrFormat("the closing exchange after %d rounds", rounds);
}

Status PieceError(const Status& s, const char* what, const ExpertPiece& p, size_t k,
                  size_t rounds) {
  return Status(s.code(),
                absl::StrFormat("moving expert %d (floats [%d, %d) of its blob) from rank %d to "
                                "rank %d, %s: %s it failed: %s",
                                p.expert, p.offset, p.offset + p.n, p.from, p.to,
                                RoundName(k, rounds), what, s.message()));
}

}  // namespace

StatusOr<int64_t> MoveExpertsInChunks(comm::Communicator* comm, const std::vector<int>& owner,
                                      const CopySources& sources, int64_t expert_floats,
                                      int64_t chunk_floats, const ReadChunk& read,
                                      const WriteChunk& write) {
  const int W = WorldOf(comm), rank = RankOf(comm);
  const ExpertChunkPlan plan = PlanExpertChunks(owner, sources, expert_floats, chunk_floats);
  for (size_t e = 0; e < owner.size(); ++e) {
    CHECK(owner[e] < W && sources.expert[e] < W)
        << "expert " << e << ": owner " << owner[e] << ", source " << sources.expert[e]
        << " in a generation of " << W;
  }
  if (plan.rounds.empty()) return plan.moved;  // every worker sees so: no collective at all
  const size_t K = plan.rounds.size();
  const std::vector<ExpertPiece> none;
  std::vector<int64_t> send_counts(W), recv_counts(W), send_at(W), recv_at(W);
  std::vector<float> send, recv;
  Status mine;  // this worker's first failed read or write
  // Round K exchanges only the status words, so that a write failed in the last round stops
  // every worker too.
  for (size_t k = 0; k <= K; ++k) {
    const std::vector<ExpertPiece>& pieces = k < K ? plan.rounds[k] : none;
    // Per peer, in rank order: its status word, then the pieces of this round in plan order.
    for (int d = 0; d < W; ++d) send_counts[d] = recv_counts[d] = d == rank ? 0 : 1;
    for (const ExpertPiece& p : pieces) {
      if (p.from == rank) send_counts[p.to] += p.n;
      if (p.to == rank) recv_counts[p.from] += p.n;
    }
    int64_t send_total = 0, recv_total = 0;
    for (int d = 0; d < W; ++d) {
      send_at[d] = send_total;
      recv_at[d] = recv_total;
      send_total += send_counts[d];
      recv_total += recv_counts[d];
    }
    send.assign(send_total, 0.0f);
    recv.assign(recv_total, 0.0f);
    std::vector<int64_t> at = send_at;
    for (int d = 0; d < W; ++d) at[d] += d == rank ? 0 : 1;
    for (const ExpertPiece& p : pieces) {
      if (p.from != rank) continue;
      float* dst = &send[at[p.to]];
      at[p.to] += p.n;
      if (!mine.ok()) continue;  // zeros: the round is void anyway
      const Status s = read(ExpertItem(p.expert), p.offset, p.n, dst);
      if (!s.ok()) mine = PieceError(s, "reading", p, k, K);
    }
    for (int d = 0; d < W; ++d) {
      if (d != rank) send[send_at[d]] = mine.ok() ? 1.0f : 0.0f;
    }
    const Status s = comm->AllToAllV(send.data(), send_counts, recv.data(), recv_counts);
    if (!s.ok()) {
      return Status(s.code(), absl::StrFormat("moving experts to their new owners, %s: %s",
                                              RoundName(k, K), s.message()));
    }
    if (!mine.ok()) return mine;
    std::string failed;
    for (int w = 0; w < W; ++w) {
      if (w != rank && recv[recv_at[w]] != 1.0f)
        absl::StrAppend(&failed, failed.empty() ? "" : ", ", w);
    }
    if (!failed.empty()) {
      return absl::AbortedError(absl::StrFormat(
          "moving experts to their new owners, %s: rank(s) %s could not read or write their "
          "pieces (their own errors say why); the experts are partly moved and this generation "
          "cannot go on from them",
          RoundName(k, K), failed));
    }
    at = recv_at;
    for (int w = 0; w < W; ++w) at[w] += w == rank ? 0 : 1;
    for (const ExpertPiece& p : pieces) {
      if (p.to != rank) continue;
      const float* src = &recv[at[p.from]];
      at[p.from] += p.n;
      const Status w = write(ExpertItem(p.expert), p.offset, p.n, src);
      if (!w.ok()) {
        mine = PieceError(w, "writing", p, k, K);
        break;
      }
    }
  }
  return plan.moved;
}

}  // namespace strata::train
