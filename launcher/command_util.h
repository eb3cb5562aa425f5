// What the subcommands of `strata` share: train's flags, the usage and failure exits, the flags
// that override a job config, the training options from flags, the job token, and the job a
// coordinator serves (its effective config, worker range, token file and options). Each
// subcommand has its own file (train_command.cc, worker_command.cc, check_command.cc,
// launch_command.cc, coordinator_command.cc, status_command.cc, ckpt_command.cc); commands.cc
// dispatches to them.
//
// Functions of the `strata` process's main thread: they read files and the environment and print
// to stdout and stderr.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/state.h"
#include "core/common/status.h"
#include "launcher/flags.h"
#include "proto/config.pb.h"
#include "train/evaluate.h"
#include "train/trainer.h"
#include "web/http_server.h"
#include "web/run_board.h"

namespace strata::launcher {

// The flags of `strata train` (and, with --config described differently, of `strata worker`).
const std::vector<FlagSpec>& TrainFlags();

// Prints `s`, then the usage of `strata command` with `specs`; returns 2 (a usage error).
int UsageError(const Status& s, const std::string& command, const std::vector<FlagSpec>& specs);

// Prints "strata: error: " and `s`'s message on stderr; returns 1 (the job failed).
int Fail(const Status& s);

// Whether the arguments ask for help (--help or -h).
bool WantsHelp(const std::vector<std::string>& args);

// The flags of a model whose experts are offloaded (`strata generate`, `strata eval`; see
// train/evaluate.h): --offload, --offload-device, --offload-host, --offload-dir.
const std::vector<FlagSpec>& OffloadFlags();
// Their OffloadOptions (offloading is on when any of them is given); INVALID_ARGUMENT naming the
// flag for a size that does not parse.
[[nodiscard]] StatusOr<train::OffloadOptions> OffloadFrom(const Flags& flags);
// What offloading did, as one line for stderr: the budgets, the SSD bytes a token, the history
// prefetch's guesses and how long compute threads waited for experts.
std::string OffloadSummary(const train::OffloadOptions& o, const train::OffloadReport& r,
                           int64_t tokens, double seconds);

// The flags that override fields of the job config.
struct Overrides {
  std::optional<int64_t> steps, threads, checkpoint_every;
  std::optional<std::string> device;
  std::optional<config::TrainConfig::Precision> precision;
};

// The numeric flags, checked before anything is loaded so that a typo is a usage error.
[[nodiscard]] StatusOr<Overrides> ParseOverrides(const Flags& flags, bool config_required = true);

// Loads --config and applies --steps / --threads / --device / --precision (then ValidateJob).
[[nodiscard]] StatusOr<config::JobConfig> LoadWithOverrides(const Flags& flags, const Overrides& o);
// Every field of a job (config::ValidateJobConfig), and its TIERED budgets against the model's
// dense state (config::CheckMemory with no machine check); errors name `source`.
[[nodiscard]] Status ValidateJob(const config::JobConfig& config, const std::string& source);

// The config's data and checkpoint paths made absolute (relative ones are relative to this
// process's folder, where the loader left them), so that they name the same files for every
// worker whatever folder it runs in.
void MakePathsAbsolute(config::JobConfig* cfg);

// The training options of `strata train` / `strata worker` for `cfg`, from the flags that are not
// the config's.
train::TrainOptions OptionsFor(const Flags& flags, config::JobConfig cfg,
                               const train::WorkerOptions& worker);

// "done: N steps, held-out loss ..." on stdout, from rank 0's latest evaluation (if any).
void PrintDone(const train::Trainer& trainer, int rank);
// A run's first log line: the BLAS and the kernel its CPU GEMMs run on, and a warning when that
// kernel is below the best this CPU runs and stays so (kernels/blas_kernel.h).
void LogBlasKernel();

// `strata train` and `strata worker --rank ...` after their own flags: loads the config with the
// flags' overrides, trains, and returns the exit code.
int RunTraining(const Flags& flags, const std::string& command, const std::vector<FlagSpec>& specs,
                const train::WorkerOptions& worker);

// --http: a run board fed every step's metrics line (through options->on_metrics_line) and
// listing the job's checkpoints, served until this is destroyed; the board outlives the server
// (members in that order). Prints the address on stderr, and the token when it is a random one
// (--http-token-file, else $STRATA_JOB_TOKEN, else random).
struct HttpEndpoint {
  std::unique_ptr<web::RunBoard> board;
  std::unique_ptr<web::HttpServer> server;
};
[[nodiscard]] StatusOr<HttpEndpoint> StartHttp(const Flags& flags, train::TrainOptions* options);

// The coordinator's --http, in two parts around CoordinatorState::Open. First the board of job
// `cfg`, fed rank 0's metrics lines (sets options->on_metrics_line) and listing the job's
// checkpoints; then, once the state is open, the board shows its record and is served on
// --http, behind --http-token-file's token, else the job's (options.token), with TLS when the
// coordinator has a certificate (options.tls_cert). `state` must outlive the endpoint.
[[nodiscard]] HttpEndpoint CoordinatorBoard(const config::JobConfig& cfg,
                                            coordinator::CoordinatorOptions* options);
[[nodiscard]] Status ServeCoordinatorBoard(const Flags& flags,
                                           const coordinator::CoordinatorOptions& options,
                                           const coordinator::CoordinatorState* state,
                                           HttpEndpoint* http);
// The --http and --http-token-file flags of a coordinator (`strata coordinator`, `strata launch`).
std::vector<FlagSpec> CoordinatorHttpFlags();

// 128 random bits as 32 hex digits (getrandom): a new job's token.
std::string RandomToken();

// The job token: from --token-file, --token or $STRATA_JOB_TOKEN, in that order ("" when none
// is given). A file that cannot be read or holds no token is an error.
[[nodiscard]] StatusOr<std::string> TokenFrom(const Flags& flags);

// The token, or a usage error (exit 2) when none was given.
std::optional<std::string> RequireToken(const Flags& flags, const std::string& command,
                                        const std::vector<FlagSpec>& specs, int* rc);

// The worker counts a job may run on, [min, max], checked against its config before anything
// starts: every worker needs at least one sequence of the batch and one expert.
[[nodiscard]] Status CheckWorkerRange(const config::JobConfig& cfg, int min, int max);

// The job config a coordinator records: FILE with the job-level flags (--steps, --checkpoint-dir,
// --checkpoint-every) applied and its paths made absolute, so workers anywhere get one config.
[[nodiscard]] StatusOr<config::JobConfig> EffectiveJobConfig(const Flags& flags);

// The coordinator's options for job `cfg` (worker counts are the caller's).
coordinator::CoordinatorOptions CoordinatorOptionsFor(const config::JobConfig& cfg,
                                                      const std::string& dir,
                                                      const std::string& token);

// Keeps the token beside the coordinator's record, readable by this user only, so that workers
// started by hand and a restarted coordinator find it. A token file already there must hold
// `token`.
[[nodiscard]] Status KeepToken(const std::string& dir, const std::string& token);

}  // namespace strata::launcher
