// The elastic worker's membership loop (train/elastic_worker.h) against a coordinator faked in
// this process: workers are threads, the rendezvous store is in memory. A generation of one
// worker trains to the end with the single process's losses; a joiner supersedes the generation
// and both workers re-form and finish the job together; a job that finishes while a worker waits
// ends it cleanly; a coordinator that never answers ends the worker with the documented error
// after elastic.coordinator_patience_ms.
#include "train/elastic_worker.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;
using strata::testing::WriteFile;

constexpr int kSteps = 8;

config::JobConfig TinyJob(const std::string& data_path) {
  return strata::testing::TinyMoeJob(data_path, R"pb(
    train {
      steps: 8
      global_batch: 8
      lr: 0.003
      warmup_steps: 2
      eval_every: 0
      eval_batches: 1
      threads: 1
    }
    elastic { heartbeat_timeout_ms: 100 restart_grace_ms: 100 coordinator_patience_ms: 1000 }
  )pb");
}

// A coordinator in this process: the first `initial` joiners form generation 1; a later joiner
// is admitted at the next step a member reports (a new generation holding every member and it).
// Records every call the workers make. HoldStepUntilJoins makes a report of one step wait (after
// it is recorded) until enough workers have joined, so that a joiner is admitted at that step
// however fast the others train.
class FakeMembership : public Membership {
 public:
  struct Report {
    std::string id;
    int64_t generation = 0, step = 0;
    double loss = 0;
  };
  struct Start {
    std::string id;
    int64_t generation = 0, step = 0;
    std::vector<int64_t> experts_per_worker;
  };

  explicit FakeMembership(int initial) : initial_(initial) {}

  std::string address() const override { return "fake:7777"; }

  StatusOr<coordinator::JoinReply> Join(const coordinator::WorkerInfo& info) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++join_calls_;
    joined_.notify_all();
    if (!join_error_.ok()) return join_error_;
    pending_.push_back(info);
    if (generation_.number() == 0 && static_cast<int>(pending_.size()) == initial_) {
      FormGeneration(absl::StrFormat("%d workers joined", initial_));
    }
    return coordinator::JoinReply();
  }
  StatusOr<coordinator::Generation> Heartbeat(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (expelled_ && id == expel_id_) return NotPartOfTheJob(id);
    return generation_;
  }
  StatusOr<coordinator::Generation> ReportStep(const std::string& id, int64_t generation,
                                               int64_t step, double loss, double) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (id == expel_id_ && step >= expel_step_) {
      // Declared failed: heartbeats hear it at once; this report is answered only after a
      // while, so that the worker learns it from its heartbeats first.
      expelled_ = true;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      return NotPartOfTheJob(id);
    }
    if (generation != generation_.number()) {
      return absl::FailedPreconditionError("generation is not current");
    }
    reports_.push_back({id, generation, step, loss});
    if (step == hold_step_ && !joined_.wait_for(lock, std::chrono::seconds(60),
                                                [&] { return join_calls_ >= hold_joins_; })) {
      ADD_FAILURE() << "the report of step " << step << " waited 60 s for " << hold_joins_
                    << " joins and got " << join_calls_;
    }
    if (step >= kSteps) finished_ = true;
    if (!pending_.empty()) FormGeneration("a worker joined");
    step_ = std::max(step_, step);
    return generation_;
  }
  StatusOr<coordinator::Generation> ReportStart(
      const std::string& id, int64_t generation, int64_t step,
      const std::vector<int64_t>& experts_per_worker) override {
    std::lock_guard<std::mutex> lock(mu_);
    starts_.push_back({id, generation, step, experts_per_worker});
    return generation_;
  }
  Status ReportCheckpoint(const std::string&, int64_t, int64_t, bool) override {
    return absl::OkStatus();
  }
  Status Attach(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    attached_.push_back(id);
    return absl::OkStatus();
  }
  Status Detach(bool finished) override {
    std::lock_guard<std::mutex> lock(mu_);
    detached_.push_back(finished);
    return absl::OkStatus();
  }
  StatusOr<coordinator::CoordinatorRecord> GetStatus() override {
    std::lock_guard<std::mutex> lock(mu_);
    coordinator::CoordinatorRecord r;
    r.set_finished(finished_);
    r.set_step(step_);
    *r.mutable_generation() = generation_;
    return r;
  }
  std::shared_ptr<comm::Store> store() override { return store_; }

  void FailJoinsWith(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    join_error_ = std::move(s);
  }
  // A report of `step` returns only once `joins` Join calls have come (or after 60 s, failing
  // the test).
  void HoldStepUntilJoins(int64_t step, int joins) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_step_ = step;
    hold_joins_ = joins;
  }
  void FinishJob() {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
  }
  // From its report of `step` on, the coordinator no longer counts worker `id` in the job.
  void ExpelAt(const std::string& id, int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    expel_id_ = id;
    expel_step_ = step;
  }
  // Copies, taken under the lock.
  std::vector<Report> reports() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reports_;
  }
  std::vector<Start> starts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return starts_;
  }
  std::vector<std::string> attached() const {
    std::lock_guard<std::mutex> lock(mu_);
    return attached_;
  }
  std::vector<bool> detached() const {
    std::lock_guard<std::mutex> lock(mu_);
    return detached_;
  }
  int join_calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return join_calls_;
  }

 private:
  static Status NotPartOfTheJob(const std::string& id) {
    return absl::NotFoundError(absl::StrFormat(
        "worker '%s' is not part of the job (it never joined, or it was declared failed)", id));
  }
  void FormGeneration(const std::string& reason) {
    coordinator::Generation next;
    next.set_number(generation_.number() + 1);
    next.set_reason(reason);
    for (const auto& w : generation_.workers()) *next.add_workers() = w;
    for (const auto& w : pending_) *next.add_workers() = w;
    pending_.clear();
    generation_ = next;
  }

  const int initial_;
  mutable std::mutex mu_;
  std::condition_variable joined_;  // notified at every Join
  std::shared_ptr<comm::Store> store_ = comm::MakeInMemoryStore();
  coordinator::Generation generation_;  // number 0: none formed yet
  std::vector<coordinator::WorkerInfo> pending_;
  Status join_error_;
  bool finished_ = false;
  int64_t step_ = 0;
  int join_calls_ = 0;
  int64_t hold_step_ = -1;  // none
  int hold_joins_ = 0;
  std::string expel_id_;
  int64_t expel_step_ = -1;
  bool expelled_ = false;
  std::vector<Report> reports_;
  std::vector<Start> starts_;
  std::vector<std::string> attached_;
  std::vector<bool> detached_;
};

class ElasticWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override { WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(60000)); }
  ElasticWorkerOptions Options(const std::string& id) {
    ElasticWorkerOptions o;
    o.info.set_id(id);
    o.info.set_host("127.0.0.1");
    o.train.config = TinyJob(dir_.File("text.txt"));
    o.train.progress = false;
    return o;
  }
  // The losses of the job trained by one plain process, step by step (1-based).
  std::vector<double> SingleProcessLosses() {
    TrainOptions o;
    o.config = TinyJob(dir_.File("text.txt"));
    o.progress = false;
    auto t = Trainer::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return {};
    EXPECT_TRUE((*t)->Run().ok());
    std::vector<double> losses = {0};
    for (const auto& r : (*t)->history()) losses.push_back(r.loss);
    return losses;
  }
  // The losses of steps s+1.. of a failure-free replay of a job that ran on worker a alone for
  // `s` steps and on a and b after: one process trains the job (its learning-rate schedule runs
  // to kSteps) and checkpoints step s, stopping right after; then two workers (threads over an
  // in-memory store) resume that checkpoint. Per rank.
  std::vector<std::map<int64_t, double>> ReplayLosses(int64_t s) {
    config::JobConfig cfg = TinyJob(dir_.File("text.txt"));
    cfg.mutable_checkpoint()->set_dir(dir_.File("replay"));
    cfg.mutable_checkpoint()->set_every(static_cast<uint32_t>(s));
    {
      TrainOptions o;
      o.config = cfg;
      o.progress = false;
      // The checkpoint of step s is written after its report; step s + 1's report stops the run.
      o.on_step = [s](const StepResult& r) {
        return r.step > s ? absl::CancelledError("the replay's first membership ends here")
                          : absl::OkStatus();
      };
      auto t = Trainer::Create(o);
      EXPECT_TRUE(t.ok()) << t.status();
      if (!t.ok()) return {};
      EXPECT_EQ((*t)->Run().code(), absl::StatusCode::kCancelled);
    }
    cfg.mutable_checkpoint()->set_every(0);
    std::vector<std::map<int64_t, double>> losses(2);
    auto store = comm::MakeInMemoryStore();
    std::vector<std::thread> workers;
    for (int rank = 0; rank < 2; ++rank) {
      workers.emplace_back([&, rank] {
        TrainOptions o;
        o.config = cfg;
        o.progress = false;
        o.resume = true;
        o.worker.rank = rank;
        o.worker.world_size = 2;
        o.worker.store = store;
        o.worker.elastic = true;
        auto t = Trainer::Create(o);
        EXPECT_TRUE(t.ok()) << t.status();
        if (!t.ok()) return;
        EXPECT_EQ((*t)->resumed_from(), s);
        EXPECT_TRUE((*t)->Run().ok());
        for (const auto& r : (*t)->history()) losses[rank][r.step] = r.loss;
      });
    }
    for (auto& w : workers) w.join();
    return losses;
  }
  TempDir dir_;
};

// What on_end saw, copied while the trainer was still alive.
struct SeenEnd {
  int calls = 0;
  Status status;
  std::string message;
  bool trained = false;
  int rank = -1;
  int64_t trainer_step = -1;
};

std::function<void(const ElasticWorkerEnd&)> Record(SeenEnd* seen) {
  return [seen](const ElasticWorkerEnd& end) {
    ++seen->calls;
    seen->status = end.status;
    seen->message = end.message;
    seen->trained = end.trainer != nullptr;
    seen->rank = end.rank;
    if (end.trainer != nullptr) seen->trainer_step = end.trainer->step();
  };
}

TEST_F(ElasticWorkerTest, AOneWorkerGenerationTrainsToTheEndWithTheSingleProcessLosses) {
  const std::vector<double> expected = SingleProcessLosses();
  ASSERT_EQ(expected.size(), kSteps + 1u);

  FakeMembership coordinator(/*initial=*/1);
  ElasticWorkerOptions o = Options("a");
  SeenEnd seen;
  o.on_end = Record(&seen);
  ASSERT_TRUE(RunElasticWorker(coordinator, std::move(o)).ok());

  EXPECT_EQ(seen.calls, 1);
  EXPECT_TRUE(seen.status.ok());
  EXPECT_TRUE(seen.message.empty());
  EXPECT_TRUE(seen.trained);
  EXPECT_EQ(seen.rank, 0);
  EXPECT_EQ(seen.trainer_step, kSteps);
  // It started generation 1 at step 0 and reported every step once, with the loss one process
  // computes (one worker: the same arithmetic, bitwise).
  const auto starts = coordinator.starts();
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].generation, 1);
  EXPECT_EQ(starts[0].step, 0);
  const auto reports = coordinator.reports();
  ASSERT_EQ(reports.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(reports[i].generation, 1);
    EXPECT_EQ(reports[i].step, i + 1);
    EXPECT_EQ(reports[i].loss, expected[i + 1]) << "step " << i + 1;
  }
  EXPECT_EQ(coordinator.attached(), std::vector<std::string>({"a"}));
  EXPECT_EQ(coordinator.detached(), std::vector<bool>({true}));  // left as finished
}

TEST_F(ElasticWorkerTest, AJoinerSupersedesTheGenerationAndBothWorkersReformAndFinish) {
  const std::vector<double> single = SingleProcessLosses();
  ASSERT_EQ(single.size(), kSteps + 1u);

  FakeMembership coordinator(/*initial=*/1);
  // a's report of step 1 waits for b's Join, so b is admitted at step 1 however fast a trains.
  coordinator.HoldStepUntilJoins(/*step=*/1, /*joins=*/2);
  SeenEnd seen_a, seen_b;
  Status status_a, status_b;
  std::thread a([&] {
    ElasticWorkerOptions o = Options("a");
    o.on_end = Record(&seen_a);
    status_a = RunElasticWorker(coordinator, std::move(o));
  });
  // b joins once a trains alone (a has reported step 1 and waits there for b's Join); the fake
  // admits it at that report.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (coordinator.reports().empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::thread b([&] {
    ElasticWorkerOptions o = Options("b");
    o.on_end = Record(&seen_b);
    status_b = RunElasticWorker(coordinator, std::move(o));
  });
  a.join();
  b.join();
  ASSERT_TRUE(status_a.ok()) << status_a;
  ASSERT_TRUE(status_b.ok()) << status_b;
  EXPECT_TRUE(seen_a.trained);
  EXPECT_TRUE(seen_b.trained);
  EXPECT_EQ(seen_a.rank, 0);  // ranks in join order
  EXPECT_EQ(seen_b.rank, 1);
  EXPECT_EQ(seen_a.trainer_step, kSteps);
  EXPECT_EQ(seen_b.trainer_step, kSteps);

  // a started generation 1 at step 0; both started generation 2 at one step s, agreed on.
  const auto starts = coordinator.starts();
  ASSERT_EQ(starts.size(), 3u);
  EXPECT_EQ(starts[0].id, "a");
  EXPECT_EQ(starts[0].generation, 1);
  EXPECT_EQ(starts[0].step, 0);
  int64_t s = -1;
  std::vector<int64_t> placement;
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(starts[i].generation, 2);
    if (s < 0) s = starts[i].step;
    EXPECT_EQ(starts[i].step, s);
    if (starts[i].id == "a") placement = starts[i].experts_per_worker;  // rank 0's report
  }
  // Generation 1 reported at least one step (b waited for it), so the worker re-formed from it.
  ASSERT_GE(s, 1);
  ASSERT_LT(s, kSteps);
  // Rank 0 placed the 4 experts over the 2 workers, at least one each.
  ASSERT_EQ(placement.size(), 2u);
  EXPECT_EQ(placement[0] + placement[1], 4);
  EXPECT_GE(placement[0], 1);
  EXPECT_GE(placement[1], 1);

  // Every step of the job was reported: 1..s by a alone (the single process's losses, bitwise),
  // s+1..kSteps by both, each once, with the whole batch's loss (the same on both workers).
  std::map<int64_t, double> gen1;
  std::map<std::string, std::map<int64_t, double>> gen2;
  for (const auto& r : coordinator.reports()) {
    if (r.generation == 1) {
      EXPECT_EQ(r.id, "a");
      gen1[r.step] = r.loss;
    } else {
      EXPECT_EQ(r.generation, 2);
      EXPECT_TRUE(gen2[r.id].emplace(r.step, r.loss).second) << r.id << " step " << r.step;
    }
  }
  for (int64_t step = 1; step <= s; ++step) {
    ASSERT_TRUE(gen1.count(step)) << "step " << step;
    EXPECT_EQ(gen1[step], single[step]) << "step " << step;
  }
  ASSERT_EQ(gen2["a"].size(), static_cast<size_t>(kSteps - s));
  ASSERT_EQ(gen2["b"].size(), static_cast<size_t>(kSteps - s));
  // Those are the losses of two workers resuming a checkpoint of a's state after step s: b got
  // a's state, not a fresh model's.
  const auto replay = ReplayLosses(s);
  ASSERT_EQ(replay.size(), 2u);
  for (int64_t step = s + 1; step <= kSteps; ++step) {
    ASSERT_TRUE(gen2["a"].count(step) && gen2["b"].count(step)) << "step " << step;
    EXPECT_EQ(gen2["a"][step], gen2["b"][step]) << "step " << step;
    EXPECT_EQ(gen2["a"][step], replay[0].at(step)) << "step " << step;
    EXPECT_EQ(gen2["b"][step], replay[1].at(step)) << "step " << step;
  }
  EXPECT_EQ(coordinator.detached(), std::vector<bool>({true, true}));
}

// The heartbeat thread aborts a generation's collectives when it sees a newer one, and may do so
// late: after the worker has already re-formed into that newer generation. Such a late abort must
// not touch the generation it names; an abort for a generation beyond it still stops the step.
TEST_F(ElasticWorkerTest, ALateAbortForTheCurrentGenerationLeavesItTraining) {
  auto store = comm::MakeInMemoryStore();
  std::vector<std::unique_ptr<Trainer>> trainers(2);
  {
    std::vector<std::thread> create;
    for (int rank = 0; rank < 2; ++rank) {
      create.emplace_back([&, rank] {
        TrainOptions o;
        o.config = TinyJob(dir_.File("text.txt"));
        o.progress = false;
        o.worker.rank = rank;
        o.worker.world_size = 2;
        o.worker.store = store;
        o.worker.elastic = true;
        o.worker.generation = 3;
        auto t = Trainer::Create(o);
        ASSERT_TRUE(t.ok()) << t.status();
        trainers[rank] = std::move(*t);
      });
    }
    for (auto& t : create) t.join();
  }
  ASSERT_TRUE(trainers[0] && trainers[1]);
  auto step_both = [&] {
    std::vector<Status> status(2);
    std::vector<std::thread> steps;
    for (int rank = 0; rank < 2; ++rank) {
      steps.emplace_back([&, rank] { status[rank] = trainers[rank]->Step().status(); });
    }
    for (auto& t : steps) t.join();
    return status;
  };
  for (auto& t : trainers) t->AbortCollectives("generation 3 formed (late)", 3);
  for (const Status& s : step_both()) EXPECT_TRUE(s.ok()) << s;
  for (auto& t : trainers) t->AbortCollectives("generation 4 formed", 4);
  for (const Status& s : step_both()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_NE(s.message().find("generation 4 formed"), std::string::npos) << s;
  }
}

TEST_F(ElasticWorkerTest, AJobThatFinishesWhileTheWorkerWaitsEndsItCleanly) {
  // Two workers form the first generation; only one comes, and the job finishes meanwhile.
  FakeMembership coordinator(/*initial=*/2);
  coordinator.FinishJob();
  ElasticWorkerOptions o = Options("a");
  SeenEnd seen;
  o.on_end = Record(&seen);
  const auto started = std::chrono::steady_clock::now();
  ASSERT_TRUE(RunElasticWorker(coordinator, std::move(o)).ok());
  // The job's state is looked at once a second while waiting.
  EXPECT_GE(std::chrono::steady_clock::now() - started, std::chrono::seconds(1));
  EXPECT_EQ(seen.calls, 1);
  EXPECT_FALSE(seen.trained);
  EXPECT_EQ(seen.message, "the job at fake:7777 finished before this worker got to train");
  EXPECT_TRUE(coordinator.starts().empty());
  EXPECT_EQ(coordinator.detached(), std::vector<bool>({true}));
}

TEST_F(ElasticWorkerTest, ACoordinatorThatNeverAnswersEndsTheWorkerAfterItsPatience) {
  FakeMembership coordinator(/*initial=*/1);
  coordinator.FailJoinsWith(absl::UnavailableError("connection refused"));
  ElasticWorkerOptions o = Options("a");
  const int patience_ms = static_cast<int>(o.train.config.elastic().coordinator_patience_ms());
  SeenEnd seen;
  o.on_end = Record(&seen);
  const auto started = std::chrono::steady_clock::now();
  const Status s = RunElasticWorker(coordinator, std::move(o));
  const auto waited = std::chrono::steady_clock::now() - started;

  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(),
            absl::StrFormat("joining: the coordinator at fake:7777 did not answer for %d s "
                            "(elastic.coordinator_patience_ms); last error: connection refused",
                            patience_ms / 1000));
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.status, s);
  // Retried every 200 ms for the patience, then given up.
  EXPECT_GE(waited, std::chrono::milliseconds(patience_ms));
  EXPECT_LT(waited, std::chrono::milliseconds(patience_ms + 2000));
  EXPECT_GE(coordinator.join_calls(), patience_ms / 200);
  EXPECT_LE(coordinator.join_calls(), patience_ms / 200 + 2);
  // It never got in: nothing to attach to or leave.
  EXPECT_TRUE(coordinator.attached().empty());
  EXPECT_TRUE(coordinator.detached().empty());
}

// A coordinator that answers after a silence is heard: its answer (here: this worker was declared
// failed meanwhile) comes back as it is, not as the silence before it.
// A worker the coordinator declared failed hears it from its heartbeats: it stops training and
// leaves at once with that reason (not after waiting for a generation that will never hold it).
// Seen failing with the heartbeat thread ignoring NOT_FOUND: the worker ends with the step
// report's error instead.
TEST_F(ElasticWorkerTest, AWorkerDeclaredFailedLeavesAtOnceSayingSo) {
  FakeMembership coordinator(/*initial=*/1);
  coordinator.ExpelAt("a", 3);
  ElasticWorkerOptions o = Options("a");
  SeenEnd seen;
  o.on_end = Record(&seen);
  const auto started = std::chrono::steady_clock::now();
  const Status s = RunElasticWorker(coordinator, std::move(o));
  const auto took = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("the coordinator at fake:7777 declared worker 'a' failed, so it "
                             "left the job"),
            std::string::npos)
      << s;
  EXPECT_EQ(seen.calls, 1);
  EXPECT_LT(took, std::chrono::seconds(20));
  // It trained up to the step whose report was refused, and left the job unfinished.
  const auto reports = coordinator.reports();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports.back().step, 2);
  EXPECT_EQ(coordinator.detached(), std::vector<bool>{false});
}

TEST(RetryWhileUnreachableTest, AnAnswerAfterRetriesIsReturnedAsItIs) {
  int calls = 0;
  auto answer = [&]() -> StatusOr<int> {
    if (++calls < 3) return absl::UnavailableError("connection refused");
    return absl::NotFoundError("worker 'a' is not part of the job");
  };
  const StatusOr<int> r =
      RetryWhileUnreachable("heartbeat", "fake:7777", std::chrono::milliseconds(5000), answer);
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "worker 'a' is not part of the job");
  // A silence that outlasts the patience is said to be one.
  calls = 0;
  auto silent = [&]() -> StatusOr<int> {
    ++calls;
    return absl::DeadlineExceededError("deadline");
  };
  const StatusOr<int> s =
      RetryWhileUnreachable("heartbeat", "fake:7777", std::chrono::milliseconds(300), silent);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.status().message(),
            "heartbeat: the coordinator at fake:7777 did not answer for 0 s "
            "(elastic.coordinator_patience_ms); last error: deadline");
  EXPECT_GE(calls, 2);
}

}  // namespace
}  // namespace strata::train
