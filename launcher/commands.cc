#include "launcher/commands.h"

#include <cstdio>

#include "absl/strings/str_format.h"
#include "core/device/device.h"
#include "kernels/blas_kernel.h"
#include "launcher/command_util.h"
#include "launcher/flags.h"

namespace strata::launcher {
namespace {

void PrintTopUsage(std::FILE* out) {
  std::fprintf(
      out,
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
      "  eval     a checkpoint's loss on a token file: --checkpoint DIR --data FILE\n"
      "  generate text from a checkpoint: --checkpoint DIR --prompt TEXT\n"
      "  plot     a run's metrics file as the dashboard's panels: plot M.jsonl -o run.png\n"
      "  version  print the version, the backends of this build, the BLAS kernel\n"
      "  help     this text\n\n"
      "flags of train:\n%s\nRun 'strata COMMAND --help' for a command's flags.\n",
      Flags::Usage(TrainFlags()).c_str());
}

}  // namespace

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
  if (cmd == "eval") return EvalCommand(args);
  if (cmd == "generate") return GenerateCommand(args);
  if (cmd == "plot") return PlotCommand(args);
  if (cmd == "coordinator") return CoordinatorCommand(args);
  if (cmd == "launch") return LaunchCommand(args);
  if (cmd == "status") return StatusCommand(args);
  if (cmd == "version" || cmd == "--version") {
    std::printf(
        "strata %s (backends: cpu%s)\n", STRATA_VERSION,
#ifdef STRATA_WITH_CUDA
        CudaDeviceCount() > 0 ? absl::StrFormat(", cuda: %d GPU(s)", CudaDeviceCount()).c_str()
                              : ", cuda: built, no GPU found"
#else
        ""
#endif
    );
    const blas::Choice blas = blas::Current();
    std::printf("blas: %s\n", blas.describe.c_str());
    if (!blas.warning.empty()) std::printf("warning: %s\n", blas.warning.c_str());
    std::fflush(stdout);  // what is known so far is out, whatever the probe's GEMMs do
    std::printf("sgemm rows: %s\n",
                blas::SgemmRowsIndependentOfRowCount()
                    ? "the same bits whatever a call's row count"
                    : "a row's bits depend on the call's row count (a distributed run matches one "
                      "process only to rounding, and routing at a near-tie can differ)");
    return 0;
  }
  std::fprintf(stderr, "strata: unknown command '%s'\n\n", cmd.c_str());
  PrintTopUsage(stderr);
  return 2;
}

}  // namespace strata::launcher
