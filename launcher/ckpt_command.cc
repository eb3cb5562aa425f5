#include "launcher/commands.h"

#include <cstdio>
#include <ctime>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "checkpoint/manager.h"
#include "checkpoint/safetensors.h"
#include "launcher/command_util.h"

namespace strata::launcher {
int CkptCommand(const std::vector<std::string>& args) {
  static const char* kUsage =
      "usage: strata ckpt ls DIR            list the checkpoints in DIR and the shards holding "
      "them\n"
      "       strata ckpt verify DIR [STEP] check every shard's part: its local manifest against\n"
      "                                     the global one, every extent's CRC-32C\n"
      "       strata ckpt rm DIR STEP       remove a checkpoint (not while training into DIR)\n"
      "       strata ckpt export DIR [--step N] --format safetensors -o FILE\n"
      "                                     the weights as a safetensors file (and FILE's stem\n"
      "                                     .json: the architecture); docs/inference.md\n";
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
    auto list = checkpoint::CheckpointManager::List(args[1]);
    if (!list.ok()) return Fail(list.status());
    std::printf("%10s  %-19s  %8s  %12s  %-9s  %-16s  %s\n", "step", "created", "tensors",
                "stored MiB", "storage", "model hash", "shards");
    for (const auto& i : *list) {
      std::time_t t = static_cast<std::time_t>(i.created_unix_ms / 1000);
      std::tm tm{};
      localtime_r(&t, &tm);
      char when[32];
      std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
      std::printf("%10lld  %-19s  %8d  %12.1f  %-9s  %016llx  %s\n", static_cast<long long>(i.step),
                  when, i.tensors, i.stored_bytes / 1048576.0, i.storage_mode.c_str(),
                  static_cast<unsigned long long>(i.config_hash),
                  absl::StrJoin(i.shards, ",").c_str());
      // A part that cannot be read: `verify` says more, `--resume` skips the checkpoint.
      if (!i.problem.empty()) std::printf("%10s  ! %s\n", "", i.problem.c_str());
    }
    if (list->empty()) std::printf("(no checkpoints)\n");
    return 0;
  }
  if (verb == "verify" && (args.size() == 2 || (args.size() == 3 && step_arg(2)))) {
    std::vector<std::string> report;
    Status s = checkpoint::CheckpointManager::Verify(args[1], args.size() == 3 ? *step_arg(2) : -1,
                                                     &report);
    for (const auto& line : report) std::printf("%s\n", line.c_str());
    return s.ok() ? 0 : Fail(s);
  }
  if (verb == "rm" && args.size() == 3 && step_arg(2)) {
    Status s = checkpoint::CheckpointManager::Remove(args[1], *step_arg(2));
    if (!s.ok()) return Fail(s);
    std::printf("removed checkpoint %lld from %s\n", static_cast<long long>(*step_arg(2)),
                args[1].c_str());
    return 0;
  }
  if (verb == "export" && args.size() >= 2) {
    std::string format, out;
    int64_t step = -1;
    for (size_t i = 2; i < args.size(); ++i) {
      const bool has_value = i + 1 < args.size();
      if ((args[i] == "--format") && has_value) {
        format = args[++i];
      } else if ((args[i] == "-o" || args[i] == "--out") && has_value) {
        out = args[++i];
      } else if (args[i] == "--step" && has_value && step_arg(i + 1)) {
        step = *step_arg(++i);
      } else {
        std::fprintf(stderr, "strata ckpt export: cannot understand '%s'\n\n%s", args[i].c_str(),
                     kUsage);
        return 2;
      }
    }
    if (format != "safetensors") {
      std::fprintf(stderr,
                   "strata ckpt export: --format safetensors is the one format (got '%s')\n\n%s",
                   format.c_str(), kUsage);
      return 2;
    }
    if (out.empty()) {
      std::fprintf(stderr, "strata ckpt export: -o FILE is required\n\n%s", kUsage);
      return 2;
    }
    auto r = checkpoint::ExportSafetensors(args[1], step, out);
    if (!r.ok()) return Fail(r.status());
    std::printf(
        "exported checkpoint %lld of %s (written by %d worker%s): %lld tensors, %.1f MiB "
        "in %s; config in %s\n",
        static_cast<long long>(r->step), args[1].c_str(), r->workers, r->workers == 1 ? "" : "s",
        static_cast<long long>(r->tensors), r->bytes / 1048576.0, out.c_str(),
        r->config_path.c_str());
    return 0;
  }
  std::fprintf(stderr, "strata ckpt: cannot understand '%s'\n\n%s",
               absl::StrJoin(args, " ").c_str(), kUsage);
  return 2;
}

}  // namespace strata::launcher
