// MetricsWriter: the JSONL metrics file, one JSON object per line, flushed line by line so a
// crash loses at most the line being written.
//
// The writer owns its open file; `env` is used only inside Open. Not synchronised: one thread at a
// time calls Write (the trainer's).
#pragma once

#include <memory>
#include <string>

#include "core/common/status.h"
#include "runtime/model/moe_layer.h"
#include "storage/env.h"

namespace strata::train {

// How evenly one MoE layer's step spread its tokens over the experts (MoeStats::routed, the whole
// batch): the busiest expert's load over the mean load (1 = perfectly even), the coefficient of
// variation (standard deviation over mean, population form), and the selection bias's range when
// loss-free balancing is on. All 0 when the layer routed nothing.
struct BalanceSummary {
  double max_over_mean = 0;
  double cv = 0;
  bool has_bias = false;
  double bias_min = 0, bias_max = 0;
};
BalanceSummary SummarizeBalance(const model::MoeStats& stats);

class MetricsWriter {
 public:
  // Creates (truncates) `path`; its folder must exist.
  [[nodiscard]] static StatusOr<std::unique_ptr<MetricsWriter>> Open(const std::string& path,
                                                                     storage::Env* env);
  // Appends one line (a complete JSON value, without the newline) and flushes it to the OS.
  [[nodiscard]] Status Write(const std::string& json);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<storage::WritableFile> file_;
};

}  // namespace strata::train
