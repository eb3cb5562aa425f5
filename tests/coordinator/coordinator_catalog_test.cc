// The coordinator's checkpoint catalog with real processes: `strata coordinator` and `strata
// worker`s on loopback, checkpoints in a real folder, processes SIGKILLed where a fault point
// (STRATA_FAULTS) holds them. What the coordinator says (GetStatus, as `strata status` gets it)
// is checked against the folder's own global manifests, read by checkpoint::ListCheckpointSets:
//
// (a) rank 0 held right after committing checkpoint 8 (checkpoint.after_commit), so its commit
//     report never leaves; the coordinator, which does not know 8 is complete, is SIGKILLed and
//     restarted on its folder: it lists 8 as complete with the manifest's shards.
// (b) every worker held between preparing checkpoint 8 and its global commit
//     (checkpoint.before_set_commit), then the coordinator and the workers SIGKILLed: the restarted
//     coordinator lists 8 as not complete, and drops it once the workers re-form.
// (c) a global manifest damaged while the coordinator is down: the restarted coordinator logs what
//     it cannot read and where, serves on, and keeps the catalog it had.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_set.h"
#include "coordinator/service.h"
#include "tests/coordinator/catalog_test_util.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WaitExit;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

// A small MoE job that checkpoints every 4 steps into ckpt/; members that stop answering are
// declared failed 6 s after a restart (time enough to ask the restarted coordinator before that).
std::string Config(int steps) {
  return absl::StrCat(
      "seed: 5\n"
      "model { seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2\n"
      "        moe { num_experts: 8 top_k: 2 d_expert: 32 } }\n"
      "data { path: \"text.txt\" }\n"
      "train { steps: ",
      steps,
      " global_batch: 12 lr: 0.004 warmup_steps: 2 eval_every: 0 threads: 1 log_every: 5 }\n"
      "parallel { timeout_ms: 60000 }\n"
      "checkpoint { every: 4 dir: \"ckpt\" }\n"
      "elastic { heartbeat_timeout_ms: 1000 restart_grace_ms: 6000 }\n");
}

using Entry = strata::testing::CatalogEntry;
using strata::testing::CompleteInCatalog;

bool Lists(const coordinator::CoordinatorRecord& r, int64_t step, bool complete) {
  for (const auto& e : r.catalog()) {
    if (e.step() == step) return e.complete() == complete;
  }
  return false;
}

class CoordinatorCatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(30000));
    WriteFile(dir_.File("job.textproto"), Config(40));
  }
  void TearDown() override {
    for (pid_t pid : pids_) {
      kill(pid, SIGKILL);
      WaitExit(pid);
    }
  }
  pid_t Spawn(const std::string& cmd) {
    pid_t pid = fork();
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", absl::StrCat("cd ", dir_.path(), " && ", cmd).c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    pids_.push_back(pid);
    return pid;
  }
  // SIGKILLs a process this test spawned and waits for it.
  void Kill(pid_t pid) {
    kill(pid, SIGKILL);
    EXPECT_EQ(WaitExit(pid), 128 + SIGKILL);
    std::erase(pids_, pid);
  }
  // `strata coordinator` on the record folder "record" with `flags`, output to `log`; returns its
  // address once it listens.
  std::string StartCoordinator(const std::string& flags, const std::string& log, pid_t* pid) {
    *pid = Spawn(absl::StrCat("STRATA_JOB_TOKEN=secret exec ", kStrata,
                              " coordinator --dir record ", flags, " > ", log, " 2>&1"));
    const std::string marker = "listening on ";
    WaitFor([&] { return ReadFile(dir_.File(log)).find(marker) != std::string::npos; },
            "the coordinator", log);
    const std::string out = ReadFile(dir_.File(log));
    const size_t at = out.find(marker) + marker.size();
    return out.substr(at, out.find(' ', at) - at);
  }
  pid_t StartWorker(const std::string& address, const std::string& id, const std::string& faults) {
    return Spawn(absl::StrCat("STRATA_JOB_TOKEN=secret STRATA_FAULTS=", faults, " exec ", kStrata,
                              " worker --coordinator ", address, " --id ", id, " --quiet > ", id,
                              ".log 2>&1"));
  }
  template <typename Pred>
  void WaitFor(Pred pred, const std::string& what, const std::string& log, int seconds = 120) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (!pred()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "waiting for " << what << "\n"
                                                            << ReadFile(dir_.File(log));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  // The coordinator's record as GetStatus gives it (retried while it starts).
  coordinator::CoordinatorRecord GetStatus(const std::string& address) {
    Status last = absl::OkStatus();
    for (int attempt = 0; attempt < 100; ++attempt) {
      auto client = coordinator::CoordinatorClient::Connect(address, "secret");
      if (client.ok()) {
        auto r = (*client)->GetStatus();
        if (r.ok()) return *r;
        last = r.status();
      } else {
        last = client.status();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "GetStatus of " << address << ": " << last;
    return {};
  }
  std::vector<Entry> InFolder() { return strata::testing::CommittedInFolder(dir_.File("ckpt")); }
  // Until some worker's log says a fault point holds it.
  void WaitForHold(const std::vector<std::string>& ids, size_t holding) {
    WaitFor(
        [&] {
          size_t n = 0;
          for (const auto& id : ids) {
            n += ReadFile(dir_.File(id + ".log")).find("holding here") != std::string::npos;
          }
          return n >= holding;
        },
        "a worker held by its fault point", ids[0] + ".log");
  }

  TempDir dir_;
  std::vector<pid_t> pids_;
};

TEST_F(CoordinatorCatalogTest, ARestartedCoordinatorKnowsTheCommitRankZeroNeverReported) {
  pid_t coordinator = 0;
  const std::string address = StartCoordinator(
      "--config job.textproto --workers 2 --listen 127.0.0.1:0", "coordinator.log", &coordinator);
  // Rank 0 (whichever worker it is) commits checkpoint 8, then holds: its trainer blocks before
  // it can report the commit.
  for (const char* id : {"w0", "w1"}) {
    StartWorker(address, id, "checkpoint.after_commit=hold_at_step:8");
  }
  WaitForHold({"w0", "w1"}, 1);
  if (HasFailure()) return;
  ASSERT_TRUE(std::filesystem::exists(dir_.File("ckpt/manifests/8.manifest")));
  const auto before = GetStatus(address);
  EXPECT_FALSE(Lists(before, 8, true))
      << "the commit of 8 was reported after all: " << before.DebugString();
  Kill(coordinator);
  StartCoordinator("", "coordinator.2.log", &coordinator);
  const auto after = GetStatus(address);
  EXPECT_TRUE(Lists(after, 8, true)) << after.DebugString();
  EXPECT_EQ(after.catalog_error(), "");
  const std::vector<Entry> folder = InFolder();
  ASSERT_FALSE(folder.empty());
  EXPECT_EQ(std::get<0>(folder.back()), 8);
  std::vector<std::string> shards = std::get<2>(folder.back());  // in rank order
  std::sort(shards.begin(), shards.end());
  EXPECT_EQ(shards, (std::vector<std::string>{"ww0", "ww1"}));
  EXPECT_EQ(CompleteInCatalog(after), folder);
  auto status = RunCommand(absl::StrCat("STRATA_JOB_TOKEN=secret ", kStrata, " status ", address));
  EXPECT_NE(status.output.find(absl::StrCat("  8  complete, 2 shards (",
                                            absl::StrJoin(std::get<2>(folder.back()), " "), ")")),
            std::string::npos)
      << status.output;
}

TEST_F(CoordinatorCatalogTest, ACheckpointWhoseWorkersDiedBeforeTheGlobalCommitIsNotComplete) {
  pid_t coordinator = 0;
  const std::string address = StartCoordinator(
      "--config job.textproto --workers 2 --listen 127.0.0.1:0", "coordinator.log", &coordinator);
  // Every worker prepares its shard of checkpoint 8 and holds before the global commit.
  std::vector<pid_t> workers;
  for (const char* id : {"w0", "w1"}) {
    workers.push_back(StartWorker(address, id, "checkpoint.before_set_commit=hold_at_step:8"));
  }
  WaitForHold({"w0", "w1"}, 2);
  if (HasFailure()) return;
  WaitFor([&] { return Lists(GetStatus(address), 8, false); }, "the prepare report of 8",
          "coordinator.log");
  if (HasFailure()) return;
  Kill(coordinator);
  for (pid_t w : workers) Kill(w);
  StartCoordinator("", "coordinator.2.log", &coordinator);
  auto r = GetStatus(address);
  EXPECT_EQ(CompleteInCatalog(r), InFolder());
  ASSERT_FALSE(CompleteInCatalog(r).empty());
  EXPECT_EQ(std::get<0>(CompleteInCatalog(r).back()), 4) << r.DebugString();
  EXPECT_TRUE(Lists(r, 8, false)) << "8 is listed as not complete: " << r.DebugString();
  auto status = RunCommand(absl::StrCat("STRATA_JOB_TOKEN=secret ", kStrata, " status ", address));
  EXPECT_NE(status.output.find("  8  not complete"), std::string::npos) << status.output;
  // The members do not come back: when their grace ends the job re-forms (without workers) and
  // the commit of 8 is abandoned.
  WaitFor([&] { return GetStatus(address).generation().number() >= 2; }, "the re-form",
          "coordinator.2.log");
  r = GetStatus(address);
  EXPECT_FALSE(Lists(r, 8, false)) << r.DebugString();
  EXPECT_EQ(CompleteInCatalog(r), InFolder());
}

TEST_F(CoordinatorCatalogTest, ADamagedCheckpointFolderIsLoggedAndTheCatalogKept) {
  WriteFile(dir_.File("job.textproto"), Config(8));
  pid_t coordinator = 0;
  const std::string address = StartCoordinator(
      "--config job.textproto --workers 1 --listen 127.0.0.1:0", "coordinator.log", &coordinator);
  const pid_t worker = StartWorker(address, "w0", "");
  EXPECT_EQ(WaitExit(worker), 0) << ReadFile(dir_.File("w0.log"));
  std::erase(pids_, worker);
  EXPECT_EQ(WaitExit(coordinator), 0) << ReadFile(dir_.File("coordinator.log"));
  std::erase(pids_, coordinator);
  const std::vector<Entry> folder = InFolder();
  ASSERT_EQ(folder.size(), 2u);
  // A byte of checkpoint 8's global manifest flips while no coordinator runs.
  const std::string manifest = dir_.File("ckpt/manifests/8.manifest");
  std::string bytes = ReadFile(manifest);
  ASSERT_GT(bytes.size(), 8u);
  bytes[bytes.size() / 2] ^= 0x20;
  WriteFile(manifest, bytes);
  const std::string again =
      StartCoordinator("--keep-serving --listen 127.0.0.1:0", "coordinator.2.log", &coordinator);
  const auto r = GetStatus(again);
  EXPECT_EQ(CompleteInCatalog(r), folder) << "the catalog keeps what it had";
  EXPECT_NE(r.catalog_error().find(dir_.File("ckpt")), std::string::npos) << r.catalog_error();
  const std::string log = ReadFile(dir_.File("coordinator.2.log"));
  EXPECT_NE(log.find("could not read the checkpoint folder '" + dir_.File("ckpt") + "'"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("8.manifest"), std::string::npos) << log;
  auto status = RunCommand(absl::StrCat("STRATA_JOB_TOKEN=secret ", kStrata, " status ", again));
  EXPECT_NE(status.output.find("checkpoint folder: the coordinator could not read"),
            std::string::npos)
      << status.output;
  kill(coordinator, SIGTERM);
  EXPECT_EQ(WaitExit(coordinator), 0) << log;
  std::erase(pids_, coordinator);
}

}  // namespace
}  // namespace strata
