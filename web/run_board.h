// RunBoard: what a job's HTTP endpoint shows, kept from its metrics lines.
//
// The board is fed the same JSON objects `--metrics-out` writes (one per step; docs/cli.md lists
// their fields), so what /metrics and /api/... serve is what the JSONL file holds, number for
// number. It renders:
// - Prometheus(): the text exposition format (version 0.0.4) — the latest step's gauges, counters
//   summed over every step seen, per MoE layer and per tier labels (docs/observability.md lists
//   them);
// - StatusJson(): the job, its state and its latest figures (`/api/status`);
// - HistoryJson(): the job's state and every step's loss, evaluation, tokens/s, learning rate and
//   tier figures (at most twice max_points of them, evenly spaced, and the latest; the
//   evaluations likewise, apart), and each MoE layer's expert loads
//   over the steps (`/api/history`, what the dashboard draws);
// - the dashboard page itself (web/dashboard.html, compiled in), at `/`.
//
// A coordinator's board also shows what the coordinator knows (SetRecordSource): the membership,
// its timeline of generations (who joined, failed or left, how long each re-form took, how many
// steps were trained again) and the counts over the job. Any board may list the job's checkpoints
// (SetCheckpointSource): step, size, write time, and whether every shard's manifest checks.
//
// Threads: thread-safe. The trainer's thread (or the coordinator's gRPC threads) add lines while
// HTTP threads render; each rendering sees whole steps (one lock). The sources are called from
// HTTP threads, outside that lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/common/status.h"
#include "proto/coordinator.pb.h"
#include "web/http_server.h"

namespace strata::web {

class RunBoard {
 public:
  // `job`: the config's name; `steps`: the steps the job trains in all; `max_points`: how many
  // steps (and evaluations) the history keeps at least before thinning (SIZE_MAX: every one).
  RunBoard(std::string job, int64_t steps, size_t max_points = kMaxPoints);

  // One step's metrics line. A line that is not a JSON object with a whole `step` is refused
  // (nothing of it is kept).
  [[nodiscard]] Status AddStepLine(const std::string& json) ABSL_LOCKS_EXCLUDED(mu_);
  // "training", "finished", or "failed: <why>".
  void SetState(const std::string& state) ABSL_LOCKS_EXCLUDED(mu_);

  // A coordinator's board: `record` returns the coordinator's record (CoordinatorState::Snapshot),
  // asked for at every rendering. Set once, before the routes are served.
  void SetRecordSource(std::function<coordinator::CoordinatorRecord()> record);

  // One checkpoint of the job's folder, as CheckpointManager::List reads it.
  struct CheckpointRow {
    int64_t step = 0;
    int64_t created_unix_ms = 0;  // when it was committed
    uint64_t bytes = 0;           // stored bytes it refers to
    int64_t write_ms = -1;        // from the snapshot to the commit (-1: not known)
    int shards = 0;
    std::string problem;  // why a shard's manifest did not check ("": every one did)
  };
  struct CheckpointList {
    std::string dir;
    std::string error;                // why the folder could not be listed ("": it was)
    std::string note;                 // what else the reader should know ("": nothing)
    std::vector<CheckpointRow> rows;  // by increasing step
  };
  // `list` reads the job's checkpoint folder; a rendering calls it when its last answer is older
  // than `refresh` (one call at a time: renderings meanwhile use the last answer, none before the
  // first). Only renderings call it: a board nobody asks lists nothing. Set once, before the
  // routes are served.
  void SetCheckpointSource(std::function<CheckpointList()> list,
                           std::chrono::milliseconds refresh = std::chrono::seconds(5));

  const std::string& job() const { return job_; }
  std::string Prometheus() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string StatusJson() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string HistoryJson() const ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kMaxPoints = 2000;

  struct Point {
    int64_t step = 0;
    double loss = 0, tokens_per_s = 0, lr = 0;
    double eval_loss = -1, eval_bits_per_byte = -1;  // -1: not evaluated at this step
    // A TIERED step's (stall_ms -1 otherwise): compute's wait, SSD reads, the hit ratios.
    double stall_ms = -1, ssd_read_gbps = 0, device_hit_ratio = 1, host_hit_ratio = 1;
  };
  // Each MoE layer's expert loads over the steps, for the heatmap: columns of `bucket_steps`
  // steps each holding every expert's load over the mean load, averaged over the column's steps;
  // past kMaxColumns columns, neighbours merge and bucket_steps doubles.
  struct LoadMap {
    static constexpr size_t kMaxColumns = 240;
    int64_t first_step = 0;  // column 0 starts here
    int64_t bucket_steps = 1;
    double dropped_tokens = 0;
    std::vector<int64_t> blocks;                         // per MoE layer
    std::vector<std::vector<std::vector<double>>> sums;  // [layer][column][expert]
    std::vector<std::vector<int64_t>> counts;            // [layer][column]: steps summed
    // Column c of layer l: each expert's load over the mean, averaged (1 for an empty column).
    std::vector<double> Column(size_t l, size_t c) const;
  };
  // A copy of everything the board holds (`strata plot` draws a finished run from it).
  struct Snapshot {
    std::string job, state;
    int64_t steps = 0;
    std::vector<Point> points;  // the steps kept (every one when max_points is SIZE_MAX)
    std::vector<Point> evals;   // the evaluated steps kept
    LoadMap load;
  };
  Snapshot Take() const ABSL_LOCKS_EXCLUDED(mu_);

  // "/", "/metrics", "/api/status", "/api/history" for an HttpServer; the board must outlive it.
  std::map<std::string, HttpHandler> Routes() const;

 private:
  // The record (none without a source) and the checkpoints (none without a source; refreshed
  // when stale, unless another rendering is refreshing them).
  std::optional<coordinator::CoordinatorRecord> Record() const;
  std::optional<CheckpointList> Checkpoints() const ABSL_LOCKS_EXCLUDED(mu_, checkpoints_mu_);

  struct Counters {  // sums over every step seen
    double tokens = 0;
    std::map<std::string, double> by_name;  // "<family>|<label value>" -> sum
  };

  // One step's loads (per MoE layer, per expert) into the map.
  static void AddLoads(LoadMap& map, int64_t step, const std::vector<int64_t>& blocks,
                       const std::vector<std::vector<double>>& loads, double dropped_tokens);

  // A history that stays bounded: points at least `stride` steps apart (every step at first);
  // at twice max_points_ every other one is dropped and the stride doubles, so what is kept stays
  // evenly spaced. The latest point is kept apart, so it is always shown.
  struct Series {
    std::vector<Point> kept;
    int64_t stride = 1;
    std::optional<Point> latest;
    std::vector<Point> Points() const;  // kept, then latest when it is not the last kept
  };
  void Add(Series* series, const Point& p) const;

  const std::string job_;
  const int64_t steps_;
  const size_t max_points_;
  mutable absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "training";
  std::string latest_ ABSL_GUARDED_BY(mu_);  // the latest step's line
  Series history_ ABSL_GUARDED_BY(mu_);
  Series evals_ ABSL_GUARDED_BY(mu_);
  LoadMap load_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
  Point last_eval_ ABSL_GUARDED_BY(mu_);

  std::function<coordinator::CoordinatorRecord()> record_source_;  // set before serving
  std::function<CheckpointList()> checkpoint_source_;              // set before serving
  std::chrono::milliseconds checkpoint_refresh_{5000};
  // Guards the last listing and whether one is under way.
  mutable absl::Mutex checkpoints_mu_;
  mutable std::optional<CheckpointList> checkpoints_ ABSL_GUARDED_BY(checkpoints_mu_);
  mutable std::chrono::steady_clock::time_point checkpoints_at_ ABSL_GUARDED_BY(checkpoints_mu_);
  mutable bool listing_ ABSL_GUARDED_BY(checkpoints_mu_) = false;  // a rendering is listing
};

}  // namespace strata::web
