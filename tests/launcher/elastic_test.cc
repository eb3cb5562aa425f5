// Elastic training with real processes on loopback: `strata launch` (gRPC coordinator + workers),
// a worker SIGKILLed mid-run, a new worker joining, the coordinator itself killed and restarted.
//
// What is compared. The global batch is fixed and every step's samples are a function of the
// step alone; so each step's per-worker sample ranges must tile [s * B, (s + 1) * B) exactly (no
// sample lost or seen twice), and each step computes what an uninterrupted job computes with the
// same workers. The reference is such a job, replayed without failures: one `strata launch` per
// membership of the elastic run (the same worker count over the same steps), each resuming the
// previous one's checkpoint (checkpoints are exact, and the schedule is CONSTANT so that stopping
// early does not change the learning rate). The losses must agree within the distributed
// tolerance, 1e-5 (measured: equal to the printed digits). A replayed segment loads its state
// through the same import as a re-formed generation, so the import itself is checked against
// `strata train` by AFourWorkerCheckpointResumesOnTwoWorkers (dropping the imported experts fails
// it), and what the replay cannot share with the elastic run — which copy each expert comes from
// (previous owner, buddy, rollback) — is checked here (labelling buddy copies one step off fails
// the first test).
//
// Why not `strata train`: a job's float reductions depend on its worker count (sums of partial
// sums), and this small MoE model amplifies such 1e-7 differences once a token's top-2 choice
// flips on a near tie: uninterrupted 2- and 3-worker runs of this config depart from the single
// process by up to 8.6e-4 within 48 steps (measured), while a 4-worker one stays at 1e-7. A step
// cut short by a failure is redone by the next generation, so a metrics file may list a step
// twice: the line of the highest generation is the one that counted. A worker killed between a
// step's last collective and its metrics line leaves that step trained but without its line (see
// Read).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "coordinator/state.h"
#include "core/device/device.h"
#include "proto/config_io.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::DoubleField;
using strata::testing::IntField;
using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::StepLosses;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = strata::testing::BinDir() + "/strata";
constexpr int kBatch = 12;  // splits evenly over 1, 2, 3 and 4 workers

std::string Config(int steps, const std::string& extra = "") {
  return absl::StrCat(
      "seed: 5\n"
      "model { seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2\n"
      "        moe { num_experts: 8 top_k: 2 d_expert: 32 gate { capacity_factor_train: 0 } } }\n"
      "data { path: \"text.txt\" }\n"
      "train { steps: ",
      steps, " global_batch: ", kBatch,
      " lr: 0.004 warmup_steps: 2 schedule: CONSTANT eval_every: 0 eval_batches: 2 threads: 1 "
      "log_every: 5 }\n"
      "parallel { expert_parallel: 0 timeout_ms: 20000 }\n",
      extra);
}

// What a job's metrics files say, per step: the loss and the sample ranges of the generation that
// counted (the highest one that wrote the step).
struct Trajectory {
  std::map<int64_t, int64_t> generation;                               // step -> generation
  std::map<int64_t, double> loss;                                      // step -> loss
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> ranges;  // step -> [first, count)
  std::map<int64_t, std::vector<int>> unwritten;  // step -> ranks without a line (see Read)
  std::set<int64_t> generations;
  std::map<int64_t, int> workers;  // generation -> workers
};

// A worker killed after a step's last collective and before it wrote the step's line leaves the
// step trained (the others could finish it only with its gradients; their lines report the loss of
// the whole batch, its share included, which ExpectMatches compares) but unwritten. That can only
// be the last step its generation wrote, and one the next generation went on from instead of
// redoing it. There its share is its share of the step before in the same generation, one batch
// on; a share missing anywhere else is lost.
Trajectory Read(const std::vector<std::string>& files) {
  struct Line {
    int rank;
    int64_t first, count;
  };
  Trajectory t;
  std::map<std::pair<int64_t, int64_t>, std::vector<Line>> by_gen;  // (step, generation) -> lines
  std::map<std::pair<int64_t, int64_t>, double> loss_by_gen;
  std::map<int64_t, int64_t> last_written;  // generation -> the last step a worker wrote in it
  for (const std::string& f : files) {
    for (const auto& l : absl::StrSplit(ReadFile(f), '\n', absl::SkipEmpty())) {
      const std::string line(l);
      const int64_t step = IntField(line, "step"), gen = IntField(line, "generation");
      by_gen[{step, gen}].push_back({static_cast<int>(IntField(line, "rank")),
                                     IntField(line, "first_sample"), IntField(line, "samples")});
      loss_by_gen[{step, gen}] = DoubleField(line, "loss");
      t.generations.insert(gen);
      t.workers[gen] = static_cast<int>(IntField(line, "workers"));
      last_written[gen] = std::max(last_written[gen], step);
      if (!t.generation.count(step) || t.generation[step] < gen) t.generation[step] = gen;
    }
  }
  for (const auto& [step, gen] : t.generation) {
    t.loss[step] = loss_by_gen[{step, gen}];
    std::set<int> written;
    for (const Line& l : by_gen[{step, gen}]) {
      t.ranges[step].emplace_back(l.first, l.count);
      written.insert(l.rank);
    }
    const auto next = t.generation.find(step + 1);
    if (step != last_written[gen] || next == t.generation.end() || next->second <= gen) continue;
    const auto before = by_gen.find({step - 1, gen});
    if (before == by_gen.end()) continue;
    for (const Line& l : before->second) {
      if (written.count(l.rank)) continue;
      t.ranges[step].emplace_back(l.first + kBatch, l.count);
      t.unwritten[step].push_back(l.rank);
    }
  }
  return t;
}

// Every step 1..steps trained exactly the step's samples.
void ExpectEveryStepTiled(const Trajectory& t, int steps) {
  ASSERT_EQ(static_cast<int>(t.loss.size()), steps) << "steps missing from the metrics";
  for (int64_t s = 1; s <= steps; ++s) {
    auto r = t.ranges.at(s);
    std::sort(r.begin(), r.end());
    const auto unwritten = t.unwritten.find(s);
    const std::string where = absl::StrCat(
        "step ", s, " (generation ", t.generation.at(s), ", ", r.size(), " shares",
        unwritten == t.unwritten.end()
            ? std::string()
            : absl::StrCat(", the share of rank ", absl::StrJoin(unwritten->second, ", "),
                           " taken from the step before"),
        ")");
    int64_t next = (s - 1) * kBatch;
    for (const auto& [first, count] : r) {
      EXPECT_EQ(first, next) << where << ": samples lost or seen twice";
      next = first + count;
    }
    EXPECT_EQ(next, s * kBatch) << where;
  }
}

// Every step 1..steps trained exactly the step's samples, and its loss matches the reference.
void ExpectMatches(const Trajectory& t, const std::map<int64_t, double>& reference, int steps) {
  ASSERT_EQ(static_cast<int>(reference.size()), steps);
  ExpectEveryStepTiled(t, steps);
  for (const auto& [s, want] : reference) {
    const auto loss = t.loss.find(s);
    if (loss != t.loss.end()) {
      EXPECT_NEAR(loss->second, want, 1e-5) << "step " << s;
    }
  }
}

// Each generation's first counted step (generation -> step).
std::map<int64_t, int64_t> FirstSteps(const Trajectory& t) {
  std::map<int64_t, int64_t> first;
  for (const auto& [step, gen] : t.generation) {
    if (!first.count(gen) || step < first[gen]) first[gen] = step;
  }
  return first;
}

// The memberships of an elastic run as (workers, last step): each generation that trained, up to
// the step the next one started from.
std::vector<std::pair<int, int64_t>> Memberships(const Trajectory& t, int steps) {
  const std::map<int64_t, int64_t> first = FirstSteps(t);
  std::vector<std::pair<int, int64_t>> out;
  for (auto it = first.begin(); it != first.end(); ++it) {
    auto next = std::next(it);
    out.emplace_back(t.workers.at(it->first), next == first.end() ? steps : next->second - 1);
  }
  return out;
}

pid_t Spawn(const std::string& cmd) {
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The last step in a metrics file (0 when none yet).
int64_t LastStep(const std::string& path) {
  int64_t last = 0;
  for (const auto& l : absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty())) {
    last = std::max(last, IntField(std::string(l), "step"));
  }
  return last;
}

template <typename Pred>
void WaitFor(Pred pred, const std::string& what, const std::string& log, int seconds = 120) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (!pred()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "waiting for " << what << "\n"
                                                          << ReadFile(log);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string Between(const std::string& s, const std::string& before, const std::string& after) {
  const size_t a = s.find(before);
  if (a == std::string::npos) return "";
  const size_t b = s.find(after, a + before.size());
  return s.substr(a + before.size(),
                  b == std::string::npos ? std::string::npos : b - a - before.size());
}

// The peak resident set of a process so far (its VmHWM), in bytes; -1 once it is gone.
int64_t PeakRss(pid_t pid) {
  const std::string kb = Between(ReadFile(absl::StrCat("/proc/", pid, "/status")), "VmHWM:", "kB");
  return kb.empty() ? -1 : std::stoll(kb) * 1024;
}

// The coordinator's address in a launch's output: the word after the first "--coordinator ".
std::string AddressIn(const std::string& out) {
  const std::string rest = Between(out, "--coordinator ", "\n");
  return rest.substr(0, rest.find(' '));
}

// Where the generation after a TIERED worker's failure goes on from: its buddy copies (of a job
// without checkpoints, or beside them), the copies of its experts in the other expert-parallel
// groups, or the newest checkpoint.
enum class GoesBackTo { kBuddies, kBuddiesBesideCheckpoints, kOtherGroups, kCheckpoint };

class ElasticTest : public ::testing::Test {
 protected:
  void SetUp() override { WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(30000)); }
  // The reference: the memberships replayed without failures, each a `strata launch` resuming
  // the previous one's checkpoint.
  //
  // The replay must not re-form: its heartbeats may lapse for 30 s (the synced writes of a TIERED
  // job checkpointing every step, on a machine loaded by other tests, have held a worker's
  // heartbeat up past the job's timeout), and each of its steps must come from its first
  // generation.
  std::map<int64_t, double> Replay(const std::vector<std::pair<int, int64_t>>& memberships) {
    auto job = strata::config::LoadJobConfig(dir_.File("job.textproto"));
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return {};
    strata::config::ElasticConfig& el = *job->mutable_elastic();
    el.set_heartbeat_timeout_ms(30000);
    el.set_restart_grace_ms(std::max<uint32_t>(el.restart_grace_ms(), 30000));
    el.set_coordinator_patience_ms(std::max<uint32_t>(el.coordinator_patience_ms(), 120000));
    WriteFile(dir_.File("replay.textproto"), strata::config::ToText(*job));
    std::map<int64_t, double> out;
    for (size_t i = 0; i < memberships.size(); ++i) {
      const auto [workers, last] = memberships[i];
      if (i > 0 && last <= memberships[i - 1].second) continue;  // it trained no step
      const std::string metrics = absl::StrCat("replay", i, ".jsonl");
      auto r = RunCommand(
          absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                       " launch --config replay.textproto --quiet --workers ", workers, " --steps ",
                       last, " --checkpoint-dir replay-ckpt --checkpoint-every 1 --metrics-out ",
                       metrics, i > 0 ? " --resume" : ""));
      EXPECT_EQ(r.exit_code, 0) << r.output;
      const std::string lines = ReadFile(dir_.File(metrics + ".0"));
      for (const auto& l : absl::StrSplit(lines, '\n', absl::SkipEmpty())) {
        const int64_t gen = IntField(std::string(l), "generation");
        EXPECT_TRUE(gen == 1 || gen == -1) << "replay " << i << " re-formed:\n" << r.output;
      }
      for (const auto& [step, loss] : StepLosses(dir_.File(metrics + ".0"))) out[step] = loss;
    }
    return out;
  }
  // The process id of the launch's worker-<i> of this test's job (0 when there is none, or before
  // the launch printed its address): the process whose arguments hold "--coordinator ADDRESS --id
  // worker-<i>", found in /proc (no procps needed: the GPU machines may lack it).
  pid_t WorkerPid(int i) {
    const std::string address = AddressIn(ReadFile(launch_log_));
    if (address.empty()) return 0;
    const std::string nul(1, '\0');  // between the arguments of /proc/PID/cmdline
    const std::string want =
        absl::StrCat("--coordinator", nul, address, nul, "--id", nul, "worker-", i, nul);
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
      const std::string name = entry.path().filename().string();
      if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream in(entry.path() / "cmdline", std::ios::binary);
      const std::string args((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      if (args.find(want) != std::string::npos) return static_cast<pid_t>(std::stol(name));
    }
    return 0;
  }
  // SIGKILLs the launch's worker-<i> of this test's job.
  ::testing::AssertionResult KillWorker(int i) {
    const pid_t pid = WorkerPid(i);
    if (pid == 0) return ::testing::AssertionFailure() << "no worker-" << i << " to kill";
    if (kill(pid, SIGKILL) == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "kill(" << pid << ", SIGKILL): " << std::strerror(errno);
  }
  // `strata worker --coordinator address` joining the launched job, metrics to joiner.jsonl.
  pid_t StartJoiner(const std::string& address) {
    return Spawn(absl::StrCat("cd ", dir_.path(), " && STRATA_JOB_TOKEN=$(cat coord/token) exec ",
                              kStrata, " worker --coordinator ", address,
                              " --config job.textproto --id joiner --quiet --metrics-out "
                              "joiner.jsonl > joiner.log 2>&1"));
  }
  // `strata launch` of the job with these flags (and `env`, VAR=value words), its coordinator's
  // folder "coord", metrics m.jsonl.<i>, output to `log`.
  pid_t Launch(const std::string& flags, const std::string& log, const std::string& env = "") {
    launch_log_ = log;
    return Spawn(absl::StrCat("cd ", dir_.path(), " && ", env, " exec ", kStrata,
                              " launch --config ", dir_.File("job.textproto"), " ", flags,
                              " --coordinator-dir coord --metrics-out m.jsonl > ", log, " 2>&1"));
  }
  // The file every worker of a gated job waits for after each step (STRATA_FAULTS
  // train.after_step=wait_for_file): removed, the workers stop between two steps; written again,
  // they go on. The test's own actions (a status query, a kill, a joiner's start) then never race
  // the steps of a job on a loaded machine.
  std::string Gate() { return dir_.File("gate"); }
  std::string GatedFaults() { return absl::StrCat("train.after_step=wait_for_file:", Gate()); }
  void Pause() { std::remove(Gate().c_str()); }
  void GoOn() { WriteFile(Gate(), ""); }
  // Until `strata status` at `address` lists worker `id` (pending or a member).
  void WaitUntilListed(const std::string& address, const std::string& token_file,
                       const std::string& id, const std::string& log) {
    WaitFor(
        [&] {
          auto r =
              RunCommand(absl::StrCat(kStrata, " status ", address, " --token-file ", token_file));
          return r.exit_code == 0 &&
                 r.output.find(absl::StrCat("  ", id, "  ")) != std::string::npos;
        },
        absl::StrCat("worker '", id, "' in the job"), log);
  }
  Trajectory KillWithoutBuddies(int steps, int every, int kill_at, std::string* out);
  Trajectory KillAndJoin(int steps, int kill_at, int on_three, const std::string& env);
  void TieredKillAndJoin(int expert_parallel, const std::string& env, GoesBackTo back);
  void TieredReformPeakRss(GoesBackTo back);
  void TieredSecondFailureDuringReform(int expert_parallel, const std::string& elastic);
  void TieredCoordinatorRestart(int expert_parallel, const std::string& elastic, GoesBackTo back);
  // `n` workers (w0 ..), the coordinator SIGKILLed once w0 trained `kill_at` steps and the last
  // worker with it; the restarted coordinator forms a generation of the n - 1 survivors, which
  // train `on_survivors` steps before a replacement joins.
  Trajectory CoordinatorRestartWithAWorkerLost(const std::string& config, int steps, int kill_at,
                                               int on_survivors, int n = 3);
  // Until worker-0 has trained a step alone.
  void WaitForAStepOnOneWorker(const std::string& log) {
    WaitFor(
        [&] {
          const Trajectory t = Read({dir_.File("m.jsonl.0")});
          for (const auto& [step, gen] : t.generation) {
            if (t.workers.at(gen) == 1) return true;
          }
          return false;
        },
        "a step on 1 worker", log);
  }
  TempDir dir_;
  std::string launch_log_;
};

// Four workers of job.textproto launched (with `env`, VAR=value words): worker-2 is SIGKILLed
// once it has trained `kill_at` steps, the three survivors go on without restarting, and once
// they trained `on_three` steps together a new worker joins. Every step must equal the
// failure-free replay of the same memberships, with each sample trained once; the joiner trains to
// the end. Returns the job's trajectory.
Trajectory ElasticTest::KillAndJoin(int steps, int kill_at, int on_three, const std::string& env) {
  const std::string log = dir_.File("launch.log");
  // The workers wait at the gate while the joiner starts (see Gate()).
  GoOn();
  const std::string faults = "STRATA_FAULTS=";
  const std::string gated = env.rfind(faults, 0) == 0
                                ? absl::StrCat(env, ",", GatedFaults())
                                : absl::StrCat(env, " ", faults, GatedFaults());
  const pid_t launch = Launch("--workers 4 --min-workers 2 --max-workers 4", log, gated);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.2")) >= kill_at; }, "the step to kill at", log);
  EXPECT_TRUE(KillWorker(2));
  const auto three = [&] {
    const Trajectory t =
        Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"), dir_.File("m.jsonl.3")});
    int n = 0;
    for (const auto& [step, gen] : t.generation) n += t.workers.at(gen) == 3;
    return n >= on_three;
  };
  WaitFor(three, "steps on 3 workers", log);
  const std::string address = AddressIn(ReadFile(log));
  EXPECT_FALSE(address.empty()) << ReadFile(log);
  Pause();
  const pid_t joiner = StartJoiner(address);
  WaitUntilListed(address, dir_.File("coord/token"), "joiner", log);
  GoOn();
  EXPECT_EQ(WaitExit(joiner), 0) << ReadFile(dir_.File("joiner.log"));
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  const std::string launched = ReadFile(log);
  EXPECT_NE(launched.find("worker-2 exited with signal 9"), std::string::npos) << launched;
  const Trajectory t = Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"), dir_.File("m.jsonl.2"),
                             dir_.File("m.jsonl.3"), dir_.File("joiner.jsonl")});
  EXPECT_EQ(t.generations, (std::set<int64_t>{1, 2, 3}));
  EXPECT_EQ(t.workers.at(1), 4);
  EXPECT_EQ(t.workers.at(2), 3);
  EXPECT_EQ(t.workers.at(3), 4);
  ExpectMatches(t, Replay(Memberships(t, steps)), steps);
  EXPECT_EQ(LastStep(dir_.File("joiner.jsonl")), steps);
  return t;
}

TEST_F(ElasticTest, AKilledWorkerAndAJoinerLoseNoSampleAndMatchTheSingleProcess) {
  constexpr int kSteps = 80;
  WriteFile(dir_.File("job.textproto"), Config(kSteps));
  const Trajectory t = KillAndJoin(kSteps, /*kill_at=*/15, /*on_three=*/15, "");
  const std::string launched = ReadFile(dir_.File("launch.log"));
  EXPECT_NE(launched.find("3 workers | generation 2 (failure)"), std::string::npos) << launched;
  EXPECT_NE(launched.find("4 workers | generation 3 (join)"), std::string::npos) << launched;
}

// The same with the workers' models on a GPU (`train.device: "cuda"`: on a machine with one GPU
// every worker on cuda:0, exchanging through page-locked host memory over Gloo): the survivors
// re-form without restarting, from state copied off their GPUs, the joiner's state lands on its
// GPU, and every step matches the failure-free replay on GPU workers (in fp32, whose rounding the
// replay's bound is argued for). Skips without a GPU;
// scripts/gpu-check.sh runs it.
TEST_F(ElasticTest, GpuWorkersKilledAndJoinedLoseNoSampleAndMatchTheReplay) {
  if (CudaDeviceCount() == 0) {
    GTEST_SKIP() << "no CUDA device: this test runs on a machine with an NVIDIA GPU";
  }
  constexpr int kSteps = 40;
  const std::string config = Config(kSteps);
  const std::string on_gpu =
      absl::StrReplaceAll(config, {{"train { ", "train { device: \"cuda\" precision: FP32 "}});
  ASSERT_NE(on_gpu, config);
  WriteFile(dir_.File("job.textproto"), on_gpu);
  KillAndJoin(kSteps, /*kill_at=*/10, /*on_three=*/10, "");
  // Launched worker i on GPU i mod GPUs; the joiner, started without --local-rank, on GPU 0.
  for (int i = 0; i < 4; ++i) {
    const std::string where = absl::StrCat("\"device\":\"cuda:", i % CudaDeviceCount(), "\"");
    EXPECT_NE(ReadFile(dir_.File(absl::StrCat("m.jsonl.", i))).find(where), std::string::npos)
        << "worker-" << i;
  }
  EXPECT_NE(ReadFile(dir_.File("joiner.jsonl")).find("\"device\":\"cuda:0\""), std::string::npos);
}

// The last step generation `gen` trained in any of `files` (a step redone later included).
int64_t LastStepOfGeneration(const std::vector<std::string>& files, int64_t gen) {
  int64_t last = 0;
  for (const std::string& f : files) {
    for (const auto& l : absl::StrSplit(ReadFile(f), '\n', absl::SkipEmpty())) {
      if (IntField(std::string(l), "generation") == gen) {
        last = std::max(last, IntField(std::string(l), "step"));
      }
    }
  }
  return last;
}

TEST_F(ElasticTest, ExpertParallelGroupsTakeALostMembersExpertsFromTheOtherGroup) {
  // Two groups of 2 hold a copy of every expert each: the failure of a member leaves its experts
  // in the other group, from which the three survivors (one group of 3) take them — no checkpoint,
  // no step replayed beyond the one cut short; the joiner makes two groups of 2 again.
  constexpr int kSteps = 40;
  std::string c = Config(kSteps, "checkpoint { every: 5 dir: \"ckpt\" }\n");
  c.replace(c.find("expert_parallel: 0"), 18, "expert_parallel: 2");
  WriteFile(dir_.File("job.textproto"), c);
  const Trajectory t = KillAndJoin(kSteps, /*kill_at=*/12, /*on_three=*/6, "");
  const std::string launched = ReadFile(dir_.File("launch.log"));
  EXPECT_EQ(launched.find("going back to the latest checkpoint"), std::string::npos) << launched;
  EXPECT_NE(launched.find("expert-parallel groups of 3"), std::string::npos) << launched;
  const std::string from = Between(launched, "generation of 3 workers starts from step ", "\n");
  EXPECT_NE(from.find(", 0 from copies"), std::string::npos) << launched;
  const std::vector<std::string> files = {dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"),
                                          dir_.File("m.jsonl.2"), dir_.File("m.jsonl.3")};
  ASSERT_EQ(FirstSteps(t).count(2), 1u) << "the 3 survivors trained no step that counted";
  EXPECT_GE(FirstSteps(t).at(2), LastStepOfGeneration(files, 1)) << launched;
  EXPECT_EQ(FirstSteps(t).at(3), LastStepOfGeneration(files, 2) + 1) << "the join replayed steps";
}

// A TIERED job: 32 experts whose weights and Adam moments (12 KiB a tensor) live in each worker's
// tiers, under device and host budgets of 3 and 7 tensors besides the dense state — 16x and 6.9x
// below a worker's share of 4 (8 experts of 2 layers, 3 tensors each) — and a checkpoint every 5
// steps, which a re-form without buddy copies goes back to. `expert_parallel` is the parallel
// block's setting.
constexpr int64_t kTensorBytes = 12288, kTieredDense = 312320;
// `config` (a Config) with 32 experts, kept in TIERED storage under these budgets, and a checkpoint
// every 5 steps.
std::string WithTieredStorage(std::string config, int64_t device_budget, int64_t host_budget) {
  config.replace(config.find("num_experts: 8"), 14, "num_experts: 32");
  return absl::StrCat(
      config, "storage { mode: TIERED io_block_bytes: 8192 device_budget_bytes: ", device_budget,
      " host_budget_bytes: ", host_budget, " }\ncheckpoint { every: 5 dir: \"ckpt\" }\n");
}
std::string TieredConfig(int steps, int expert_parallel = 0, const std::string& extra = "") {
  std::string c =
      WithTieredStorage(Config(steps, extra), kTieredDense + 3 * kTensorBytes, 7 * kTensorBytes);
  c.replace(c.find("expert_parallel: 0"), 18, absl::StrCat("expert_parallel: ", expert_parallel));
  return c;
}

// The same without checkpoints: a TIERED job with buddy copies (elastic.replicas 1, the default)
// needs none.
std::string TieredConfigWithoutCheckpoints(int steps, const std::string& extra = "") {
  std::string c = TieredConfig(steps, /*expert_parallel=*/0, extra);
  c.erase(c.find("checkpoint {"));
  return c;
}

// Each generation after the first (or each of `generations`, when given) began at a checkpoint (a
// multiple of 5) at or before the step it replaced.
void ExpectGenerationsBeganAtCheckpoints(const Trajectory& t,
                                         const std::set<int64_t>& generations = {}) {
  for (const auto& [gen, step] : FirstSteps(t)) {
    if (generations.empty() ? gen > 1 : generations.count(gen) > 0) {
      EXPECT_EQ((step - 1) % 5, 0) << "generation " << gen << " began at step " << step;
    }
  }
}

// The rank a launched worker has in generation 1, from its metrics file.
int RankOf(const std::string& metrics) {
  for (const auto& l : absl::StrSplit(ReadFile(metrics), '\n', absl::SkipEmpty())) {
    return static_cast<int>(IntField(std::string(l), "rank"));
  }
  return -1;
}

TEST_F(ElasticTest, ASecondFailureWhileTheOthersReformIsRiddenThrough) {
  // Ranks 1 and 3 of 4 die 40 ms apart: the second death lands while the survivors re-form
  // without the first (their rendezvous must end at once, not at timeout_ms = 20 s). Their
  // experts live on: rank 1's buddy is rank 2, rank 3's is rank 0.
  constexpr int kSteps = 80;
  WriteFile(dir_.File("job.textproto"), Config(kSteps));
  const std::string log = dir_.File("launch.log");
  const pid_t launch = Launch("--workers 4 --min-workers 2", log);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.0")) >= 20; }, "step 20", log);
  std::map<int, int> worker_of;  // rank -> launch's worker index
  for (int i = 0; i < 4; ++i) worker_of[RankOf(dir_.File(absl::StrCat("m.jsonl.", i)))] = i;
  ASSERT_EQ(worker_of.size(), 4u);
  const auto t0 = std::chrono::steady_clock::now();
  for (int rank : {1, 3}) {
    ASSERT_TRUE(KillWorker(worker_of.at(rank))) << "rank " << rank;
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
  }
  // Training goes on with 2 within a few seconds.
  const std::vector<std::string> survivors = {dir_.File(absl::StrCat("m.jsonl.", worker_of.at(0))),
                                              dir_.File(absl::StrCat("m.jsonl.", worker_of.at(2)))};
  WaitFor(
      [&] {
        const Trajectory t = Read(survivors);
        for (const auto& [gen, n] : t.workers) {
          if (n == 2) return true;
        }
        return false;
      },
      "a step on 2 workers", log);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << ReadFile(log);
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  std::vector<std::string> files;
  for (int i = 0; i < 4; ++i) files.push_back(dir_.File(absl::StrCat("m.jsonl.", i)));
  const Trajectory t = Read(files);
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
}

TEST_F(ElasticTest, DownToOneWorkerAndBackToTwo) {
  // One worker alone runs ~100 steps a second here (no collectives): it waits at the gate (see
  // Gate()) while the joiner starts up and gets in.
  constexpr int kSteps = 300;
  WriteFile(dir_.File("job.textproto"), Config(kSteps));
  const std::string log = dir_.File("launch.log");
  GoOn();
  const pid_t launch = Launch("--workers 2", log, "STRATA_FAULTS=" + GatedFaults());
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.1")) >= 30; }, "step 30", log);
  ASSERT_TRUE(KillWorker(1));
  // The survivor trains alone (no collectives at all); once it has, a joiner brings it back to
  // two (joining earlier, while the coordinator still counts two members, would be refused: the
  // job's maximum is the 2 workers it started with).
  WaitForAStepOnOneWorker(log);
  const std::string address = AddressIn(ReadFile(log));
  Pause();
  const pid_t joiner = StartJoiner(address);
  WaitUntilListed(address, dir_.File("coord/token"), "joiner", log);
  GoOn();
  EXPECT_EQ(WaitExit(joiner), 0) << ReadFile(dir_.File("joiner.log"));
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  const Trajectory t =
      Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"), dir_.File("joiner.jsonl")});
  EXPECT_EQ(t.generations, (std::set<int64_t>{1, 2, 3}));
  EXPECT_EQ(t.workers.at(2), 1);
  EXPECT_EQ(t.workers.at(3), 2);
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
}

// Two workers without buddy copies (the survivor alone cannot hold the dead one's experts), a
// checkpoint every `every` steps into ckpt, worker-1 SIGKILLed once it trained `kill_at` steps.
// Returns the job's trajectory, the launch's output in *out.
Trajectory ElasticTest::KillWithoutBuddies(int steps, int every, int kill_at, std::string* out) {
  WriteFile(dir_.File("job.textproto"),
            Config(steps, absl::StrCat("elastic { replicas: 0 }\ncheckpoint { every: ", every,
                                       " dir: \"ckpt\" }\n")));
  const std::string log = dir_.File("launch.log");
  const pid_t launch = Launch("--workers 2", log);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.1")) >= kill_at; }, "the step to kill at", log);
  EXPECT_TRUE(KillWorker(1));
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  *out = ReadFile(log);
  return Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1")});
}

TEST_F(ElasticTest, WithoutBuddyCopiesAFailureGoesBackToTheLatestCheckpoint) {
  constexpr int kSteps = 100;
  // Past checkpoint 30 and before 40 is committed... or a little later: either way some steps
  // after the newest checkpoint are redone.
  std::string out;
  const Trajectory t = KillWithoutBuddies(kSteps, /*every=*/10, /*kill_at=*/34, &out);
  EXPECT_NE(out.find("going back to the latest checkpoint"), std::string::npos) << out;
  EXPECT_EQ(t.generations, (std::set<int64_t>{1, 2}));
  EXPECT_EQ(t.workers.at(2), 1);
  // Generation 2 began at a checkpoint (a multiple of 10) at or before the failure.
  int64_t first_of_2 = kSteps + 1, last_of_1 = 0;
  for (const auto& [step, gen] : t.generation) {
    if (gen == 2) first_of_2 = std::min(first_of_2, step);
  }
  for (const auto& l : absl::StrSplit(ReadFile(dir_.File("m.jsonl.1")), '\n', absl::SkipEmpty())) {
    last_of_1 = std::max(last_of_1, IntField(std::string(l), "step"));
  }
  EXPECT_EQ((first_of_2 - 1) % 10, 0) << first_of_2;
  EXPECT_LE(first_of_2 - 1, last_of_1);
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
}

TEST_F(ElasticTest, WithoutBuddyCopiesAFailureBeforeTheFirstCheckpointStartsOver) {
  // No buddy copies and no checkpoint committed yet (the first is due at step 1000): the state
  // that went with the dead worker can only come from the job's beginning. The survivor starts
  // over from step 0 and must compute what a fresh one-worker job computes.
  constexpr int kSteps = 60;
  std::string out;
  const Trajectory t = KillWithoutBuddies(kSteps, /*every=*/1000, /*kill_at=*/10, &out);
  EXPECT_NE(out.find("the job goes back to step 0"), std::string::npos) << out;
  EXPECT_EQ(t.generations, (std::set<int64_t>{1, 2}));
  EXPECT_EQ(t.generation.at(1), 2) << "generation 2 trained step 1 again";
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
}

TEST_F(ElasticTest, AJobRidesThroughItsCoordinatorBeingKilledAndRestarted) {
  constexpr int kSteps = 80;
  WriteFile(dir_.File("job.textproto"), Config(kSteps));
  const std::string clog = dir_.File("coordinator.log");
  const std::string coordinator_cmd =
      absl::StrCat("cd ", dir_.path(), " && STRATA_JOB_TOKEN=secret exec ", kStrata,
                   " coordinator --dir record --config job.textproto --workers 2 --listen ");
  pid_t coordinator = Spawn(absl::StrCat(coordinator_cmd, "127.0.0.1:0 > ", clog, " 2>&1"));
  WaitFor([&] { return ReadFile(clog).find("listening on ") != std::string::npos; },
          "the coordinator", clog);
  const std::string address = Between(ReadFile(clog), "listening on ", " ");
  std::vector<pid_t> workers;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(
        Spawn(absl::StrCat("cd ", dir_.path(), " && STRATA_JOB_TOKEN=secret exec ", kStrata,
                           " worker --coordinator ", address, " --config job.textproto --id w", i,
                           " --quiet --metrics-out m", i, ".jsonl > w", i, ".log 2>&1")));
  }
  WaitFor([&] { return LastStep(dir_.File("m0.jsonl")) >= 20; }, "step 20", clog);
  kill(coordinator, SIGKILL);
  EXPECT_EQ(WaitExit(coordinator), 128 + SIGKILL);
  // Down for a second (longer than the workers' heartbeat period); then back on the same port,
  // from the same record.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  coordinator =
      Spawn(absl::StrCat(coordinator_cmd, address, " --keep-serving > ", clog, ".2 2>&1"));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(WaitExit(workers[i]), 0) << ReadFile(dir_.File(absl::StrCat("w", i, ".log")));
  }
  const std::string restarted = ReadFile(clog + ".2");
  EXPECT_NE(restarted.find("generation 1"), std::string::npos) << restarted;
  auto status = RunCommand(absl::StrCat("STRATA_JOB_TOKEN=secret ", kStrata, " status ", address));
  EXPECT_NE(status.output.find(absl::StrCat("step ", kSteps)), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("the job finished"), std::string::npos) << status.output;
  kill(coordinator, SIGTERM);
  WaitExit(coordinator);
  const Trajectory t = Read({dir_.File("m0.jsonl"), dir_.File("m1.jsonl")});
  EXPECT_EQ(t.generations, (std::set<int64_t>{1}));  // nothing re-formed: no worker changed
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
  EXPECT_NE(ReadFile(dir_.File("w0.log")).find("answers again"), std::string::npos)
      << ReadFile(dir_.File("w0.log"));
}

TEST_F(ElasticTest, AFourWorkerCheckpointResumesOnTwoWorkers) {
  // The schedule is constant after warm-up, so stopping at step 20 (--steps 20) trains the same
  // first 20 steps as the 40-step single process, the reference here (4 workers compute what it
  // does to 1e-7, and 20 steps on 2 stay within the tolerance: measured 1e-7).
  constexpr int kSteps = 40;
  WriteFile(dir_.File("job.textproto"), Config(kSteps, "checkpoint { every: 10 dir: \"ckpt\" }\n"));
  auto single = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                        " train --config job.textproto --quiet --checkpoint-dir "
                                        "single-ckpt --metrics-out single.jsonl"));
  ASSERT_EQ(single.exit_code, 0) << single.output;
  auto first = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                       " launch --config job.textproto --workers 4 --steps 20 "
                                       "--quiet --metrics-out four.jsonl"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto list = RunCommand(absl::StrCat(kStrata, " ckpt ls ", dir_.File("ckpt")));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  EXPECT_NE(list.output.find("20"), std::string::npos) << list.output;
  // Each launched worker wrote the shard named by its id (stable across generations).
  std::set<std::string> shards;
  for (const auto& f : std::filesystem::directory_iterator(dir_.File("ckpt/shards"))) {
    shards.insert(f.path().filename().string());
  }
  EXPECT_EQ(shards, (std::set<std::string>{"wworker-0", "wworker-1", "wworker-2", "wworker-3"}))
      << list.output;
  auto second = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                        " launch --config job.textproto --workers 2 --resume "
                                        "--quiet --metrics-out two.jsonl"));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from checkpoint 20"), std::string::npos) << second.output;
  const auto want = StepLosses(dir_.File("single.jsonl"));
  const Trajectory t = Read({dir_.File("two.jsonl.0"), dir_.File("two.jsonl.1")});
  ASSERT_EQ(t.loss.size(), 20u) << "the two workers train steps 21..40 only";
  EXPECT_EQ(t.loss.begin()->first, 21);
  EXPECT_EQ(t.workers.at(1), 2);
  for (const auto& [step, loss] : t.loss) EXPECT_NEAR(loss, want.at(step), 1e-5) << step;
  for (const auto& [step, ranges] : t.ranges) {
    ASSERT_EQ(ranges.size(), 2u);
    EXPECT_EQ(ranges[0].second + ranges[1].second, kBatch) << step;
  }
}

TEST_F(ElasticTest, AWorkerRangeTheBatchOrTheExpertsCannotCoverIsRefusedUpFront) {
  WriteFile(dir_.File("job.textproto"), Config(10));
  // 12 sequences for up to 13 workers.
  auto r = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                   " launch --config job.textproto --workers 4 --max-workers 13"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("train.global_batch = 12 gives the 13 workers"), std::string::npos)
      << r.output;
  // 8 experts for up to 9 workers.
  r = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                              " launch --config job.textproto --workers 4 --max-workers 9"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("moe.num_experts = 8 is fewer than the 9 workers"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("at most 8"), std::string::npos) << r.output;
}

// The launch's "add a worker" line, as printed (the command after "add a worker: ").
std::string AddAWorkerLine(const std::string& out) { return Between(out, "add a worker: ", "\n"); }

TEST_F(ElasticTest, TheAddAWorkerLineStartsAWorkerOfTheJobAsLaunched) {
  // The file says 40 steps and no checkpoints; the launch says 300 steps and a checkpoint every
  // 10 into ckpt. A replacement started from the printed line must train the launched job: to
  // step 300, writing the same checkpoints (a replacement with the file's settings stopped the job
  // at 40, or broke it at the next checkpoint). The survivor alone runs fast: 300 steps leave the
  // replacement time to get in even on a loaded machine.
  constexpr int kFileSteps = 40, kSteps = 300;
  WriteFile(dir_.File("job.textproto"), Config(kFileSteps));
  const std::string log = dir_.File("launch.log");
  const pid_t launch = Launch(absl::StrCat("--workers 2 --max-workers 2 --threads 1 --steps ",
                                           kSteps, " --checkpoint-dir ckpt --checkpoint-every 10"),
                              log);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.1")) >= 12; }, "step 12", log);
  const std::string line = AddAWorkerLine(ReadFile(log));
  ASSERT_FALSE(line.empty()) << ReadFile(log);
  EXPECT_EQ(line.find("--config"), std::string::npos) << line;
  ASSERT_TRUE(KillWorker(1));
  // Once the survivor trains alone, the line brings the job back to two.
  WaitForAStepOnOneWorker(log);
  const pid_t joiner = Spawn(absl::StrCat("cd ", dir_.path(), " && ", line,
                                          " --id joiner --quiet --metrics-out joiner.jsonl > "
                                          "joiner.log 2>&1"));
  EXPECT_EQ(WaitExit(joiner), 0) << ReadFile(dir_.File("joiner.log"));
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  const Trajectory t =
      Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"), dir_.File("joiner.jsonl")});
  EXPECT_EQ(t.workers.at(t.generation.at(kSteps)), 2) << "the joiner trained the last step";
  EXPECT_EQ(LastStep(dir_.File("joiner.jsonl")), kSteps);
  ExpectEveryStepTiled(t, kSteps);
  auto list = RunCommand(absl::StrCat(kStrata, " ckpt ls ", dir_.File("ckpt")));
  ASSERT_EQ(list.exit_code, 0) << list.output;
  EXPECT_NE(list.output.find(absl::StrCat(" ", kSteps, " ")), std::string::npos) << list.output;
}

TEST_F(ElasticTest, AJoinerWithAnotherConfigIsRefusedAndTheJobGoesOn) {
  constexpr int kSteps = 300;
  WriteFile(dir_.File("job.textproto"), Config(kSteps));
  // Another model, and the same model with ten times the learning rate.
  std::string other_model = Config(kSteps);
  other_model.replace(other_model.find("d_model: 32"), 11, "d_model: 48");
  WriteFile(dir_.File("other_model.textproto"), other_model);
  std::string other_lr = Config(kSteps);
  other_lr.replace(other_lr.find("lr: 0.004"), 9, "lr: 0.04");
  WriteFile(dir_.File("other_lr.textproto"), other_lr);
  const std::string log = dir_.File("launch.log");
  const pid_t launch = Launch("--workers 2 --max-workers 3", log);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.0")) >= 5; }, "step 5", log);
  const std::string address = AddressIn(ReadFile(log));
  for (const auto& [file, field] : std::vector<std::pair<std::string, std::string>>{
           {"other_model.textproto", "model.d_model: 32 (job) vs 48 (this worker)"},
           {"other_lr.textproto", "train.lr: 0.004 (job) vs 0.04 (this worker)"}}) {
    auto r = RunCommand(absl::StrCat("cd ", dir_.path(), " && STRATA_JOB_TOKEN=$(cat coord/token) ",
                                     kStrata, " worker --coordinator ", address, " --config ", file,
                                     " --id bad --quiet"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(field), std::string::npos) << r.output;
  }
  // A token file this machine does not have is named before the worker joins.
  auto no_data = RunCommand(absl::StrCat("STRATA_JOB_TOKEN=$(cat ", dir_.File("coord/token"), ") ",
                                         kStrata, " worker --coordinator ", address,
                                         " --data /nonexistent/text.txt --id bad3 --quiet"));
  EXPECT_EQ(no_data.exit_code, 1) << no_data.output;
  EXPECT_NE(no_data.output.find("'/nonexistent/text.txt' (data.path) is not on this machine"),
            std::string::npos)
      << no_data.output;
  // A job-level flag that disagrees is refused the same way.
  auto r =
      RunCommand(absl::StrCat("STRATA_JOB_TOKEN=$(cat ", dir_.File("coord/token"), ") ", kStrata,
                              " worker --coordinator ", address, " --steps 999 --id bad2 --quiet"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("train.steps: 300 (job) vs 999 (this worker)"), std::string::npos)
      << r.output;
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  const Trajectory t = Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1")});
  EXPECT_EQ(t.generations, (std::set<int64_t>{1})) << "nobody was admitted";
  ExpectEveryStepTiled(t, kSteps);
}

TEST_F(ElasticTest, ALaunchRefusesACoordinatorFolderThatHoldsAJobAndChangesNothing) {
  WriteFile(dir_.File("job.textproto"), Config(5));
  auto first = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                       " launch --config job.textproto --workers 2 --quiet "
                                       "--coordinator-dir coord"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto before = coordinator::CoordinatorState::ReadRecord(dir_.File("coord"));
  ASSERT_TRUE(before.ok() && before->has_value()) << before.status();
  const std::string token = ReadFile(dir_.File("coord/token"));
  auto again = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                       " launch --config job.textproto --workers 3 --quiet "
                                       "--coordinator-dir coord"));
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("holds the record of a job"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("strata coordinator --dir coord"), std::string::npos) << again.output;
  auto after = coordinator::CoordinatorState::ReadRecord(dir_.File("coord"));
  ASSERT_TRUE(after.ok() && after->has_value()) << after.status();
  EXPECT_EQ((*after)->SerializeAsString(), (*before)->SerializeAsString());
  EXPECT_EQ(ReadFile(dir_.File("coord/token")), token);
}

// `n` workers of `config` (a job of `steps` steps) under a standalone coordinator; once worker
// w0 trained `kill_at` steps the coordinator is SIGKILLed, the last worker dies while it is down,
// and the coordinator is restarted from its folder alone (`strata coordinator --dir record`:
// config, worker counts, address and token come from the record). The survivors wait for it, it
// finds the lost member when its restart grace ends, they re-form, and once they trained
// `on_survivors` steps together a replacement joins; the job finishes, and the coordinator exits
// by itself. Returns the job's trajectory.
Trajectory ElasticTest::CoordinatorRestartWithAWorkerLost(const std::string& config, int steps,
                                                          int kill_at, int on_survivors, int n) {
  // Workers w0 .. w<n-1>; w<n-1> is lost, w<n> replaces it.
  auto id_of = [](int i) { return absl::StrCat("w", i); };
  std::vector<std::string> survivors;
  for (int i = 0; i + 1 < n; ++i) survivors.push_back(dir_.File(id_of(i) + ".jsonl"));
  WriteFile(dir_.File("job.textproto"), config);
  WriteFile(dir_.File("token.txt"), "secret-token\n");
  const std::string clog = dir_.File("coordinator.log");
  pid_t coordinator = Spawn(absl::StrCat(
      "cd ", dir_.path(), " && exec ", kStrata,
      " coordinator --dir record --config job.textproto --token-file token.txt --workers ", n,
      " --min-workers 1 --max-workers ", n, " --listen 127.0.0.1:0 > ", clog, " 2>&1"));
  WaitFor([&] { return ReadFile(clog).find("listening on ") != std::string::npos; },
          "the coordinator", clog);
  if (HasFailure()) {
    kill(coordinator, SIGKILL);
    WaitExit(coordinator);
    return {};
  }
  const std::string address = Between(ReadFile(clog), "listening on ", " ");
  // The workers wait at the gate (see Gate()) while the test queries, kills and restarts, so the
  // kill lands within a step of `kill_at`, and while the replacement starts.
  GoOn();
  auto start_worker = [&](const std::string& id) {
    return Spawn(absl::StrCat("cd ", dir_.path(), " && STRATA_FAULTS=", GatedFaults(), " exec ",
                              kStrata, " worker --coordinator ", address,
                              " --token-file token.txt --id ", id, " --quiet ", "--metrics-out ",
                              id, ".jsonl > ", id, ".log 2>&1"));
  };
  std::map<std::string, pid_t> workers;
  for (int i = 0; i < n; ++i) workers[id_of(i)] = start_worker(id_of(i));
  WaitFor([&] { return LastStep(dir_.File("w0.jsonl")) >= kill_at; }, "the step to kill at", clog);
  Pause();
  auto status = RunCommand(
      absl::StrCat(kStrata, " status ", address, " --token-file ", dir_.File("token.txt")));
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_NE(status.output.find(absl::StrCat("  ", id_of(n - 1), "  127.0.0.1")), std::string::npos)
      << status.output;
  WriteFile(dir_.File("wrong.txt"), "secret-tokem\n");
  auto refused = RunCommand(
      absl::StrCat(kStrata, " status ", address, " --token-file ", dir_.File("wrong.txt")));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("token"), std::string::npos) << refused.output;

  kill(coordinator, SIGKILL);
  EXPECT_EQ(WaitExit(coordinator), 128 + SIGKILL);
  kill(workers[id_of(n - 1)], SIGKILL);
  EXPECT_EQ(WaitExit(workers[id_of(n - 1)]), 128 + SIGKILL);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  coordinator = Spawn(absl::StrCat("cd ", dir_.path(), " && exec ", kStrata,
                                   " coordinator --dir record > ", clog, ".2 2>&1"));
  GoOn();
  // The survivors train on, n - 1 of them, in a generation formed for the failure.
  WaitFor(
      [&] {
        const Trajectory t = Read(survivors);
        int trained = 0;
        for (const auto& [step, gen] : t.generation) {
          trained += gen > 1 && t.workers.at(gen) == n - 1;
        }
        return trained >= on_survivors;
      },
      "steps on the survivors", clog + ".2");
  Pause();
  workers[id_of(n)] = start_worker(id_of(n));
  WaitUntilListed(address, dir_.File("token.txt"), id_of(n), clog + ".2");
  GoOn();
  workers.erase(id_of(n - 1));
  for (const auto& [id, pid] : workers) {
    EXPECT_EQ(WaitExit(pid), 0) << id << ":\n" << ReadFile(dir_.File(absl::StrCat(id, ".log")));
  }
  // A job that failed never finishes: its coordinator would serve on.
  if (HasFailure()) kill(coordinator, SIGKILL);
  EXPECT_EQ(WaitExit(coordinator), 0) << ReadFile(clog + ".2");
  const std::string restarted = ReadFile(clog + ".2");
  EXPECT_NE(restarted.find("coordinator listening on " + address + " (resumed"), std::string::npos)
      << restarted;
  EXPECT_NE(restarted.find(absl::StrCat("workers 1 to ", n)), std::string::npos) << restarted;
  EXPECT_NE(restarted.find(absl::StrCat("the job finished at step ", steps)), std::string::npos)
      << restarted;
  std::vector<std::string> files;
  for (int i = 0; i <= n; ++i) files.push_back(dir_.File(id_of(i) + ".jsonl"));
  const Trajectory t = Read(files);
  const auto last = t.generation.find(steps);
  if (last == t.generation.end()) {
    ADD_FAILURE() << "nobody trained step " << steps;
  } else {
    EXPECT_EQ(t.workers.at(last->second), n) << "the replacement trained the last step\n"
                                             << restarted << id_of(n) << ":\n"
                                             << ReadFile(dir_.File(id_of(n) + ".log"));
  }
  ExpectEveryStepTiled(t, steps);
  return t;
}

TEST_F(ElasticTest, ACoordinatorRestartWithAWorkerLostMeanwhileCarriesOn) {
  CoordinatorRestartWithAWorkerLost(
      Config(200, "elastic { heartbeat_timeout_ms: 1000 restart_grace_ms: 6000 }\n"), 200,
      /*kill_at=*/20, /*on_survivors=*/1);
}

// Four TIERED workers (TieredConfig: budgets far below each one's share): worker-2 is SIGKILLed
// once it trained 11 steps, the three survivors go on without restarting, a joiner makes four
// again, and every step equals the failure-free replay of the same memberships, each sample
// trained once. With buddy copies (elastic.replicas 1; kBuddies: with no checkpoints at all) the
// dead worker's experts come from its buddy's SSD: the failure's generation goes back at most one
// refresh of the copies. With expert-parallel groups (kOtherGroups) they come from the other
// group's stores, and the generation goes on from the step every survivor finished. Without
// either (kCheckpoint: elastic.replicas 0) it goes back to the newest checkpoint. Every expert is
// still held when the joiner comes, so the join goes on from the step the three finished,
// replaying nothing: the experts the joiner now owns moved from the others' stores to its own.
// `env` goes before the launch (STRATA_FAULTS).
void ElasticTest::TieredKillAndJoin(int expert_parallel, const std::string& env, GoesBackTo back) {
  constexpr int kSteps = 50;
  if (back == GoesBackTo::kBuddies) {
    WriteFile(dir_.File("job.textproto"), TieredConfigWithoutCheckpoints(kSteps));
  } else if (back == GoesBackTo::kCheckpoint) {
    WriteFile(dir_.File("job.textproto"), TieredConfig(kSteps, 0, "elastic { replicas: 0 }\n"));
  } else {
    WriteFile(dir_.File("job.textproto"), TieredConfig(kSteps, expert_parallel));
  }
  const Trajectory t = KillAndJoin(kSteps, /*kill_at=*/11, /*on_three=*/6, env);
  ASSERT_EQ(FirstSteps(t).count(2), 1u) << "the 3 survivors trained no step that counted";
  const std::string launched = ReadFile(dir_.File("launch.log"));
  const std::vector<std::string> files = {dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"),
                                          dir_.File("m.jsonl.2"), dir_.File("m.jsonl.3")};
  if (back != GoesBackTo::kCheckpoint) {
    EXPECT_EQ(launched.find("going back to the latest checkpoint"), std::string::npos) << launched;
    const int64_t last_of_1 = LastStepOfGeneration(files, 1);
    EXPECT_GE(FirstSteps(t).at(2), last_of_1 - 1)
        << "the failure went back further than its copies\n"
        << launched;
    const std::string from = Between(launched, "generation of 3 workers starts from step ", "\n");
    EXPECT_NE(from.find(" from copies"), std::string::npos) << launched;
    if (back == GoesBackTo::kOtherGroups) {
      // The other group's live copies, moved to the new owners.
      EXPECT_NE(from.find(", 0 from copies"), std::string::npos) << launched;
      EXPECT_EQ(from.find(", 0 moved"), std::string::npos) << launched;
    } else {
      // The dead worker's experts came from its buddy's copies (moved, or kept where they were).
      EXPECT_EQ(from.find(", 0 from copies"), std::string::npos) << launched;
    }
  } else {
    ExpectGenerationsBeganAtCheckpoints(t, {2});
  }
  const int64_t last_of_2 = LastStepOfGeneration(files, 2);
  EXPECT_EQ(FirstSteps(t).at(3), last_of_2 + 1) << "the join replayed steps\n" << launched;
  const std::string moved =
      Between(launched, absl::StrCat("generation of 4 workers starts from step ", last_of_2), "\n");
  EXPECT_NE(moved.find(" moved"), std::string::npos) << launched;
  EXPECT_EQ(moved.find(", 0 moved"), std::string::npos) << "the joiner got no experts\n"
                                                        << launched;
}

TEST_F(ElasticTest, ATieredJobTakesAFailedWorkersExpertsFromItsBuddiesAndAJoinerFromTheStores) {
  TieredKillAndJoin(/*expert_parallel=*/0, "", GoesBackTo::kBuddies);
}

TEST_F(ElasticTest, WithoutBuddyCopiesATieredJobGoesBackToACheckpointOnAFailure) {
  TieredKillAndJoin(/*expert_parallel=*/0, "", GoesBackTo::kCheckpoint);
}

TEST_F(ElasticTest, TieredExpertParallelGroupsOfTwoBecomeOneGroupOfThree) {
  TieredKillAndJoin(/*expert_parallel=*/2, "", GoesBackTo::kOtherGroups);
  // Three workers cannot form groups of 2: they formed one group of 3 (and four, groups of 2).
  const std::string w0 = ReadFile(dir_.File("launch.log"));
  EXPECT_NE(w0.find("expert-parallel groups of 3"), std::string::npos) << w0;
}

TEST_F(ElasticTest, ATieredWorkerKilledWhileACheckpointCommitsLeavesTheOneBefore) {
  // Every checkpoint's shards wait 1.5 s between their synced extents and their commit, so the
  // kill after step 11 lands while checkpoint 10 commits: it never completes (or completes just
  // before), and the survivors go back to the newest one that did.
  TieredKillAndJoin(/*expert_parallel=*/0, "STRATA_FAULTS=checkpoint.before_commit=sleep_ms:1500",
                    GoesBackTo::kCheckpoint);
  const std::string log = ReadFile(dir_.File("launch.log"));
  const size_t killed = log.find("worker-2 exited with signal 9");
  ASSERT_NE(killed, std::string::npos) << log;
  const size_t committed = log.find("checkpoint 10 committed");
  if (committed == std::string::npos || committed > killed) {
    const Trajectory t = Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"),
                               dir_.File("m.jsonl.3"), dir_.File("joiner.jsonl")});
    // The first step a later generation trained again (generation 3 may have gone back as far).
    int64_t first_redone = 0;
    for (const auto& [step, gen] : t.generation) {
      if (gen > 1 && first_redone == 0) first_redone = step;
    }
    EXPECT_EQ(first_redone, 6) << "checkpoint 10 never committed: generation 2 went back to 5\n"
                               << log;
  }
}

TEST_F(ElasticTest, ATieredWorkerKilledWhileACheckpointCommitsIsReplacedFromItsBuddies) {
  // The same kill during checkpoint 10's commit, with buddy copies: the commit is given up and the
  // survivors go on from their copies, not from a checkpoint.
  TieredKillAndJoin(/*expert_parallel=*/0, "STRATA_FAULTS=checkpoint.before_commit=sleep_ms:1500",
                    GoesBackTo::kBuddiesBesideCheckpoints);
}

// Ranks 1 and 3 of 4 TIERED workers die 40 ms apart: the second death lands while the survivors
// re-form (from their buddy copies, or — when the second death cut the copies of the first
// re-form's placement short, or took both copies of some experts — from the newest checkpoint).
// `expert_parallel` and `elastic` (an elastic block's fields) go into the job's config.
void ElasticTest::TieredSecondFailureDuringReform(int expert_parallel, const std::string& elastic) {
  constexpr int kSteps = 40;
  WriteFile(dir_.File("job.textproto"),
            TieredConfig(kSteps, expert_parallel, absl::StrCat("elastic { ", elastic, " }\n")));
  const std::string log = dir_.File("launch.log");
  const pid_t launch = Launch("--workers 4 --min-workers 2", log);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.0")) >= 8; }, "step 8", log);
  std::map<int, int> worker_of;  // rank -> launch's worker index
  for (int i = 0; i < 4; ++i) worker_of[RankOf(dir_.File(absl::StrCat("m.jsonl.", i)))] = i;
  ASSERT_EQ(worker_of.size(), 4u);
  for (int rank : {1, 3}) {
    ASSERT_TRUE(KillWorker(worker_of.at(rank))) << "rank " << rank;
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
  }
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  std::vector<std::string> files;
  for (int i = 0; i < 4; ++i) files.push_back(dir_.File(absl::StrCat("m.jsonl.", i)));
  const Trajectory t = Read(files);
  EXPECT_EQ(t.workers.at(t.generation.at(kSteps)), 2);
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
}

TEST_F(ElasticTest, ATieredJobRidesThroughASecondFailureDuringItsReform) {
  TieredSecondFailureDuringReform(0, "");
}

TEST_F(ElasticTest, ATieredJobWithExpertParallelGroupsRidesThroughASecondFailureDuringItsReform) {
  TieredSecondFailureDuringReform(2, "");
}

TEST_F(ElasticTest, ATieredJobWithoutBuddyCopiesRidesThroughASecondFailureDuringItsReform) {
  TieredSecondFailureDuringReform(0, "replicas: 0");
}

// The coordinator restart of ACoordinatorRestartWithAWorkerLostMeanwhileCarriesOn, for a 4-worker
// TIERED job with `expert_parallel` and `elastic` (more of the elastic block's fields): the 3
// survivors that waited for the coordinator re-form (`back` says from what), a replacement joins
// them, and every step equals the failure-free replay of the same memberships. A worker's death is
// seen at once (its stream to the coordinator breaks); heartbeats may lapse for 8 s (and the
// restart grace may not be shorter), because the synced writes of a TIERED job (and of the replay's
// checkpoint every step) on a loaded machine have held a live worker up past 2 s, and a live worker
// declared failed would end the job another way.
void ElasticTest::TieredCoordinatorRestart(int expert_parallel, const std::string& elastic,
                                           GoesBackTo back) {
  constexpr int kSteps = 50;
  const Trajectory t = CoordinatorRestartWithAWorkerLost(
      TieredConfig(kSteps, expert_parallel,
                   absl::StrCat("elastic { heartbeat_timeout_ms: 8000 restart_grace_ms: 8000 ",
                                elastic, " }\n")),
      kSteps, /*kill_at=*/12, /*on_survivors=*/6, /*n=*/4);
  if (HasFailure()) return;  // the replay would only repeat what failed
  ASSERT_EQ(FirstSteps(t).count(2), 1u) << "the 3 survivors trained no step that counted";
  if (back == GoesBackTo::kCheckpoint) {
    ExpectGenerationsBeganAtCheckpoints(t, {2});
  } else {
    // Not from checkpoint 10: the kill lands after step 12.
    EXPECT_GE(FirstSteps(t).at(2), 12) << "the failure went back to a checkpoint";
    for (const char* w : {"w0.log", "w1.log", "w2.log"}) {
      const std::string out = ReadFile(dir_.File(w));
      EXPECT_EQ(out.find("going back to the latest checkpoint"), std::string::npos) << out;
    }
  }
  ExpectMatches(t, Replay(Memberships(t, kSteps)), kSteps);
}

TEST_F(ElasticTest, ATieredJobRidesThroughACoordinatorRestartWithAWorkerLostMeanwhile) {
  TieredCoordinatorRestart(0, "", GoesBackTo::kBuddiesBesideCheckpoints);
}

TEST_F(ElasticTest, ATieredJobWithoutBuddyCopiesRidesThroughACoordinatorRestartWithAWorkerLost) {
  TieredCoordinatorRestart(0, "replicas: 0", GoesBackTo::kCheckpoint);
}

TEST_F(ElasticTest, ATieredJobWithExpertParallelGroupsRidesThroughACoordinatorRestart) {
  // Groups of 2: the lost worker's experts come from the other group (3 survivors form one group
  // of 3); the replacement makes groups of 2 again.
  TieredCoordinatorRestart(2, "", GoesBackTo::kOtherGroups);
}

TEST_F(ElasticTest, ATieredWorkerWithExpertParallelGroupsKilledWhileACheckpointCommits) {
  // The kill during checkpoint 10's commit, with groups of 2: the survivors take the lost
  // member's experts from the other group.
  TieredKillAndJoin(/*expert_parallel=*/2, "STRATA_FAULTS=checkpoint.before_commit=sleep_ms:1500",
                    GoesBackTo::kOtherGroups);
}

// A TIERED re-form rebuilds each survivor's model and store and fills them from the buddy copies
// (GoesBackTo::kBuddiesBesideCheckpoints) or from its share of the newest checkpoint
// (kCheckpoint); that share must go through the store's slots and bounded rounds, not sit in
// memory. The
// experts are big enough for that to show in a survivor's peak RSS: d_model 64, d_expert 1024
// (GELU, biases) gives each expert tensor 2 * 64 * 1024 + 1024 + 64 = 132160 floats (528640
// bytes, a slot of 532480 with its 4 KiB alignment), and each of the 2 survivors of 3 holds 16
// of the 32 experts of both MoE layers: 32 experts x 3 tensors (weights, 2 Adam moments) =
// 48.4 MiB (64.5 MiB with their gradients), the whole model's experts 96.8 MiB. The budgets are
// the store's minimum at 1 thread: the dense state (55424 parameters x 16 bytes: value,
// gradient, 2 moments) and 3 slots on the device, 7 slots on the host. During the re-form and
// the steps after it a survivor may hold: the device and host budgets, a checkpoint's snapshot
// arena (the dense state and the dirty experts in its slots: at most the same again), and 16 MiB
// for the allocator and the new generation's communicators and checkpoint index: 27.8 MiB above
// its peak before; from buddy copies, also the rounds of the moves (whole tensors, at most 4 MiB
// out and 4 MiB in): 35.8 MiB. Both are well below the share it would hold otherwise.
void ElasticTest::TieredReformPeakRss(GoesBackTo back) {
  constexpr int kSteps = 40;
  constexpr int64_t kTensor = (2 * 64 * 1024 + 1024 + 64) * 4;
  constexpr int64_t kSlot = (kTensor + 4095) / 4096 * 4096, kDense = 55424 * 16;
  constexpr int64_t kDevice = kDense + 3 * kSlot, kHost = 7 * kSlot;
  constexpr int64_t kRounds = 2 * (4 << 20);
  constexpr int64_t kCheckpointBound = 2 * (kDevice + kHost) + (16 << 20);
  static_assert(kCheckpointBound + kRounds < 32 * 3 * kTensor,
                "a survivor's expert share would fit in the bound");
  const int64_t kBound = kCheckpointBound + (back == GoesBackTo::kCheckpoint ? 0 : kRounds);
  // Heartbeats may lapse for 8 s (see ATieredJobRidesThroughACoordinatorRestartWith...).
  std::string c =
      WithTieredStorage(Config(kSteps, back == GoesBackTo::kCheckpoint
                                           ? "elastic { heartbeat_timeout_ms: 8000 replicas: 0 }\n"
                                           : "elastic { heartbeat_timeout_ms: 8000 }\n"),
                        kDevice, kHost);
  c.replace(c.find("d_model: 32"), 11, "d_model: 64");
  c.replace(c.find("d_expert: 32"), 12, "d_expert: 1024");
  WriteFile(dir_.File("job.textproto"), c);
  const std::string log = dir_.File("launch.log");
  const pid_t launch = Launch("--workers 3 --min-workers 2", log);
  WaitFor([&] { return LastStep(dir_.File("m.jsonl.2")) >= 12; }, "step 12", log);
  std::map<int, int64_t> before;  // worker -> peak RSS before the failure
  for (int i : {0, 1}) {
    before[i] = PeakRss(WorkerPid(i));
    ASSERT_GT(before[i], 0) << "no worker-" << i;
  }
  ASSERT_TRUE(KillWorker(2));
  // Past the re-form (back to checkpoint 10, or to the copies of step 11 or after) and two
  // checkpoints of the new generation.
  const std::vector<std::string> survivors = {dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1")};
  WaitFor(
      [&] {
        const Trajectory t = Read(survivors);
        return t.generation.count(22) && t.generation.at(22) > 1;
      },
      "step 22 on the 2 survivors", log);
  for (int i : {0, 1}) {
    const int64_t after = PeakRss(WorkerPid(i));
    ASSERT_GT(after, 0) << "worker-" << i << " is gone";
    std::printf("worker-%d: peak RSS %.1f MiB before the failure, %.1f MiB after the re-form\n", i,
                before[i] / 1048576.0, after / 1048576.0);
    EXPECT_LE(after, before[i] + kBound)
        << "worker-" << i << ": the re-form raised its peak RSS by "
        << (after - before[i]) / 1048576.0 << " MiB, more than its budgets allow ("
        << kBound / 1048576.0 << " MiB)";
  }
  EXPECT_EQ(WaitExit(launch), 0) << ReadFile(log);
  // The budgets left the slots they were meant to: 3 on the device and 7 on the host (a dense
  // state or a slot size other than the one above would leave others).
  const std::string metrics = ReadFile(dir_.File("m.jsonl.0"));
  const size_t at = metrics.find("\"tiers\"");
  ASSERT_NE(at, std::string::npos) << metrics;
  const std::string tiers = metrics.substr(at, metrics.find('\n', at) - at);
  EXPECT_EQ(IntField(tiers, "budget_bytes"), 3 * kSlot) << tiers;
  EXPECT_EQ(IntField(tiers.substr(tiers.find("\"host\"")), "budget_bytes"), 7 * kSlot) << tiers;
  const Trajectory t =
      Read({dir_.File("m.jsonl.0"), dir_.File("m.jsonl.1"), dir_.File("m.jsonl.2")});
  ExpectEveryStepTiled(t, kSteps);
  if (back == GoesBackTo::kCheckpoint) {
    ExpectGenerationsBeganAtCheckpoints(t);  // the re-form read the checkpoint
  } else {
    EXPECT_GE(FirstSteps(t).at(2), 12) << "the re-form went back to a checkpoint";
  }
}

TEST_F(ElasticTest, ATieredReformFromBuddyCopiesHoldsNoMoreMemoryThanItsBudgets) {
  TieredReformPeakRss(GoesBackTo::kBuddiesBesideCheckpoints);
}

TEST_F(ElasticTest, ATieredReformFromACheckpointHoldsNoMoreMemoryThanItsBudgets) {
  TieredReformPeakRss(GoesBackTo::kCheckpoint);
}

TEST_F(ElasticTest, ATieredElasticJobWithoutCheckpointsOrBuddyCopiesIsRefusedUpFront) {
  WriteFile(dir_.File("job.textproto"),
            TieredConfigWithoutCheckpoints(10, "elastic { replicas: 0 }\n"));
  auto r = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", kStrata,
                                   " launch --config job.textproto --workers 2 --quiet"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("storage.mode: TIERED and elastic.replicas: 0 goes back to its newest "
                          "checkpoint when its workers' copies cannot make up its state; set "
                          "checkpoint.dir and checkpoint.every"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace strata
