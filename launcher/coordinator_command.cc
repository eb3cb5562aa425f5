#include "launcher/commands.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "coordinator/service.h"
#include "coordinator/state.h"
#include "core/common/logging.h"
#include "launcher/command_util.h"
#include "launcher/job_config.h"
#include "proto/config_io.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& CoordinatorFlags() {
  static const std::vector<FlagSpec> specs = [] {
    std::vector<FlagSpec> s = {
        {"config", "job config in text format (.textproto); required for a new job"},
        {"dir", "folder of the coordinator's RocksDB record; required (a record there is resumed)"},
        {"listen",
         "HOST:PORT to serve on (default: where the record's coordinator served, else "
         "127.0.0.1:7777; port 0 picks a free one)"},
        {"token-file",
         "file holding the job token (default: $STRATA_JOB_TOKEN, else DIR/token); every call must "
         "carry it"},
        {"token", "the job token (visible in `ps`: prefer --token-file or $STRATA_JOB_TOKEN)"},
        {"workers", "workers that form the first generation (default: the record's, else 1)"},
        {"steps", "override train.steps of a new job"},
        {"checkpoint-dir", "folder of checkpoints of a new job (overrides checkpoint.dir)"},
        {"checkpoint-every", "checkpoint every N steps (overrides checkpoint.every) of a new job"},
        {"keep-serving", "serve until SIGINT/SIGTERM, also after the job finished", false},
        {"min-workers", "fewer than this and training waits (default: elastic.min_workers, or 1)"},
        {"max-workers", "more than this are refused (default: elastic.max_workers, or --workers)"},
        {"tls-cert", "PEM certificate: serve with TLS (needs --tls-key)"},
        {"tls-key", "PEM private key of --tls-cert"},
    };
    for (FlagSpec& f : CoordinatorHttpFlags()) s.push_back(std::move(f));
    return s;
  }();
  return specs;
}

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop = true; }

// What `strata coordinator` was asked to serve: the record's folder and token, the job's config
// (the record's when it resumes one), and the coordinator's options.
struct CoordinatorPlan {
  Flags flags;
  std::string dir, token;
  std::optional<int64_t> workers, min_workers, max_workers;
  config::JobConfig cfg;
  bool resumed = false;                 // the folder holds a job's record
  coordinator::CoordinatorRecord kept;  // that record (empty for a new job)
  coordinator::CoordinatorOptions options;
};

// Parse: the flags, the folder and the job token. Returns the exit code when the command ends
// here (help, a usage error).
std::optional<int> ParseCoordinator(const std::vector<std::string>& args, CoordinatorPlan* plan) {
  if (WantsHelp(args)) {
    std::printf(
        "usage: strata coordinator --dir DIR [--config FILE] [flags]\n"
        "Serves a job's coordinator. A new job needs --config; a record already in DIR is "
        "resumed with everything it holds (config, worker counts, address, TLS files, and the "
        "token in DIR/token), so `strata coordinator --dir DIR` restarts a coordinator that died. "
        "Exit codes: 0 once its job has finished and its workers are gone (unless "
        "--keep-serving) or on SIGINT/SIGTERM, 1 on an error, 2 on a usage error.\n%s",
        Flags::Usage(CoordinatorFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("coordinator", CoordinatorFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "coordinator", CoordinatorFlags());
  plan->flags = *std::move(flags);
  const Flags& f = plan->flags;
  auto workers = f.Int("workers", 1, 4096);
  auto min_workers = f.Int("min-workers", 1, 4096);
  auto max_workers = f.Int("max-workers", 1, 4096);
  for (const auto* v : {&workers, &min_workers, &max_workers}) {
    if (!v->ok()) return UsageError(v->status(), "coordinator", CoordinatorFlags());
  }
  plan->workers = *workers;
  plan->min_workers = *min_workers;
  plan->max_workers = *max_workers;
  if (!f.Has("dir")) {
    return UsageError(absl::InvalidArgumentError("--dir DIR is required"), "coordinator",
                      CoordinatorFlags());
  }
  plan->dir = *f.String("dir");
  auto given_token = TokenFrom(f);
  if (!given_token.ok()) return Fail(given_token.status());
  plan->token = *given_token;
  if (plan->token.empty()) {
    // A restart finds the token beside the record.
    std::ifstream in(plan->dir + "/token");
    std::string line;
    if (in && std::getline(in, line)) plan->token = std::string(absl::StripAsciiWhitespace(line));
  }
  if (plan->token.empty()) {
    return UsageError(
        absl::InvalidArgumentError(absl::StrFormat(
            "give the job token with --token-file FILE or $STRATA_JOB_TOKEN (%s/token "
            "holds none)",
            plan->dir)),
        "coordinator", CoordinatorFlags());
  }
  return std::nullopt;
}

// The job's config: the record's when resuming (a --config given too must agree with it), else
// --config FILE with the job-level flags. Returns the exit code when the command ends here.
std::optional<int> ReadJob(CoordinatorPlan* plan) {
  const Flags& f = plan->flags;
  const std::string& dir = plan->dir;
  auto record = coordinator::CoordinatorState::ReadRecord(dir);
  if (!record.ok()) return Fail(record.status());
  if (record->has_value()) plan->kept = **record;
  plan->resumed = record->has_value() && !plan->kept.job_config().empty();
  if (!plan->resumed) {
    if (!f.Has("config")) {
      return Fail(absl::InvalidArgumentError(
          absl::StrFormat("'%s' holds no job yet: give --config FILE for a new job", dir)));
    }
    auto given = EffectiveJobConfig(f);
    if (!given.ok()) return Fail(given.status());
    plan->cfg = *std::move(given);
    return std::nullopt;
  }
  auto parsed = config::ParseJobConfig(plan->kept.job_config(),
                                       absl::StrFormat("the job config recorded in '%s'", dir), "");
  if (!parsed.ok()) return Fail(parsed.status());
  plan->cfg = *std::move(parsed);
  if (!f.Has("config")) {
    for (const char* flag : {"steps", "checkpoint-dir", "checkpoint-every"}) {
      if (f.Has(flag)) {
        return UsageError(absl::InvalidArgumentError(absl::StrFormat(
                              "--%s applies to a new job; the job recorded in '%s' keeps its "
                              "config",
                              flag, dir)),
                          "coordinator", CoordinatorFlags());
      }
    }
    return std::nullopt;
  }
  auto given = EffectiveJobConfig(f);
  if (!given.ok()) return Fail(given.status());
  const std::vector<std::string> diff = JobDifferences(plan->cfg, *given);
  if (!diff.empty()) {
    return Fail(absl::FailedPreconditionError(absl::StrFormat(
        "--config %s differs from the job recorded in '%s' (a running job keeps its "
        "config):\n  %s\nDrop --config to resume the job, or give an empty --dir for a new "
        "one",
        *f.String("config"), dir, absl::StrJoin(diff, "\n  "))));
  }
  return std::nullopt;
}

// Plan: the token kept beside the record, and the coordinator's options. Worker counts come from
// the flags, else the record's, else the config's elastic section (a record that does not hold
// them counts the workers of its generation); TLS from the flags, else the record's files.
Status PlanCoordinator(CoordinatorPlan* plan) {
  RETURN_IF_ERROR(KeepToken(plan->dir, plan->token));
  coordinator::CoordinatorOptions& o = plan->options;
  o = CoordinatorOptionsFor(plan->cfg, plan->dir, plan->token);
  const config::ElasticConfig& el = plan->cfg.elastic();
  const coordinator::CoordinatorRecord& kept = plan->kept;
  const int members = std::max(1, kept.generation().workers_size() + kept.pending_size());
  o.initial_workers = static_cast<int>(plan->workers.value_or(
      kept.initial_workers() > 0 ? kept.initial_workers() : (plan->resumed ? members : 1)));
  o.min_workers = static_cast<int>(plan->min_workers.value_or(
      kept.min_workers() > 0 ? kept.min_workers() : (el.min_workers() > 0 ? el.min_workers() : 1)));
  o.max_workers = static_cast<int>(plan->max_workers.value_or(
      kept.max_workers() > 0
          ? kept.max_workers()
          : std::max(el.max_workers() > 0 ? el.max_workers() : o.initial_workers, members)));
  if (plan->resumed && kept.generation().number() > 0) {
    // The first generation formed long ago: its size only has to fit the other bounds.
    o.initial_workers =
        std::clamp(o.initial_workers, o.min_workers, std::max(o.min_workers, o.max_workers));
  }
  o.tls_cert = plan->flags.String("tls-cert").value_or(kept.tls_cert());
  o.tls_key = plan->flags.String("tls-key").value_or(kept.tls_key());
  return CheckWorkerRange(plan->cfg, std::min(o.min_workers, o.initial_workers), o.max_workers);
}

// Run: opens the record, serves it until the job is done and its workers are gone (a few more
// seconds, so that a joiner still waiting learns the job finished), or until SIGINT/SIGTERM
// (always, with --keep-serving).
int RunCoordinator(const CoordinatorPlan& plan) {
  coordinator::CoordinatorOptions o = plan.options;
  // The dashboard's board is fed from the state, so it is made first; its server, which reads
  // the state, stops before the state goes.
  HttpEndpoint http;
  if (plan.flags.Has("http")) http = CoordinatorBoard(plan.cfg, &o);
  auto state = coordinator::CoordinatorState::Open(o, config::ToText(plan.cfg),
                                                   std::chrono::steady_clock::now());
  if (!state.ok()) return Fail(state.status());
  absl::Cleanup stop_http = [&http] { http.server.reset(); };
  // Where to serve: --listen, else where this job's coordinator served before (so its workers
  // find it again), else the default.
  const std::optional<std::string> listen_flag = plan.flags.String("listen");
  if (plan.resumed && plan.kept.listen().empty() && !listen_flag) {
    STRATA_LOG(WARNING) << "the record in " << plan.dir
                        << " does not say where its coordinator served; serving on "
                           "127.0.0.1:7777 (give --listen HOST:PORT where its workers look)";
  }
  const std::string listen = listen_flag.value_or(
      !plan.kept.listen().empty() ? plan.kept.listen() : std::string("127.0.0.1:7777"));
  coordinator::TlsFiles tls{o.tls_cert, o.tls_key, ""};
  auto server = coordinator::CoordinatorServer::Start(state->get(), listen, tls);
  if (!server.ok()) return Fail(server.status());
  if (Status l = (*state)->SetListenAddress((*server)->address()); !l.ok()) return Fail(l);
  if (http.board) {
    if (Status h = ServeCoordinatorBoard(plan.flags, o, state->get(), &http); !h.ok()) {
      return Fail(h);
    }
  }
  const auto snapshot = (*state)->Snapshot();
  std::printf(
      "coordinator listening on %s (%s: generation %lld, step %lld, workers %d to %d, record in "
      "%s)\n",
      (*server)->address().c_str(), plan.resumed ? "resumed" : "new job",
      static_cast<long long>(snapshot.generation().number()),
      static_cast<long long>(snapshot.step()), o.min_workers, o.max_workers, plan.dir.c_str());
  std::fflush(stdout);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  const bool keep_serving = plan.flags.Has("keep-serving");
  std::optional<std::chrono::steady_clock::time_point> done_since;
  while (!g_stop.load()) {
    if (!keep_serving && (*state)->Done()) {
      if (!done_since) done_since = std::chrono::steady_clock::now();
      if (std::chrono::steady_clock::now() - *done_since > std::chrono::seconds(2)) {
        std::printf("the job finished at step %lld; coordinator exits\n",
                    static_cast<long long>((*state)->Snapshot().step()));
        return 0;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::printf("coordinator stopping\n");
  return 0;
}

}  // namespace

int CoordinatorCommand(const std::vector<std::string>& args) {
  CoordinatorPlan plan;
  if (std::optional<int> rc = ParseCoordinator(args, &plan)) return *rc;
  if (std::optional<int> rc = ReadJob(&plan)) return *rc;
  if (Status p = PlanCoordinator(&plan); !p.ok()) return Fail(p);
  if (plan.kept.finished() && !plan.flags.Has("keep-serving")) {
    std::printf(
        "the job in %s finished at step %lld; nothing to serve (--keep-serving serves its "
        "status anyway)\n",
        plan.dir.c_str(), static_cast<long long>(plan.kept.step()));
    return 0;
  }
  return RunCoordinator(plan);
}

}  // namespace strata::launcher
