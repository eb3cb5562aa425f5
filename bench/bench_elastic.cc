// bench_elastic: how fast a running job rides through a failed worker and takes in a joiner,
// against what a job without elasticity does — stop every worker and restart the job from its
// latest checkpoint — measured in the same run on the same job.
//
//   build/bin/bench_elastic [--workers 4] [--trials 5] [--restarts 3] [--threads 1] [--json]
//
// The job: the default example's model (4 layers, d_model 128, 16 experts) on a synthetic byte
// corpus, global batch 32, buddy copies (elastic.replicas 1), a checkpoint every 20 steps, with
// the coordinator in this process and every worker a `strata worker` process on loopback.
//
//   failure  SIGKILL one worker (a different rank each trial) and time until the first step of
//            the generation without it is done (coordinator record: step > first_step). Steps
//            lost: the recorded boundary before the kill minus the step the new generation
//            started from (0 when buddy copies hold the dead worker's experts).
//   join     start a worker; time from its Join (it shows up as pending at the coordinator) to
//            the first step done by the generation that includes it. Also shown: from process
//            start, which adds loading the corpus and building the model.
//   restart  the baseline: SIGKILL every worker and start as many fresh ones; time until the job's
//            first step done again (from the latest checkpoint). Steps lost: as above.
//
// Prints a table and, with --json, one JSON object per event: event, trials, median_s, worst_s,
// steps_lost (the most over the trials), plus the per-trial times.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/bench_util.h"
#include "launcher/coordinator_service.h"
#include "launcher/coordinator_state.h"

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
  bool json = false;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "bench_elastic: %s\n", what.c_str());
  std::exit(1);
}

class Job {
 public:
  Job(const Options& o, const std::string& dir, const std::string& strata)
      : o_(o), dir_(dir), strata_(strata) {
    std::ofstream(dir + "/corpus.txt") << bench::WordCorpus(2 << 20);
    // The coordinator records the job's config and hands it to the workers.
    const std::string job =
        "name: \"bench_elastic\"\n"
        "model { vocab_size: 256 seq_len: 64 d_model: 128 n_layers: 4 n_heads: 4\n"
        "        moe { num_experts: 16 top_k: 2 d_expert: 128\n"
        "              gate { capacity_factor_train: 0 capacity_factor_eval: 0 } } }\n"
        "data { path: \"corpus.txt\" format: BYTES }\n"
        "train { steps: 1000000 global_batch: 32 lr: 0.003 warmup_steps: 20 eval_every: 0 "
        "log_every: 1000000 }\n"
        "elastic { replicas: 1 }\n"
        "checkpoint { every: 20 dir: \"ckpt\" keep: 2 }\n";
    std::ofstream(dir + "/job.textproto") << job;
    launcher::CoordinatorOptions co;
    co.dir = dir + "/coordinator";
    co.token = "bench-token";
    co.initial_workers = o.workers;
    co.min_workers = 2;
    co.max_workers = o.workers;
    auto state = launcher::CoordinatorState::Open(co, job, Clock::now());
    if (!state.ok()) Die(std::string(state.status().message()));
    state_ = std::move(*state);
    auto server = launcher::CoordinatorServer::Start(state_.get(), "127.0.0.1:0");
    if (!server.ok()) Die(std::string(server.status().message()));
    server_ = std::move(*server);
  }
  ~Job() {
    for (auto& [id, pid] : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
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
  }
  void Kill(const std::string& id) {
    kill(pids_.at(id), SIGKILL);
    waitpid(pids_.at(id), nullptr, 0);
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
  const std::map<std::string, pid_t>& pids() const { return pids_; }

 private:
  Options o_;
  std::string dir_, strata_;
  std::unique_ptr<launcher::CoordinatorState> state_;
  std::unique_ptr<launcher::CoordinatorServer> server_;
  std::map<std::string, pid_t> pids_;
};

struct Row {
  explicit Row(std::string e) : event(std::move(e)) {}
  std::string event;
  std::vector<double> seconds;
  int64_t steps_lost = 0;
  double Median() const {
    std::vector<double> v = seconds;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
  }
  double Worst() const {
    return seconds.empty() ? 0 : *std::max_element(seconds.begin(), seconds.end());
  }
};

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> int {
      if (i + 1 >= argc) Die(a + " needs a value");
      return std::atoi(argv[++i]);
    };
    if (a == "--workers") {
      o.workers = value();
    } else if (a == "--trials") {
      o.trials = value();
    } else if (a == "--restarts") {
      o.restarts = value();
    } else if (a == "--threads") {
      o.threads = value();
    } else if (a == "--json") {
      o.json = true;
    } else {
      Die("unknown flag " + a +
          "; usage: bench_elastic [--workers N] [--trials N] [--restarts N] [--threads N] "
          "[--json]");
    }
  }
  if (o.workers < 3 || o.workers > 16) Die("--workers must be in [3, 16]");
  if (o.trials < 1 || o.restarts < 0) Die("--trials must be >= 1 and --restarts >= 0");
  const std::string strata =
      (std::filesystem::canonical("/proc/self/exe").parent_path() / "strata").string();
  if (!std::filesystem::exists(strata)) Die("no strata binary next to this one: " + strata);
  char tmpl[] = "/tmp/strata-bench-elastic-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) Die("cannot create a temporary folder");
  const std::string dir = tmpl;

  Row failure("failure"), join("join"), join_spawn("join_from_process_start"),
      restart("restart_from_checkpoint");
  {
    Job job(o, dir, strata);
    int next_id = 0;
    for (int i = 0; i < o.workers; ++i) job.Start(absl::StrCat("w", next_id++));
    job.Steady(o.workers, 5);
    for (int t = 0; t < o.trials; ++t) {
      // Failure: a different rank each trial.
      coordinator::CoordinatorRecord before = job.Record();
      const int rank = t % o.workers;
      const std::string victim = before.generation().workers(rank).id();
      const auto t0 = Clock::now();
      job.Kill(victim);
      const int64_t gen = before.generation().number();
      auto after = job.WaitFor(
          [&](const auto& r) {
            return r.generation().number() > gen &&
                   r.generation().workers_size() == o.workers - 1 &&
                   r.step() > r.generation().first_step();
          },
          "the first step without the killed worker");
      failure.seconds.push_back(Since(t0));
      failure.steps_lost =
          std::max(failure.steps_lost, before.step() - after.generation().first_step());
      job.Steady(o.workers - 1, 3);
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
      const int64_t boundary = job.Record().step();
      auto in = job.WaitFor(
          [&](const auto& r) {
            return r.generation().number() > gen_before_join &&
                   r.generation().workers_size() == o.workers &&
                   r.step() > r.generation().first_step();
          },
          "the first step with the joiner");
      join.seconds.push_back(Since(joined));
      join_spawn.seconds.push_back(Since(spawned));
      join.steps_lost = std::max<int64_t>(join.steps_lost, boundary - in.generation().first_step());
      job.Steady(o.workers, 3);
      std::fprintf(stderr,
                   "trial %d/%d: failure of rank %d %.3f s (%lld steps lost), join %.3f s\n", t + 1,
                   o.trials, rank, failure.seconds.back(),
                   static_cast<long long>(before.step() - after.generation().first_step()),
                   join.seconds.back());
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
      const int64_t gen = before.generation().number();
      for (int i = 0; i < o.workers; ++i) job.Start(absl::StrCat("w", next_id++));
      // The job may form more than one generation on its way back (the first workers to join
      // form one, the others join it at a step boundary): the step it went back to is the lowest
      // first step seen.
      int64_t back_to = before.step();
      job.WaitFor(
          [&](const auto& r) {
            if (r.generation().number() > gen && r.generation().workers_size() > 0) {
              back_to = std::min(back_to, r.generation().first_step());
            }
            return r.generation().number() > gen && r.generation().workers_size() > 0 &&
                   r.step() > r.generation().first_step();
          },
          "the restarted job's first step");
      restart.seconds.push_back(Since(t0));
      restart.steps_lost = std::max(restart.steps_lost, before.step() - back_to);
      std::fprintf(stderr, "restart %d/%d: %.3f s (at step %lld, back to checkpoint %lld)\n", t + 1,
                   o.restarts, restart.seconds.back(), static_cast<long long>(before.step()),
                   static_cast<long long>(back_to));
    }
  }
  std::filesystem::remove_all(dir);

  std::printf("bench_elastic: %d local workers (%d threads each), %d trials, %d restarts\n",
              o.workers, o.threads, o.trials, o.restarts);
  std::printf("%-26s %7s %10s %10s %11s\n", "event", "trials", "median s", "worst s", "steps lost");
  for (const Row* r : {&failure, &join, &join_spawn, &restart}) {
    if (r->seconds.empty()) continue;
    std::printf("%-26s %7zu %10.3f %10.3f %11lld\n", r->event.c_str(), r->seconds.size(),
                r->Median(), r->Worst(), static_cast<long long>(r->steps_lost));
  }
  if (!restart.seconds.empty()) {
    std::printf(
        "a failure costs %.1fx less time than a restart from the checkpoint (medians), and %lld "
        "steps lost instead of up to %lld\n",
        restart.Median() / failure.Median(), static_cast<long long>(failure.steps_lost),
        static_cast<long long>(restart.steps_lost));
  }
  std::printf("targets: failure < 3 s: %s; join < 2 s: %s; no step lost: %s\n",
              failure.Worst() < 3 ? "met" : "MISSED", join.Worst() < 2 ? "met" : "MISSED",
              failure.steps_lost == 0 ? "met" : "MISSED");
  if (o.json) {
    for (const Row* r : {&failure, &join, &join_spawn, &restart}) {
      if (r->seconds.empty()) continue;
      std::vector<std::string> each;
      for (double s : r->seconds) each.push_back(absl::StrFormat("%.4f", s));
      std::printf(
          "{\"event\":\"%s\",\"workers\":%d,\"trials\":%zu,\"median_s\":%.4f,\"worst_s\":%.4f,"
          "\"steps_lost\":%lld,\"seconds\":[%s]}\n",
          r->event.c_str(), o.workers, r->seconds.size(), r->Median(), r->Worst(),
          static_cast<long long>(r->steps_lost), absl::StrJoin(each, ",").c_str());
    }
  }
  return 0;
}
