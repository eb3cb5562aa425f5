#include "launcher/commands.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/service.h"
#include "coordinator/state.h"
#include "core/common/clock.h"
#include "core/device/device.h"
#include "launcher/command_util.h"
#include "proto/config_io.h"
#include "runtime/model/memory_estimate.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& LaunchFlags() {
  static const std::vector<FlagSpec> specs = {
      {"config", "job config in text format (.textproto); required"},
      {"workers", "local workers to start; required"},
      {"min-workers", "fewer than this and training waits (default: elastic.min_workers, or 1)"},
      {"max-workers", "more than this are refused (default: elastic.max_workers, or --workers)"},
      {"listen", "the coordinator's HOST:PORT (default 127.0.0.1:0, a free port)"},
      {"coordinator-dir", "folder of the coordinator's record (default: a temporary folder)"},
      {"threads", "CPU threads per worker (overrides train.threads)"},
      {"device",
       "every worker's device (overrides train.device): cpu, cuda (worker i on cuda:<i mod "
       "GPUs>) or cuda:N"},
      {"steps", "override train.steps"},
      {"metrics-out", "each worker i writes FILE.i (JSONL)"},
      {"checkpoint-dir", "folder of checkpoints (overrides checkpoint.dir)"},
      {"checkpoint-every", "checkpoint every N steps (overrides checkpoint.every)"},
      {"resume",
       "continue from the newest checkpoint (written by any number of workers; the experts are "
       "placed over these)",
       false},
      {"init-from",
       "every worker starts from the weights of this safetensors file (strata ckpt export's)"},
      {"quiet", "no status lines", false},
  };
  static const std::vector<FlagSpec> with_http = [] {
    std::vector<FlagSpec> s = specs;
    for (FlagSpec& f : CoordinatorHttpFlags()) s.push_back(std::move(f));
    return s;
  }();
  return with_http;
}

// What `strata launch` was asked to do: the job, its workers, and the coordinator's options.
struct LaunchPlan {
  Flags flags;
  config::JobConfig cfg;
  std::string config_path;
  int workers = 0;
  coordinator::CoordinatorOptions options;
  std::optional<int64_t> threads;
  std::optional<std::string> device;
  std::optional<std::string> metrics_out;
  std::string init_from;  // absolute
  std::string listen;
  bool resume = false;
  bool quiet = false;
  bool temp_dir = false;  // options.dir is a temporary folder, removed at the end
};

// Parse: the flags into a plan. Returns the exit code when the command ends here (help, a usage
// error, a config that does not load or does not fit the worker counts).
std::optional<int> ParseLaunch(const std::vector<std::string>& args, LaunchPlan* plan) {
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
  plan->cfg = *std::move(cfg);
  plan->config_path = *flags->String("config");
  const int n = plan->workers = static_cast<int>(**workers);
  coordinator::CoordinatorOptions& o = plan->options;
  o = CoordinatorOptionsFor(plan->cfg, "", RandomToken());
  o.initial_workers = n;
  const config::ElasticConfig& el = plan->cfg.elastic();
  o.min_workers = static_cast<int>(min_w->value_or(el.min_workers() > 0 ? el.min_workers() : 1));
  o.max_workers = static_cast<int>(max_w->value_or(el.max_workers() > 0 ? el.max_workers() : n));
  if (o.max_workers < n) {
    return UsageError(absl::InvalidArgumentError(absl::StrFormat(
                          "--workers %d is above --max-workers %d", n, o.max_workers)),
                      "launch", LaunchFlags());
  }
  if (Status range = CheckWorkerRange(plan->cfg, std::min(o.min_workers, n), o.max_workers);
      !range.ok()) {
    return Fail(range);
  }
  plan->threads = *threads;
  plan->device = flags->String("device");
  // Where the workers would find no GPU, one error here rather than one from every worker.
  const std::string device = plan->device.value_or(plan->cfg.train().device());
  if (StatusOr<Device> d = Device::Parse(device);
      d.ok() && !d->is_cpu() && d->index >= CudaDeviceCount()) {
    return Fail(absl::FailedPreconditionError(absl::StrFormat(
        "%s %s: the workers would train on %s, but this machine has %s; launch with --device "
        "cpu or cuda (worker i on GPU i mod GPUs), or on a machine with that GPU",
        plan->device ? "--device" : "train.device", device,
        device == "cuda" ? "GPUs" : d->ToString(), CudaDeviceDescription(d->index))));
  }
  plan->metrics_out = flags->String("metrics-out");
  plan->listen = flags->String("listen").value_or("127.0.0.1:0");
  plan->resume = flags->Has("resume");
  if (auto f = flags->String("init-from")) {
    if (plan->resume) {
      return UsageError(absl::InvalidArgumentError(
                            "--init-from and --resume: a resume takes its weights from the "
                            "checkpoint; give one"),
                        "launch", LaunchFlags());
    }
    std::error_code ec;
    if (!std::filesystem::is_regular_file(*f, ec)) {
      return Fail(absl::NotFoundError(absl::StrFormat(
          "--init-from '%s' is not a file it can read%s (strata ckpt export writes one)", *f,
          ec ? absl::StrCat(": ", ec.message()) : std::string())));
    }
    plan->init_from = std::filesystem::absolute(*f, ec).string();
  }
  plan->quiet = flags->Has("quiet");
  if (auto d = flags->String("coordinator-dir")) o.dir = *d;
  plan->flags = *std::move(flags);
  return std::nullopt;
}

// Plan: the n workers fit this machine's memory together, and the coordinator has a folder — an
// empty one given, or a temporary one.
Status PlanLaunch(LaunchPlan* plan) {
  // On the device the workers will use: --device is a machine setting, not the job's.
  config::JobConfig here = plan->cfg;
  if (plan->device) here.mutable_train()->set_device(*plan->device);
  RETURN_IF_ERROR(config::CheckMemory(here, config::EstimateWorkerMemory(here, plan->workers),
                                      config::AvailableHostMemory(), plan->config_path,
                                      plan->workers));
  coordinator::CoordinatorOptions& o = plan->options;
  if (!o.dir.empty()) {
    // A folder with a job's record is that job's: its coordinator restarts from it alone.
    ASSIGN_OR_RETURN(std::optional<coordinator::CoordinatorRecord> kept,
                     coordinator::CoordinatorState::ReadRecord(o.dir));
    if (kept.has_value()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "--coordinator-dir '%s' holds the record of a job (generation %d, step %d); restart "
          "its coordinator with `strata coordinator --dir %s` (its workers reconnect to it), or "
          "give an empty folder for a new job",
          o.dir, kept->generation().number(), kept->step(), o.dir));
    }
    return absl::OkStatus();
  }
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/strata-coordinator-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot create a folder from '%s'; give --coordinator-dir", tmpl));
  }
  o.dir = tmpl;
  plan->temp_dir = true;
  return absl::OkStatus();
}

// The lines that tell the user how to add a worker and restart the coordinator.
void PrintBanner(const LaunchPlan& plan, const std::string& address) {
  const coordinator::CoordinatorOptions& o = plan.options;
  const std::string token_file = o.dir + "/token";
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  // Workers get the job's config from the coordinator; only this machine's settings are flags
  // (and the weights the job started from, which a job going back to step 0 reads again).
  std::string machine_flags =
      plan.threads ? absl::StrFormat(" --threads %d", *plan.threads) : std::string();
  if (plan.device) absl::StrAppend(&machine_flags, " --device ", *plan.device);
  if (!plan.init_from.empty()) {
    // Quoted for the shell: the line is meant to be pasted.
    std::string quoted = "'";
    for (char c : plan.init_from) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    absl::StrAppend(&machine_flags, " --init-from ", quoted, "'");
  }
  const char* name = plan.cfg.name().c_str();
  std::printf(
      "[%s] coordinator on %s; starting %d workers (%d to %d may train)\n"
      "[%s] add a worker: STRATA_JOB_TOKEN=$(cat %s) %s worker --coordinator %s%s\n"
      "[%s] restart the coordinator if this process dies: STRATA_JOB_TOKEN=$(cat %s) %s "
      "coordinator --dir %s\n",
      name, address.c_str(), plan.workers, o.min_workers, o.max_workers, name, token_file.c_str(),
      self.c_str(), address.c_str(), machine_flags.c_str(), name, token_file.c_str(), self.c_str(),
      std::filesystem::absolute(o.dir).string().c_str());
  std::fflush(stdout);
}

// Starts the workers as `strata worker --coordinator` processes of this binary.
std::vector<pid_t> StartWorkers(const LaunchPlan& plan, const std::string& address) {
  std::vector<pid_t> pids;
  for (int i = 0; i < plan.workers; ++i) {
    std::vector<std::string> argv = {"strata", "worker", "--coordinator",
                                     address,  "--id",   absl::StrCat("worker-", i),
                                     "--quiet"};
    if (plan.threads) argv.insert(argv.end(), {"--threads", absl::StrCat(*plan.threads)});
    if (plan.device) argv.insert(argv.end(), {"--device", *plan.device});
    // Worker i of this machine: with train.device "cuda", on cuda:<i mod GPUs>.
    argv.insert(argv.end(), {"--local-rank", absl::StrCat(i)});
    if (plan.metrics_out) {
      argv.insert(argv.end(), {"--metrics-out", absl::StrCat(*plan.metrics_out, ".", i)});
    }
    if (plan.resume) argv.push_back("--resume");
    if (!plan.init_from.empty()) argv.insert(argv.end(), {"--init-from", plan.init_from});
    pid_t pid = fork();
    if (pid == 0) {
      setenv("STRATA_JOB_TOKEN", plan.options.token.c_str(), 1);
      std::vector<char*> cargv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      execv("/proc/self/exe", cargv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  return pids;
}

// The status line from the coordinator's record: on a terminal one line kept up to date (a new
// one per generation), otherwise a line every log_every steps and at every generation; tokens/s
// smoothed over windows of at least a second with progress.
class StatusLine {
 public:
  explicit StatusLine(const config::JobConfig& cfg)
      : cfg_(cfg),
        total_(cfg.train().steps()),
        every_(std::max(1, cfg.train().log_every())),
        tokens_per_step_(static_cast<double>(cfg.train().global_batch()) * cfg.model().seq_len()),
        tty_(isatty(STDOUT_FILENO)) {}

  void Show(const coordinator::CoordinatorRecord& r) {
    const bool finished = shown_step_ >= total_;
    UpdateRate(r.step());
    const bool new_generation = r.generation().number() != shown_generation_;
    const bool due =
        tty_ ? r.step() != shown_step_
             : r.step() != shown_step_ && (r.step() % every_ == 0 || r.step() == total_);
    if (finished || !(new_generation || due)) return;
    std::string line = absl::StrFormat("[%s] step %d/%d", cfg_.name(), r.step(), total_);
    if (r.generation().workers_size() == 0) {
      absl::StrAppend(&line, " | no workers training");
    } else {
      if (r.step() > 0) absl::StrAppendFormat(&line, " | loss %.4f", r.loss());
      if (rate_ > 0) absl::StrAppendFormat(&line, " | %.0f tok/s", rate_);
      absl::StrAppendFormat(&line, " | %d workers", r.generation().workers_size());
    }
    absl::StrAppendFormat(&line, " | generation %d (%s)", r.generation().number(),
                          r.generation().reason());
    if (tty_) {
      std::printf("%s\r\033[K%s", new_generation && shown_generation_ >= 0 ? "\n" : "",
                  line.c_str());
    } else {
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
    shown_step_ = r.step();
    shown_generation_ = r.generation().number();
  }
  // Ends the terminal's line.
  void End() {
    if (tty_ && shown_generation_ >= 0) std::printf("\n");
  }

 private:
  void UpdateRate(int64_t step) {
    const double now = NowSeconds();
    if (rate_at_ == 0 || step < rate_step_) {
      rate_at_ = now;
      rate_step_ = step;
    } else if (now - rate_at_ >= 1.0 && step > rate_step_) {
      // A step count in a window is coarse; an evaluation is a window without progress.
      const double sample =
          tokens_per_step_ * static_cast<double>(step - rate_step_) / (now - rate_at_);
      rate_ = rate_ == 0 ? sample : 0.7 * rate_ + 0.3 * sample;
      rate_at_ = now;
      rate_step_ = step;
    }
  }

  const config::JobConfig& cfg_;
  const int64_t total_;
  const int every_;
  const double tokens_per_step_;
  const bool tty_;
  int64_t shown_step_ = -1, shown_generation_ = -1;
  double rate_ = 0, rate_at_ = 0;
  int64_t rate_step_ = 0;
};

// Waits for every worker to exit, showing the status line meanwhile; returns how many failed.
// The others carry on without a failed one (nothing is restarted).
int WatchWorkers(const LaunchPlan& plan, const std::vector<pid_t>& pids,
                 const coordinator::CoordinatorState& state) {
  StatusLine status(plan.cfg);
  int failed = 0;
  int alive = static_cast<int>(pids.size());
  std::vector<bool> exited(pids.size(), false);
  while (alive > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (exited[i]) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) != pids[i]) continue;
      exited[i] = true;
      --alive;
      const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (code != 0) {
        std::fprintf(stderr, "strata launch: worker-%zu exited with %s %d\n", i,
                     WIFEXITED(st) ? "code" : "signal", WIFEXITED(st) ? code : WTERMSIG(st));
        ++failed;
      }
    }
    if (!plan.quiet) status.Show(state.Snapshot());
    if (alive > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!plan.quiet) status.End();
  return failed;
}

// Run: the coordinator in this process, the workers, the status line until they are gone, and the
// outcome; 0 when the job reached its last step (without the workers that failed, if any), 1
// otherwise.
int RunLaunch(const LaunchPlan& plan) {
  // The dashboard's board is fed from the state, so it is made first; its server, which reads
  // the state, stops before the state goes.
  coordinator::CoordinatorOptions o = plan.options;
  HttpEndpoint http;
  if (plan.flags.Has("http")) http = CoordinatorBoard(plan.cfg, &o);
  auto state = coordinator::CoordinatorState::Open(o, config::ToText(plan.cfg),
                                                   std::chrono::steady_clock::now());
  if (!state.ok()) return Fail(state.status());
  absl::Cleanup stop_http = [&http] { http.server.reset(); };
  auto server = coordinator::CoordinatorServer::Start(state->get(), plan.listen);
  if (!server.ok()) return Fail(server.status());
  const std::string address = (*server)->address();
  if (Status l = (*state)->SetListenAddress(address); !l.ok()) return Fail(l);
  // The token, for workers started by hand and a restarted coordinator.
  if (Status t = KeepToken(plan.options.dir, plan.options.token); !t.ok()) return Fail(t);
  if (http.board) {
    if (Status h = ServeCoordinatorBoard(plan.flags, o, state->get(), &http); !h.ok()) {
      return Fail(h);
    }
  }
  if (!plan.quiet) PrintBanner(plan, address);
  const int failed = WatchWorkers(plan, StartWorkers(plan, address), **state);
  // A joiner still pending when the job finished learns so (it asks every second) before the
  // coordinator goes away with this process.
  if (const auto r = (*state)->Snapshot(); r.finished() && r.pending_size() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  }
  const auto last = (*state)->Snapshot();
  const int64_t total = plan.cfg.train().steps();
  int rc = 0;
  if (last.step() < total && !last.finished()) {
    std::fprintf(stderr, "strata launch: the job stopped at step %lld of %lld\n",
                 static_cast<long long>(last.step()), static_cast<long long>(total));
    rc = 1;
  } else if (failed > 0 && !plan.quiet) {
    std::printf("strata launch: the job finished without the %d worker(s) that failed\n", failed);
  }
  if (!plan.quiet) {
    std::printf(rc == 0
                    ? "strata launch: the job finished (%d workers started)\n"
                    : "strata launch: the job failed (%d workers started); see the errors above\n",
                plan.workers);
  }
  return rc;
}

}  // namespace

int LaunchCommand(const std::vector<std::string>& args) {
  LaunchPlan plan;
  if (std::optional<int> rc = ParseLaunch(args, &plan)) return *rc;
  if (Status p = PlanLaunch(&plan); !p.ok()) return Fail(p);
  const int rc = RunLaunch(plan);
  if (plan.temp_dir) {
    std::error_code ec;
    std::filesystem::remove_all(plan.options.dir, ec);
  }
  return rc;
}

}  // namespace strata::launcher
