// The rendezvous stores and the Gloo communicator with the real parts: FileStore on a real
// folder shared by threads and processes, and collectives between real worker processes over
// loopback TCP (tests/runtime/comm_worker.cc checks every result against a local reference),
// including a peer killed with SIGKILL in the middle of a collective, and Abort; and the
// hierarchical all-to-all of several processes per "node" against the flat one.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/communicator.h"
#include "runtime/comm/hierarchical.h"
#include "runtime/comm/staging.h"
#include "runtime/comm/store.h"
#include "tests/test_util.h"

namespace strata::comm {
namespace {

using strata::testing::TempDir;
using namespace std::chrono_literals;

void ExerciseStore(Store& s) {
  EXPECT_TRUE(absl::IsNotFound(s.Get("a").status()));
  ASSERT_TRUE(s.Set("a", std::string("x\0y", 3)).ok());
  EXPECT_EQ(*s.Get("a"), std::string("x\0y", 3));
  ASSERT_TRUE(s.Set("a", "replaced").ok());
  EXPECT_EQ(*s.Get("a"), "replaced");
  ASSERT_TRUE(s.Set("odd/key with spaces:1", "v").ok());
  EXPECT_EQ(*s.Get("odd/key with spaces:1"), "v");
  // Wait: a key set later by another thread; and a timeout that names what is missing.
  auto setter = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(50ms);
    return s.Set("late", "1");
  });
  EXPECT_TRUE(s.Wait({"a", "late"}, 5000ms).ok());
  EXPECT_TRUE(setter.get().ok());
  const auto t0 = std::chrono::steady_clock::now();
  Status w = s.Wait({"a", "never"}, 100ms);
  EXPECT_TRUE(absl::IsDeadlineExceeded(w)) << w;
  EXPECT_NE(w.message().find("never"), std::string::npos) << w;
  EXPECT_EQ(w.message().find("'a'"), std::string::npos) << w;  // only the missing key is named
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  // Add from 4 threads at once: no increment is lost.
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 25; ++i) ASSERT_TRUE(s.Add("counter", 2).ok());
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(*s.Add("counter", 0), 200);
  EXPECT_EQ(*s.Add("counter", -50), 150);
  EXPECT_TRUE(absl::IsFailedPrecondition(s.Add("a", 1).status()));  // not a counter
}

TEST(StoreTest, InMemory) {
  auto s = MakeInMemoryStore();
  ExerciseStore(*s);
}

TEST(StoreTest, FileStoreAndPrefixesKeepGenerationsApart) {
  TempDir dir;
  auto s = MakeFileStore(dir.path() + "/store");
  ASSERT_TRUE(s.ok()) << s.status();
  ExerciseStore(**s);
  auto g1 = MakePrefixStore(*s, GenerationPrefix(1));
  auto g2 = MakePrefixStore(*s, GenerationPrefix(2));
  ASSERT_TRUE(g1->Set("rank_0", "old address").ok());
  EXPECT_TRUE(absl::IsNotFound(g2->Get("rank_0").status()));
  EXPECT_TRUE(absl::IsDeadlineExceeded(g2->Wait({"rank_0"}, 50ms)));
  EXPECT_EQ(*(*s)->Get("gen/1/rank_0"), "old address");
  // A second store object on the same folder (another process would do the same) sees it all.
  auto other = MakeFileStore(dir.path() + "/store");
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(*(*other)->Get("gen/1/rank_0"), "old address");
  EXPECT_EQ(*(*other)->Add("counter", 1), 151);
}

TEST(StoreTest, ACancelledWaitEndsAtOnceAndOtherwiseBehavesLikeItsBase) {
  auto base = MakeInMemoryStore();
  std::atomic<bool> cancelled{false};
  auto s = MakeCancellableStore(
      base, [&] { return cancelled.load(); }, "generation 3 superseded");
  ExerciseStore(*s);
  // Not cancelled: a missing key is the base's deadline.
  EXPECT_TRUE(absl::IsDeadlineExceeded(s->Wait({"missing"}, 150ms)));
  // A key set meanwhile ends the wait.
  std::thread setter([&] {
    std::this_thread::sleep_for(250ms);
    ASSERT_TRUE(base->Set("late", "v").ok());
  });
  EXPECT_TRUE(s->Wait({"late"}, 10000ms).ok());
  setter.join();
  // Cancelled while waiting: ABORTED with the reason, long before the 10 s timeout.
  std::thread canceller([&] {
    std::this_thread::sleep_for(200ms);
    cancelled = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  Status w = s->Wait({"never"}, 10000ms);
  canceller.join();
  EXPECT_TRUE(absl::IsAborted(w)) << w;
  EXPECT_NE(w.message().find("generation 3 superseded"), std::string::npos) << w;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2000ms);
}

TEST(StoreTest, FileStoreInAFileIsAClearError) {
  TempDir dir;
  strata::testing::WriteFile(dir.File("plain"), "x");
  auto s = MakeFileStore(dir.File("plain"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("plain"), std::string::npos) << s.status();
}

pid_t Spawn(const std::vector<std::string>& args) {
  const std::string bin = std::string(STRATA_TEST_DIR) + "/comm_worker";
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(bin.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for a process for at most `limit`; kills it (and reports -1) if it does not finish.
int WaitExit(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(10ms);
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

std::vector<std::string> Args(int rank, int world, const std::string& store,
                              const std::string& scenario, int timeout_ms = 20000,
                              std::vector<std::string> more = {}) {
  std::vector<std::string> args = {
      "--rank", std::to_string(rank), "--world", std::to_string(world), "--store",
      store,    "--scenario",         scenario,  "--timeout-ms",        std::to_string(timeout_ms)};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, EveryCollectiveMatchesALocalReference) {
  const int world = GetParam();
  TempDir dir;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) pids.push_back(Spawn(Args(r, world, dir.path(), "collectives")));
  for (int r = 0; r < world; ++r) EXPECT_EQ(WaitExit(pids[r], 120s), 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Workers, CollectivesTest, ::testing::Values(2, 4));

// The same collectives and references through the staging communicator (staging.h) on the CPU
// device: its copies, its two-half pipelined all-reduce in 64 KiB chunks (the 1.5M-float and
// 700001-double sums take 92 and 86 chunks, the 1000-float one a partial chunk), and its buffers
// grown for the all-to-all-v, all-gather and broadcast. The rank-order sums are checked bit for
// bit: chunking must not change a single addition.
TEST_P(CollectivesTest, EveryCollectiveStagedThroughHostBuffersMatchesTheReference) {
  const int world = GetParam();
  TempDir dir;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pids.push_back(Spawn(Args(r, world, dir.path(), "collectives", 20000,
                              {"--staged-chunk-bytes", std::to_string(64 << 10)})));
  }
  for (int r = 0; r < world; ++r) EXPECT_EQ(WaitExit(pids[r], 120s), 0) << "rank " << r;
}

TEST(StagingTest, BadArgumentsAreClearErrors) {
  auto none = MakeStaging(nullptr, Device::Cpu());
  EXPECT_TRUE(absl::IsInvalidArgument(none.status())) << none.status();
  EXPECT_NE(none.status().message().find("no host communicator"), std::string::npos);
  // A one-rank Gloo communicator to wrap.
  CommOptions o;
  auto one = ConnectGloo(MakeInMemoryStore(), o);
  ASSERT_TRUE(one.ok()) << one.status();
  auto tiny = MakeStaging(*std::move(one), Device::Cpu(), StagingOptions{4});
  EXPECT_TRUE(absl::IsInvalidArgument(tiny.status())) << tiny.status();
  EXPECT_NE(tiny.status().message().find("chunk_bytes 4"), std::string::npos) << tiny.status();
}

// (nodes, local ranks per node): real processes on this machine standing in for the nodes.
class HierarchicalTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(HierarchicalTest, TwoLevelAllToAllVMatchesFlatAndReferenceBitForBit) {
  const auto [nodes, local] = GetParam();
  const int world = nodes * local;
  TempDir dir;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pids.push_back(Spawn(Args(r, world, dir.path(), "hierarchical", 20000,
                              {"--local-size", std::to_string(local)})));
  }
  for (int r = 0; r < world; ++r) EXPECT_EQ(WaitExit(pids[r], 120s), 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Layouts, HierarchicalTest,
                         ::testing::Values(std::pair{2, 2}, std::pair{1, 2}, std::pair{2, 1}),
                         [](const auto& info) {
                           return std::to_string(info.param.first) + "x" +
                                  std::to_string(info.param.second);
                         });

TEST(HierarchicalCommTest, AbortEndsEveryStage) {
  // 2 nodes x 2 local ranks as threads of this process. Rank 0 starts an AllToAllV that its
  // node's other rank never joins: Abort ends it, and every later call on rank 0 (whichever of
  // the three communicators it uses) is ABORTED; rank 1 fails fast instead of at its timeout.
  auto store = MakeInMemoryStore();
  constexpr int kWorld = 4;
  std::vector<std::future<StatusOr<std::unique_ptr<Communicator>>>> connects;
  for (int r = 0; r < kWorld; ++r) {
    connects.push_back(std::async(std::launch::async, [&store, r] {
      CommOptions o;
      o.rank = r;
      o.world_size = kWorld;
      o.timeout = 60s;
      return ConnectHierarchicalGloo(store, o, /*local_size=*/2);
    }));
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& f : connects) {
    auto c = f.get();
    ASSERT_TRUE(c.ok()) << c.status();
    comms.push_back(*std::move(c));
  }
  std::vector<int64_t> counts(kWorld, 3);
  std::vector<float> in(3 * kWorld, 1.f), out(3 * kWorld);
  const auto t0 = std::chrono::steady_clock::now();
  auto waiting = std::async(std::launch::async, [&] {
    return comms[0]->AllToAllV(in.data(), counts, out.data(), counts);
  });
  std::this_thread::sleep_for(300ms);
  comms[0]->Abort("membership changed (test)");
  Status s = waiting.get();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_TRUE(absl::IsAborted(comms[0]->AllToAllV(in.data(), counts, out.data(), counts)));
  EXPECT_TRUE(absl::IsAborted(comms[0]->AllReduce(in.data(), in.size())));
  EXPECT_TRUE(absl::IsAborted(comms[0]->Barrier()));
  const auto t1 = std::chrono::steady_clock::now();
  Status peer = comms[1]->AllToAllV(in.data(), counts, out.data(), counts);
  EXPECT_FALSE(peer.ok());
  EXPECT_NE(peer.message().find("hierarchical AllToAllV on rank 1 of 4"), std::string::npos)
      << peer;
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 30s);
}

TEST(HierarchicalCommTest, LayoutsThatDoNotFitAreInvalid) {
  CommOptions o;
  o.world_size = 3;
  EXPECT_TRUE(absl::IsInvalidArgument(
      ConnectHierarchicalGloo(MakeInMemoryStore(), o, /*local_size=*/2).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(MakeHierarchical(nullptr, nullptr, nullptr, 1).status()));
}

// Each survivor checks that its error names the killed rank ("peer rank 2 ([127.0.0.1]:port)");
// in Gloo's all-gather, a peer rank (see comm_worker.cc).
// The operation; "staged_<op>" runs it through the staging communicator (64 KiB chunks), whose
// errors must name the operation and the peer as the host communicator's do.
class CommFailureKillTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CommFailureKillTest, PeerKilledMidCollectiveIsAnErrorWithinTheTimeout) {
  TempDir dir;
  const int world = 3, victim = 2;
  std::string op = GetParam();
  std::vector<std::string> more = {"--victim", std::to_string(victim)};
  if (op.rfind("staged_", 0) == 0) {
    op = op.substr(7);
    more.insert(more.end(), {"--staged-chunk-bytes", std::to_string(64 << 10)});
  }
  more.insert(more.end(), {"--op", op});
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pids.push_back(Spawn(
        Args(r, world, dir.path(), r == victim ? "victim" : "survivor", /*timeout=*/5000, more)));
  }
  // Once every rank has met, the survivors are inside a collective that needs the victim.
  auto store = MakeFileStore(dir.path());
  ASSERT_TRUE(store.ok());
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline) {
    auto n = (*store)->Get("ready");
    if (n.ok() && *n == std::to_string(world)) break;
    std::this_thread::sleep_for(10ms);
  }
  std::this_thread::sleep_for(200ms);
  ASSERT_EQ(kill(pids[victim], SIGKILL), 0);
  EXPECT_EQ(WaitExit(pids[victim], 10s), 128 + SIGKILL);
  for (int r = 0; r < world; ++r) {
    if (r != victim) {
      EXPECT_EQ(WaitExit(pids[r], 30s), 0) << "survivor " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CommFailureKillTest,
                         ::testing::Values("allreduce", "allgather", "staged_allreduce"),
                         [](const auto& info) { return std::string(info.param); });

TEST(CommFailureTest, AHungPeerIsADeadlineThatNamesIt) {
  // Rank 1 is connected but never joins: rank 0's call ends at its timeout, naming rank 1.
  auto store = MakeInMemoryStore();
  auto connect = [&](int rank) {
    CommOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.timeout = 2000ms;  // the rendezvous too: room for a loaded machine
    return ConnectGloo(store, o);
  };
  auto f1 = std::async(std::launch::async, connect, 1);
  auto c0 = connect(0);
  auto c1 = f1.get();
  ASSERT_TRUE(c0.ok()) << c0.status();
  ASSERT_TRUE(c1.ok()) << c1.status();
  for (int op = 0; op < 2; ++op) {
    std::vector<float> x(1000, 1.f);
    const auto t0 = std::chrono::steady_clock::now();
    Status s = op == 0 ? (*c0)->AllReduce(x.data(), x.size()) : (*c0)->Barrier();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
    if (op == 0) {
      EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
      EXPECT_NE(s.message().find("waiting for peer rank 1 ("), std::string::npos) << s;
    } else {
      EXPECT_TRUE(absl::IsAborted(s)) << s;  // finished after the failure
    }
  }
}

TEST(CommFailureTest, AbortUnblocksAWaitingCall) {
  // Two ranks in this process; rank 1 never joins the AllReduce, so rank 0 would wait for the
  // whole (long) timeout — Abort from another thread ends it at once.
  auto store = MakeInMemoryStore();
  CommOptions o;
  o.world_size = 2;
  o.timeout = 60s;
  auto connect = [&](int rank) {
    CommOptions ro = o;
    ro.rank = rank;
    return ConnectGloo(store, ro);
  };
  auto f1 = std::async(std::launch::async, connect, 1);
  auto c0 = connect(0);
  auto c1 = f1.get();
  ASSERT_TRUE(c0.ok()) << c0.status();
  ASSERT_TRUE(c1.ok()) << c1.status();
  std::vector<float> x(1000, 1.f);
  const auto t0 = std::chrono::steady_clock::now();
  auto waiting =
      std::async(std::launch::async, [&] { return (*c0)->AllReduce(x.data(), x.size()); });
  std::this_thread::sleep_for(300ms);
  (*c0)->Abort("membership changed (test)");
  Status s = waiting.get();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("membership changed (test)"), std::string::npos) << s;
  EXPECT_LT(took, 10s);
  EXPECT_TRUE(absl::IsAborted((*c0)->Barrier()));
  // The peer's next call fails fast too instead of waiting for the timeout.
  const auto t1 = std::chrono::steady_clock::now();
  Status peer = (*c1)->Barrier();
  EXPECT_FALSE(peer.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 30s);
}

}  // namespace
}  // namespace strata::comm
