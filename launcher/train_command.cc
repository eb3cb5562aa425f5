#include "launcher/commands.h"

#include <cstdio>

#include "launcher/command_util.h"

namespace strata::launcher {
int TrainCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    std::printf("usage: strata train [flags]\n%s", Flags::Usage(TrainFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("train", TrainFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "train", TrainFlags());
  return RunTraining(*flags, "train", TrainFlags(), train::WorkerOptions{});
}

}  // namespace strata::launcher
