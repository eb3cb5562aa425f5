// WorkerComms (train/worker_comms.h) with real Gloo communicators in this process: an abort of an
// older generation is ignored, a newer one aborts the collectives and marks the checkpoint in
// flight abandoned, a communicator that connects after the abort is born aborted, and one process
// (no communicator) sums and waits for nobody.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "runtime/comm/store.h"
#include "train/worker_comms.h"

namespace strata::train {
namespace {

TEST(WorkerCommsTest, AbortsOnlyForANewerGenerationAndWhatConnectsAfterIsBornAborted) {
  WorkerComms comms;
  comms.Reset(/*generation=*/5);
  const auto store = comm::MakeInMemoryStore();
  comm::CommOptions co;
  co.timeout = std::chrono::seconds(10);
  const WorkerComms::Layout alone{0, 1, 1, 0};
  ASSERT_TRUE(comms.Connect(comm::MakePrefixStore(store, "g5/"), co, alone, nullptr).ok());
  ASSERT_NE(comms.world(), nullptr);
  EXPECT_EQ(comms.ep(), nullptr);  // groups of one worker: no group communicator
  const auto abandoned = comms.CheckpointAbandonFlag();
  EXPECT_FALSE(abandoned->load());

  // A late abort, for the generation the communicators already belong to: nothing happens.
  comms.Abort("late", /*newer_generation=*/5);
  EXPECT_FALSE(abandoned->load());
  EXPECT_TRUE(comms.Barrier().ok());
  double x[2] = {1.5, -2};
  ASSERT_TRUE(comms.SumOverWorkers(x, 2).ok());
  EXPECT_EQ(x[0], 1.5);  // the sum over one worker
  EXPECT_EQ(x[1], -2);

  // A newer generation: the collectives fail ABORTED, the checkpoint in flight is abandoned.
  comms.Abort("generation 6 formed", /*newer_generation=*/6);
  EXPECT_TRUE(abandoned->load());
  const Status after = comms.Barrier();
  EXPECT_EQ(after.code(), absl::StatusCode::kAborted) << after;
  // The flag of a checkpoint opened now is set from the start.
  EXPECT_TRUE(comms.CheckpointAbandonFlag()->load());
  // A communicator that finishes connecting after the abort is aborted at once.
  ASSERT_TRUE(comms.Connect(comm::MakePrefixStore(store, "late/"), co, alone, nullptr).ok());
  EXPECT_EQ(comms.Barrier().code(), absl::StatusCode::kAborted);

  // The next generation starts clean; without communicators it is one process.
  comms.Reset(6);
  EXPECT_EQ(comms.world(), nullptr);
  EXPECT_FALSE(comms.CheckpointAbandonFlag()->load());
  EXPECT_TRUE(comms.Barrier().ok());
  ASSERT_TRUE(comms.SumOverWorkers(x, 1).ok());
  EXPECT_EQ(x[0], 1.5);
}

TEST(WorkerCommsTest, AConnectThatANewerGenerationSupersedesGivesUp) {
  WorkerComms comms;
  comm::CommOptions co;
  co.timeout = std::chrono::seconds(3);
  // Two workers, and the other never comes: the connect would wait out its timeout.
  const auto started = std::chrono::steady_clock::now();
  const Status s = comms.Connect(comm::MakeInMemoryStore(), co, {0, 2, 2, 0}, [&] {
    return std::chrono::steady_clock::now() - started > std::chrono::milliseconds(200);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("world/"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(2));
  EXPECT_EQ(comms.world(), nullptr);
  // The connect left behind ends at its timeout; the process outlives it.
  std::this_thread::sleep_for(std::chrono::seconds(4));
}

}  // namespace
}  // namespace strata::train
