#include "launcher/commands.h"

#include <cstdio>

#include "absl/strings/str_split.h"
#include "kernels/blas_kernel.h"
#include "launcher/command_util.h"
#include "proto/config_io.h"
#include "runtime/data/dataset.h"
#include "runtime/model/memory_estimate.h"
#include "storage/env.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& CheckFlags() {
  static const std::vector<FlagSpec> specs = {
      {"config", "job config in text format (.textproto); required"},
      {"workers", "estimate the memory of one of N workers (default 1: strata train)"},
  };
  return specs;
}

}  // namespace

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
  // The SSD tier's files (and an elastic worker's copies) against the free space of their folder.
  const config::DiskEstimate disk =
      config::EstimateDisk(*cfg, static_cast<int>(workers->value_or(1)));
  if (Status d = config::CheckDiskHere(*cfg, disk, *flags->String("config")); !d.ok()) {
    return Fail(d);
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
  std::printf("# available here: %s\n", config::FormatBytes(config::AvailableHostMemory()).c_str());
  const blas::Choice blas = blas::Current();
  std::printf("# blas: %s\n", blas.describe.c_str());
  if (!blas.warning.empty()) std::printf("# warning: %s\n", blas.warning.c_str());
  if (const std::string need = config::FormatDiskEstimate(disk); !need.empty()) {
    std::printf("# %s# free in %s: %s\n", need.c_str(), disk.ssd_dir.c_str(),
                config::FormatBytes(config::AvailableDiskBytes(disk.ssd_dir)).c_str());
  }
  std::printf("%s", config::ToText(*cfg).c_str());
  return 0;
}

}  // namespace strata::launcher
