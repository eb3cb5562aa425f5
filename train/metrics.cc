#include "train/metrics.h"

#include <algorithm>
#include <cmath>

namespace strata::train {

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

}  // namespace strata::train
