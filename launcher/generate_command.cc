#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "launcher/command_util.h"
#include "launcher/commands.h"
#include "train/generate.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& GenerateFlags() {
  static const std::vector<FlagSpec> specs = [] {
    std::vector<FlagSpec> s = {
        {"checkpoint", "checkpoint folder (a job's checkpoint.dir or --checkpoint-dir); required"},
        {"step", "the checkpoint of this step (default: the newest)"},
        {"prompt", "the text to continue"},
        {"prompt-file", "prompts to continue together, one per line (instead of --prompt)"},
        {"max-tokens", "tokens to generate per prompt (default 64)"},
        {"temperature", "divides the logits; 0 takes the most likely token (default 1)"},
        {"top-k", "sample among the K most likely tokens; 0: all (default 0)"},
        {"top-p", "sample among the most likely tokens holding this probability (default 1)"},
        {"seed", "seed of the draws (default 0): the same seed, the same text"},
        {"batch", "prompts of a --prompt-file generated together (default 16)"},
        {"threads", "CPU threads (default: every core)"},
        {"device", "cpu (default), cuda or cuda:N"},
    };
    s.insert(s.end(), OffloadFlags().begin(), OffloadFlags().end());
    return s;
  }();
  return specs;
}

// A floating-point flag, or `fallback` when absent.
StatusOr<double> DoubleFlag(const Flags& flags, const std::string& name, double fallback) {
  const std::optional<std::string> v = flags.String(name);
  if (!v) return fallback;
  double d;
  if (!absl::SimpleAtod(*v, &d)) {
    return absl::InvalidArgumentError(absl::StrFormat("--%s %s is not a number", name, *v));
  }
  return d;
}

}  // namespace

int GenerateCommand(const std::vector<std::string>& args) {
  const char* kUsageLine =
      "usage: strata generate --checkpoint DIR --prompt TEXT | --prompt-file F [flags]\n";
  if (WantsHelp(args)) {
    std::printf("%s%s", kUsageLine, Flags::Usage(GenerateFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("generate", GenerateFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "generate", GenerateFlags());
  auto usage = [&](const std::string& why) {
    return UsageError(absl::InvalidArgumentError(why), "generate", GenerateFlags());
  };
  if (!flags->Has("checkpoint")) return usage("--checkpoint is required");
  if (flags->Has("prompt") == flags->Has("prompt-file")) {
    return usage("give one of --prompt TEXT and --prompt-file FILE");
  }
  train::GenerateOptions o;
  o.checkpoint_dir = *flags->String("checkpoint");
  if (flags->Has("prompt")) {
    o.prompts.push_back(*flags->String("prompt"));
  } else {
    const std::string path = *flags->String("prompt-file");
    std::ifstream in(path, std::ios::binary);
    if (!in)
      return Fail(absl::NotFoundError(absl::StrFormat("cannot read --prompt-file '%s'", path)));
    std::stringstream text;
    text << in.rdbuf();
    for (absl::string_view line : absl::StrSplit(text.str(), '\n', absl::SkipEmpty())) {
      if (absl::ConsumeSuffix(&line, "\r") && line.empty()) continue;  // a CRLF file's lines
      o.prompts.emplace_back(line);
    }
    if (o.prompts.empty()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrFormat("--prompt-file '%s' holds no prompt (one per line)", path)));
    }
  }
  struct IntFlag {
    const char* name;
    int64_t min, max;
    int64_t* into;
  };
  int64_t step = -1, threads = 0, seed = 0;
  for (const IntFlag& f : std::vector<IntFlag>{{"step", 1, INT64_MAX, &step},
                                               {"max-tokens", 1, 1 << 20, &o.max_tokens},
                                               {"top-k", 0, 1 << 20, &o.top_k},
                                               {"seed", 0, INT64_MAX, &seed},
                                               {"batch", 1, 4096, &o.batch},
                                               {"threads", 1, 4096, &threads}}) {
    auto v = flags->Int(f.name, f.min, f.max);
    if (!v.ok()) return UsageError(v.status(), "generate", GenerateFlags());
    if (v->has_value()) *f.into = **v;
  }
  o.step = step;
  o.threads = static_cast<int>(threads);
  o.seed = static_cast<uint64_t>(seed);
  for (auto [name, into, fallback] :
       {std::tuple<const char*, double*, double>{"temperature", &o.temperature, 1.0},
        {"top-p", &o.top_p, 1.0}}) {
    auto v = DoubleFlag(*flags, name, fallback);
    if (!v.ok()) return UsageError(v.status(), "generate", GenerateFlags());
    *into = *v;
  }
  o.device = flags->String("device").value_or("cpu");
  auto offload = OffloadFrom(*flags);
  if (!offload.ok()) return UsageError(offload.status(), "generate", GenerateFlags());
  o.offload = *offload;
  // One prompt streams its text as it comes; several print each prompt and its continuation once
  // all are done.
  const bool stream = o.prompts.size() == 1;
  bool started = false;
  if (stream) {
    // The prompt goes out with the first token: the model's loading logs come before both.
    o.on_token = [&](int, uint8_t token) {
      if (!started) std::fputs(o.prompts[0].c_str(), stdout);
      started = true;
      std::fputc(token, stdout);
      std::fflush(stdout);
    };
  }
  auto g = train::GenerateFromCheckpoint(o);
  if (!g.ok()) {
    if (started) std::fputc('\n', stdout);
    return Fail(g.status());
  }
  if (stream) {
    std::fputc('\n', stdout);
  } else {
    // Raw bytes (a byte 0 included), each prompt's text on a line of its own.
    for (size_t i = 0; i < o.prompts.size(); ++i) {
      std::fwrite(o.prompts[i].data(), 1, o.prompts[i].size(), stdout);
      std::fwrite(g->completions[i].data(), 1, g->completions[i].size(), stdout);
      std::fputc('\n', stdout);
    }
  }
  std::fflush(stdout);
  std::fprintf(stderr, "generate: checkpoint %lld, %lld tokens in %.2f s (%.0f tokens/s)\n",
               static_cast<long long>(g->step), static_cast<long long>(g->tokens), g->seconds,
               g->tokens / std::max(g->seconds, 1e-9));
  if (o.offload.enabled) {
    std::fprintf(stderr, "%s\n",
                 OffloadSummary(o.offload, g->offload, g->tokens, g->seconds).c_str());
  }
  return 0;
}

}  // namespace strata::launcher
