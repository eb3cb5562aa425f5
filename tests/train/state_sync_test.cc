// The phases of a new generation's state sync (train/elastic/state_sync.h), with the generation's
// workers as threads of this process, each connecting a real Gloo communicator through an
// in-memory store. Every worker holds hand-made blobs whose values say which item, which version
// and which worker they are, so a blob that arrives says where it came from; each scenario
// compares the agreed step, the placement, the sources and every moved blob (bitwise) with what
// was worked out by hand for it.
#include "train/elastic/state_sync.h"
#include "tests/train/gloo_workers.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"

namespace strata::train {
namespace {

using namespace std::chrono_literals;

constexpr int64_t kDenseFloats = 7, kExpertFloats = 5;

// Item `item` at `version` as worker `holder` keeps it. Values stay below 2^24, so floats hold
// them exactly.
std::vector<float> Blob(size_t item, int64_t version, int holder) {
  const int64_t n = item == kDenseItem ? kDenseFloats : kExpertFloats;
  std::vector<float> b(n);
  for (int64_t k = 0; k < n; ++k) {
    b[k] =
        static_cast<float>(static_cast<int64_t>(item) * 100000 + version * 1000 + holder * 100 + k);
  }
  return b;
}

// One worker of the new generation: what it holds, and its measured expert loads.
struct Worker {
  Worker(int rank, int64_t num_experts) : rank(rank), holdings(1, num_experts) {}

  void Hold(size_t item, HoldingSlot slot, int64_t version) {
    holdings.SetBlobFloats(0, kDenseFloats, kExpertFloats);
    holdings.Set(0, item, slot, version);
    blobs[{item, version}] = Blob(item, version, rank);
  }
  void HoldExperts(int64_t first, int64_t count, HoldingSlot slot, int64_t version) {
    for (int64_t e = first; e < first + count; ++e) Hold(ExpertItem(e), slot, version);
  }
  // A worker that trained in the previous generation: its model at `live`, its copy from before
  // the update at live - 1, and buddy copies of experts [buddy_first, + buddy_count) after their
  // source's latest two updates.
  void Trained(int64_t live, int64_t first, int64_t count, int64_t buddy_first, int64_t buddy_count,
               int64_t buddy_latest) {
    Hold(kDenseItem, HoldingSlot::kLive, live);
    HoldExperts(first, count, HoldingSlot::kLive, live);
    Hold(kDenseItem, HoldingSlot::kRollback, live - 1);
    HoldExperts(first, count, HoldingSlot::kRollback, live - 1);
    HoldExperts(buddy_first, buddy_count, HoldingSlot::kBuddyLatest, buddy_latest);
    HoldExperts(buddy_first, buddy_count, HoldingSlot::kBuddyPrevious, buddy_latest - 1);
  }

  int rank;
  Holdings holdings;
  std::map<std::pair<size_t, int64_t>, std::vector<float>> blobs;  // (item, version)
  std::vector<double> load;
};

// What one worker got from the phases.
struct Outcome {
  Status status;
  AgreedStep agreed;
  ExpertPlan plan;
  CopySources sources;
  std::vector<float> dense;
  MovedExperts experts;
  std::set<size_t> read;              // items the phases read from this worker
  std::vector<size_t> read_not_held;  // items read that it does not hold at the agreed step
};

// The phases in the order ElasticState::SyncState calls them, on one worker.
Outcome SyncOne(comm::Communicator* comm, const Worker& me) {
  Outcome o;
  StatusOr<Holdings> all = GatherHoldings(comm, me.holdings);
  if (!all.ok()) {
    o.status = all.status();
    return o;
  }
  o.agreed = AgreeOnStep(*all);
  if (o.agreed.step < 0) return o;
  const int64_t step = o.agreed.step;
  StatusOr<ExpertPlan> plan = ReplanExperts(comm, *all, me.load);
  if (!plan.ok()) {
    o.status = plan.status();
    return o;
  }
  o.plan = *plan;
  o.sources = LocateCopies(*all, step, o.plan.owner);
  const ReadItem read = [&](size_t item, float* dst) {
    o.read.insert(item);
    auto it = me.blobs.find({item, step});
    if (it == me.blobs.end()) {
      o.read_not_held.push_back(item);
      return;
    }
    std::memcpy(dst, it->second.data(), it->second.size() * sizeof(float));
  };
  StatusOr<std::vector<float>> dense = MoveDenseState(comm, *all, step, o.sources, read);
  if (!dense.ok()) {
    o.status = dense.status();
    return o;
  }
  o.dense = *dense;
  StatusOr<MovedExperts> experts =
      MoveExperts(comm, o.plan.owner, o.sources, all->expert_floats(), read);
  if (!experts.ok()) {
    o.status = experts.status();
    return o;
  }
  o.experts = *experts;
  return o;
}

// Every worker as a thread with its own Gloo communicator; a generation of one communicates
// nothing (as ElasticState::SyncState passes no communicator then).
std::vector<Outcome> Sync(const std::vector<Worker>& workers) {
  const int W = static_cast<int>(workers.size());
  std::vector<Outcome> out(W);
  if (W == 1) {
    out[0] = SyncOne(nullptr, workers[0]);
    return out;
  }
  strata::testing::RunGlooWorkers(
      W, 30s, [&](comm::Communicator* c, int r) { out[r] = SyncOne(c, workers[r]); });
  return out;
}

// The blobs an owner of experts [first, first + count) must end up with: each expert's at
// `step` as worker source[e] holds it.
std::vector<float> ExpectedExperts(int64_t first, int64_t count, int64_t step,
                                   const std::vector<int>& source) {
  std::vector<float> out;
  for (int64_t e = first; e < first + count; ++e) {
    const std::vector<float> b = Blob(ExpertItem(e), step, source[e]);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Checks every worker's outcome against a placement and sources worked out by hand.
void ExpectPlaced(const std::vector<Outcome>& out, int64_t step, const std::vector<int64_t>& counts,
                  const std::vector<int>& source, int64_t moved, int planner_moved) {
  std::vector<int> owner;
  for (size_t w = 0; w < counts.size(); ++w)
    owner.insert(owner.end(), counts[w], static_cast<int>(w));
  int64_t first = 0;
  for (size_t w = 0; w < out.size(); ++w) {
    SCOPED_TRACE(::testing::Message() << "worker " << w);
    const Outcome& o = out[w];
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.agreed.step, step);
    EXPECT_EQ(o.plan.counts, counts);
    EXPECT_EQ(o.plan.owner, owner);
    EXPECT_EQ(o.plan.planner_moved, planner_moved);
    EXPECT_EQ(o.sources.expert, source);
    EXPECT_EQ(o.experts.moved, moved);
    EXPECT_TRUE(o.read_not_held.empty())
        << "read an item it does not hold, e.g. item " << o.read_not_held.front();
    EXPECT_TRUE(SameBits(o.experts.blobs, ExpectedExperts(first, counts[w], step, source)));
    first += counts[w];
  }
}

// Every worker finds no whole step and says what is lost.
void ExpectNoStep(const std::vector<Outcome>& out, int64_t newest, const std::string& lost) {
  for (size_t w = 0; w < out.size(); ++w) {
    SCOPED_TRACE(::testing::Message() << "worker " << w);
    ASSERT_TRUE(out[w].status.ok()) << out[w].status;
    EXPECT_EQ(out[w].agreed.step, -1);
    EXPECT_EQ(out[w].agreed.newest, newest);
    EXPECT_EQ(out[w].agreed.lost, lost);
  }
}

TEST(StateSyncTest, BuddyCopiesCoverALostWorkerAtTheNewestWholeStep) {
  // Four workers trained 8 experts, 2 each, with one buddy copy (rank r's experts on r + 1);
  // rank 2 died while rank 0 had already applied step 11 and the others had not. The survivors
  // (old ranks 0, 1, 3) are the new ranks 0, 1, 2. Step 11 is not whole (only rank 0 has it);
  // step 10 is: rank 0's copy from before its update, the others' models, and experts 4 and 5
  // in old rank 3's buddy copy of old rank 2.
  std::vector<Worker> w;
  for (int r = 0; r < 3; ++r) w.emplace_back(r, 8);
  w[0].Trained(/*live=*/11, 0, 2, /*buddies of old rank 3:*/ 6, 2, /*buddy_latest=*/10);
  w[1].Trained(10, 2, 2, /*of old rank 0:*/ 0, 2, 10);
  w[2].Trained(10, 6, 2, /*of old rank 2:*/ 4, 2, 10);
  const std::vector<Outcome> out = Sync(w);
  // Equal loads (rank 0 measured none): 8 experts on 3 workers, at most 3 each; (2, 3, 3) keeps
  // every surviving owner's experts, so only the orphans 4 and 5 change owner. Expert 4 comes
  // from new rank 2's buddy copy; rank 2 keeps its buddy copy of expert 5; the rest stay.
  ExpectPlaced(out, 10, {2, 3, 3}, {0, 0, 1, 1, 2, 2, 2, 2}, /*moved=*/1, /*planner_moved=*/2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].agreed.newest, 11);
    EXPECT_FALSE(out[r].sources.anyone_lacks_dense);
    // Nobody lacks the dense state: each keeps its own copy of step 10 (rank 0 its copy from
    // before the update, not its model at 11).
    EXPECT_TRUE(SameBits(out[r].dense, Blob(kDenseItem, 10, r))) << "worker " << r;
  }
  EXPECT_EQ(out[0].read, (std::set<size_t>{0, 1, 2}));
  EXPECT_EQ(out[1].read, (std::set<size_t>{0, 3, 4}));
  EXPECT_EQ(out[2].read, (std::set<size_t>{0, 5, 6, 7, 8}));
}

TEST(StateSyncTest, AJoinerGetsTheDenseStateAndItsExperts) {
  // Two workers trained 6 experts (3 each, buddy copies of each other) to step 7; a third joins
  // holding nothing.
  std::vector<Worker> w;
  for (int r = 0; r < 3; ++r) w.emplace_back(r, 6);
  w[0].Trained(7, 0, 3, /*buddies of rank 1:*/ 3, 3, 7);
  w[1].Trained(7, 3, 3, /*of rank 0:*/ 0, 3, 7);
  const std::vector<Outcome> out = Sync(w);
  // (2, 2, 2) is the only placement of 6 on 3 with at most 2 each. Expert 2 goes to rank 1,
  // which holds its buddy copy and keeps it; experts 4 and 5 go to the joiner from the lowest
  // rank holding them, rank 0's buddy copy. The planner counts 2, 4, 5 as changing owner.
  ExpectPlaced(out, 7, {2, 2, 2}, {0, 0, 1, 1, 0, 0}, /*moved=*/2, /*planner_moved=*/3);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(out[r].sources.anyone_lacks_dense);
    EXPECT_EQ(out[r].sources.dense_root, 0);
    // The joiner lacked it: everyone has the dense root's copy.
    EXPECT_TRUE(SameBits(out[r].dense, Blob(kDenseItem, 7, 0))) << "worker " << r;
  }
  // Rank 0 reads the dense state, its own experts and what it sends; never expert 2.
  EXPECT_EQ(out[0].read, (std::set<size_t>{0, 1, 2, 5, 6}));
  EXPECT_EQ(out[1].read, (std::set<size_t>{0, 3, 4}));
  EXPECT_TRUE(out[2].read.empty());
}

TEST(StateSyncTest, FourWorkersOneLostOneJoined) {
  // Four workers trained 8 experts (2 each) to step 5; old rank 1 died and a worker joined. New
  // ranks: old 0, old 2, old 3, the joiner.
  std::vector<Worker> w;
  for (int r = 0; r < 4; ++r) w.emplace_back(r, 8);
  w[0].Trained(5, 0, 2, /*buddies of old rank 3:*/ 6, 2, 5);
  w[1].Trained(5, 4, 2, /*of old rank 1:*/ 2, 2, 5);
  w[2].Trained(5, 6, 2, /*of old rank 2:*/ 4, 2, 5);
  const std::vector<Outcome> out = Sync(w);
  // 2 each. Ranks 1 and 2 own experts they hold buddy copies of (2, 3 and 4, 5) and keep them;
  // the joiner's 6 and 7 come from rank 0's buddy copy. The planner: 2, 3 orphans, 4, 5 from new
  // rank 1 to 2, 6, 7 from 2 to 3.
  ExpectPlaced(out, 5, {2, 2, 2, 2}, {0, 0, 1, 1, 2, 2, 0, 0}, /*moved=*/2, /*planner_moved=*/6);
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(SameBits(out[r].dense, Blob(kDenseItem, 5, 0))) << "worker " << r;
  }
  EXPECT_EQ(out[0].read, (std::set<size_t>{0, 1, 2, 7, 8}));
  EXPECT_EQ(out[1].read, (std::set<size_t>{0, 3, 4}));
  EXPECT_EQ(out[2].read, (std::set<size_t>{0, 5, 6}));
  EXPECT_TRUE(out[3].read.empty());
}

TEST(StateSyncTest, PlansWithRankZerosMeasuredLoads) {
  // Three workers with 7 experts as (3, 3, 1) at step 9, nobody lost. Rank 0 measured expert 0 as
  // three times the others; ranks 1 and 2 (wrongly) measured expert 6 so. Only rank 0's count:
  // with loads 3,1,1,1,1,1,1 the only ranges whose heaviest is 3 are (1, 3, 3) — with the
  // others' loads it would be (3, 3, 1).
  std::vector<Worker> w;
  for (int r = 0; r < 3; ++r) w.emplace_back(r, 7);
  w[0].Trained(9, 0, 3, /*buddies of rank 2:*/ 6, 1, 9);
  w[1].Trained(9, 3, 3, /*of rank 0:*/ 0, 3, 9);
  w[2].Trained(9, 6, 1, /*of rank 1:*/ 3, 3, 9);
  w[0].load = {3, 1, 1, 1, 1, 1, 1};
  w[1].load = w[2].load = {1, 1, 1, 1, 1, 1, 3};
  const std::vector<Outcome> out = Sync(w);
  // Experts 1, 2 and 4, 5 change owner in the plan, but each new owner holds their buddy copies:
  // nothing moves.
  ExpectPlaced(out, 9, {1, 3, 3}, {0, 1, 1, 1, 2, 2, 2}, /*moved=*/0, /*planner_moved=*/4);
  EXPECT_EQ(out[0].read, (std::set<size_t>{0, 1}));
  EXPECT_EQ(out[1].read, (std::set<size_t>{0, 2, 3, 4}));
  EXPECT_EQ(out[2].read, (std::set<size_t>{0, 5, 6, 7}));
}

// Four workers trained 4 * `per` experts (`per` each) with one buddy copy; old ranks 1 and 2 died
// together, so old rank 1's experts (its buddy copy on old rank 2) are gone at every step: the
// message names them.
void ExpectLostWithTwoNeighbours(int64_t per, const std::string& lost) {
  std::vector<Worker> w;
  for (int r = 0; r < 2; ++r) w.emplace_back(r, 4 * per);
  w[0].Trained(12, 0, per, /*buddies of old rank 3:*/ 3 * per, per, 12);
  w[1].Trained(12, 3 * per, per, /*of old rank 2:*/ 2 * per, per, 12);
  ExpectNoStep(Sync(w), /*newest=*/12,
               lost + " went with the failed workers and their buddy copies");
}

TEST(StateSyncTest, NamesTheExpertsNothingCovers) {
  ExpectLostWithTwoNeighbours(2, "expert 2, expert 3");
  // Runs of three or more as ranges.
  ExpectLostWithTwoNeighbours(4, "experts 4-7");
}

TEST(StateSyncTest, SaysSoWhenNoWorkerHoldsAnyState) {
  // Every worker of the generation is new.
  std::vector<Worker> w;
  for (int r = 0; r < 2; ++r) w.emplace_back(r, 4);
  ExpectNoStep(Sync(w), /*newest=*/0,
               "no worker of this generation holds any of the job's state (every worker that "
               "trained it is gone)");
}

TEST(StateSyncTest, AWorkerAloneTakesItsOwnCopy) {
  // A generation of one (no communicator): rank 0 offers a checkpoint of step 20 as its copy of
  // everything from before an update.
  std::vector<Worker> w;
  w.emplace_back(0, 4);
  w[0].Hold(kDenseItem, HoldingSlot::kRollback, 20);
  w[0].HoldExperts(0, 4, HoldingSlot::kRollback, 20);
  const std::vector<Outcome> out = Sync(w);
  ExpectPlaced(out, 20, {4}, {0, 0, 0, 0}, /*moved=*/0, /*planner_moved=*/0);
  EXPECT_TRUE(SameBits(out[0].dense, Blob(kDenseItem, 20, 0)));
}

TEST(StateSyncTest, AgreesOnTheNewestWholeVersion) {
  // Three workers, 2 experts, set slot by slot: step 8 lacks expert 1; 7 and 6 are whole.
  Holdings all(3, 2);
  for (int w = 0; w < 3; ++w) all.SetBlobFloats(w, kDenseFloats, kExpertFloats);
  all.Set(0, kDenseItem, HoldingSlot::kLive, 8);
  all.Set(0, ExpertItem(0), HoldingSlot::kLive, 8);
  all.Set(0, kDenseItem, HoldingSlot::kRollback, 7);
  all.Set(0, ExpertItem(0), HoldingSlot::kRollback, 7);
  all.Set(1, kDenseItem, HoldingSlot::kLive, 6);
  all.Set(1, ExpertItem(0), HoldingSlot::kBuddyPrevious, 6);
  all.Set(1, ExpertItem(1), HoldingSlot::kLive, 6);
  all.Set(2, ExpertItem(1), HoldingSlot::kBuddyLatest, 7);
  const AgreedStep a = AgreeOnStep(all);
  EXPECT_EQ(a.step, 7);
  EXPECT_EQ(a.newest, 8);
  EXPECT_TRUE(a.lost.empty());
  // Where it comes from: the dense state only rank 0 holds at 7; expert 1's owner (rank 0) lacks
  // it, so the lowest rank holding it.
  const CopySources s = LocateCopies(all, 7, /*owner=*/{1, 0});
  EXPECT_EQ(s.expert, (std::vector<int>{0, 2}));
  EXPECT_EQ(s.dense_root, 0);
  EXPECT_TRUE(s.anyone_lacks_dense);
  // Without expert 1 at 7 and 6 nothing is whole; the message names what the oldest lacks.
  Holdings partial = all;
  partial.Set(2, ExpertItem(1), HoldingSlot::kBuddyLatest, -1);
  partial.Set(1, ExpertItem(1), HoldingSlot::kLive, -1);
  partial.Set(1, kDenseItem, HoldingSlot::kLive, -1);
  const AgreedStep none = AgreeOnStep(partial);
  EXPECT_EQ(none.step, -1);
  EXPECT_EQ(none.newest, 8);
  EXPECT_EQ(none.lost,
            "the dense parameters, expert 1 went with the failed workers and their buddy copies");
}

// --- Chunked expert moves --------------------------------------------------------------------

// A communicator that forwards to another and records, per AllToAllV, how many floats this worker
// sent and received, so a test sees the buffers of every round.
class WatchedCommunicator : public comm::Communicator {
 public:
  explicit WatchedCommunicator(comm::Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend() const override { return inner_->backend(); }
  Status AllReduce(float* data, size_t n) override { return inner_->AllReduce(data, n); }
  Status AllReduce(double* data, size_t n) override { return inner_->AllReduce(data, n); }
  Status AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, size_t element_bytes) override {
    int64_t out = 0, in = 0;
    for (int64_t c : send_counts) out += c;
    for (int64_t c : recv_counts) in += c;
    sent.push_back(out);
    received.push_back(in);
    return inner_->AllToAllV(send, send_counts, recv, recv_counts, element_bytes);
  }
  Status AllGather(const void* send, size_t bytes, void* recv) override {
    return inner_->AllGather(send, bytes, recv);
  }
  Status Broadcast(void* data, size_t bytes, int root) override {
    return inner_->Broadcast(data, bytes, root);
  }
  Status Barrier() override { return inner_->Barrier(); }
  void Abort(const std::string& why) override { inner_->Abort(why); }

  std::vector<int64_t> sent, received;  // floats, per AllToAllV

 private:
  comm::Communicator* inner_;
};

// The value of float `i` of expert e's blob (below 2^24: exact in a float).
float PieceValue(int64_t e, int64_t i) { return static_cast<float>(e * 10000 + i); }
constexpr float kUnwritten = -7.0f;

// One worker's side of a chunked move: the blobs it holds (expert -> floats), and what the move
// did to them, round by round (a round is the number of AllToAllV calls made before).
struct ChunkedWorker {
  std::map<int64_t, std::vector<float>> blobs;
  std::map<int64_t, std::vector<int>> writes;  // per moved-in expert: times each float was written
  std::map<size_t, int64_t> read_in_round, written_in_round;  // floats
  std::vector<std::string> violations;  // reads or writes of what it must not touch
  Status status;
  int64_t moved = -1;
};

// A random plan: every expert's owner and source drawn from W workers.
void RandomPlan(std::mt19937& rng, int W, int64_t E, std::vector<int>* owner,
                CopySources* sources) {
  std::uniform_int_distribution<int> pick(0, W - 1);
  owner->resize(E);
  sources->expert.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    (*owner)[e] = pick(rng);
    // One in three stays with its owner.
    sources->expert[e] = rng() % 3 == 0 ? (*owner)[e] : pick(rng);
  }
}

// The blobs a worker starts with: a source holds its experts' blobs; an owner that is not the
// source, a blob of kUnwritten to be filled.
void Seed(ChunkedWorker& w, int rank, const std::vector<int>& owner, const CopySources& sources,
          int64_t S) {
  for (size_t e = 0; e < owner.size(); ++e) {
    if (sources.expert[e] == rank) {
      std::vector<float>& b = w.blobs[e];
      for (int64_t i = 0; i < S; ++i) b.push_back(PieceValue(e, i));
    } else if (owner[e] == rank) {
      w.blobs[e].assign(S, kUnwritten);
      w.writes[e].assign(S, 0);
    }
  }
}

// MoveExpertsInChunks on one worker over `watched`, with callbacks that check what they are
// asked for and record it. `fail_read` / `fail_write` pick calls to fail (by round).
void ChunkedMoveOne(WatchedCommunicator* watched, int rank, const std::vector<int>& owner,
                    const CopySources& sources, int64_t S, int64_t chunk, ChunkedWorker& w,
                    const std::function<bool(size_t round)>& fail_read = nullptr,
                    const std::function<bool(size_t round)>& fail_write = nullptr) {
  auto round = [&] { return watched ? watched->sent.size() : 0; };
  const ReadChunk read = [&](size_t item, int64_t offset, int64_t n, float* dst) -> Status {
    const int64_t e = static_cast<int64_t>(item) - 1;
    if (sources.expert[e] != rank || owner[e] == rank || offset < 0 || offset + n > S) {
      w.violations.push_back(absl::StrCat("read expert ", e, " [", offset, ", +", n, ")"));
      return absl::OkStatus();
    }
    if (fail_read && fail_read(round())) return absl::DataLossError("the disk is gone");
    w.read_in_round[round()] += n;
    std::memcpy(dst, w.blobs[e].data() + offset, n * sizeof(float));
    return absl::OkStatus();
  };
  const WriteChunk write = [&](size_t item, int64_t offset, int64_t n, const float* src) -> Status {
    const int64_t e = static_cast<int64_t>(item) - 1;
    if (owner[e] != rank || sources.expert[e] == rank || offset < 0 || offset + n > S) {
      w.violations.push_back(absl::StrCat("wrote expert ", e, " [", offset, ", +", n, ")"));
      return absl::OkStatus();
    }
    if (fail_write && fail_write(round())) return absl::ResourceExhaustedError("the disk is full");
    w.written_in_round[round()] += n;
    std::memcpy(w.blobs[e].data() + offset, src, n * sizeof(float));
    for (int64_t i = offset; i < offset + n; ++i) w.writes[e][i]++;
    return absl::OkStatus();
  };
  StatusOr<int64_t> moved = MoveExpertsInChunks(watched, owner, sources, S, chunk, read, write);
  w.status = moved.status();
  if (moved.ok()) w.moved = *moved;
}

TEST(StateSyncTest, PlansChunksThatFillEachRound) {
  // Two workers, expert blobs of 5 floats, chunks of 8. Experts 0 and 1 go from rank 0 to rank 1,
  // expert 2 stays with rank 0, expert 3 goes from rank 1 to rank 0. Round 1: expert 0 whole and
  // 3 floats of expert 1 (rank 0 sends 8), expert 3 whole (rank 1 sends 5); round 2: the rest of
  // expert 1.
  CopySources sources;
  sources.expert = {0, 0, 0, 1};
  const ExpertChunkPlan plan = PlanExpertChunks({1, 1, 0, 0}, sources, 5, 8);
  EXPECT_EQ(plan.moved, 3);
  ASSERT_EQ(plan.rounds.size(), 2u);
  auto same = [](const ExpertPiece& a, const ExpertPiece& b) {
    return a.expert == b.expert && a.from == b.from && a.to == b.to && a.offset == b.offset &&
           a.n == b.n;
  };
  const std::vector<ExpertPiece> r1 = {{0, 0, 1, 0, 5}, {1, 0, 1, 0, 3}, {3, 1, 0, 0, 5}};
  const std::vector<ExpertPiece> r2 = {{1, 0, 1, 3, 2}};
  ASSERT_EQ(plan.rounds[0].size(), r1.size());
  for (size_t i = 0; i < r1.size(); ++i) EXPECT_TRUE(same(plan.rounds[0][i], r1[i])) << i;
  ASSERT_EQ(plan.rounds[1].size(), r2.size());
  EXPECT_TRUE(same(plan.rounds[1][0], r2[0]));
  // Nothing to move: no rounds at all.
  sources.expert = {1, 1, 0, 0};
  EXPECT_TRUE(PlanExpertChunks({1, 1, 0, 0}, sources, 5, 8).rounds.empty());
}

TEST(StateSyncTest, MovesRandomPlansInChunksOfAnySize) {
  constexpr int64_t S = 12, E = 9;
  std::mt19937 rng(20261125);
  for (int W : {3, 4}) {
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<int> owner;
      CopySources sources;
      RandomPlan(rng, W, E, &owner, &sources);
      // Independently: what each worker sends and receives in all, and the experts that move.
      std::vector<int64_t> out(W, 0), in(W, 0);
      int64_t moved = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (owner[e] == sources.expert[e]) continue;
        ++moved;
        out[sources.expert[e]] += S;
        in[owner[e]] += S;
      }
      int64_t busiest = 0;
      for (int w = 0; w < W; ++w) busiest = std::max({busiest, out[w], in[w]});
      for (int64_t chunk : {int64_t{1}, int64_t{5}, S, int64_t{40}}) {
        SCOPED_TRACE(::testing::Message()
                     << W << " workers, trial " << trial << ", chunks of " << chunk);
        std::vector<ChunkedWorker> w(W);
        std::vector<std::unique_ptr<WatchedCommunicator>> watched(W);
        for (int r = 0; r < W; ++r) Seed(w[r], r, owner, sources, S);
        strata::testing::RunGlooWorkers(W, 30s, [&](comm::Communicator* c, int r) {
          watched[r] = std::make_unique<WatchedCommunicator>(c);
          ChunkedMoveOne(watched[r].get(), r, owner, sources, S, chunk, w[r]);
        });
        for (int r = 0; r < W; ++r) {
          SCOPED_TRACE(::testing::Message() << "worker " << r);
          ASSERT_TRUE(w[r].status.ok()) << w[r].status;
          EXPECT_EQ(w[r].moved, moved);
          EXPECT_TRUE(w[r].violations.empty()) << w[r].violations.front();
          // The same number of collectives everywhere; at least as many rounds as the busiest
          // worker's floats need, plus the closing exchange.
          EXPECT_EQ(watched[r]->sent.size(), watched[0]->sent.size());
          if (moved > 0) {
            EXPECT_GE(static_cast<int64_t>(watched[r]->sent.size()),
                      (busiest + chunk - 1) / chunk + 1);
          }
          // Buffers: a chunk of pieces and a status word per peer, each way, every round.
          for (size_t k = 0; k < watched[r]->sent.size(); ++k) {
            EXPECT_LE(watched[r]->sent[k], chunk + W - 1) << "round " << k;
            EXPECT_LE(watched[r]->received[k], chunk + W - 1) << "round " << k;
          }
          for (const auto& [k, n] : w[r].read_in_round) EXPECT_LE(n, chunk) << "round " << k;
          for (const auto& [k, n] : w[r].written_in_round) EXPECT_LE(n, chunk) << "round " << k;
          // Every blob it owns or sourced, bitwise; every moved-in float written once.
          for (const auto& [e, blob] : w[r].blobs) {
            std::vector<float> want(S);
            for (int64_t i = 0; i < S; ++i) want[i] = PieceValue(e, i);
            EXPECT_TRUE(SameBits(blob, want)) << "expert " << e;
          }
          for (const auto& [e, times] : w[r].writes) {
            EXPECT_EQ(times, std::vector<int>(S, 1)) << "expert " << e;
          }
        }
      }
    }
  }
}

TEST(StateSyncTest, ChunkedMovesEndAsMoveExpertsDoes) {
  // The scenario of FourWorkersOneLostOneJoined, moved both ways over the same communicators: each
  // owner's blobs after the chunked move (its own copies, which stay, and what was written) are
  // MoveExperts' bitwise.
  constexpr int W = 4;
  const std::vector<int> owner = {0, 0, 1, 1, 2, 2, 3, 3};
  CopySources sources;
  sources.expert = {0, 0, 1, 1, 2, 2, 0, 0};
  std::mt19937 rng(7);
  std::vector<int> more_owner;
  CopySources more_sources;
  RandomPlan(rng, W, 11, &more_owner, &more_sources);
  struct Plan {
    std::vector<int> owner;
    CopySources sources;
  };
  for (const Plan& plan : {Plan{owner, sources}, Plan{more_owner, more_sources}}) {
    const std::vector<int>& own = plan.owner;
    const CopySources& src = plan.sources;
    const int64_t n = static_cast<int64_t>(own.size());
    std::vector<MovedExperts> whole(W);
    std::vector<ChunkedWorker> chunked(W);
    for (int r = 0; r < W; ++r) Seed(chunked[r], r, own, src, kExpertFloats);
    strata::testing::RunGlooWorkers(W, 30s, [&](comm::Communicator* c, int r) {
      const ReadItem read = [&](size_t item, float* dst) {
        const int64_t e = static_cast<int64_t>(item) - 1;
        for (int64_t i = 0; i < kExpertFloats; ++i) dst[i] = PieceValue(e, i);
      };
      StatusOr<MovedExperts> m = MoveExperts(c, own, src, kExpertFloats, read);
      ASSERT_TRUE(m.ok()) << m.status();
      whole[r] = *m;
      WatchedCommunicator watched(c);
      ChunkedMoveOne(&watched, r, own, src, kExpertFloats, /*chunk=*/3, chunked[r]);
    });
    for (int r = 0; r < W; ++r) {
      SCOPED_TRACE(::testing::Message() << "worker " << r);
      ASSERT_TRUE(chunked[r].status.ok()) << chunked[r].status;
      EXPECT_EQ(chunked[r].moved, whole[r].moved);
      std::vector<float> mine;
      for (int64_t e = 0; e < n; ++e) {
        if (own[e] != r) continue;
        const std::vector<float>& b = chunked[r].blobs.at(e);
        mine.insert(mine.end(), b.begin(), b.end());
      }
      EXPECT_TRUE(SameBits(mine, whole[r].blobs));
    }
  }
}

TEST(StateSyncTest, AWorkerAloneMovesNothingInChunks) {
  CopySources sources;
  sources.expert = {0, 0, 0};
  int calls = 0;
  StatusOr<int64_t> moved = MoveExpertsInChunks(
      nullptr, {0, 0, 0}, sources, 4, 2,
      [&](size_t, int64_t, int64_t, float*) {
        ++calls;
        return absl::OkStatus();
      },
      [&](size_t, int64_t, int64_t, const float*) {
        ++calls;
        return absl::OkStatus();
      });
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, 0);
  EXPECT_EQ(calls, 0);
}

TEST(StateSyncTest, AFailedReadOrWriteStopsEveryWorkerAfterTheSameRound) {
  // Rank 1 sends experts 0-2 to rank 0 and receives 3-5 from rank 2 in chunks of 4 floats (of
  // blobs of 5); rank 3 only watches. A failure of rank 1 must end the move on every worker with
  // an error well before the communicators' timeout (60 s).
  constexpr int W = 4;
  constexpr int64_t S = 5, chunk = 4;
  const std::vector<int> owner = {0, 0, 0, 1, 1, 1};
  CopySources sources;
  sources.expert = {1, 1, 1, 2, 2, 2};
  const size_t rounds = PlanExpertChunks(owner, sources, S, chunk).rounds.size();
  ASSERT_EQ(rounds, 4u);  // 15 floats each way, 4 a round
  struct Case {
    const char* name;
    std::function<bool(size_t)> fail_read, fail_write;
    std::string own_error;
    size_t collectives;  // how many every worker makes before it stops
  };
  const std::vector<Case> cases = {
      {"read in round 2", [](size_t k) { return k == 1; }, nullptr,
       "from rank 1 to rank 0, round 2 of 4: reading it failed: the disk is gone", 2},
      {"write in the last round", nullptr, [&](size_t k) { return k == rounds; },
       "from rank 2 to rank 1, round 4 of 4: writing it failed: the disk is full", rounds + 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<ChunkedWorker> w(W);
    std::vector<std::unique_ptr<WatchedCommunicator>> watched(W);
    for (int r = 0; r < W; ++r) Seed(w[r], r, owner, sources, S);
    const auto t0 = std::chrono::steady_clock::now();
    strata::testing::RunGlooWorkers(W, 60s, [&](comm::Communicator* comm, int r) {
      watched[r] = std::make_unique<WatchedCommunicator>(comm);
      ChunkedMoveOne(watched[r].get(), r, owner, sources, S, chunk, w[r],
                     r == 1 ? c.fail_read : nullptr, r == 1 ? c.fail_write : nullptr);
    });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
    for (int r = 0; r < W; ++r) {
      SCOPED_TRACE(::testing::Message() << "worker " << r);
      EXPECT_EQ(watched[r]->sent.size(), c.collectives);
      if (r == 1) {
        EXPECT_NE(w[r].status.code(), absl::StatusCode::kAborted) << w[r].status;
        EXPECT_NE(w[r].status.message().find(c.own_error), std::string::npos) << w[r].status;
      } else {
        EXPECT_EQ(w[r].status.code(), absl::StatusCode::kAborted) << w[r].status;
        EXPECT_NE(w[r].status.message().find("rank(s) 1 could not read or write"),
                  std::string::npos)
            << w[r].status;
      }
    }
  }
}

}  // namespace
}  // namespace strata::train
