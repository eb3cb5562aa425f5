#include "launcher/commands.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/membership_client.h"
#include "coordinator/service.h"
#include "core/device/device.h"
#include "launcher/command_util.h"
#include "launcher/job_config.h"
#include "proto/config_io.h"
#include "runtime/comm/store.h"
#include "train/elastic_worker.h"

namespace strata::launcher {
namespace {

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
        {"local-rank",
         "this worker's index among the workers on its machine: with train.device \"cuda\" it "
         "trains on cuda:<N mod GPUs> (default: --rank mod parallel.local_size, or --rank; 0 "
         "with --coordinator)"},
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

// A worker of a coordinator trains with the job's config (the coordinator's record) and this
// machine's own settings: --threads, --device and --data, or those of a --config FILE, which must
// agree with the job's on everything else. Job settings given as flags (--steps, --precision,
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
    if (o.precision) mine.mutable_train()->set_precision(*o.precision);
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
  RETURN_IF_ERROR(ValidateJob(cfg, source + " on this worker"));
  return cfg;
}

int JoinAndTrain(const Flags& flags) {
  LogBlasKernel();
  const std::string address = *flags.String("coordinator");
  int rc = 0;
  const std::optional<std::string> token = RequireToken(flags, "worker", WorkerFlags(), &rc);
  if (!token) return rc;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::string id = flags.String("id").value_or(absl::StrFormat("%s:%d", host, getpid()));
  auto overrides = ParseOverrides(flags, /*config_required=*/false);
  if (!overrides.ok()) return UsageError(overrides.status(), "worker", WorkerFlags());
  auto local_rank = flags.Int("local-rank", 0, 4095);
  if (!local_rank.ok()) return UsageError(local_rank.status(), "worker", WorkerFlags());
  auto connected =
      coordinator::CoordinatorClient::Connect(address, *token, flags.String("tls-ca").value_or(""));
  if (!connected.ok()) return Fail(connected.status());
  coordinator::MembershipClient membership(connected->get(), address);
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
  // The GPU this worker trains on is fixed for its life, whatever rank its generations give it.
  options.train.worker.elastic = true;
  options.train.worker.local_rank = local_rank->value_or(0);
  auto device = train::TrainingDeviceHere(options.train);
  if (!device.ok()) return Fail(device.status());
  options.train.config.mutable_train()->set_device(device->ToString());
  options.info.set_device(device->ToString());
  HttpEndpoint http;  // served across the worker's generations, until it ends
  if (flags.Has("http")) {
    auto started = StartHttp(flags, &options.train);
    if (!started.ok()) return Fail(started.status());
    http = *std::move(started);
  }
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
  auto local_rank = flags->Int("local-rank", 0, 4095);
  if (!local_rank.ok()) return UsageError(local_rank.status(), "worker", WorkerFlags());
  if (*local_rank) worker.local_rank = static_cast<int>(**local_rank);
  // Rendezvous keys of this job must not greet the next one that uses the folder.
  worker.after_rendezvous = [dir = *store_dir] {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      std::filesystem::remove_all(entry.path(), ec);
    }
  };
  return RunTraining(*flags, "worker", WorkerFlags(), worker);
}

}  // namespace strata::launcher
