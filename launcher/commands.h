// The strata subcommands. Each returns the process exit code: 0 on success, 1 when the job
// failed, 2 for a usage error (bad flags); errors are printed to stderr. Each is defined in a file
// of its own (train_command.cc, worker_command.cc, ...; their shared helpers in command_util.h),
// Main in commands.cc. Called on the process's main thread.
#pragma once

#include <string>
#include <vector>

namespace strata::launcher {

// strata train --config FILE [--steps N] [--threads T] [--metrics-out FILE.jsonl]
//              [--checkpoint-dir DIR] [--checkpoint-every N] [--resume] [--quiet]
int TrainCommand(const std::vector<std::string>& args);
// strata worker --rank R --world-size W --store DIR --config FILE [train's flags]: one of W
// processes that train a job together (data and expert parallel; see ParallelConfig). Or
// strata worker --coordinator HOST:PORT [--config FILE] [--data PATH] [train's flags]: joins the
// coordinator's job and trains with its config (launcher/job_config.h).
int WorkerCommand(const std::vector<std::string>& args);
// strata check --config FILE: validates the config and its data file, prints the effective config.
int CheckCommand(const std::vector<std::string>& args);
// strata ckpt ls|verify|rm DIR ...: the checkpoints in a folder.
int CkptCommand(const std::vector<std::string>& args);
// strata eval --checkpoint DIR --data FILE [--step N] [--batch B] [--device D] [--json]: the
// loss (and bits per byte) of a checkpoint's model over every window of a token file.
int EvalCommand(const std::vector<std::string>& args);
// strata generate --checkpoint DIR --prompt TEXT | --prompt-file F [--max-tokens N]
// [--temperature T] [--top-k K] [--top-p P] [--seed S]: text from a checkpoint's model.
int GenerateCommand(const std::vector<std::string>& args);
// strata plot METRICS.jsonl [-o FILE.png|FILE.svg] [--title T]: a finished run's metrics file as
// the dashboard's panels, drawn by gnuplot.
int PlotCommand(const std::vector<std::string>& args);
// strata coordinator --dir DIR [--config FILE] [--listen HOST:PORT] [--token-file F] [--workers N]
// [--min-workers M] [--max-workers X] [--keep-serving] [--tls-cert F --tls-key F]: serves a job's
// coordinator; a record already in DIR is resumed with everything it holds (config, worker counts,
// address, DIR/token). Exits 0 once the job has finished (unless --keep-serving) or on
// SIGINT/SIGTERM.
int CoordinatorCommand(const std::vector<std::string>& args);
// strata launch --config FILE --workers N [...]: a coordinator in this process and N local
// `strata worker --coordinator` processes; status lines from the coordinator until they end.
int LaunchCommand(const std::vector<std::string>& args);
// strata status HOST:PORT [--token-file F]: a running coordinator's generation, members and step.
int StatusCommand(const std::vector<std::string>& args);
// strata [help|--help], strata version, and dispatch to the subcommands.
int Main(int argc, char** argv);

}  // namespace strata::launcher
