// The elastic worker's heartbeat against a scripted coordinator in this process: a newer
// generation aborts (with its number and reason) while the one training does not; a coordinator
// that no longer counts the worker expels it and aborts once; a coordinator that stops answering
// is recorded as unreachable and attached to again once it answers; after set_abort(nullptr) the
// old callback is not called again.
#include "train/heartbeat.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace strata::train {
namespace {

// Answers every heartbeat with `answer` (changed by the test) and counts the calls.
class ScriptedMembership : public Membership {
 public:
  std::string address() const override { return "scripted:1"; }
  StatusOr<coordinator::JoinReply> Join(const coordinator::WorkerInfo&) override {
    return absl::UnimplementedError("not in this test");
  }
  StatusOr<coordinator::Generation> Heartbeat(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++heartbeats_;
    last_id_ = id;
    return answer_;
  }
  StatusOr<coordinator::Generation> ReportStep(const std::string&, int64_t, int64_t, double,
                                               double) override {
    return absl::UnimplementedError("not in this test");
  }
  StatusOr<coordinator::Generation> ReportStart(const std::string&, int64_t, int64_t,
                                                const std::vector<int64_t>&) override {
    return absl::UnimplementedError("not in this test");
  }
  Status ReportCheckpoint(const std::string&, int64_t, int64_t, bool) override {
    return absl::UnimplementedError("not in this test");
  }
  Status Attach(const std::string&) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++attaches_;
    return absl::OkStatus();
  }
  Status Detach(bool) override { return absl::OkStatus(); }
  StatusOr<coordinator::CoordinatorRecord> GetStatus() override {
    return absl::UnimplementedError("not in this test");
  }
  std::shared_ptr<comm::Store> store() override { return nullptr; }

  void Answer(StatusOr<coordinator::Generation> answer) {
    std::lock_guard<std::mutex> lock(mu_);
    answer_ = std::move(answer);
    heartbeats_ = 0;
  }
  int heartbeats() {
    std::lock_guard<std::mutex> lock(mu_);
    return heartbeats_;
  }
  int attaches() {
    std::lock_guard<std::mutex> lock(mu_);
    return attaches_;
  }
  std::string last_id() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_id_;
  }

 private:
  std::mutex mu_;
  StatusOr<coordinator::Generation> answer_ = absl::UnavailableError("no answer yet");
  int heartbeats_ = 0, attaches_ = 0;
  std::string last_id_;
};

coordinator::Generation Gen(int64_t number, const std::string& reason) {
  coordinator::Generation g;
  g.set_number(number);
  g.set_reason(reason);
  return g;
}

struct AbortCall {
  std::string why;
  int64_t newer = 0;
};

class HeartbeatTest : public ::testing::Test {
 protected:
  // Waits until the scripted coordinator has answered `n` heartbeats since its last Answer.
  void WaitForBeats(int n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (membership_.heartbeats() < n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_GE(membership_.heartbeats(), n) << "the heartbeat thread did not beat";
  }
  std::vector<AbortCall> Calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  Heartbeat::Abort Recorder() {
    return [this](const std::string& why, int64_t newer) {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back({why, newer});
    };
  }

  ScriptedMembership membership_;
  Heartbeat heartbeat_{membership_, "w7", std::chrono::milliseconds(1)};
  std::mutex mu_;
  std::vector<AbortCall> calls_;
};

TEST_F(HeartbeatTest, OnlyANewerGenerationThanTheOneTrainingAborts) {
  membership_.Answer(Gen(3, "3 workers joined"));
  heartbeat_.set_training_generation(3);
  heartbeat_.set_abort(Recorder());
  heartbeat_.Start();
  WaitForBeats(3);
  EXPECT_EQ(membership_.last_id(), "w7");
  EXPECT_EQ(heartbeat_.latest_generation()->load(), 3);
  EXPECT_TRUE(Calls().empty()) << Calls()[0].why;

  membership_.Answer(Gen(4, "worker w2 failed"));
  WaitForBeats(2);
  heartbeat_.Stop();
  EXPECT_EQ(heartbeat_.latest_generation()->load(), 4);
  const std::vector<AbortCall> calls = Calls();
  ASSERT_FALSE(calls.empty());
  for (const AbortCall& c : calls) {
    EXPECT_EQ(c.why, "generation 4 formed (worker w2 failed)");
    EXPECT_EQ(c.newer, 4);
  }
  EXPECT_FALSE(heartbeat_.expelled()->load());
  EXPECT_EQ(heartbeat_.unreachable_ms().load(), 0) << "every heartbeat was answered";
}

TEST_F(HeartbeatTest, AWorkerTheCoordinatorNoLongerCountsIsExpelledAndAbortsOnce) {
  heartbeat_.set_abort(Recorder());
  membership_.Answer(absl::NotFoundError("worker w7 is not part of the job"));
  heartbeat_.Start();
  WaitForBeats(5);
  heartbeat_.Stop();
  EXPECT_TRUE(heartbeat_.expelled()->load());
  const std::vector<AbortCall> calls = Calls();
  ASSERT_EQ(calls.size(), 1u) << "expelled once, aborted once";
  EXPECT_EQ(calls[0].why, "the coordinator declared this worker failed");
  EXPECT_EQ(calls[0].newer, std::numeric_limits<int64_t>::max());
}

TEST_F(HeartbeatTest, ACoordinatorThatStopsAnsweringIsRecordedAndAttachedToAgain) {
  membership_.Answer(absl::UnavailableError("connection refused"));
  const int64_t before = SteadyMs();
  heartbeat_.Start();
  WaitForBeats(2);
  EXPECT_GE(heartbeat_.unreachable_ms().load(), before);
  EXPECT_EQ(membership_.attaches(), 0) << "no reattaching while it does not answer";
  membership_.Answer(Gen(1, "1 worker joined"));
  WaitForBeats(3);
  heartbeat_.Stop();
  EXPECT_EQ(membership_.attaches(), 1) << "attached again once, when it answered";
  EXPECT_EQ(heartbeat_.latest_generation()->load(), 1);
  EXPECT_TRUE(Calls().empty()) << "no trainer was set: nothing to abort";
}

TEST_F(HeartbeatTest, AfterSetAbortNullTheOldCallbackIsNotCalled) {
  membership_.Answer(Gen(2, "a worker joined"));
  heartbeat_.set_training_generation(1);
  heartbeat_.set_abort(Recorder());
  heartbeat_.Start();
  WaitForBeats(2);
  heartbeat_.set_abort(nullptr);
  const size_t seen = Calls().size();
  EXPECT_GE(seen, 1u);
  WaitForBeats(3);
  membership_.Answer(Gen(2, "a worker joined"));
  WaitForBeats(3);
  heartbeat_.Stop();
  EXPECT_EQ(Calls().size(), seen) << "a callback ran after set_abort(nullptr) returned";
}

}  // namespace
}  // namespace strata::train
