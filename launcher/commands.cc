#include "launcher/commands.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/common/clock.h"
#include "core/common/logging.h"
#include "core/device/device.h"
#include "launcher/coordinator_membership.h"
#include "launcher/coordinator_service.h"
#include "launcher/flags.h"
#include "launcher/job_config.h"
#include "proto/config_io.h"
#include "proto/memory_estimate.h"
#include "runtime/data/dataset.h"
#include "train/elastic_worker.h"
#include "train/trainer.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& TrainFlags() {
  static const std::vector<FlagSpec> specs = {
      {"config", "job config in text format (.textproto); required"},
      {"steps", "override train.steps"},
      {"threads", "override train.threads (CPU threads; 0 = every core)"},
      {"device", "override train.device: cpu, cuda or cuda:N (an NVIDIA GPU)"},
      {"metrics-out", "write one JSON object per step to this file (JSONL)"},
      {"checkpoint-dir", "folder of checkpoints (overrides checkpoint.dir)"},
      {"checkpoint-every", "checkpoint every N steps (overrides checkpoint.every)"},
      {"resume", "continue from the newest valid checkpoint in the checkpoint folder", false},
      {"start-over", "move what the checkpoint folder holds aside, then train afresh", false},
      {"trace", "write a Chrome trace-event JSON of compute, I/O and copies (open in Perfetto)"},
      {"export-params", "when training ends, write every parameter to DIR/<name>.f32 (float32)"},
      {"quiet", "no progress line", false},
  };
  return specs;
}

const std::vector<FlagSpec>& WorkerFlags() {
  static const std::vector<FlagSpec> specs = [] {
    std::vector<FlagSpec> v = {
        {"rank", "this worker's rank in [0, world-size) (without --coordinator)"},
        {"world-size", "number of workers (without --coordinator)"},
        {"store",
         "rendezvous folder shared by all workers, created if missing (without "
         "--coordinator)"},
        {"hostname", "address the other workers reach this one at (default 127.0.0.1)"},
        {"coordinator",
         "HOST:PORT of the job's coordinator: join through it instead of "
         "--rank/--world-size/--store"},
        {"id", "this worker's id at the coordinator (default HOSTNAME:PID)"},
        {"token-file", "file holding the job token for --coordinator (default: $STRATA_JOB_TOKEN)"},
        {"token",
         "the job token for --coordinator (visible to every user of this machine in `ps`: "
         "prefer --token-file or $STRATA_JOB_TOKEN)"},
        {"tls-ca", "PEM CA certificate: reach a coordinator that serves TLS"},
        {"data",
         "with --coordinator: the token file on this machine (overrides the job's data.path)"},
    };
    for (const FlagSpec& f : TrainFlags()) {
      if (f.name == "config") {
        v.push_back({"config",
                     "job config (.textproto); required without --coordinator. With it, optional: "
                     "the job's config comes from the coordinator, and a file given here must "
                     "agree with it on every field but train.threads, train.device, data.path and "
                     "storage.ssd_dir"});
      } else {
        v.push_back(f);
      }
    }
    return v;
  }();
  return specs;
}

const std::vector<FlagSpec>& CheckFlags() {
  static const std::vector<FlagSpec> specs = {
      {"config", "job config in text format (.textproto); required"},
      {"workers", "estimate the memory of one of N workers (default 1: strata train)"},
  };
  return specs;
}

int UsageError(const Status& s, const std::string& command, const std::vector<FlagSpec>& specs) {
  std::fprintf(stderr, "%s\n\nusage: strata %s [flags]\n%s", std::string(s.message()).c_str(),
               command.c_str(), Flags::Usage(specs).c_str());
  return 2;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "strata: error: %s\n", std::string(s.message()).c_str());
  return 1;
}

struct Overrides {
  std::optional<int64_t> steps, threads, checkpoint_every;
  std::optional<std::string> device;
};

// The numeric flags, checked before anything is loaded so that a typo is a usage error.
StatusOr<Overrides> ParseOverrides(const Flags& flags, bool config_required = true) {
  Overrides o;
  if (config_required && !flags.Has("config")) {
    return absl::InvalidArgumentError("--config FILE is required");
  }
  ASSIGN_OR_RETURN(o.steps, flags.Int("steps", 1, 1'000'000'000));
  ASSIGN_OR_RETURN(o.threads, flags.Int("threads", 0, 1024));
  ASSIGN_OR_RETURN(o.checkpoint_every, flags.Int("checkpoint-every", 0, 1'000'000'000));
  if (auto device = flags.String("device")) {
    auto parsed = Device::Parse(*device);
    if (!parsed.ok())
      return absl::InvalidArgumentError(absl::StrCat("--device: ", parsed.status().message()));
    o.device = *device;
  }
  return o;
}

// Loads --config and applies --steps / --threads / --device.
StatusOr<config::JobConfig> LoadWithOverrides(const Flags& flags, const Overrides& o) {
  ASSIGN_OR_RETURN(config::JobConfig cfg, config::LoadJobConfig(*flags.String("config")));
  if (o.steps) cfg.mutable_train()->set_steps(static_cast<int>(*o.steps));
  if (o.threads) cfg.mutable_train()->set_threads(static_cast<int>(*o.threads));
  if (o.device) cfg.mutable_train()->set_device(*o.device);
  if (o.checkpoint_every) {
    cfg.mutable_checkpoint()->set_every(static_cast<uint32_t>(*o.checkpoint_every));
  }
  if (auto dir = flags.String("checkpoint-dir")) cfg.mutable_checkpoint()->set_dir(*dir);
  RETURN_IF_ERROR(config::ValidateJobConfig(cfg, *flags.String("config") + " with flags"));
  return cfg;
}

// The config's data and checkpoint paths made absolute (relative ones are relative to this
// process's folder, where the loader left them), so that they name the same files for every
// worker whatever folder it runs in.
void MakePathsAbsolute(config::JobConfig* cfg) {
  auto absolute = [](std::string* path) {
    if (path->empty()) return;
    std::error_code ec;
    const auto abs = std::filesystem::absolute(*path, ec);
    if (!ec) *path = abs.lexically_normal().string();
  };
  absolute(cfg->mutable_data()->mutable_path());
  if (cfg->has_storage() && cfg->storage().has_ssd_dir()) {
    absolute(cfg->mutable_storage()->mutable_ssd_dir());
  }
  if (cfg->has_checkpoint() && cfg->checkpoint().has_dir()) {
    absolute(cfg->mutable_checkpoint()->mutable_dir());
  }
}

void PrintTopUsage(std::FILE* out) {
  std::fprintf(out,
               "strata — elastic Mixture-of-Experts training\n\n"
               "usage: strata COMMAND [flags]\n\n"
               "commands:\n"
               "  train    train a model from a job config on this machine\n"
               "  launch   start a coordinator and N local workers for a job (--workers N)\n"
               "  worker   one of several processes training a job together (--rank, "
               "--world-size, --store)\n"
               "  check    validate a job config and its data file, print the effective config\n"
               "  coordinator  serve a job's membership and rendezvous (gRPC; --dir, --config)\n"
               "  status   a running coordinator's generation, members and step: status HOST:PORT\n"
               "  ckpt     list, verify or remove checkpoints: strata ckpt ls|verify|rm DIR ...\n"
               "  version  print the version and the backends this build has\n"
               "  help     this text\n\n"
               "flags of train:\n%s\nRun 'strata COMMAND --help' for a command's flags.\n",
               Flags::Usage(TrainFlags()).c_str());
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

}  // namespace

namespace {

train::TrainOptions OptionsFor(const Flags& flags, config::JobConfig cfg,
                               const train::WorkerOptions& worker);

// `strata train` and `strata worker` after their own flags: the config with the flags'
// overrides, as training options. On failure returns the exit code in *rc.
std::optional<train::TrainOptions> TrainOptionsFrom(const Flags& flags, const std::string& command,
                                                    const std::vector<FlagSpec>& specs,
                                                    const train::WorkerOptions& worker, int* rc) {
  auto overrides = ParseOverrides(flags);
  if (!overrides.ok()) {
    *rc = UsageError(overrides.status(), command, specs);
    return std::nullopt;
  }
  auto cfg = LoadWithOverrides(flags, *overrides);
  if (!cfg.ok()) {
    *rc = Fail(cfg.status());
    return std::nullopt;
  }
  return OptionsFor(flags, *std::move(cfg), worker);
}

// The training options of `strata train` / `strata worker` for `cfg`, from the flags that are not
// the config's.
train::TrainOptions OptionsFor(const Flags& flags, config::JobConfig cfg,
                               const train::WorkerOptions& worker) {
  train::TrainOptions options;
  options.config = std::move(cfg);
  options.worker = worker;
  options.metrics_path = flags.String("metrics-out").value_or("");
  // One progress line per job: the first worker's.
  options.progress = !flags.Has("quiet") && worker.rank == 0;
  options.trace_path = flags.String("trace").value_or("");
  options.export_params_dir = flags.String("export-params").value_or("");
  options.resume = flags.Has("resume");
  options.start_over = flags.Has("start-over");
  return options;
}

void PrintDone(const train::Trainer& trainer, int rank) {
  if (trainer.evals().empty() || rank != 0) return;
  const auto& [step, e] = trainer.evals().back();
  std::string bpb = std::isfinite(e.bits_per_byte)
                        ? absl::StrFormat(", %.3f bits per byte", e.bits_per_byte)
                        : std::string();
  std::printf("done: %d steps, held-out loss %.4f nats per token%s\n", static_cast<int>(step),
              e.loss, bpb.c_str());
}

int RunTraining(const Flags& flags, const std::string& command, const std::vector<FlagSpec>& specs,
                const train::WorkerOptions& worker) {
  int rc = 0;
  auto options = TrainOptionsFrom(flags, command, specs, worker, &rc);
  if (!options) return rc;
  auto trainer = train::Trainer::Create(*options);
  if (!trainer.ok()) return Fail(trainer.status());
  Status s = (*trainer)->Run();
  if (!s.ok()) return Fail(s);
  PrintDone(**trainer, worker.rank);
  return 0;
}

}  // namespace

int TrainCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    std::printf("usage: strata train [flags]\n%s", Flags::Usage(TrainFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("train", TrainFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "train", TrainFlags());
  return RunTraining(*flags, "train", TrainFlags(), train::WorkerOptions{});
}

namespace {
int JoinAndTrain(const Flags& flags);  // below, with the coordinator commands
}  // namespace

int WorkerCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    std::printf(
        "usage: strata worker --rank R --world-size W --store DIR --config FILE [flags]\n"
        "       strata worker --coordinator HOST:PORT [--config FILE] [--data PATH] [flags]\n"
        "One of W processes training one job together: each takes global_batch / W sequences of "
        "every step; experts are split as the config's `parallel` section says. Start all W with "
        "the same config and store folder. With --coordinator, the worker joins that "
        "coordinator's job and trains with its config (only this machine's settings are "
        "flags).\n%s",
        Flags::Usage(WorkerFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("worker", WorkerFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "worker", WorkerFlags());
  if (flags->Has("coordinator")) {
    if (flags->Has("rank") || flags->Has("world-size") || flags->Has("store")) {
      return UsageError(absl::InvalidArgumentError(
                            "with --coordinator the coordinator assigns ranks; drop --rank, "
                            "--world-size and --store"),
                        "worker", WorkerFlags());
    }
    return JoinAndTrain(*flags);
  }
  if (flags->Has("data")) {
    return UsageError(absl::InvalidArgumentError(
                          "--data applies with --coordinator; without it the token file is "
                          "--config's data.path"),
                      "worker", WorkerFlags());
  }
  auto world = flags->Int("world-size", 1, 4096);
  if (!world.ok()) return UsageError(world.status(), "worker", WorkerFlags());
  auto rank = flags->Int("rank", 0, 4095);
  if (!rank.ok()) return UsageError(rank.status(), "worker", WorkerFlags());
  auto store_dir = flags->String("store");
  if (!*world || !*rank || !store_dir) {
    return UsageError(absl::InvalidArgumentError("--rank, --world-size and --store are required"),
                      "worker", WorkerFlags());
  }
  if (**rank >= **world) {
    return UsageError(absl::InvalidArgumentError(absl::StrFormat(
                          "--rank %d must be below --world-size %d", **rank, **world)),
                      "worker", WorkerFlags());
  }
  auto store = comm::MakeFileStore(*store_dir);
  if (!store.ok()) return Fail(store.status());
  train::WorkerOptions worker;
  worker.rank = static_cast<int>(**rank);
  worker.world_size = static_cast<int>(**world);
  worker.store = comm::MakePrefixStore(std::move(*store), comm::GenerationPrefix(0));
  worker.hostname = flags->String("hostname").value_or("127.0.0.1");
  // Rendezvous keys of this job must not greet the next one that uses the folder.
  worker.after_rendezvous = [dir = *store_dir] {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      std::filesystem::remove_all(entry.path(), ec);
    }
  };
  return RunTraining(*flags, "worker", WorkerFlags(), worker);
}

int CheckCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    std::printf("usage: strata check [flags]\n%s", Flags::Usage(CheckFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("check", CheckFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "check", CheckFlags());
  auto overrides = ParseOverrides(*flags);
  if (!overrides.ok()) return UsageError(overrides.status(), "check", CheckFlags());
  auto workers = flags->Int("workers", 1, 4096);
  if (!workers.ok()) return UsageError(workers.status(), "check", CheckFlags());
  auto cfg = LoadWithOverrides(*flags, *overrides);
  if (!cfg.ok()) return Fail(cfg.status());
  const config::MemoryEstimate estimate =
      config::EstimateWorkerMemory(*cfg, static_cast<int>(workers->value_or(1)));
  if (Status m = config::CheckMemory(*cfg, estimate, config::AvailableHostMemory(),
                                     *flags->String("config"));
      !m.ok()) {
    return Fail(m);
  }
  auto data = data::TokenDataset::Open(cfg->data(), cfg->model().vocab_size(),
                                       cfg->model().seq_len(), storage::Env::Default());
  if (!data.ok()) return Fail(data.status());
  std::printf("# %s: valid; data %s: %lld tokens, %lld training and %lld held-out windows\n",
              flags->String("config")->c_str(), cfg->data().path().c_str(),
              static_cast<long long>((*data)->num_tokens()),
              static_cast<long long>((*data)->train_windows()),
              static_cast<long long>((*data)->eval_windows()));
  // The estimate checked against this machine, for the record.
  if (workers->value_or(1) > 1) {
    std::printf("# memory of one of %lld workers:\n", static_cast<long long>(**workers));
  }
  const std::string memory = config::FormatMemoryEstimate(estimate);
  for (absl::string_view line : absl::StrSplit(memory, '\n', absl::SkipEmpty())) {
    std::printf("# %s\n", std::string(line).c_str());
  }
  std::printf("# available here: %s\n%s",
              config::FormatBytes(config::AvailableHostMemory()).c_str(),
              config::ToText(*cfg).c_str());
  return 0;
}

namespace {

const std::vector<FlagSpec>& CoordinatorFlags() {
  static const std::vector<FlagSpec> specs = {
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
  return specs;
}

// The job token: from --token-file, --token or $STRATA_JOB_TOKEN, in that order ("" when none
// is given). A file that cannot be read or holds no token is an error.
StatusOr<std::string> TokenFrom(const Flags& flags) {
  if (auto path = flags.String("token-file")) {
    std::ifstream in(*path);
    std::string token;
    if (!in || !std::getline(in, token)) {
      return absl::NotFoundError(absl::StrFormat(
          "cannot read a token from --token-file '%s' (missing, unreadable or empty)", *path));
    }
    token = std::string(absl::StripAsciiWhitespace(token));
    if (token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--token-file '%s' holds no token on its first line", *path));
    }
    return token;
  }
  if (auto t = flags.String("token")) {
    STRATA_LOG(WARNING) << "--token is visible to every user of this machine (ps); prefer "
                           "--token-file FILE or $STRATA_JOB_TOKEN";
    return *t;
  }
  const char* env = std::getenv("STRATA_JOB_TOKEN");
  return std::string(env ? env : "");
}

// The token, or a usage error (exit 2) when none was given.
std::optional<std::string> RequireToken(const Flags& flags, const std::string& command,
                                        const std::vector<FlagSpec>& specs, int* rc) {
  auto token = TokenFrom(flags);
  if (!token.ok()) {
    *rc = Fail(token.status());
    return std::nullopt;
  }
  if (token->empty()) {
    *rc = UsageError(absl::InvalidArgumentError(
                         "give the job token with --token-file FILE or $STRATA_JOB_TOKEN"),
                     command, specs);
    return std::nullopt;
  }
  return *token;
}

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

}  // namespace

namespace {

// A worker of a coordinator trains with the job's config (the coordinator's record) and this
// machine's own settings: --threads, --device and --data, or those of a --config FILE, which must
// agree with the job's on everything else. Job settings given as flags (--steps,
// --checkpoint-dir, --checkpoint-every) must agree with the job's too.
StatusOr<config::JobConfig> WorkerConfig(const Flags& flags, const Overrides& o,
                                         const std::string& job_text, const std::string& address) {
  const std::string source = absl::StrFormat("the job config of the coordinator at %s", address);
  if (job_text.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the coordinator at %s holds no job config; start it with --config FILE", address));
  }
  ASSIGN_OR_RETURN(config::JobConfig job, config::ParseJobConfig(job_text, source, ""));
  config::JobConfig mine = job;
  if (flags.Has("config")) {
    ASSIGN_OR_RETURN(mine, LoadWithOverrides(flags, o));
    MakePathsAbsolute(&mine);
  } else {
    if (o.steps) mine.mutable_train()->set_steps(static_cast<int>(*o.steps));
    if (o.threads) mine.mutable_train()->set_threads(static_cast<int>(*o.threads));
    if (o.device) mine.mutable_train()->set_device(*o.device);
    if (o.checkpoint_every) {
      mine.mutable_checkpoint()->set_every(static_cast<uint32_t>(*o.checkpoint_every));
    }
    if (auto dir = flags.String("checkpoint-dir")) {
      mine.mutable_checkpoint()->set_dir(*dir);
      MakePathsAbsolute(&mine);
    }
  }
  const std::vector<std::string> diff = JobDifferences(job, mine);
  if (!diff.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "this worker's %s differs from the job's config at the coordinator %s:\n  %s\n"
        "Drop %s to train with the job's config (train.threads, train.device, data.path and "
        "storage.ssd_dir may "
        "differ: --threads, --device, --data)",
        flags.Has("config") ? "--config " + *flags.String("config") : std::string("flags"), address,
        absl::StrJoin(diff, "\n  "),
        flags.Has("config") ? "--config" : std::string("the job-level flags")));
  }
  config::JobConfig cfg = job;
  cfg.mutable_train()->set_threads(mine.train().threads());
  cfg.mutable_train()->set_device(mine.train().device());
  if (flags.Has("config")) {
    cfg.mutable_data()->set_path(mine.data().path());
    cfg.mutable_storage()->set_ssd_dir(mine.storage().ssd_dir());
  }
  if (auto d = flags.String("data")) cfg.mutable_data()->set_path(*d);
  RETURN_IF_ERROR(config::ValidateJobConfig(cfg, source + " on this worker"));
  return cfg;
}

int JoinAndTrain(const Flags& flags) {
  const std::string address = *flags.String("coordinator");
  int rc = 0;
  const std::optional<std::string> token = RequireToken(flags, "worker", WorkerFlags(), &rc);
  if (!token) return rc;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::string id = flags.String("id").value_or(absl::StrFormat("%s:%d", host, getpid()));
  auto overrides = ParseOverrides(flags, /*config_required=*/false);
  if (!overrides.ok()) return UsageError(overrides.status(), "worker", WorkerFlags());
  auto connected = CoordinatorClient::Connect(address, *token, flags.String("tls-ca").value_or(""));
  if (!connected.ok()) return Fail(connected.status());
  CoordinatorMembership membership(connected->get(), address);
  // The job's config is the coordinator's: read it first (the coordinator may be restarting).
  auto record = train::RetryWhileUnreachable(
      "reading the job's config", address,
      std::chrono::milliseconds(config::ElasticConfig().coordinator_patience_ms()),
      [&] { return membership.GetStatus(); });
  if (!record.ok()) return Fail(record.status());
  if (record->finished()) {
    std::printf("the job at %s already finished (step %lld); nothing to join\n", address.c_str(),
                static_cast<long long>(record->step()));
    return 0;
  }
  auto cfg = WorkerConfig(flags, *overrides, record->job_config(), address);
  if (!cfg.ok()) return Fail(cfg.status());
  if (std::error_code ec; !std::filesystem::exists(cfg->data().path(), ec)) {
    return Fail(absl::NotFoundError(absl::StrFormat(
        "the job's token file '%s' (data.path) is not on this machine; give its path here with "
        "--data PATH",
        cfg->data().path())));
  }
  train::ElasticWorkerOptions options;
  options.train = OptionsFor(flags, *cfg, train::WorkerOptions{});
  options.info.set_id(id);
  options.info.set_host(flags.String("hostname").value_or("127.0.0.1"));
  options.info.set_threads(options.train.config.train().threads());
  options.info.set_job_config(config::ToText(JobPart(*cfg)));
  options.on_end = [](const train::ElasticWorkerEnd& end) {
    if (!end.status.ok()) {
      Fail(end.status);
      return;
    }
    if (!end.message.empty()) std::printf("%s\n", end.message.c_str());
    if (end.trainer != nullptr) PrintDone(*end.trainer, end.rank);
  };
  return train::RunElasticWorker(membership, std::move(options)).ok() ? 0 : 1;
}

// The worker counts a job may run on, [min, max], checked against its config before anything
// starts: every worker needs at least one sequence of the batch and one expert.
Status CheckWorkerRange(const config::JobConfig& cfg, int min, int max) {
  if (min > max) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--min-workers %d is above --max-workers %d", min, max));
  }
  const int64_t B = cfg.train().global_batch();
  if (B < max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "train.global_batch = %d gives the %d workers the job may grow to less than one sequence "
        "each; raise it or lower --max-workers (elastic.max_workers) to at most %d",
        B, max, B));
  }
  const int64_t E = cfg.model().moe().num_experts();
  if (cfg.parallel().expert_parallel() == 0 && E < max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "moe.num_experts = %d is fewer than the %d workers the job may grow to; lower "
        "--max-workers (elastic.max_workers) to at most %d",
        E, max, E));
  }
  return absl::OkStatus();
}

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

// The job config a coordinator records: FILE with the job-level flags (--steps, --checkpoint-dir,
// --checkpoint-every) applied and its paths made absolute, so workers anywhere get one config.
StatusOr<config::JobConfig> EffectiveJobConfig(const Flags& flags) {
  ASSIGN_OR_RETURN(Overrides o, ParseOverrides(flags));
  o.threads.reset();  // the machine's, not the job's: passed to local workers as a flag
  o.device.reset();
  ASSIGN_OR_RETURN(config::JobConfig cfg, LoadWithOverrides(flags, o));
  MakePathsAbsolute(&cfg);
  return cfg;
}

// The coordinator's options for job `cfg` (worker counts are the caller's).
CoordinatorOptions CoordinatorOptionsFor(const config::JobConfig& cfg, const std::string& dir,
                                         const std::string& token) {
  CoordinatorOptions o;
  o.dir = dir;
  o.token = token;
  o.heartbeat_timeout = std::chrono::milliseconds(cfg.elastic().heartbeat_timeout_ms());
  o.restart_grace = std::chrono::milliseconds(cfg.elastic().restart_grace_ms());
  o.check_config = [](const std::string& job, const coordinator::WorkerInfo& w) {
    return CheckJoinerConfig(job, w.id(), w.job_config());
  };
  return o;
}

// Keeps the token beside the coordinator's record, readable by this user only, so that workers
// started by hand and a restarted coordinator find it. A token file already there must hold
// `token`.
Status KeepToken(const std::string& dir, const std::string& token) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = dir + "/token";
  std::ifstream in(path);
  std::string kept;
  if (in && std::getline(in, kept)) {
    if (std::string(absl::StripAsciiWhitespace(kept)) != token) {
      return absl::PermissionDeniedError(absl::StrFormat(
          "the job in '%s' has another token (in %s); give that one (--token-file %s), or use "
          "another --dir for a new job",
          dir, path, path));
    }
    return absl::OkStatus();
  }
  // Created readable by this user only from the start; written whole or not at all.
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const std::string line = token + "\n";
  const bool written = fd >= 0 &&
                       write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                       fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) close(fd);
  if (!written) {
    if (fd >= 0) unlink(path.c_str());
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot write the job token to '%s': %s", path, std::strerror(err)));
  }
  return absl::OkStatus();
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
  CoordinatorOptions o = CoordinatorOptionsFor(*cfg, "", RandomToken());
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
    auto kept = CoordinatorState::ReadRecord(o.dir);
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
    auto state = CoordinatorState::Open(o, config::ToText(*cfg), std::chrono::steady_clock::now());
    if (!state.ok()) return Fail(state.status());
    auto server =
        CoordinatorServer::Start(state->get(), flags->String("listen").value_or("127.0.0.1:0"));
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

int CoordinatorCommand(const std::vector<std::string>& args) {
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
  auto workers = flags->Int("workers", 1, 4096);
  auto min_workers = flags->Int("min-workers", 1, 4096);
  auto max_workers = flags->Int("max-workers", 1, 4096);
  for (const auto* v : {&workers, &min_workers, &max_workers}) {
    if (!v->ok()) return UsageError(v->status(), "coordinator", CoordinatorFlags());
  }
  if (!flags->Has("dir")) {
    return UsageError(absl::InvalidArgumentError("--dir DIR is required"), "coordinator",
                      CoordinatorFlags());
  }
  const std::string dir = *flags->String("dir");
  auto given_token = TokenFrom(*flags);
  if (!given_token.ok()) return Fail(given_token.status());
  std::string token = *given_token;
  if (token.empty()) {
    // A restart finds the token beside the record.
    std::ifstream in(dir + "/token");
    if (in && std::getline(in, token)) token = std::string(absl::StripAsciiWhitespace(token));
  }
  if (token.empty()) {
    return UsageError(
        absl::InvalidArgumentError(absl::StrFormat(
            "give the job token with --token-file FILE or $STRATA_JOB_TOKEN (%s/token "
            "holds none)",
            dir)),
        "coordinator", CoordinatorFlags());
  }
  auto record = CoordinatorState::ReadRecord(dir);
  if (!record.ok()) return Fail(record.status());
  const bool resumed = record->has_value() && !(*record)->job_config().empty();
  // The job's config: the record's when resuming (a --config given too must agree with it),
  // else --config FILE with the job-level flags.
  config::JobConfig cfg;
  if (resumed) {
    auto parsed = config::ParseJobConfig(
        (*record)->job_config(), absl::StrFormat("the job config recorded in '%s'", dir), "");
    if (!parsed.ok()) return Fail(parsed.status());
    cfg = *parsed;
    if (!flags->Has("config")) {
      for (const char* f : {"steps", "checkpoint-dir", "checkpoint-every"}) {
        if (flags->Has(f)) {
          return UsageError(absl::InvalidArgumentError(absl::StrFormat(
                                "--%s applies to a new job; the job recorded in '%s' keeps its "
                                "config",
                                f, dir)),
                            "coordinator", CoordinatorFlags());
        }
      }
    }
    if (flags->Has("config")) {
      auto given = EffectiveJobConfig(*flags);
      if (!given.ok()) return Fail(given.status());
      const std::vector<std::string> diff = JobDifferences(cfg, *given);
      if (!diff.empty()) {
        return Fail(absl::FailedPreconditionError(absl::StrFormat(
            "--config %s differs from the job recorded in '%s' (a running job keeps its "
            "config):\n  %s\nDrop --config to resume the job, or give an empty --dir for a new "
            "one",
            *flags->String("config"), dir, absl::StrJoin(diff, "\n  "))));
      }
    }
  } else {
    if (!flags->Has("config")) {
      return Fail(absl::InvalidArgumentError(
          absl::StrFormat("'%s' holds no job yet: give --config FILE for a new job", dir)));
    }
    auto given = EffectiveJobConfig(*flags);
    if (!given.ok()) return Fail(given.status());
    cfg = *given;
  }
  if (Status t = KeepToken(dir, token); !t.ok()) return Fail(t);
  CoordinatorOptions o = CoordinatorOptionsFor(cfg, dir, token);
  // Worker counts: the flags, else the record's, else the config's elastic section. A record
  // that does not hold them counts the workers of its generation.
  const config::ElasticConfig& el = cfg.elastic();
  const coordinator::CoordinatorRecord kept =
      record->has_value() ? **record : coordinator::CoordinatorRecord();
  const int members = std::max(1, kept.generation().workers_size() + kept.pending_size());
  o.initial_workers = static_cast<int>(workers->value_or(
      kept.initial_workers() > 0 ? kept.initial_workers() : (resumed ? members : 1)));
  o.min_workers = static_cast<int>(min_workers->value_or(
      kept.min_workers() > 0 ? kept.min_workers() : (el.min_workers() > 0 ? el.min_workers() : 1)));
  o.max_workers = static_cast<int>(max_workers->value_or(
      kept.max_workers() > 0
          ? kept.max_workers()
          : std::max(el.max_workers() > 0 ? el.max_workers() : o.initial_workers, members)));
  if (resumed && kept.generation().number() > 0) {
    // The first generation formed long ago: its size only has to fit the other bounds.
    o.initial_workers =
        std::clamp(o.initial_workers, o.min_workers, std::max(o.min_workers, o.max_workers));
  }
  // TLS: the flags, else the record's certificate files.
  o.tls_cert = flags->String("tls-cert").value_or(kept.tls_cert());
  o.tls_key = flags->String("tls-key").value_or(kept.tls_key());
  if (Status range =
          CheckWorkerRange(cfg, std::min(o.min_workers, o.initial_workers), o.max_workers);
      !range.ok()) {
    return Fail(range);
  }
  if (kept.finished() && !flags->Has("keep-serving")) {
    std::printf(
        "the job in %s finished at step %lld; nothing to serve (--keep-serving serves its "
        "status anyway)\n",
        dir.c_str(), static_cast<long long>(kept.step()));
    return 0;
  }
  auto state = CoordinatorState::Open(o, config::ToText(cfg), std::chrono::steady_clock::now());
  if (!state.ok()) return Fail(state.status());
  // Where to serve: --listen, else where this job's coordinator served before (so its workers
  // find it again), else the default.
  if (resumed && kept.listen().empty() && !flags->Has("listen")) {
    STRATA_LOG(WARNING) << "the record in " << dir
                        << " does not say where its coordinator served; serving on "
                           "127.0.0.1:7777 (give --listen HOST:PORT where its workers look)";
  }
  std::string listen = flags->String("listen").value_or(
      !kept.listen().empty() ? kept.listen() : std::string("127.0.0.1:7777"));
  TlsFiles tls{o.tls_cert, o.tls_key, ""};
  auto server = CoordinatorServer::Start(state->get(), listen, tls);
  if (!server.ok()) return Fail(server.status());
  if (Status l = (*state)->SetListenAddress((*server)->address()); !l.ok()) return Fail(l);
  const auto snapshot = (*state)->Snapshot();
  std::printf(
      "coordinator listening on %s (%s: generation %lld, step %lld, workers %d to %d, record in "
      "%s)\n",
      (*server)->address().c_str(), resumed ? "resumed" : "new job",
      static_cast<long long>(snapshot.generation().number()),
      static_cast<long long>(snapshot.step()), o.min_workers, o.max_workers, dir.c_str());
  std::fflush(stdout);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  const bool keep_serving = flags->Has("keep-serving");
  // Once the job is done, a few more seconds of service: a joiner still waiting for a place
  // learns that the job finished instead of finding nobody there.
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

int StatusCommand(const std::vector<std::string>& args) {
  static const std::vector<FlagSpec> specs = {
      {"token-file", "file holding the job token (default: $STRATA_JOB_TOKEN)"},
      {"token", "the job token (visible in `ps`: prefer --token-file or $STRATA_JOB_TOKEN)"},
      {"tls-ca", "PEM CA certificate: reach a coordinator that serves TLS"},
  };
  if (args.empty() || WantsHelp(args)) {
    std::fprintf(args.empty() ? stderr : stdout,
                 "usage: strata status HOST:PORT [--token-file F] [--tls-ca FILE]\n");
    return args.empty() ? 2 : 0;
  }
  auto flags = Flags::Parse("status", specs, {args.begin() + 1, args.end()});
  if (!flags.ok()) return UsageError(flags.status(), "status", specs);
  auto token = TokenFrom(*flags);
  if (!token.ok()) return Fail(token.status());
  auto client = CoordinatorClient::Connect(args[0], *token, flags->String("tls-ca").value_or(""));
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->GetStatus();
  if (!r.ok()) return Fail(r.status());
  const auto& g = r->generation();
  std::printf("generation %lld (%s) since step %lld; step %lld done\n",
              static_cast<long long>(g.number()), g.reason().c_str(),
              static_cast<long long>(g.first_step()), static_cast<long long>(r->step()));
  for (int i = 0; i < g.workers_size(); ++i) {
    std::printf("  rank %d  %s  %s\n", i, g.workers(i).id().c_str(), g.workers(i).host().c_str());
  }
  for (const auto& w : r->pending()) {
    std::printf("  pending  %s  %s\n", w.id().c_str(), w.host().c_str());
  }
  if (r->finished()) std::printf("the job finished\n");
  if (r->tokens_per_s() > 0) std::printf("throughput %.0f tokens/s\n", r->tokens_per_s());
  if (r->experts_per_worker_size() > 0) {
    std::printf("experts per rank: %s\n", absl::StrJoin(r->experts_per_worker(), " ").c_str());
  }
  if (r->checkpoints_size() > 0 || r->checkpoint_pending() > 0) {
    std::printf("checkpoints: %s%s\n", absl::StrJoin(r->checkpoints(), " ").c_str(),
                r->checkpoint_pending() > 0
                    ? absl::StrFormat(" (writing %d)", r->checkpoint_pending()).c_str()
                    : "");
  }
  return 0;
}

int CkptCommand(const std::vector<std::string>& args) {
  static const char* kUsage =
      "usage: strata ckpt ls DIR            list the checkpoints in DIR\n"
      "       strata ckpt verify DIR [STEP] read every extent and check its CRC-32C\n"
      "       strata ckpt rm DIR STEP       remove a checkpoint (not while training into DIR)\n";
  if (args.empty() || WantsHelp(args)) {
    std::fprintf(args.empty() ? stderr : stdout, "%s", kUsage);
    return args.empty() ? 2 : 0;
  }
  const std::string& verb = args[0];
  auto step_arg = [&](size_t i) -> std::optional<int64_t> {
    int64_t s;
    if (i < args.size() && absl::SimpleAtoi(args[i], &s) && s >= 0) return s;
    return std::nullopt;
  };
  if (verb == "ls" && args.size() == 2) {
    auto list = train::CheckpointManager::List(args[1]);
    if (!list.ok()) return Fail(list.status());
    std::printf("%10s  %-19s  %8s  %12s  %-9s  %s\n", "step", "created", "tensors", "stored MiB",
                "storage", "model hash");
    for (const auto& i : *list) {
      std::time_t t = static_cast<std::time_t>(i.created_unix_ms / 1000);
      std::tm tm{};
      localtime_r(&t, &tm);
      char when[32];
      std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
      std::printf("%10lld  %-19s  %8d  %12.1f  %-9s  %016llx\n", static_cast<long long>(i.step),
                  when, i.tensors, i.stored_bytes / 1048576.0, i.storage_mode.c_str(),
                  static_cast<unsigned long long>(i.config_hash));
    }
    if (list->empty()) std::printf("(no checkpoints)\n");
    return 0;
  }
  if (verb == "verify" && (args.size() == 2 || (args.size() == 3 && step_arg(2)))) {
    std::vector<std::string> report;
    Status s =
        train::CheckpointManager::Verify(args[1], args.size() == 3 ? *step_arg(2) : -1, &report);
    for (const auto& line : report) std::printf("%s\n", line.c_str());
    return s.ok() ? 0 : Fail(s);
  }
  if (verb == "rm" && args.size() == 3 && step_arg(2)) {
    Status s = train::CheckpointManager::Remove(args[1], *step_arg(2));
    if (!s.ok()) return Fail(s);
    std::printf("removed checkpoint %lld from %s\n", static_cast<long long>(*step_arg(2)),
                args[1].c_str());
    return 0;
  }
  std::fprintf(stderr, "strata ckpt: cannot understand '%s'\n\n%s",
               absl::StrJoin(args, " ").c_str(), kUsage);
  return 2;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    PrintTopUsage(args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  if (cmd == "train") return TrainCommand(args);
  if (cmd == "worker") return WorkerCommand(args);
  if (cmd == "check") return CheckCommand(args);
  if (cmd == "ckpt") return CkptCommand(args);
  if (cmd == "coordinator") return CoordinatorCommand(args);
  if (cmd == "launch") return LaunchCommand(args);
  if (cmd == "status") return StatusCommand(args);
  if (cmd == "version" || cmd == "--version") {
    std::printf(
        "strata 0.1.0 (backends: cpu%s)\n",
#ifdef STRATA_WITH_CUDA
        CudaDeviceCount() > 0 ? absl::StrFormat(", cuda: %d GPU(s)", CudaDeviceCount()).c_str()
                              : ", cuda: built, no GPU found"
#else
        ""
#endif
    );
    return 0;
  }
  std::fprintf(stderr, "strata: unknown command '%s'\n\n", cmd.c_str());
  PrintTopUsage(stderr);
  return 2;
}

}  // namespace strata::launcher
