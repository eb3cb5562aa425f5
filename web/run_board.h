// RunBoard: what a job's HTTP endpoint shows, kept from its metrics lines.
//
// The board is fed the same JSON objects `--metrics-out` writes (one per step; docs/cli.md lists
// their fields), so what /metrics and /api/... serve is what the JSONL file holds, number for
// number. It renders:
// - Prometheus(): the text exposition format (version 0.0.4) — the latest step's gauges, counters
//   summed over every step seen, per MoE layer and per tier labels (docs/dashboard.md lists them);
// - StatusJson(): the job, its state and its latest figures (`/api/status`);
// - HistoryJson(): every step's loss, evaluation, tokens/s and learning rate (`/api/history`).
//
// Threads: thread-safe. The trainer's thread adds lines while HTTP threads render; each rendering
// sees whole steps (one lock).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/common/status.h"
#include "web/http_server.h"

namespace strata::web {

class RunBoard {
 public:
  // `job`: the config's name; `steps`: the steps the job trains in all.
  RunBoard(std::string job, int64_t steps);

  // One step's metrics line. A line that is not a JSON object with a whole `step` is refused
  // (nothing of it is kept).
  [[nodiscard]] Status AddStepLine(const std::string& json) ABSL_LOCKS_EXCLUDED(mu_);
  // "training", "finished", or "failed: <why>".
  void SetState(const std::string& state) ABSL_LOCKS_EXCLUDED(mu_);

  std::string Prometheus() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string StatusJson() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string HistoryJson() const ABSL_LOCKS_EXCLUDED(mu_);

  // "/metrics", "/api/status", "/api/history" for an HttpServer; the board must outlive it.
  std::map<std::string, HttpHandler> Routes() const;

 private:
  struct Point {
    int64_t step = 0;
    double loss = 0, tokens_per_s = 0, lr = 0;
    double eval_loss = -1, eval_bits_per_byte = -1;  // -1: not evaluated at this step
  };
  struct Counters {  // sums over every step seen
    double tokens = 0;
    std::map<std::string, double> by_name;  // "<family>|<label value>" -> sum
  };

  const std::string job_;
  const int64_t steps_;
  mutable absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "training";
  std::string latest_ ABSL_GUARDED_BY(mu_);  // the latest step's line
  std::vector<Point> history_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
  Point last_eval_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::web
