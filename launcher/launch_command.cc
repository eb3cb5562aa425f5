#include "launcher/commands.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/service.h"
#include "coordinator/state.h"
#include "core/common/clock.h"
#include "launcher/command_util.h"
#include "proto/config_io.h"
#include "proto/memory_estimate.h"

namespace strata::launcher {
namespace {

std::string RandomToken() {
  unsigned char bytes[16] = {0};
  std::FILE* f = std::fopen("/dev/urandom", "rb");
  if (f != nullptr) {
    if (std::fread(bytes, 1, sizeof(bytes), f) != sizeof(bytes)) bytes[0] ^= 1;
    std::fclose(f);
  }
  std::string hex;
  for (unsigned char b : bytes) hex += absl::StrFormat("%02x", b);
  return hex;
}

const std::vector<FlagSpec>& LaunchFlags() {
  static const std::vector<FlagSpec> specs = {
      {"config", "job config in text format (.textproto); required"},
      {"workers", "local workers to start; required"},
      {"min-workers", "fewer than this and training waits (default: elastic.min_workers, or 1)"},
      {"max-workers", "more than this are refused (default: elastic.max_workers, or --workers)"},
      {"listen", "the coordinator's HOST:PORT (default 127.0.0.1:0, a free port)"},
      {"coordinator-dir", "folder of the coordinator's record (default: a temporary folder)"},
      {"threads", "CPU threads per worker (overrides train.threads)"},
      {"steps", "override train.steps"},
      {"metrics-out", "each worker i writes FILE.i (JSONL)"},
      {"checkpoint-dir", "folder of checkpoints (overrides checkpoint.dir)"},
      {"checkpoint-every", "checkpoint every N steps (overrides checkpoint.every)"},
      {"resume",
       "continue from the newest checkpoint (written by any number of workers; the experts are "
       "placed over these)",
       false},
      {"quiet", "no status lines", false},
  };
  return specs;
}

}  // namespace

int LaunchCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    std::printf("usage: strata launch --config FILE --workers N [flags]\n%s",
                Flags::Usage(LaunchFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("launch", LaunchFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "launch", LaunchFlags());
  auto workers = flags->Int("workers", 1, 4096);
  auto min_w = flags->Int("min-workers", 1, 4096);
  auto max_w = flags->Int("max-workers", 1, 4096);
  auto threads = flags->Int("threads", 0, 1024);
  auto steps = flags->Int("steps", 1, 1'000'000'000);
  for (const auto* v : {&workers, &min_w, &max_w, &threads, &steps}) {
    if (!v->ok()) return UsageError(v->status(), "launch", LaunchFlags());
  }
  if (!flags->Has("config") || !*workers) {
    return UsageError(absl::InvalidArgumentError("--config FILE and --workers N are required"),
                      "launch", LaunchFlags());
  }
  auto cfg = EffectiveJobConfig(*flags);
  if (!cfg.ok()) return Fail(cfg.status());
  const int n = static_cast<int>(**workers);
  coordinator::CoordinatorOptions o = CoordinatorOptionsFor(*cfg, "", RandomToken());
  o.initial_workers = n;
  const config::ElasticConfig& el = cfg->elastic();
  o.min_workers = static_cast<int>(min_w->value_or(el.min_workers() > 0 ? el.min_workers() : 1));
  o.max_workers = static_cast<int>(max_w->value_or(el.max_workers() > 0 ? el.max_workers() : n));
  if (o.max_workers < n) {
    return UsageError(absl::InvalidArgumentError(absl::StrFormat(
                          "--workers %d is above --max-workers %d", n, o.max_workers)),
                      "launch", LaunchFlags());
  }
  if (Status range = CheckWorkerRange(*cfg, std::min(o.min_workers, n), o.max_workers);
      !range.ok()) {
    return Fail(range);
  }
  // The n workers started here, together, against this machine's memory.
  if (Status m = config::CheckMemory(*cfg, config::EstimateWorkerMemory(*cfg, n),
                                     config::AvailableHostMemory(), *flags->String("config"), n);
      !m.ok()) {
    return Fail(m);
  }
  std::string temp_dir;
  if (auto d = flags->String("coordinator-dir")) {
    o.dir = *d;
    // A folder with a job's record is that job's: its coordinator restarts from it alone.
    auto kept = coordinator::CoordinatorState::ReadRecord(o.dir);
    if (!kept.ok()) return Fail(kept.status());
    if (kept->has_value()) {
      return Fail(absl::FailedPreconditionError(absl::StrFormat(
          "--coordinator-dir '%s' holds the record of a job (generation %d, step %d); restart "
          "its coordinator with `strata coordinator --dir %s` (its workers reconnect to it), or "
          "give an empty folder for a new job",
          o.dir, (*kept)->generation().number(), (*kept)->step(), o.dir)));
    }
  } else {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/strata-coordinator-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      return Fail(absl::PermissionDeniedError(
          absl::StrFormat("cannot create a folder from '%s'; give --coordinator-dir", tmpl)));
    }
    temp_dir = o.dir = tmpl;
  }
  int rc = 0;
  {
    auto state = coordinator::CoordinatorState::Open(o, config::ToText(*cfg),
                                                     std::chrono::steady_clock::now());
    if (!state.ok()) return Fail(state.status());
    auto server = coordinator::CoordinatorServer::Start(
        state->get(), flags->String("listen").value_or("127.0.0.1:0"));
    if (!server.ok()) return Fail(server.status());
    const std::string address = (*server)->address();
    if (Status l = (*state)->SetListenAddress(address); !l.ok()) return Fail(l);
    const bool quiet = flags->Has("quiet");
    // The token, for workers started by hand and a restarted coordinator.
    const std::string token_file = o.dir + "/token";
    if (Status t = KeepToken(o.dir, o.token); !t.ok()) return Fail(t);
    std::error_code ec;
    const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    // Workers get the job's config from the coordinator; only this machine's settings are flags.
    const std::string machine_flags =
        *threads ? absl::StrFormat(" --threads %d", **threads) : std::string();
    if (!quiet) {
      std::printf(
          "[%s] coordinator on %s; starting %d workers (%d to %d may train)\n"
          "[%s] add a worker: STRATA_JOB_TOKEN=$(cat %s) %s worker --coordinator %s%s\n"
          "[%s] restart the coordinator if this process dies: STRATA_JOB_TOKEN=$(cat %s) %s "
          "coordinator --dir %s\n",
          cfg->name().c_str(), address.c_str(), n, o.min_workers, o.max_workers,
          cfg->name().c_str(), token_file.c_str(), self.c_str(), address.c_str(),
          machine_flags.c_str(), cfg->name().c_str(), token_file.c_str(), self.c_str(),
          std::filesystem::absolute(o.dir).string().c_str());
      std::fflush(stdout);
    }
    std::vector<pid_t> pids;
    for (int i = 0; i < n; ++i) {
      std::vector<std::string> argv = {"strata", "worker", "--coordinator",
                                       address,  "--id",   absl::StrCat("worker-", i),
                                       "--quiet"};
      if (*threads) argv.insert(argv.end(), {"--threads", absl::StrCat(**threads)});
      if (auto m = flags->String("metrics-out")) {
        argv.insert(argv.end(), {"--metrics-out", absl::StrCat(*m, ".", i)});
      }
      if (flags->Has("resume")) argv.push_back("--resume");
      pid_t pid = fork();
      if (pid == 0) {
        setenv("STRATA_JOB_TOKEN", o.token.c_str(), 1);
        std::vector<char*> cargv;
        for (auto& a : argv) cargv.push_back(a.data());
        cargv.push_back(nullptr);
        execv("/proc/self/exe", cargv.data());
        _exit(127);
      }
      pids.push_back(pid);
    }
    // Status lines from the coordinator's record until every worker is gone.
    const int64_t total = cfg->train().steps();
    const int every = std::max(1, cfg->train().log_every());
    int64_t shown_step = -1, shown_generation = -1;
    const double tokens_per_step =
        static_cast<double>(cfg->train().global_batch()) * cfg->model().seq_len();
    const bool tty = isatty(STDOUT_FILENO);
    double rate = 0, rate_at = 0;
    int64_t rate_step = 0;
    int failed = 0;
    int alive = n;
    std::vector<bool> exited(n, false);
    while (alive > 0) {
      for (int i = 0; i < n; ++i) {
        if (exited[i]) continue;
        int status = 0;
        if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
          exited[i] = true;
          --alive;
          const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
          if (code != 0) {
            // The others carry on without it (nothing is restarted); the job fails only if it
            // does not reach its last step.
            std::fprintf(stderr, "strata launch: worker-%d exited with %s %d\n", i,
                         WIFEXITED(status) ? "code" : "signal",
                         WIFEXITED(status) ? code : WTERMSIG(status));
            ++failed;
          }
        }
      }
      const auto r = (*state)->Snapshot();
      const bool finished = shown_step >= total;
      const double now = NowSeconds();
      if (rate_at == 0 || r.step() < rate_step) {
        rate_at = now;
        rate_step = r.step();
      } else if (now - rate_at >= 1.0 && r.step() > rate_step) {
        // Smoothed over windows of at least a second with progress (a step count in a window is
        // coarse; an evaluation is a window without progress).
        const double sample =
            tokens_per_step * static_cast<double>(r.step() - rate_step) / (now - rate_at);
        rate = rate == 0 ? sample : 0.7 * rate + 0.3 * sample;
        rate_at = now;
        rate_step = r.step();
      }
      const bool new_generation = r.generation().number() != shown_generation;
      // On a terminal one line is kept up to date (a new one per generation); otherwise a line
      // every log_every steps and at every generation.
      const bool due = tty ? r.step() != shown_step
                           : r.step() != shown_step && (r.step() % every == 0 || r.step() == total);
      if (!quiet && !finished && (new_generation || due)) {
        std::string line = absl::StrFormat("[%s] step %d/%d", cfg->name(), r.step(), total);
        if (r.generation().workers_size() == 0) {
          absl::StrAppend(&line, " | no workers training");
        } else {
          if (r.step() > 0) absl::StrAppendFormat(&line, " | loss %.4f", r.loss());
          if (rate > 0) absl::StrAppendFormat(&line, " | %.0f tok/s", rate);
          absl::StrAppendFormat(&line, " | %d workers", r.generation().workers_size());
        }
        absl::StrAppendFormat(&line, " | generation %d (%s)", r.generation().number(),
                              r.generation().reason());
        if (tty) {
          std::printf("%s\r\033[K%s", new_generation && shown_generation >= 0 ? "\n" : "",
                      line.c_str());
        } else {
          std::printf("%s\n", line.c_str());
        }
        std::fflush(stdout);
        shown_step = r.step();
        shown_generation = r.generation().number();
      }
      if (alive > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (tty && !quiet && shown_generation >= 0) std::printf("\n");
    // A joiner still pending when the job finished learns so (it asks every second) before the
    // coordinator goes away with this process.
    if (const auto r = (*state)->Snapshot(); r.finished() && r.pending_size() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    }
    const auto last = (*state)->Snapshot();
    const int64_t reached = last.step();
    if (reached < total && !last.finished()) {
      std::fprintf(stderr, "strata launch: the job stopped at step %lld of %lld\n",
                   static_cast<long long>(reached), static_cast<long long>(total));
      rc = 1;
    } else if (failed > 0 && !quiet) {
      std::printf("strata launch: the job finished without the %d worker(s) that failed\n", failed);
    }
  }
  if (!temp_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(temp_dir, ec);
  }
  if (!flags->Has("quiet")) {
    std::printf(rc == 0
                    ? "strata launch: the job finished (%d workers started)\n"
                    : "strata launch: the job failed (%d workers started); see the errors above\n",
                static_cast<int>(**workers));
  }
  return rc;
}

}  // namespace strata::launcher
