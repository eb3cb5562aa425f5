#include "train/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/common/clock.h"
#include "core/common/json.h"

namespace strata::train {

namespace {

// A TIERED step's tiers: each tier's traffic and occupancy, the SSD's transfer rates, and the
// time the step waited for the store.
void WriteTierFields(JsonWriter& j, const storage::StoreStats& s) {
  auto tier = [&](const char* name, const storage::TierStats& t) {
    j.Key(name).BeginObject();
    j.Field("hits", t.hits)
        .Field("misses", t.misses)
        .Field("bytes_in", t.bytes_in)
        .Field("bytes_out", t.bytes_out)
        .Field("evictions", t.evictions)
        .Field("used_bytes", t.used_bytes)
        .Field("budget_bytes", t.budget_bytes);
  };
  j.Key("tiers").BeginObject();
  tier("device", s.device);
  j.EndObject();
  tier("host", s.host);
  j.EndObject();
  tier("ssd", s.ssd);
  j.Field("read_gbps", s.ssd_read_seconds > 0 ? s.ssd.bytes_out / s.ssd_read_seconds / 1e9 : 0.0)
      .Field("write_gbps",
             s.ssd_write_seconds > 0 ? s.ssd.bytes_in / s.ssd_write_seconds / 1e9 : 0.0);
  j.EndObject();
  j.EndObject();
  j.Field("stall_ms", 1e3 * s.stall_seconds);
  j.Field("optimizer_wait_ms", 1e3 * s.background_wait_seconds);
}

}  // namespace

BalanceSummary SummarizeBalance(const model::MoeStats& stats) {
  BalanceSummary b;
  b.has_bias = stats.has_bias;
  b.bias_min = stats.bias_min;
  b.bias_max = stats.bias_max;
  const auto& load = stats.routed;
  if (load.empty()) return b;
  double sum = 0, peak = 0;
  for (int64_t l : load) {
    sum += static_cast<double>(l);
    peak = std::max(peak, static_cast<double>(l));
  }
  if (sum <= 0) return b;
  const double n = static_cast<double>(load.size());
  const double mean = sum / n;
  double var = 0;
  for (int64_t l : load) var += (static_cast<double>(l) - mean) * (static_cast<double>(l) - mean);
  b.max_over_mean = peak / mean;
  b.cv = std::sqrt(var / n) / mean;
  return b;
}

std::string StepMetricsLine(const StepResult& r, const std::vector<int>& moe_blocks,
                            bool sequence_aux_loss, const std::optional<WorkerStepFields>& worker,
                            const EvalResult* eval) {
  JsonWriter j;
  j.BeginObject()
      .Field("step", r.step)
      .Field("loss", r.loss)
      .Field("aux_loss", r.aux_loss)
      .Field("z_loss", r.z_loss)
      .Field("lr", r.lr)
      .Field("grad_norm", r.grad_norm)
      .Field("tokens", r.tokens)
      .Field("tokens_per_s", r.tokens / r.seconds)
      .Field("step_ms", 1e3 * r.seconds);
  if (worker) {
    j.Field("rank", worker->rank)
        .Field("workers", worker->workers)
        .Field("generation", worker->generation)
        .Field("first_sample", worker->first_sample)
        .Field("samples", worker->samples)
        .Field("device", worker->device)
        .Field("comm_ms", 1e3 * r.comm_seconds);
  }
  j.Key("moe").BeginArray();
  for (size_t i = 0; i < r.moe.size(); ++i) {
    const model::MoeStats& s = r.moe[i];
    j.BeginObject().Field("layer", moe_blocks.at(i));
    j.Key("load").IntArray(s.load);
    j.Field("dropped", s.dropped)
        .Field("dropped_tokens", s.dropped_tokens)
        .Field("capacity", s.capacity)
        .Field("aux_loss", s.aux_loss)
        .Field("z_loss", s.z_loss);
    if (sequence_aux_loss) j.Field("sequence_aux_loss", s.sequence_aux_loss);
    // Balance over the whole batch: the busiest expert against the mean, the spread.
    const BalanceSummary b = SummarizeBalance(s);
    j.Field("max_over_mean", b.max_over_mean).Field("cv", b.cv);
    if (b.has_bias) j.Field("bias_min", b.bias_min).Field("bias_max", b.bias_max);
    j.EndObject();
  }
  j.EndArray();
  if (r.tiered) WriteTierFields(j, r.store);
  if (eval != nullptr) {
    j.Field("eval_loss", eval->loss);
    if (std::isfinite(eval->bits_per_byte)) j.Field("eval_bits_per_byte", eval->bits_per_byte);
  }
  j.EndObject();
  return j.str();
}

StatusOr<std::unique_ptr<MetricsWriter>> MetricsWriter::Open(const std::string& path,
                                                             storage::Env* env) {
  auto file = env->OpenWritable(path, /*truncate=*/true);
  if (!file.ok()) {
    return absl::Status(
        file.status().code(),
        absl::StrCat("cannot create the metrics file (--metrics-out): ", file.status().message()));
  }
  std::unique_ptr<MetricsWriter> w(new MetricsWriter);
  w->path_ = path;
  w->file_ = *std::move(file);
  return w;
}

Status MetricsWriter::Write(const std::string& json) {
  RETURN_IF_ERROR(file_->Append(json));
  RETURN_IF_ERROR(file_->Append("\n"));
  return file_->Flush();
}

double ZLossSum(const model::MoeTransformer& model) {
  double z = 0;
  for (const auto& ref : model.moe_layers()) z += ref.layer->stats().z_loss;
  return z;
}

void RecordMoeStats(const model::MoeTransformer& model, double z_loss, StepResult* r) {
  for (const auto& ref : model.moe_layers()) {
    r->moe.push_back(ref.layer->stats());
    r->aux_loss += ref.layer->stats().aux_loss;
  }
  r->z_loss = z_loss;
  if (!model.moe_layers().empty()) {
    r->aux_loss /= static_cast<double>(model.moe_layers().size());
    r->z_loss /= static_cast<double>(model.moe_layers().size());
  }
}

ProgressLine::ProgressLine(std::string job_name, int64_t steps, int log_every)
    : job_name_(std::move(job_name)),
      steps_(steps),
      log_every_(std::max(1, log_every)),
      tty_(isatty(STDERR_FILENO)) {}

void ProgressLine::Start() { started_ = NowSeconds(); }

void ProgressLine::Print(const StepResult& r, const EvalResult* eval) {
  if (eval != nullptr) {
    last_eval_loss_ = eval->loss;
    last_eval_bpb_ = eval->bits_per_byte;
  }
  const bool final_line = r.step == steps_;
  smoothed_step_seconds_ =
      smoothed_step_seconds_ == 0 ? r.seconds : 0.9 * smoothed_step_seconds_ + 0.1 * r.seconds;
  const double eta = smoothed_step_seconds_ * static_cast<double>(steps_ - r.step);
  std::string line =
      absl::StrFormat("[%s] step %*d/%d | loss %.4f", job_name_,
                      static_cast<int>(std::to_string(steps_).size()), r.step, steps_, r.loss);
  if (last_eval_loss_ >= 0) {
    absl::StrAppendFormat(&line, " | eval %.4f", last_eval_loss_);
    if (std::isfinite(last_eval_bpb_)) absl::StrAppendFormat(&line, " (%.3f bpb)", last_eval_bpb_);
  }
  absl::StrAppendFormat(&line, " | %.0f tok/s | %s elapsed | ETA %s", r.tokens / r.seconds,
                        FormatDuration(NowSeconds() - started_), FormatDuration(eta));
  const bool periodic = r.step % log_every_ == 0;
  if (tty_) {
    // Overwrite in place; keep a permanent line at evaluations and at the end.
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), (eval || final_line) ? "\n" : "");
  } else if (periodic || eval || final_line || r.step == 1) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

}  // namespace strata::train
