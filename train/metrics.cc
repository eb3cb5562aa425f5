#include "train/metrics.h"

namespace strata::train {

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
