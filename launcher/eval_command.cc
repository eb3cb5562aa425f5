#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/json.h"
#include "launcher/command_util.h"
#include "launcher/commands.h"
#include "train/evaluate.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& EvalFlags() {
  static const std::vector<FlagSpec> specs = [] {
    std::vector<FlagSpec> s = {
        {"checkpoint", "checkpoint folder (a job's checkpoint.dir or --checkpoint-dir); required"},
        {"step", "the checkpoint of this step (default: the newest)"},
        {"data", "token file to evaluate on, every window of seq_len + 1 tokens; required"},
        {"format", "the file's tokens: bytes (default) or uint16 (little-endian)"},
        {"batch", "windows per forward pass (default 8)"},
        {"max-windows", "evaluate only the first N windows (default: all)"},
        {"threads", "CPU threads (default: every core)"},
        {"device", "cpu (default), cuda or cuda:N"},
        {"json", "print the result as one JSON object", false},
        {"quiet", "no progress line", false},
    };
    s.insert(s.end(), OffloadFlags().begin(), OffloadFlags().end());
    return s;
  }();
  return specs;
}

}  // namespace

int EvalCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    std::printf("usage: strata eval --checkpoint DIR --data FILE [flags]\n%s",
                Flags::Usage(EvalFlags()).c_str());
    return 0;
  }
  auto flags = Flags::Parse("eval", EvalFlags(), args);
  if (!flags.ok()) return UsageError(flags.status(), "eval", EvalFlags());
  train::CheckpointEvalOptions o;
  for (const char* required : {"checkpoint", "data"}) {
    if (!flags->Has(required)) {
      return UsageError(absl::InvalidArgumentError(absl::StrCat("--", required, " is required")),
                        "eval", EvalFlags());
    }
  }
  o.checkpoint_dir = *flags->String("checkpoint");
  o.data.set_path(*flags->String("data"));
  const std::string format = absl::AsciiStrToLower(flags->String("format").value_or("bytes"));
  if (format == "uint16") {
    o.data.set_format(config::DataConfig::UINT16);
  } else if (format != "bytes") {
    return UsageError(absl::InvalidArgumentError(
                          absl::StrFormat("--format %s: the formats are bytes and uint16", format)),
                      "eval", EvalFlags());
  }
  struct IntFlag {
    const char* name;
    int64_t min, max;
    std::function<void(int64_t)> set;
  };
  for (const IntFlag& f : std::vector<IntFlag>{
           {"step", 1, INT64_MAX, [&](int64_t v) { o.step = v; }},
           {"batch", 1, 1 << 20, [&](int64_t v) { o.batch = v; }},
           {"max-windows", 1, INT64_MAX, [&](int64_t v) { o.max_windows = v; }},
           {"threads", 1, 4096, [&](int64_t v) { o.threads = static_cast<int>(v); }}}) {
    auto v = flags->Int(f.name, f.min, f.max);
    if (!v.ok()) return UsageError(v.status(), "eval", EvalFlags());
    if (v->has_value()) f.set(**v);
  }
  o.device = flags->String("device").value_or("cpu");
  auto offload = OffloadFrom(*flags);
  if (!offload.ok()) return UsageError(offload.status(), "eval", EvalFlags());
  o.offload = *offload;
  const bool json = flags->Has("json");
  const bool progress = !flags->Has("quiet") && !json;
  const bool tty = isatty(STDERR_FILENO);
  int64_t last_tenth = -1;
  if (progress) {
    o.progress = [&](int64_t done, int64_t total) {
      // A line that redraws itself on a terminal; elsewhere one line per tenth of the file.
      const int64_t tenth = done * 10 / total;
      if (!tty && tenth == last_tenth && done < total) return;
      last_tenth = tenth;
      std::fprintf(stderr, "%seval: %lld of %lld windows%s", tty ? "\r" : "",
                   static_cast<long long>(done), static_cast<long long>(total),
                   tty && done < total ? "" : "\n");
    };
  }
  auto r = train::EvaluateCheckpoint(o);
  if (!r.ok()) return Fail(r.status());
  if (json) {
    JsonWriter j;
    j.BeginObject()
        .Field("checkpoint", o.checkpoint_dir)
        .Field("step", r->step)
        .Field("workers", r->workers)
        .Field("data", o.data.path())
        .Field("windows", r->windows)
        .Field("tokens", r->tokens);
    // Every digit of a double: a script compares runs with it.
    j.Key("loss").Double(r->loss, 17);
    if (std::isfinite(r->bits_per_byte)) j.Key("bits_per_byte").Double(r->bits_per_byte, 17);
    j.Field("seconds", r->seconds);
    if (o.offload.enabled) {
      j.Key("offload")
          .BeginObject()
          .Field("expert_bytes", r->offload.expert_bytes)
          .Field("ssd_bytes_read", r->offload.ssd_bytes_read)
          .Field("device_bytes_in", r->offload.device_bytes_in)
          .Field("routed", r->offload.routed)
          .Field("guessed", r->offload.guessed)
          .Field("resident", r->offload.resident)
          .Field("stall_seconds", r->offload.stall_seconds)
          .Field("load_seconds", r->offload.load_seconds)
          .EndObject();
    }
    j.EndObject();
    std::printf("%s\n", j.str().c_str());
    return 0;
  }
  std::printf("checkpoint %lld of %s (%lld parameters, written by %d worker%s) on %s:\n",
              static_cast<long long>(r->step), o.checkpoint_dir.c_str(),
              static_cast<long long>(r->parameters), r->workers, r->workers == 1 ? "" : "s",
              o.data.path().c_str());
  std::printf("  %lld windows, %lld tokens: loss %.6f nats per token",
              static_cast<long long>(r->windows), static_cast<long long>(r->tokens), r->loss);
  if (std::isfinite(r->bits_per_byte)) std::printf(", %.4f bits per byte", r->bits_per_byte);
  std::printf(" (%.1f s, %.0f tokens/s)\n", r->seconds, r->tokens / std::max(r->seconds, 1e-9));
  if (o.offload.enabled) {
    std::printf("  %s\n", OffloadSummary(o.offload, r->offload, r->tokens, r->seconds).c_str());
  }
  return 0;
}

}  // namespace strata::launcher
