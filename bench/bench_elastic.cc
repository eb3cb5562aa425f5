// bench_elastic: how fast a running job rides through a failed worker and takes in a joiner,
// against what a job without elasticity does — stop every worker and restart the job from its
// latest checkpoint — measured in the same run on the same job, once with the experts in memory
// and once in the tiered store.
//
//   build/bin/bench_elastic [--workers 4] [--trials 5] [--restarts 3] [--threads 1]
//                           [--storage both|in_memory|tiered] [--json]
//
// The jobs: the default example's model (4 layers, d_model 128, 16 experts of hidden 128) on a
// synthetic byte corpus, global batch 32, a checkpoint every 20 steps, with the coordinator in
// this process and every worker a `strata worker` process on loopback; each job in its own folder
// under $TMPDIR (or /tmp), one after the other (--storage picks one).
//   IN_MEMORY  buddy copies (elastic.replicas 1): a failed worker's experts come from them.
//   TIERED     storage.mode TIERED with per-worker budgets at the store's minimum: the device
//              budget holds the dense state (parameters, gradients and 2 Adam moments, 16 bytes a
//              scalar, as Trainer::SetUpTiered reserves it) plus 2t+1 expert tensors, the host
//              budget 4t+3 expert tensors (t = --threads; StoreOptions::MinDeviceSlots and
//              MinHostSlots). Each worker's share of the expert state (its experts x MoE layers x
//              3 tensors: weights and 2 Adam moments) must be at least 4x the expert tensors of
//              either budget: 48 tensors against 3 and 7 (16x and 6.9x) at 4 workers x 1 thread.
//              Where more workers or threads leave less, both jobs get more experts (num_experts
//              becomes the smallest multiple of --workers that does; the first line says so).
//              Buddy copies on each worker's SSD (elastic.replicas 1, replica_every 1): at the
//              start of every update a worker copies its experts' state from before it out of its
//              store onto its own shelf and its buddy's (storage::CopyShelf), so a failure goes
//              on from the newest step held there — at most replica_every steps back, not to the
//              checkpoint — with the dead worker's experts taken from its buddy's shelf.
// The sizes come from the model built in this process (its MoE layers, an expert's parameters
// and the dense parameters, model::MoeTransformer with unbound experts). The heartbeat timeout is
// 30 s: a SIGKILLed worker is seen at once by its broken stream, and a machine busy with other
// work (synced writes stalling for seconds) then does not have live workers declared failed.
//
//   failure  SIGKILL one worker (a different rank each trial) and time until the first step of
//            the generation without it is done (coordinator record: step > first_step).
//   join     start a worker; time from its Join (it shows up as pending at the coordinator) to
//            the first step done by the generation that includes it. Also shown: from process
//            start, which adds loading the corpus and building the model.
//   restart  the baseline: SIGKILL every worker and start as many fresh ones; time until the job's
//            first step done again (from the latest checkpoint).
// Steps replayed: the recorded step boundary before the event minus the lowest first step of the
// generations formed after it (0 where buddy copies and the survivors hold every expert, up to
// replica_every for the TIERED job's copies of the state before an update; a job that goes back
// to its checkpoint replays the steps since it). The times end at the first step done, so they
// do not include replaying those steps.
//
// The price of the TIERED copies in steady state: the mean time of 20 steps of the TIERED job
// from the first step boundary after step 5 (before any event), against the same job with
// elastic.replicas 0 (no copies; it re-forms from its checkpoints) timed the same way in its own
// folder just before it, with the same workers and budgets; both spans hold the checkpoint of
// step 20.
//
// Bytes moved per event are computed from the sizes above, not measured; per row, the most over
// the trials. An event went back to a checkpoint when the generation after it began at a multiple
// of checkpoint.every before the step boundary it replaced (a restart always does):
//   read from checkpoint  (an event that went back) the whole expert state (3 tensors x experts x
//                         MoE layers x an expert's parameters x 4 bytes) plus, for every worker of
//                         the new generation, the dense parameters and their 2 Adam moments (12
//                         bytes a scalar).
//   dead worker's experts (a failure that did not go back: from its buddies' memory, or TIERED
//                         their SSD copies) 3 tensors x its experts (the record's
//                         experts_per_worker) x MoE layers x an expert's parameters x 4 bytes.
//   experts changing owner + dense to joiner  (a join that did not go back) 3 tensors x the
//                         experts whose owner differs between the record's experts_per_worker
//                         before and after the join (contiguous ranges in rank order) x MoE layers
//                         x an expert's parameters x 4 bytes, plus the dense parameters and their 2
//                         moments for the joiner; "not computed" where the record lacks the ranges.
// The first failure waits for a committed checkpoint (the coordinator's catalog), so a job that
// goes back replays the steps since one, not the whole run; every failure waits until the job is
// 2 steps or more past a multiple of checkpoint.every (see WentBackToCheckpoint).
//
// The SSD tier's speed (TIERED only), measured in the same run before the jobs, in the bench's
// folder: through storage::SsdTier (io_uring, O_DIRECT, the TIERED job's queue depth and request
// size) the state of the worker holding the most experts (one extent per tensor) is written, read
// back (CRC-checked and compared with what was written) and freed, 5 rounds, medians. Moving a
// failed worker's experts at that speed = its expert state / the read speed + the same / the write
// speed (read out of one store, written into another).
//
// Prints a table, each mode's failure against its own restart baseline (medians), the IN_MEMORY
// targets, the TIERED step time with and without copies, and the TIERED goals — failure (median)
// < restart from checkpoint (median), failure (worst) < 3 s + moving the failed worker's experts
// at the SSD tier's speed, and no failure replays more than replica_every steps — and with --json
// one JSON object per row (storage, event, workers, trials, median_s, worst_s, steps_lost — the
// most steps replayed —, bytes_moved, bytes_what, seconds: each trial), then the SSD speed, the
// steady-state step times and the goals as objects of their own (event "ssd_tier",
// "steady_state", "goals").
#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "coordinator/service.h"
#include "coordinator/state.h"
#include "core/common/json.h"
#include "core/common/thread_pool.h"
#include "proto/config_io.h"
#include "runtime/model/expert.h"
#include "runtime/model/parameter.h"
#include "runtime/model/transformer.h"
#include "storage/block_io.h"
#include "storage/io_memory.h"
#include "storage/ssd_tier.h"
#include "storage/tiered_store.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Options {
  int workers = 4;
  int trials = 5;
  int restarts = 3;
  int threads = 1;
  bool in_memory = true;
  bool tiered = true;
  bool json = false;
};

// The worker processes this bench started and has not killed yet: Die ends them too, since
// std::exit skips the destructors of the jobs on the stack.
std::set<pid_t>& LiveWorkers() {
  static std::set<pid_t> pids;
  return pids;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "bench_elastic: %s\n", what.c_str());
  for (pid_t pid : LiveWorkers()) kill(pid, SIGKILL);
  std::exit(1);
}

constexpr int64_t kDefaultExperts = 16;
constexpr int64_t kCheckpointEvery = 20;
// A worker SIGKILLed is seen at once (its stream to the coordinator breaks), so the heartbeat
// timeout does not enter the times; 15x the default keeps a machine busy with other work (synced
// writes that stall for seconds) from declaring live workers failed. The restart grace must be at
// least as long.
constexpr int kHeartbeatTimeoutMs = 30000;
constexpr int kSsdRounds = 5;
// The TIERED job's buddy copies: refreshed before every update.
constexpr int kReplicaEvery = 1;
// The steps whose mean time prices the copies: from step kSteadyFrom, kSteadySteps of them.
constexpr int64_t kSteadyFrom = 5;
constexpr int64_t kSteadySteps = 20;
constexpr const char* kReadFromCheckpoint = "read from checkpoint";

// The job either mode runs in `dir`: the default example's model with `experts` experts; `storage`
// is a storage block, or "" for IN_MEMORY; `replicas` buddy copies (0: none). The checkpoint
// folder is named in full, so that the coordinator in this process finds the one the workers
// (started in `dir`) write.
std::string JobText(const std::string& dir, int64_t experts, const std::string& storage,
                    int replicas) {
  return absl::StrCat(
      "name: \"bench_elastic\"\n"
      "model { vocab_size: 256 seq_len: 64 d_model: 128 n_layers: 4 n_heads: 4\n"
      "        moe { num_experts: ",
      experts,
      " top_k: 2 d_expert: 128\n"
      "              gate { capacity_factor_train: 0 capacity_factor_eval: 0 } } }\n"
      "data { path: \"corpus.txt\" format: BYTES }\n"
      "train { steps: 1000000 global_batch: 32 lr: 0.003 warmup_steps: 20 eval_every: 0 "
      "log_every: 1000000 }\n"
      "elastic { replicas: ",
      replicas, " replica_every: ", kReplicaEvery, " heartbeat_timeout_ms: ", kHeartbeatTimeoutMs,
      " restart_grace_ms: ", kHeartbeatTimeoutMs,
      " }\n"
      "checkpoint { every: ",
      kCheckpointEvery, " dir: \"", dir, "/ckpt\" keep: 2 }\n", storage);
}

config::JobConfig ParseJob(const std::string& text) {
  auto cfg = config::ParseJobConfig(text, "bench_elastic job", "");
  if (!cfg.ok()) Die(absl::StrCat("the job config does not parse: ", cfg.status().message()));
  return *std::move(cfg);
}

// The model's sizes that the TIERED budgets and the bytes columns are computed from.
struct Sizes {
  int64_t experts = 0;
  int64_t moe_layers = 0;
  int64_t expert_floats = 0;  // one expert's parameters
  int64_t dense_scalars = 0;  // every parameter outside the experts

  uint64_t TensorBytes() const { return static_cast<uint64_t>(expert_floats) * sizeof(float); }
  // A tensor's slot in the store's tiers (SlotArena rounds it up to 4 KiB).
  uint64_t SlotBytes() const { return (TensorBytes() + 4095) / 4096 * 4096; }
  // Weights and both Adam moments of `n` experts in every MoE layer.
  uint64_t ExpertStateBytes(int64_t n) const {
    return 3 * static_cast<uint64_t>(n * moe_layers) * TensorBytes();
  }
  // The dense parameters with both Adam moments: what a worker reads from a checkpoint, or a
  // joiner receives.
  uint64_t DenseCheckpointBytes() const { return 3 * dense_scalars * sizeof(float); }
  // What `workers` workers read from a checkpoint: every expert once, the dense state each.
  uint64_t CheckpointReadBytes(int workers) const {
    return ExpertStateBytes(experts) + static_cast<uint64_t>(workers) * DenseCheckpointBytes();
  }
  // The device budget's share that the trainer reserves for the dense state (with gradients).
  uint64_t DenseDeviceBytes() const { return 4 * dense_scalars * sizeof(float); }
};

// Builds the model of JobText(., experts, "", 1) in this process for its shapes (experts unbound,
// one built).
Sizes MeasureModel(int64_t experts) {
  const config::JobConfig cfg = ParseJob(JobText(".", experts, "", 1));
  ThreadPool pool(1);
  ops::Context ctx;
  ctx.pool = &pool;
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.seed = cfg.seed();
  mo.unbound_experts = true;
  mo.num_local_experts = 1;
  auto m = model::MoeTransformer::Create(ctx, mo);
  if (!m.ok()) Die(absl::StrCat("cannot build the job's model: ", m.status().message()));
  Sizes s;
  s.experts = experts;
  s.moe_layers = static_cast<int64_t>((*m)->moe_layers().size());
  if (s.moe_layers == 0) Die("the job's model has no MoE layer");
  s.expert_floats =
      model::ExpertLayout::Of((*m)->moe_layers()[0].layer->expert(0).Parameters()).floats;
  s.dense_scalars = model::CountScalars((*m)->DenseParameters());
  return s;
}

// The TIERED job's storage block: budgets at the store's minimum (see the header).
std::string TieredStorage(const Sizes& s, const storage::StoreOptions& slots) {
  return absl::StrCat("storage { mode: TIERED device_budget_bytes: ",
                      s.DenseDeviceBytes() + slots.MinDeviceSlots() * s.SlotBytes(),
                      " host_budget_bytes: ", slots.MinHostSlots() * s.SlotBytes(), " }\n");
}

// Whether the job holds a committed checkpoint to go back to.
bool HasCheckpoint(const coordinator::CoordinatorRecord& r) {
  return std::any_of(r.catalog().begin(), r.catalog().end(),
                     [](const auto& c) { return c.complete(); });
}

// Whether a generation that began at `back_to`, replacing one at step boundary `boundary`, went
// back to a checkpoint (rather than going on from the state its workers held, at the boundary or
// one step before it). The record holds no more than the steps: an event at a checkpoint's step,
// or the step after it, cannot be told apart, so the failures wait until 2 steps past one.
bool WentBackToCheckpoint(int64_t boundary, int64_t back_to) {
  return back_to < boundary && back_to % kCheckpointEvery == 0;
}

// Whether step boundary `step` is 2 steps or more from every multiple of checkpoint.every, so that
// WentBackToCheckpoint can tell the two ways of re-forming apart for an event there.
bool AwayFromCheckpoints(int64_t step) {
  return step % kCheckpointEvery >= 2 && step % kCheckpointEvery <= kCheckpointEvery - 2;
}

// How many experts have another worker as owner in `after` than in `before`: each record's
// experts_per_worker are contiguous ranges in rank order (one expert-parallel group); -1 when a
// record lacks them.
int64_t ExpertsChangingOwner(const coordinator::CoordinatorRecord& before,
                             const coordinator::CoordinatorRecord& after) {
  auto owners = [](const coordinator::CoordinatorRecord& r) {
    std::vector<std::string> owner;
    if (r.experts_per_worker_size() != r.generation().workers_size()) return owner;
    for (int w = 0; w < r.experts_per_worker_size(); ++w) {
      owner.insert(owner.end(), r.experts_per_worker(w), r.generation().workers(w).id());
    }
    return owner;
  };
  const std::vector<std::string> a = owners(before), b = owners(after);
  if (a.empty() || a.size() != b.size()) return -1;
  int64_t moved = 0;
  for (size_t e = 0; e < a.size(); ++e) moved += a[e] != b[e];
  return moved;
}

class Job {
 public:
  Job(const Options& o, const std::string& dir, const std::string& strata, const std::string& job)
      : o_(o), dir_(dir), strata_(strata) {
    std::ofstream(dir + "/corpus.txt") << bench::WordCorpus(2 << 20);
    // The coordinator records the job's config and hands it to the workers.
    std::ofstream(dir + "/job.textproto") << job;
    coordinator::CoordinatorOptions co;
    co.dir = dir + "/coordinator";
    co.token = "bench-token";
    co.initial_workers = o.workers;
    co.min_workers = 2;
    co.max_workers = o.workers;
    co.heartbeat_timeout = std::chrono::milliseconds(kHeartbeatTimeoutMs);
    co.restart_grace = co.heartbeat_timeout;
    auto state = coordinator::CoordinatorState::Open(co, job, Clock::now());
    if (!state.ok()) Die(std::string(state.status().message()));
    state_ = std::move(*state);
    auto server = coordinator::CoordinatorServer::Start(state_.get(), "127.0.0.1:0");
    if (!server.ok()) Die(std::string(server.status().message()));
    server_ = std::move(*server);
  }
  ~Job() {
    for (auto& [id, pid] : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      LiveWorkers().erase(pid);
    }
    server_.reset();
  }

  void Start(const std::string& id) {
    const std::string cmd =
        absl::StrCat("cd ", dir_, " && STRATA_JOB_TOKEN=bench-token exec ", strata_,
                     " worker --coordinator ", server_->address(), " --quiet --threads ",
                     o_.threads, " --id ", id, " > ", id, ".log 2>&1");
    const pid_t pid = fork();
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    pids_[id] = pid;
    LiveWorkers().insert(pid);
  }
  void Kill(const std::string& id) {
    kill(pids_.at(id), SIGKILL);
    waitpid(pids_.at(id), nullptr, 0);
    LiveWorkers().erase(pids_.at(id));
    pids_.erase(id);
  }
  coordinator::CoordinatorRecord Record() const { return state_->Snapshot(); }
  // Polls the record until pred holds; dies naming `what` after `limit` seconds.
  template <typename Pred>
  coordinator::CoordinatorRecord WaitFor(Pred pred, const std::string& what, double limit = 120) {
    const auto t0 = Clock::now();
    while (true) {
      coordinator::CoordinatorRecord r = Record();
      if (pred(r)) return r;
      if (Since(t0) > limit) {
        Die(absl::StrFormat("waited %.0f s for %s; the workers' logs are in %s", limit, what,
                            dir_));
      }
      for (auto& [id, pid] : pids_) {
        int status = 0;
        if (waitpid(pid, &status, WNOHANG) == pid) {
          Die(absl::StrFormat("worker %s exited while waiting for %s; see %s/%s.log", id, what,
                              dir_, id));
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  // A generation of `n` workers that has done `steps` steps.
  coordinator::CoordinatorRecord Steady(int n, int steps) {
    return WaitFor(
        [&](const auto& r) {
          return r.generation().workers_size() == n &&
                 r.step() >= r.generation().first_step() + steps;
        },
        absl::StrFormat("%d workers to train %d steps", n, steps));
  }
  // Waits until a generation after `gen` with `n` workers (0: any number) has done a step, and
  // returns the lowest first step of the generations after `gen` seen on the way: the job may form
  // more than one (a restart's first workers form one, the others join it at a step boundary).
  // `reached`, when given, receives the record that ended the wait.
  int64_t FirstStepAfter(int64_t gen, int n, const std::string& what,
                         coordinator::CoordinatorRecord* reached = nullptr) {
    int64_t back_to = INT64_MAX;
    coordinator::CoordinatorRecord r = WaitFor(
        [&](const auto& r) {
          const bool later = r.generation().number() > gen && r.generation().workers_size() > 0;
          if (later) back_to = std::min(back_to, r.generation().first_step());
          return later && (n == 0 || r.generation().workers_size() == n) &&
                 r.step() > r.generation().first_step();
        },
        what);
    if (reached != nullptr) *reached = std::move(r);
    return back_to;
  }
  // The mean time of `steps` steps of a generation of `n` workers, from the first step boundary
  // after step `from` (timed from the poll that sees it, 2 ms apart, to the one that sees the
  // last).
  double MeanStepSeconds(int n, int64_t from, int64_t steps) {
    const coordinator::CoordinatorRecord reached = WaitFor(
        [&](const auto& r) { return r.generation().workers_size() == n && r.step() >= from; },
        absl::StrFormat("%d workers to reach step %d", n, from));
    const coordinator::CoordinatorRecord start =
        WaitFor([&](const auto& r) { return r.step() > reached.step(); },
                absl::StrFormat("%d workers to finish step %d", n, reached.step() + 1));
    const auto t0 = Clock::now();
    const coordinator::CoordinatorRecord end = WaitFor(
        [&](const auto& r) {
          return r.generation().number() == start.generation().number() &&
                 r.step() >= start.step() + steps;
        },
        absl::StrFormat("%d workers to train %d steps from step %d", n, steps, start.step()));
    return Since(t0) / static_cast<double>(end.step() - start.step());
  }
  const std::map<std::string, pid_t>& pids() const { return pids_; }

 private:
  Options o_;
  std::string dir_, strata_;
  std::unique_ptr<coordinator::CoordinatorState> state_;
  std::unique_ptr<coordinator::CoordinatorServer> server_;
  std::map<std::string, pid_t> pids_;
};

struct Row {
  Row(std::string s, std::string e) : storage(std::move(s)), event(std::move(e)) {}
  std::string storage, event;
  std::vector<double> seconds;
  int64_t steps_lost = 0;  // the most steps replayed over the trials
  int64_t bytes = -1;      // bytes moved, the most over the trials; -1: not computed
  std::string bytes_what;
  void Moved(uint64_t b, const char* what) {
    bytes = std::max(bytes, static_cast<int64_t>(b));
    bytes_what = what;
  }
  double Median() const { return seconds.empty() ? 0 : bench::MedianOf(seconds); }
  double Worst() const {
    return seconds.empty() ? 0 : *std::max_element(seconds.begin(), seconds.end());
  }
};

struct ModeRows {
  explicit ModeRows(const std::string& storage)
      : failure(storage, "failure"),
        join(storage, "join"),
        join_spawn(storage, "join_from_process_start"),
        restart(storage, "restart_from_checkpoint") {}
  Row failure, join, join_spawn, restart;
  uint64_t failed_expert_bytes = 0;  // the dead worker's expert state, the most over the failures
  // TIERED: the mean step time before any event, with buddy copies and without (replicas 0).
  double step_s = 0, no_copies_step_s = 0;
  std::vector<const Row*> rows() const { return {&failure, &join, &join_spawn, &restart}; }
};

// Runs one job (IN_MEMORY, or TIERED with `storage` its storage block) in `dir`: the failure and
// join trials, then the restarts.
ModeRows RunJob(const Options& o, bool tiered, const Sizes& s, const std::string& storage,
                const std::string& dir, const std::string& strata) {
  const std::string mode = tiered ? "TIERED" : "IN_MEMORY";
  ModeRows m(mode);
  std::filesystem::create_directories(dir);
  Job job(o, dir, strata, JobText(dir, s.experts, storage, 1));
  int next_id = 0;
  for (int i = 0; i < o.workers; ++i) job.Start(absl::StrCat("w", next_id++));
  job.Steady(o.workers, 5);
  if (tiered) m.step_s = job.MeanStepSeconds(o.workers, kSteadyFrom, kSteadySteps);
  for (int t = 0; t < o.trials; ++t) {
    // Failure: a different rank each trial, once the job has a checkpoint to go back to (a job
    // that goes back to its first step measures nothing a long-running job would see), and not
    // within a step of one (see WentBackToCheckpoint).
    coordinator::CoordinatorRecord before = job.WaitFor(
        [&](const auto& r) {
          return HasCheckpoint(r) && r.generation().workers_size() == o.workers &&
                 r.step() >= r.generation().first_step() + 3 && AwayFromCheckpoints(r.step());
        },
        "a committed checkpoint");
    const int rank = t % o.workers;
    const std::string victim = before.generation().workers(rank).id();
    const int64_t held = before.experts_per_worker_size() == before.generation().workers_size()
                             ? before.experts_per_worker(rank)
                             : (s.experts + o.workers - 1) / o.workers;
    const auto t0 = Clock::now();
    job.Kill(victim);
    const int64_t back_to = job.FirstStepAfter(before.generation().number(), o.workers - 1,
                                               "the first step without the killed worker");
    m.failure.seconds.push_back(Since(t0));
    m.failure.steps_lost = std::max(m.failure.steps_lost, before.step() - back_to);
    m.failed_expert_bytes = std::max(m.failed_expert_bytes, s.ExpertStateBytes(held));
    if (WentBackToCheckpoint(before.step(), back_to)) {
      m.failure.Moved(s.CheckpointReadBytes(o.workers - 1), kReadFromCheckpoint);
    } else {
      m.failure.Moved(s.ExpertStateBytes(held), tiered ? "dead worker's experts from buddy copies"
                                                       : "dead worker's experts from buddies");
    }
    job.WaitFor(
        [&](const auto& r) {
          return r.generation().workers_size() == o.workers - 1 &&
                 r.step() >= r.generation().first_step() + 3 && AwayFromCheckpoints(r.step());
        },
        "the survivors to train 3 steps");
    // Join.
    const std::string id = absl::StrCat("w", next_id++);
    const int64_t gen_before_join = job.Record().generation().number();
    const auto spawned = Clock::now();
    job.Start(id);
    job.WaitFor(
        [&](const auto& r) {
          for (const auto& w : r.pending()) {
            if (w.id() == id) return true;
          }
          return false;
        },
        "the joiner to join");
    const auto joined = Clock::now();
    const coordinator::CoordinatorRecord before_join = job.Record();
    const int64_t boundary = before_join.step();
    coordinator::CoordinatorRecord with_joiner;
    const int64_t join_back_to = job.FirstStepAfter(gen_before_join, o.workers,
                                                    "the first step with the joiner", &with_joiner);
    m.join.seconds.push_back(Since(joined));
    m.join_spawn.seconds.push_back(Since(spawned));
    m.join.steps_lost = std::max(m.join.steps_lost, boundary - join_back_to);
    m.join_spawn.steps_lost = m.join.steps_lost;
    if (WentBackToCheckpoint(boundary, join_back_to)) {
      m.join.Moved(s.CheckpointReadBytes(o.workers), kReadFromCheckpoint);
      m.join_spawn.Moved(s.CheckpointReadBytes(o.workers), kReadFromCheckpoint);
    } else if (const int64_t moved = ExpertsChangingOwner(before_join, with_joiner); moved >= 0) {
      const uint64_t bytes = s.ExpertStateBytes(moved) + s.DenseCheckpointBytes();
      const char* what = tiered ? "experts changing owner, store to store, + dense to joiner"
                                : "experts changing owner + dense to joiner";
      m.join.Moved(bytes, what);
      m.join_spawn.Moved(bytes, what);
    }
    job.Steady(o.workers, 3);
    std::fprintf(stderr,
                 "%s trial %d/%d: failure of rank %d %.3f s (%lld steps replayed), join %.3f s "
                 "(%lld steps replayed)\n",
                 mode.c_str(), t + 1, o.trials, rank, m.failure.seconds.back(),
                 static_cast<long long>(std::max<int64_t>(0, before.step() - back_to)),
                 m.join.seconds.back(),
                 static_cast<long long>(std::max<int64_t>(0, boundary - join_back_to)));
  }
  // Baseline: every worker killed, as many started afresh; the job goes back to its latest
  // checkpoint.
  for (int t = 0; t < o.restarts; ++t) {
    job.Steady(o.workers, 25);  // past at least one checkpoint of this membership
    coordinator::CoordinatorRecord before = job.Record();
    std::vector<std::string> ids;
    for (const auto& [id, pid] : job.pids()) ids.push_back(id);
    const auto t0 = Clock::now();
    for (const std::string& id : ids) job.Kill(id);
    for (int i = 0; i < o.workers; ++i) job.Start(absl::StrCat("w", next_id++));
    const int64_t back_to =
        job.FirstStepAfter(before.generation().number(), 0, "the restarted job's first step");
    m.restart.seconds.push_back(Since(t0));
    m.restart.steps_lost = std::max(m.restart.steps_lost, before.step() - back_to);
    m.restart.Moved(s.CheckpointReadBytes(o.workers), kReadFromCheckpoint);
    std::fprintf(stderr, "%s restart %d/%d: %.3f s (at step %lld, back to checkpoint %lld)\n",
                 mode.c_str(), t + 1, o.restarts, m.restart.seconds.back(),
                 static_cast<long long>(before.step()), static_cast<long long>(back_to));
  }
  return m;
}

// The TIERED job with elastic.replicas 0 (no buddy copies) in `dir`: its mean step time over the
// steps the TIERED job with copies is timed on.
double NoCopiesStepSeconds(const Options& o, const Sizes& s, const std::string& storage,
                           const std::string& dir, const std::string& strata) {
  std::filesystem::create_directories(dir);
  const auto t0 = Clock::now();
  double step_s = 0;
  {
    Job job(o, dir, strata, JobText(dir, s.experts, storage, 0));
    for (int i = 0; i < o.workers; ++i) job.Start(absl::StrCat("w", i));
    step_s = job.MeanStepSeconds(o.workers, kSteadyFrom, kSteadySteps);
  }
  std::filesystem::remove_all(dir);
  std::fprintf(stderr, "TIERED without buddy copies: %.3f s a step (the job ran %.1f s)\n", step_s,
               Since(t0));
  return step_s;
}

struct SsdSpeed {
  double write_gbps = 0, read_gbps = 0;  // 1e9 bytes per second
  int64_t extents = 0;
  uint64_t extent_bytes = 0;
};

// Writes and reads back `extents` extents of `extent_bytes` through an SsdTier in `dir` with the
// I/O settings of `st`, kSsdRounds times; medians (see the header).
SsdSpeed MeasureSsd(const std::string& dir, const config::StorageConfig& st, uint64_t extent_bytes,
                    int64_t extents) {
  storage::UringOptions uo;
  uo.queue_depth = st.io_queue_depth();
  uo.block_bytes = st.io_block_bytes();
  auto io = storage::MakeUringIo(uo);
  if (!io.ok()) Die(absl::StrCat("io_uring for the SSD measurement: ", io.status().message()));
  storage::SsdOptions so;
  so.dir = dir;
  so.file_bytes = st.ssd_file_bytes();
  auto tier = storage::SsdTier::Open(so, *std::move(io));
  if (!tier.ok()) Die(absl::StrCat("the SSD tier in ", dir, ": ", tier.status().message()));
  const uint64_t stride = (extent_bytes + 4095) / 4096 * 4096;
  const uint64_t span = stride * static_cast<uint64_t>(extents);
  auto buf = storage::IoBuffer::Allocate(2 * span);
  if (!buf.ok()) Die(absl::StrCat("the SSD measurement's buffer: ", buf.status().message()));
  char* out = buf->data();  // written from
  char* in = out + span;    // read into
  std::mt19937_64 gen(1);
  for (uint64_t i = 0; i + 8 <= span; i += 8) {
    const uint64_t v = gen();
    std::memcpy(out + i, &v, 8);
  }
  (*tier)->RegisterRegions({iovec{buf->data(), 2 * span}});
  const double bytes = static_cast<double>(extent_bytes) * static_cast<double>(extents);
  std::vector<double> writes_gbps, reads_gbps;
  const std::string what = "bench extent";
  for (int round = 0; round < kSsdRounds; ++round) {
    std::vector<storage::StoredExtent> stored(extents);
    std::vector<storage::SsdTier::WriteItem> writes;
    std::vector<storage::SsdTier::ReadItem> reads;
    for (int64_t i = 0; i < extents; ++i) {
      writes.push_back({out + i * stride, extent_bytes, &stored[i]});
      reads.push_back({&stored[i], in + i * stride, &what});
    }
    std::memset(in, 0, span);
    auto t0 = Clock::now();
    Status s = (*tier)->WriteMany(writes);
    if (!s.ok()) Die(absl::StrCat("SSD measurement, write: ", s.message()));
    writes_gbps.push_back(bytes / Since(t0) / 1e9);
    t0 = Clock::now();
    s = (*tier)->ReadMany(reads);
    if (!s.ok()) Die(absl::StrCat("SSD measurement, read: ", s.message()));
    reads_gbps.push_back(bytes / Since(t0) / 1e9);
    for (int64_t i = 0; i < extents; ++i) {
      if (std::memcmp(out + i * stride, in + i * stride, extent_bytes) != 0) {
        Die(
            absl::StrFormat("SSD measurement: extent %d read back from %s differs from what was "
                            "written",
                            i, dir));
      }
      (*tier)->Free(stored[i].extent);
    }
  }
  tier->reset();
  return SsdSpeed{bench::MedianOf(writes_gbps), bench::MedianOf(reads_gbps), extents, extent_bytes};
}

std::string MB(int64_t bytes) {
  return bytes < 0 ? std::string("-") : absl::StrFormat("%.2f", static_cast<double>(bytes) / 1e6);
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  // The workers this benchmark starts inherit the kernel it settles on and do not re-execute.
  bench::ChooseBlasKernelAtStart("bench_elastic", argv);
  Options o;
  const char* usage =
      "usage: bench_elastic [--workers N] [--trials N] [--restarts N] [--threads N] "
      "[--storage both|in_memory|tiered] [--json]";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> int {
      return std::atoi(bench::FlagValue("bench_elastic", argc, argv, &i).c_str());
    };
    if (a == "--workers") {
      o.workers = value();
    } else if (a == "--trials") {
      o.trials = value();
    } else if (a == "--restarts") {
      o.restarts = value();
    } else if (a == "--threads") {
      o.threads = value();
    } else if (a == "--storage") {
      const std::string s = bench::FlagValue("bench_elastic", argc, argv, &i);
      if (s != "both" && s != "in_memory" && s != "tiered") {
        Die(absl::StrCat("--storage ", s, ": must be both, in_memory or tiered"));
      }
      o.in_memory = s != "tiered";
      o.tiered = s != "in_memory";
    } else if (a == "--json") {
      o.json = true;
    } else {
      Die(absl::StrCat("unknown flag ", a, "; ", usage));
    }
  }
  if (o.workers < 3 || o.workers > 16) Die("--workers must be in [3, 16]");
  if (o.trials < 1 || o.restarts < 0) Die("--trials must be >= 1 and --restarts >= 0");
  if (o.threads < 1) Die("--threads must be >= 1");
  const std::string strata =
      (std::filesystem::canonical("/proc/self/exe").parent_path() / "strata").string();
  if (!std::filesystem::exists(strata)) Die("no strata binary next to this one: " + strata);

  // The model, with enough experts per worker for the TIERED budgets to sit 4x below its share.
  storage::StoreOptions slots;
  slots.compute_threads = o.threads;
  const int64_t budget_tensors = std::max(slots.MinDeviceSlots(), slots.MinHostSlots());
  Sizes sizes = MeasureModel(kDefaultExperts);
  const int64_t per_worker =
      (4 * budget_tensors + 3 * sizes.moe_layers - 1) / (3 * sizes.moe_layers);
  if (kDefaultExperts / o.workers < per_worker) sizes = MeasureModel(per_worker * o.workers);
  const std::string tiered_storage = TieredStorage(sizes, slots);
  const int64_t share_tensors = 3 * (sizes.experts / o.workers) * sizes.moe_layers;

  const std::string tmpl_path = bench::ScratchDir() + "/strata-bench-elastic-XXXXXX";
  std::vector<char> tmpl(tmpl_path.begin(), tmpl_path.end());
  tmpl.push_back('\0');
  if (mkdtemp(tmpl.data()) == nullptr) Die("cannot create a temporary folder from " + tmpl_path);
  const std::string dir = tmpl.data();

  SsdSpeed ssd;
  if (o.tiered) {
    const int64_t most = (sizes.experts + o.workers - 1) / o.workers;
    ssd =
        MeasureSsd(dir + "/ssd", ParseJob(JobText(dir, sizes.experts, tiered_storage, 1)).storage(),
                   sizes.TensorBytes(), 3 * most * sizes.moe_layers);
    std::filesystem::remove_all(dir + "/ssd");
  }
  std::vector<ModeRows> modes;
  if (o.in_memory) modes.push_back(RunJob(o, false, sizes, "", dir + "/in_memory", strata));
  if (o.tiered) {
    const double no_copies_step_s =
        NoCopiesStepSeconds(o, sizes, tiered_storage, dir + "/tiered_no_copies", strata);
    modes.push_back(RunJob(o, true, sizes, tiered_storage, dir + "/tiered", strata));
    modes.back().no_copies_step_s = no_copies_step_s;
  }
  std::filesystem::remove_all(dir);

  std::printf(
      "bench_elastic: %d local workers (%d threads each), %d trials, %d restarts; %lld experts%s "
      "x %lld MoE layers, an expert tensor %llu bytes, %lld dense parameters\n",
      o.workers, o.threads, o.trials, o.restarts, static_cast<long long>(sizes.experts),
      sizes.experts == kDefaultExperts ? "" : " (more than the default 16: see TIERED budgets)",
      static_cast<long long>(sizes.moe_layers),
      static_cast<unsigned long long>(sizes.TensorBytes()),
      static_cast<long long>(sizes.dense_scalars));
  bench::PrintBlasReport(bench::MeasureBlas(o.threads));
  if (o.tiered) {
    std::printf(
        "TIERED budgets per worker: device %llu bytes (dense state %llu + %d expert tensors), host "
        "%llu bytes (%d expert tensors); a worker's share: %lld expert tensors (%.1fx and %.1fx "
        "the budgets' tensors)\n",
        static_cast<unsigned long long>(sizes.DenseDeviceBytes() +
                                        slots.MinDeviceSlots() * sizes.SlotBytes()),
        static_cast<unsigned long long>(sizes.DenseDeviceBytes()), slots.MinDeviceSlots(),
        static_cast<unsigned long long>(slots.MinHostSlots() * sizes.SlotBytes()),
        slots.MinHostSlots(), static_cast<long long>(share_tensors),
        static_cast<double>(share_tensors) / slots.MinDeviceSlots(),
        static_cast<double>(share_tensors) / slots.MinHostSlots());
  }
  std::printf("%-34s %6s %9s %9s %14s %9s  %s\n", "event", "trials", "median s", "worst s",
              "steps replayed", "MB moved", "bytes moved are");
  for (const ModeRows& m : modes) {
    for (const Row* r : m.rows()) {
      if (r->seconds.empty()) continue;
      const std::string label = absl::StrCat(r->storage, " ", r->event);
      std::printf("%-34s %6zu %9.3f %9.3f %14lld %9s  %s\n", label.c_str(), r->seconds.size(),
                  r->Median(), r->Worst(), static_cast<long long>(r->steps_lost),
                  MB(r->bytes).c_str(), r->bytes < 0 ? "not computed" : r->bytes_what.c_str());
    }
  }
  bool tiered_below_restart = false, tiered_below_move = false, tiered_replay = false;
  double move_s = 0, step_s = 0, no_copies_step_s = 0;
  for (const ModeRows& m : modes) {
    const std::string& mode = m.failure.storage;
    if (!m.restart.seconds.empty()) {
      const double ratio = m.restart.Median() / m.failure.Median();
      std::printf(
          "%s: a failure costs %.1fx %s time than a restart from the checkpoint (medians), with "
          "up to %lld steps replayed against up to %lld\n",
          mode.c_str(), ratio >= 1 ? ratio : 1 / ratio, ratio >= 1 ? "less" : "more",
          static_cast<long long>(m.failure.steps_lost),
          static_cast<long long>(m.restart.steps_lost));
    }
    if (mode == "IN_MEMORY") {
      std::printf("IN_MEMORY targets: failure < 3 s: %s; join < 2 s: %s; no step lost: %s\n",
                  m.failure.Worst() < 3 ? "met" : "MISSED", m.join.Worst() < 2 ? "met" : "MISSED",
                  m.failure.steps_lost == 0 ? "met" : "MISSED");
      continue;
    }
    const double mb = static_cast<double>(m.failed_expert_bytes);
    move_s = mb / (ssd.read_gbps * 1e9) + mb / (ssd.write_gbps * 1e9);
    std::printf(
        "SSD tier (SsdTier, io_uring, O_DIRECT): write %.3f GB/s, read %.3f GB/s (%lld extents of "
        "%llu bytes, medians of %d rounds); moving a failed worker's expert state (%.2f MB) at "
        "that "
        "speed, read then written: %.3f s\n",
        ssd.write_gbps, ssd.read_gbps, static_cast<long long>(ssd.extents),
        static_cast<unsigned long long>(ssd.extent_bytes), kSsdRounds, mb / 1e6, move_s);
    step_s = m.step_s;
    no_copies_step_s = m.no_copies_step_s;
    std::printf(
        "TIERED steady state, mean of %lld steps after step %lld: %.3f s a step with buddy "
        "copies (replicas 1, replica_every %d), %.3f s without (replicas 0): the copies cost "
        "%.2fx the step time\n",
        static_cast<long long>(kSteadySteps), static_cast<long long>(kSteadyFrom), step_s,
        kReplicaEvery, no_copies_step_s, step_s / no_copies_step_s);
    tiered_below_restart = !m.restart.seconds.empty() && m.failure.Median() < m.restart.Median();
    tiered_below_move = m.failure.Worst() < 3 + move_s;
    tiered_replay = m.failure.steps_lost <= kReplicaEvery;
    std::printf(
        "TIERED failure < restart from checkpoint: %s; TIERED failure < 3 s + moving the failed "
        "worker's experts at the SSD tier's speed: %s; TIERED failure replays at most "
        "replica_every (%d) steps: %s\n",
        m.restart.seconds.empty() ? "no baseline (--restarts 0)"
        : tiered_below_restart    ? "met"
                                  : "MISSED",
        tiered_below_move ? "met" : "MISSED", kReplicaEvery, tiered_replay ? "met" : "MISSED");
    std::printf(
        "  (failure median %.3f s against restart median %.3f s; failure worst %.3f s "
        "against %.3f s; up to %lld steps replayed)\n",
        m.failure.Median(), m.restart.Median(), m.failure.Worst(), 3 + move_s,
        static_cast<long long>(m.failure.steps_lost));
  }
  if (o.json) {
    for (const ModeRows& m : modes) {
      for (const Row* r : m.rows()) {
        if (r->seconds.empty()) continue;
        JsonWriter j;
        j.BeginObject()
            .Field("storage", r->storage)
            .Field("event", r->event)
            .Field("workers", o.workers)
            .Field("trials", static_cast<int64_t>(r->seconds.size()))
            .Field("median_s", r->Median())
            .Field("worst_s", r->Worst())
            .Field("steps_lost", r->steps_lost);
        j.Key("bytes_moved");
        if (r->bytes < 0) {
          j.Null();
        } else {
          j.Int(r->bytes);
        }
        j.Field("bytes_what", r->bytes < 0 ? std::string("not computed") : r->bytes_what);
        j.Key("seconds").BeginArray();
        for (double s : r->seconds) j.Double(s, 5);
        j.EndArray().EndObject();
        std::printf("%s\n", j.str().c_str());
      }
    }
    if (o.tiered) {
      JsonWriter j;
      j.BeginObject()
          .Field("storage", "TIERED")
          .Field("event", "ssd_tier")
          .Field("write_gbps", ssd.write_gbps)
          .Field("read_gbps", ssd.read_gbps)
          .Field("extents", ssd.extents)
          .Field("extent_bytes", ssd.extent_bytes)
          .Field("move_failed_experts_s", move_s)
          .EndObject();
      std::printf("%s\n", j.str().c_str());
      JsonWriter st;
      st.BeginObject()
          .Field("storage", "TIERED")
          .Field("event", "steady_state")
          .Field("from_step", kSteadyFrom)
          .Field("steps", kSteadySteps)
          .Field("replica_every", kReplicaEvery)
          .Field("step_s_copies", step_s)
          .Field("step_s_no_copies", no_copies_step_s)
          .Field("copies_step_ratio", step_s / no_copies_step_s)
          .EndObject();
      std::printf("%s\n", st.str().c_str());
      JsonWriter g;
      g.BeginObject()
          .Field("storage", "TIERED")
          .Field("event", "goals")
          .Field("failure_below_restart", tiered_below_restart)
          .Field("failure_below_3s_plus_move", tiered_below_move)
          .Field("failure_replays_at_most_replica_every", tiered_replay)
          .EndObject();
      std::printf("%s\n", g.str().c_str());
    }
  }
  return 0;
}
