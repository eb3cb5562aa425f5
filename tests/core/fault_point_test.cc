// Fault-injection points: callbacks run at the point they are set for and nowhere else, from any
// thread; STRATA_FAULTS's actions (sleep_ms, hold_at_step, wait_for_file) do what they say, in a
// real process where they hold; the parser accepts the documented forms and refuses every other
// with a message naming the variable, the entry and the valid forms; and a point compiled out
// evaluates nothing (fault_point_compiled_out.cc is this suite's translation unit built without the
// macro).
#include "core/common/fault_point.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace strata {

// Defined in fault_point_compiled_out.cc, where STRATA_FAULT_INJECTION is not defined: reaches a
// point whose name and argument count how often they were evaluated into `*evaluations`.
void ReachPointCompiledOut(const std::string& name, int* evaluations);

namespace {

using Clock = std::chrono::steady_clock;

double MillisecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

class FaultPointTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef STRATA_FAULT_INJECTION
    GTEST_SKIP() << "built with -DSTRATA_FAULT_INJECTION=OFF: no points to reach";
#endif
    FaultPoints::Instance().ClearAll();
  }
  void TearDown() override { FaultPoints::Instance().ClearAll(); }
};

TEST_F(FaultPointTest, CallbackRunsAtItsPointOnlyAndSeesTheArgument) {
  int calls = 0;
  void* seen = nullptr;
  FaultPoints::Instance().Set("test.armed", [&](void* arg) {
    ++calls;
    seen = arg;
    *static_cast<int64_t*>(arg) += 100;  // a callback may change what the point passed
  });
  int64_t value = 7;
  STRATA_FAULT_POINT("test.armed", &value);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, &value);
  EXPECT_EQ(value, 107);
  STRATA_FAULT_POINT("test.other", &value);
  STRATA_FAULT_POINT("test.armed.not", nullptr);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(value, 107);

  // The latest Set of a name wins; Clear disarms it.
  int replaced = 0;
  FaultPoints::Instance().Set("test.armed", [&](void*) { ++replaced; });
  STRATA_FAULT_POINT("test.armed", &value);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(replaced, 1);
  FaultPoints::Instance().Clear("test.armed");
  STRATA_FAULT_POINT("test.armed", &value);
  EXPECT_EQ(replaced, 1);
  FaultPoints::Instance().Clear("test.never.set");  // nothing to do
}

TEST_F(FaultPointTest, PointsReachedFromManyThreadsWhileOthersAreSetAndCleared) {
  std::atomic<int64_t> armed_calls{0}, churn_calls{0};
  FaultPoints::Instance().Set("test.threads",
                              [&](void* arg) { armed_calls.fetch_add(*static_cast<int*>(arg)); });
  constexpr int kThreads = 4, kReaches = 2000;
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      FaultPoints::Instance().Set("test.churn", [&](void*) { churn_calls.fetch_add(1); });
      FaultPoints::Instance().Clear("test.churn");
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      [[maybe_unused]] int weight = t + 1;
      for (int i = 0; i < kReaches; ++i) STRATA_FAULT_POINT("test.threads", &weight);
    });
  }
  for (auto& t : threads) t.join();
  stop.store(true);
  churn.join();
  // Each thread t adds t + 1 per reach: (1 + 2 + 3 + 4) * 2000.
  EXPECT_EQ(armed_calls.load(), 10 * kReaches);
  EXPECT_EQ(churn_calls.load(), 0);  // nothing reaches test.churn
}

TEST(FaultSpecTest, AcceptsTheDocumentedForms) {
  auto empty = ParseFaultSpec("  ");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->empty());

  auto two = ParseFaultSpec(
      "checkpoint.before_commit=sleep_ms:3000, checkpoint.after_commit = hold_at_step:30");
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[0].point, "checkpoint.before_commit");
  EXPECT_EQ((*two)[0].kind, FaultAction::Kind::kSleepMs);
  EXPECT_EQ((*two)[0].value, 3000);
  EXPECT_EQ((*two)[1].point, "checkpoint.after_commit");
  EXPECT_EQ((*two)[1].kind, FaultAction::Kind::kHoldAtStep);
  EXPECT_EQ((*two)[1].value, 30);

  auto wait = ParseFaultSpec("train.after_step=wait_for_file:/tmp/a b/gate:1");
  ASSERT_TRUE(wait.ok()) << wait.status();
  ASSERT_EQ(wait->size(), 1u);
  EXPECT_EQ((*wait)[0].point, "train.after_step");
  EXPECT_EQ((*wait)[0].kind, FaultAction::Kind::kWaitForFile);
  EXPECT_EQ((*wait)[0].path, "/tmp/a b/gate:1");

  auto bounds = ParseFaultSpec(
      "checkpoint.after_commit=sleep_ms:0,"
      "checkpoint.after_commit=sleep_ms:3600000,"
      "checkpoint.before_commit=hold_at_step:1");
  ASSERT_TRUE(bounds.ok()) << bounds.status();
  EXPECT_EQ(bounds->size(), 3u);
}

TEST(FaultSpecTest, RefusesEveryOtherFormNamingTheEntryAndTheValidForms) {
  struct Case {
    const char* spec;
    const char* says;
  };
  const Case cases[] = {
      {"checkpoint.before_commit", "entry 1 'checkpoint.before_commit': no '=' after the point"},
      {"checkpoint.before_commit=sleep_ms:5,checkpoint.befor_commit=sleep_ms:5",
       "entry 2 'checkpoint.befor_commit=sleep_ms:5': unknown point 'checkpoint.befor_commit'"},
      {"checkpoint.before_commit=sleep:5", "unknown action 'sleep'"},
      {"checkpoint.before_commit=sleep_ms", "action 'sleep_ms' has no ':VALUE'"},
      {"checkpoint.before_commit=sleep_ms:3s", "'3s' is not a whole number"},
      {"checkpoint.before_commit=sleep_ms:", "'' is not a whole number"},
      {"checkpoint.before_commit=sleep_ms:-1", "sleep_ms must be 0 to 3600000, not -1"},
      {"checkpoint.before_commit=sleep_ms:3600001", "sleep_ms must be 0 to 3600000, not 3600001"},
      {"checkpoint.after_commit=hold_at_step:0", "hold_at_step must be 1 or more, not 0"},
      {"checkpoint.after_commit=hold_at_step:30,", "entry 2 '': no '='"},
      {"train.after_step=wait_for_file:", "wait_for_file needs a path"},
      {"STRATA_FAULT_CHECKPOINT_HOLD_AFTER=30",
       "unknown point 'STRATA_FAULT_CHECKPOINT_HOLD_AFTER'"},
  };
  for (const Case& c : cases) {
    auto r = ParseFaultSpec(c.spec);
    ASSERT_FALSE(r.ok()) << c.spec;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    const std::string message(r.status().message());
    EXPECT_EQ(message.rfind("STRATA_FAULTS entry ", 0), 0u) << c.spec << "\n" << message;
    EXPECT_NE(message.find(c.says), std::string::npos) << c.spec << "\n" << message;
    for (const char* part : {"POINT=sleep_ms:MILLISECONDS", "POINT=hold_at_step:STEP",
                             "POINT=wait_for_file:PATH", "train.after_step (in ",
                             "checkpoint.before_commit (in ", "checkpoint.after_commit (in "}) {
      EXPECT_NE(message.find(part), std::string::npos) << c.spec << ": no " << part << "\n"
                                                       << message;
    }
  }
}

TEST_F(FaultPointTest, ArmedSleepDelaysOnlyItsPointAndABadSpecArmsNothing) {
  ASSERT_TRUE(FaultPoints::Instance().Arm("checkpoint.before_commit=sleep_ms:200").ok());
  [[maybe_unused]] int64_t step = 10;
  auto t0 = Clock::now();
  STRATA_FAULT_POINT("checkpoint.after_commit", &step);
  EXPECT_LT(MillisecondsSince(t0), 150.0);
  t0 = Clock::now();
  STRATA_FAULT_POINT("checkpoint.before_commit", &step);
  EXPECT_GE(MillisecondsSince(t0), 200.0);

  FaultPoints::Instance().ClearAll();
  const Status bad =
      FaultPoints::Instance().Arm("checkpoint.after_commit=sleep_ms:300,checkpoint.x=sleep_ms:1");
  EXPECT_FALSE(bad.ok());
  t0 = Clock::now();
  STRATA_FAULT_POINT("checkpoint.after_commit", &step);
  EXPECT_LT(MillisecondsSince(t0), 150.0);  // the valid first entry was not armed either
}

TEST_F(FaultPointTest, HoldAtStepPassesOtherStepsAndHoldsAtItsStepUntilKilled) {
  ASSERT_TRUE(FaultPoints::Instance().Arm("checkpoint.after_commit=hold_at_step:30").ok());
  [[maybe_unused]] int64_t step = 29;
  STRATA_FAULT_POINT("checkpoint.after_commit", &step);    // returns: not its step
  STRATA_FAULT_POINT("checkpoint.after_commit", nullptr);  // returns: no step

  // At step 30 the thread must never return: run it in a child process and kill it there.
  int err[2];
  ASSERT_EQ(pipe(err), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(err[1], STDERR_FILENO);
    close(err[0]);
    [[maybe_unused]] int64_t at = 30;
    STRATA_FAULT_POINT("checkpoint.after_commit", &at);
    _exit(3);  // only if the hold returned
  }
  close(err[1]);
  std::string output;
  char buf[512];
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (output.find("holding here") == std::string::npos && Clock::now() < deadline) {
    const ssize_t n = read(err[0], buf, sizeof(buf));
    if (n <= 0) break;
    output.append(buf, n);
  }
  close(err[0]);
  EXPECT_NE(output.find("fault point checkpoint.after_commit at step 30: holding here (fault "
                        "injection) until the process is killed"),
            std::string::npos)
      << output;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, WNOHANG), 0) << "the held process exited";
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

TEST_F(FaultPointTest, WaitForFileWaitsWhileItsFileIsMissingAndGoesOnOnceItExists) {
  char dir_template[] = "/tmp/strata_fault_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string gate = std::string(dir_template) + "/gate";
  ASSERT_TRUE(FaultPoints::Instance().Arm("train.after_step=wait_for_file:" + gate).ok());
  [[maybe_unused]] int64_t step = 7;
  std::atomic<bool> passed{false};
  std::thread t([&] {
    STRATA_FAULT_POINT("train.after_step", &step);
    passed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(passed.load()) << "the point went on without its file";
  auto t0 = Clock::now();
  ASSERT_EQ(close(creat(gate.c_str(), 0644)), 0);
  t.join();
  EXPECT_LT(MillisecondsSince(t0), 2000.0);
  // With the file there, the point goes straight on (and other points never waited).
  t0 = Clock::now();
  STRATA_FAULT_POINT("train.after_step", &step);
  STRATA_FAULT_POINT("checkpoint.after_commit", &step);
  EXPECT_LT(MillisecondsSince(t0), 150.0);
  unlink(gate.c_str());
  rmdir(dir_template);
}

// STRATA_FAULTS is read once, when the process first uses FaultPoints: each case runs in a fresh
// process (a death test re-executes this binary).
TEST(FaultEnvironmentTest, ReadOnceAtFirstUseAndRefusedWhenBad) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
#ifdef STRATA_FAULT_INJECTION
  const char* expected =
      "status: STRATA_FAULTS entry 1 'checkpoint.after_commit=hold_at_step:x': 'x' is not a whole "
      "number";
#else
  const char* expected =
      "status: STRATA_FAULTS is set \\('checkpoint.after_commit=hold_at_step:x'\\), but this "
      "strata was built with -DSTRATA_FAULT_INJECTION=OFF";
#endif
  EXPECT_EXIT(
      {
        setenv("STRATA_FAULTS", "checkpoint.after_commit=hold_at_step:x", 1);
        const Status s = FaultPoints::Instance().EnvironmentStatus();
        fprintf(stderr, "status: %s\n", std::string(s.message()).c_str());
        _exit(s.ok() ? 0 : 2);
      },
      ::testing::ExitedWithCode(2), expected);
#ifdef STRATA_FAULT_INJECTION
  EXPECT_EXIT(
      {
        setenv("STRATA_FAULTS", "checkpoint.before_commit=sleep_ms:250", 1);
        const bool ok = FaultPoints::Instance().EnvironmentStatus().ok();
        int64_t step = 1;
        const auto t0 = Clock::now();
        STRATA_FAULT_POINT("checkpoint.before_commit", &step);
        _exit(ok && MillisecondsSince(t0) >= 250.0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
#endif
}

// The variables STRATA_FAULTS replaced are refused, naming the entry that does what each did: a
// drill still setting one would otherwise run without its fault. Also in a build without fault
// points, and also beside a valid STRATA_FAULTS. Each case in a fresh process.
TEST(FaultEnvironmentTest, RetiredVariablesAreRefusedNamingTheirReplacement) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  struct Case {
    const char* faults;  // STRATA_FAULTS, or null: unset
    const char* variable;
    const char* value;
    const char* says;  // a regular expression
  };
  const Case cases[] = {
      {nullptr, "STRATA_FAULT_CHECKPOINT_COMMIT_DELAY_MS", "3000",
       "status: STRATA_FAULT_CHECKPOINT_COMMIT_DELAY_MS is set \\('3000'\\), but strata no longer "
       "reads it, so the fault it asks for would not happen; unset "
       "STRATA_FAULT_CHECKPOINT_COMMIT_DELAY_MS and set "
       "STRATA_FAULTS=\"checkpoint.before_commit=sleep_ms:3000\" instead"},
      {"checkpoint.before_commit=sleep_ms:10", "STRATA_FAULT_CHECKPOINT_HOLD_AFTER", "30",
       "status: STRATA_FAULT_CHECKPOINT_HOLD_AFTER is set \\('30'\\), but strata no longer reads "
       "it, so the fault it asks for would not happen; unset STRATA_FAULT_CHECKPOINT_HOLD_AFTER "
       "and "
       "set STRATA_FAULTS=\"checkpoint.after_commit=hold_at_step:30\" instead"},
  };
  for (const Case& c : cases) {
    EXPECT_EXIT(
        {
          if (c.faults != nullptr) setenv("STRATA_FAULTS", c.faults, 1);
          setenv(c.variable, c.value, 1);
          const Status s = FaultPoints::Instance().EnvironmentStatus();
          fprintf(stderr, "status: %s\n", std::string(s.message()).c_str());
          _exit(s.code() == absl::StatusCode::kInvalidArgument ? 2 : 0);
        },
        ::testing::ExitedWithCode(2), c.says)
        << c.variable;
  }
}

TEST(FaultPointCompiledOutTest, APointWithoutTheMacroEvaluatesNothingAndRunsNothing) {
  int callbacks = 0;
  FaultPoints::Instance().Set("test.compiled_out", [&](void*) { ++callbacks; });
  int evaluations = 0;
  ReachPointCompiledOut("test.compiled_out", &evaluations);
  FaultPoints::Instance().Clear("test.compiled_out");
  EXPECT_EQ(evaluations, 0);
  EXPECT_EQ(callbacks, 0);
#ifdef STRATA_FAULT_INJECTION
  // The same point in this translation unit, compiled in: both arguments are evaluated once and
  // the callback runs, so the zeros above are the macro's doing.
  FaultPoints::Instance().Set("test.compiled_out", [&](void*) { ++callbacks; });
  auto name = [&] {
    ++evaluations;
    return "test.compiled_out";
  };
  auto arg = [&]() -> void* {
    ++evaluations;
    return nullptr;
  };
  STRATA_FAULT_POINT(name(), arg());
  FaultPoints::Instance().Clear("test.compiled_out");
  EXPECT_EQ(evaluations, 2);
  EXPECT_EQ(callbacks, 1);
#endif
}

}  // namespace
}  // namespace strata
