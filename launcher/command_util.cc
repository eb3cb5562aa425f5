#include "launcher/command_util.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "checkpoint/manager.h"
#include "core/common/bytes.h"
#include "core/common/logging.h"
#include "core/device/device.h"
#include "kernels/blas_kernel.h"
#include "launcher/job_config.h"
#include "proto/config_io.h"
#include "runtime/model/memory_estimate.h"
#include "web/http_server.h"
#include "web/run_board.h"

namespace strata::launcher {
namespace {

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

}  // namespace

const std::vector<FlagSpec>& TrainFlags() {
  static const std::vector<FlagSpec> specs = {
      {"config", "job config in text format (.textproto); required"},
      {"steps", "override train.steps"},
      {"threads", "override train.threads (CPU threads; 0 = every core)"},
      {"device", "override train.device: cpu, cuda or cuda:N (an NVIDIA GPU)"},
      {"precision",
       "override train.precision: auto (bf16 on a GPU, fp32 on the CPU), fp32 or bf16 (bf16 "
       "GEMMs with fp32 accumulation and fp32 master weights)"},
      {"metrics-out", "write one JSON object per step to this file (JSONL)"},
      {"checkpoint-dir", "folder of checkpoints (overrides checkpoint.dir)"},
      {"checkpoint-every", "checkpoint every N steps (overrides checkpoint.every)"},
      {"resume", "continue from the newest valid checkpoint in the checkpoint folder", false},
      {"start-over", "move what the checkpoint folder holds aside, then train afresh", false},
      {"trace", "write a Chrome trace-event JSON of compute, I/O and copies (open in Perfetto)"},
      {"export-params", "when training ends, write every parameter to DIR/<name>.f32 (float32)"},
      {"init-from", "start from the weights of a safetensors file (strata ckpt export's)"},
      {"http",
       "serve a live dashboard (/), /metrics (Prometheus), /api/status and /api/history on "
       "HOST:PORT (port 0: a free one), every request behind a token"},
      {"http-token-file",
       "file holding the token HTTP requests must carry (default: $STRATA_JOB_TOKEN, else a "
       "random one, printed with the address)"},
      {"quiet", "no progress line", false},
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

StatusOr<Overrides> ParseOverrides(const Flags& flags, bool config_required) {
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
  if (auto precision = flags.String("precision")) {
    const std::string upper = absl::AsciiStrToUpper(*precision);
    config::TrainConfig::Precision p;
    if (!config::TrainConfig::Precision_Parse(upper, &p)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--precision: '", *precision, "' is not one of auto, fp32, bf16"));
    }
    o.precision = p;
  }
  return o;
}

StatusOr<config::JobConfig> LoadWithOverrides(const Flags& flags, const Overrides& o) {
  ASSIGN_OR_RETURN(config::JobConfig cfg, config::LoadJobConfig(*flags.String("config")));
  if (o.steps) cfg.mutable_train()->set_steps(static_cast<int>(*o.steps));
  if (o.threads) cfg.mutable_train()->set_threads(static_cast<int>(*o.threads));
  if (o.device) cfg.mutable_train()->set_device(*o.device);
  if (o.precision) cfg.mutable_train()->set_precision(*o.precision);
  if (o.checkpoint_every) {
    cfg.mutable_checkpoint()->set_every(static_cast<uint32_t>(*o.checkpoint_every));
  }
  if (auto dir = flags.String("checkpoint-dir")) cfg.mutable_checkpoint()->set_dir(*dir);
  RETURN_IF_ERROR(ValidateJob(cfg, *flags.String("config") + " with flags"));
  return cfg;
}

Status ValidateJob(const config::JobConfig& cfg, const std::string& source) {
  RETURN_IF_ERROR(config::ValidateJobConfig(cfg, source));
  // No machine check: that is for whoever trains, with its share.
  return config::CheckMemory(cfg, config::EstimateMemory(cfg), /*available_bytes=*/0, source);
}

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

const std::vector<FlagSpec>& OffloadFlags() {
  static const std::vector<FlagSpec> specs = {
      {"offload", "keep the experts in a tiered store (the next three flags imply it)", false},
      {"offload-device", "device memory of its ring of expert slots, e.g. 2GiB (default: all)"},
      {"offload-host", "host memory for experts, e.g. 8GiB (default: all)"},
      {"offload-dir", "folder in which its SSD tier goes (default: $TMPDIR, else /tmp)"},
  };
  return specs;
}

StatusOr<train::OffloadOptions> OffloadFrom(const Flags& flags) {
  train::OffloadOptions o;
  for (const FlagSpec& f : OffloadFlags()) o.enabled |= flags.Has(f.name);
  for (auto [name, into] : {std::pair<const char*, uint64_t*>{"offload-device", &o.device_bytes},
                            {"offload-host", &o.host_bytes}}) {
    if (const std::optional<std::string> v = flags.String(name)) {
      auto bytes = ParseBytes(*v);
      if (!bytes.ok()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("--%s: %s", name, bytes.status().message()));
      }
      *into = *bytes;
    }
  }
  o.ssd_dir = flags.String("offload-dir").value_or("");
  return o;
}

std::string OffloadSummary(const train::OffloadOptions& o, const train::OffloadReport& r,
                           int64_t tokens, double seconds) {
  auto budget = [](uint64_t b) { return b == 0 ? std::string("unlimited") : FormatBytes(b); };
  return absl::StrFormat(
      "offload: %s of experts through a ring of %s over %s of host memory (loaded in %.2f s); "
      "%s read from SSD (%s a token), %s into the ring; of %d routed experts, routing history "
      "guessed %d (%.0f%%) and %d more were still in the ring; compute threads waited %.2f s in "
      "all, in %.2f s",
      FormatBytes(r.expert_bytes), budget(o.device_bytes), budget(o.host_bytes), r.load_seconds,
      FormatBytes(r.ssd_bytes_read), FormatBytes(r.ssd_bytes_read / std::max<int64_t>(tokens, 1)),
      FormatBytes(r.device_bytes_in), r.routed, r.guessed,
      100.0 * static_cast<double>(r.guessed) / std::max<double>(1.0, static_cast<double>(r.routed)),
      r.resident, r.stall_seconds, seconds);
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

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
  options.init_from = flags.String("init-from").value_or("");
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

void LogBlasKernel() {
  const blas::Choice blas = blas::Current();
  STRATA_LOG(INFO) << "blas: " << blas.describe;
  if (!blas.warning.empty()) STRATA_LOG(WARNING) << "blas: " << blas.warning;
}

namespace {

// --http's address and token: --http-token-file's, else `job_token` (a coordinator's), else
// $STRATA_JOB_TOKEN, else a random one. *told says where the token is, for the user.
StatusOr<web::HttpOptions> HttpOptionsFrom(const Flags& flags, const std::string& job_token,
                                           std::string* told) {
  web::HttpOptions o;
  o.address = *flags.String("http");
  if (auto path = flags.String("http-token-file")) {
    std::ifstream in(*path);
    std::string token;
    std::getline(in, token);
    o.token = std::string(absl::StripAsciiWhitespace(token));
    if (!in || o.token.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--http-token-file '%s' is missing, unreadable or holds no token on its first line",
          *path));
    }
    *told = absl::StrCat("the token of ", *path);
  } else if (!job_token.empty()) {
    o.token = job_token;
    *told = "the job's token";  // the caller says where it is
  } else if (const char* env = std::getenv("STRATA_JOB_TOKEN"); env != nullptr && *env) {
    o.token = env;
    *told = "the token of $STRATA_JOB_TOKEN";
  } else {
    o.token = RandomToken();
    *told = absl::StrCat("token ", o.token);
  }
  return o;
}

// A board for job `cfg`, fed the metrics lines `*on_line` is given, listing the job's
// checkpoints (checkpoint.dir, if it has one).
std::unique_ptr<web::RunBoard> NewBoard(const config::JobConfig& cfg,
                                        std::function<void(const std::string&)>* on_line) {
  auto board = std::make_unique<web::RunBoard>(cfg.name(), cfg.train().steps());
  web::RunBoard* b = board.get();
  *on_line = [b](const std::string& line) {
    if (Status s = b->AddStepLine(line); !s.ok()) STRATA_LOG(WARNING) << "http: " << s;
  };
  if (const std::string dir = cfg.checkpoint().dir(); !dir.empty()) {
    b->SetCheckpointSource([dir] {
      web::RunBoard::CheckpointList list;
      list.dir = dir;
      std::error_code ec;
      if (!std::filesystem::exists(dir, ec)) {
        list.note =
            "no such folder here: no checkpoint written yet, or it lies on a file system this "
            "machine does not mount";
        return list;
      }
      auto infos = checkpoint::CheckpointManager::List(dir);
      if (!infos.ok()) {
        list.error = std::string(infos.status().message());
        return list;
      }
      for (const checkpoint::CheckpointInfo& i : *infos) {
        list.rows.push_back({i.step, i.created_unix_ms, i.stored_bytes, i.write_ms,
                             static_cast<int>(i.shards.size()), i.problem});
      }
      return list;
    });
  }
  return board;
}

void PrintDashboard(const std::string& job, const web::HttpServer& server,
                    const std::string& told) {
  std::fprintf(stderr,
               "[%s] dashboard: %s/?token=TOKEN; also /metrics, /api/status, /api/history (%s; "
               "or the header Authorization: Bearer TOKEN)\n",
               job.c_str(), server.base_url().c_str(), told.c_str());
}

}  // namespace

StatusOr<HttpEndpoint> StartHttp(const Flags& flags, train::TrainOptions* options) {
  HttpEndpoint http;
  const config::JobConfig& cfg = options->config;
  std::string told;
  ASSIGN_OR_RETURN(const web::HttpOptions o, HttpOptionsFrom(flags, "", &told));
  http.board = NewBoard(cfg, &options->on_metrics_line);
  ASSIGN_OR_RETURN(http.server, web::HttpServer::Start(o, http.board->Routes()));
  PrintDashboard(cfg.name(), *http.server, told);
  return http;
}

HttpEndpoint CoordinatorBoard(const config::JobConfig& cfg,
                              coordinator::CoordinatorOptions* options) {
  HttpEndpoint http;
  http.board = NewBoard(cfg, &options->on_metrics_line);
  return http;
}

Status ServeCoordinatorBoard(const Flags& flags, const coordinator::CoordinatorOptions& options,
                             const coordinator::CoordinatorState* state, HttpEndpoint* http) {
  std::string told;
  ASSIGN_OR_RETURN(web::HttpOptions o, HttpOptionsFrom(flags, options.token, &told));
  if (!flags.Has("http-token-file"))
    told = absl::StrCat("the job's token, in ", options.dir, "/token");
  // HTTPS when the coordinator serves gRPC with TLS: the same certificate.
  o.tls_cert = options.tls_cert;
  o.tls_key = options.tls_key;
  http->board->SetRecordSource([state] { return state->Snapshot(); });
  ASSIGN_OR_RETURN(http->server, web::HttpServer::Start(o, http->board->Routes()));
  PrintDashboard(http->board->job(), *http->server, told);
  return absl::OkStatus();
}

std::vector<FlagSpec> CoordinatorHttpFlags() {
  return {
      {"http",
       "serve the job's live dashboard (/), /metrics (Prometheus), /api/status and /api/history "
       "on HOST:PORT (port 0: a free one), behind the job token (HTTPS when the coordinator has "
       "a certificate)"},
      {"http-token-file",
       "file holding the token HTTP requests must carry (default: the job's, which also admits "
       "workers: give the page its own when you share its link)"},
  };
}

int RunTraining(const Flags& flags, const std::string& command, const std::vector<FlagSpec>& specs,
                const train::WorkerOptions& worker) {
  LogBlasKernel();
  int rc = 0;
  auto options = TrainOptionsFrom(flags, command, specs, worker, &rc);
  if (!options) return rc;
  HttpEndpoint http;
  if (flags.Has("http")) {
    auto started = StartHttp(flags, &*options);
    if (!started.ok()) return Fail(started.status());
    http = *std::move(started);
  }
  auto trainer = train::Trainer::Create(*options);
  if (!trainer.ok()) return Fail(trainer.status());
  Status s = (*trainer)->Run();
  if (http.board) http.board->SetState(s.ok() ? "finished" : absl::StrCat("failed: ", s.message()));
  if (!s.ok()) return Fail(s);
  PrintDone(**trainer, worker.rank);
  return 0;
}

std::string RandomToken() {
  unsigned char bytes[16] = {0};
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    CHECK(n > 0) << "the kernel gave no random bytes (getrandom: " << std::strerror(errno)
                 << "): a job token cannot be made";
    got += static_cast<size_t>(n);
  }
  std::string hex;
  for (unsigned char b : bytes) hex += absl::StrFormat("%02x", b);
  return hex;
}

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

StatusOr<config::JobConfig> EffectiveJobConfig(const Flags& flags) {
  ASSIGN_OR_RETURN(Overrides o, ParseOverrides(flags));
  o.threads.reset();  // the machine's, not the job's: passed to local workers as a flag
  o.device.reset();
  ASSIGN_OR_RETURN(config::JobConfig cfg, LoadWithOverrides(flags, o));
  MakePathsAbsolute(&cfg);
  return cfg;
}

coordinator::CoordinatorOptions CoordinatorOptionsFor(const config::JobConfig& cfg,
                                                      const std::string& dir,
                                                      const std::string& token) {
  coordinator::CoordinatorOptions o;
  o.dir = dir;
  o.token = token;
  o.heartbeat_timeout = std::chrono::milliseconds(cfg.elastic().heartbeat_timeout_ms());
  o.restart_grace = std::chrono::milliseconds(cfg.elastic().restart_grace_ms());
  o.check_config = [](const std::string& job, const coordinator::WorkerInfo& w) {
    return CheckJoinerConfig(job, w.id(), w.job_config());
  };
  return o;
}

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

}  // namespace strata::launcher
