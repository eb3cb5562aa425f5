// A training step's figures, and the JSONL metrics file they are written to
//
// - StepResult and EvalResult: what one step and one evaluation measured.
// - StepMetricsLine: one step's line of the metrics file (docs/cli.md lists its fields).
// - MetricsWriter: the file, one JSON object per line, flushed line by line so a crash loses at
//   most the line being written. It owns its open file; `env` is used only inside Open. Not
//   synchronised: one thread at a time calls Write (the trainer's).
// - ProgressLine: the progress line on stderr. Not synchronised either: the trainer's thread
//   calls it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "runtime/model/moe_layer.h"
#include "runtime/model/transformer.h"
#include "storage/env.h"
#include "storage/tiered_store.h"

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

struct StepResult {
  int64_t step = 0;      // 1-based: steps completed after this one
  double loss = 0;       // mean cross-entropy, nats per token
  double aux_loss = 0;   // mean over MoE layers of the unweighted load-balancing loss
  double z_loss = 0;     // mean over MoE layers of the unweighted router z-loss
  double grad_norm = 0;  // before clipping
  double lr = 0;
  double seconds = 0;
  int64_t tokens = 0;
  double comm_seconds = 0;           // distributed: time the communication threads were busy
  std::vector<model::MoeStats> moe;  // per MoE layer, in model.moe_layers() order
  bool tiered = false;
  storage::StoreStats store;  // TIERED: this step's tier figures
};

struct EvalResult {
  double loss = 0;           // nats per token
  double bits_per_byte = 0;  // loss / ln 2 for byte-level data, NaN otherwise
  int64_t tokens = 0;
};

// A distributed worker's part in a step: who it is, and the step's global sample indices it
// trained on, [first_sample, first_sample + samples).
struct WorkerStepFields {
  int rank = 0;
  int workers = 1;
  int64_t generation = 0;
  int64_t first_sample = 0;
  int64_t samples = 0;
  std::string device = "cpu";  // where its model trains: "cpu" or "cuda:N"
};

// The MoE layers' z-losses of the model's last forward, summed in layer order.
double ZLossSum(const model::MoeTransformer& model);
// The per-layer MoE figures of the model's last forward into r, with the means over the layers
// of the auxiliary loss and of `z_loss` (the batch's sum over the layers).
void RecordMoeStats(const model::MoeTransformer& model, double z_loss, StepResult* r);

// One line of the metrics file for step `r` (a JSON object, no newline): the step's figures, then
// `worker`'s fields when given (a distributed or elastic job), each MoE layer's routing (its block
// index from `moe_blocks`, in r.moe's order; sequence_aux_loss when that loss is on), the tiers of
// a TIERED step, and `eval` when the step was evaluated.
std::string StepMetricsLine(const StepResult& r, const std::vector<int>& moe_blocks,
                            bool sequence_aux_loss, const std::optional<WorkerStepFields>& worker,
                            const EvalResult* eval);

// The longest metrics line an elastic worker's step report carries (a line lists every expert's
// load of every MoE layer: 64 layers of 256 experts take ~200 KiB); a longer one is not sent, and
// the coordinator refuses one.
inline constexpr size_t kMaxMetricsLineBytes = size_t{1} << 20;

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

// The progress line on stderr: step, loss, the latest evaluation, tokens/s, time elapsed and an
// ETA from the smoothed step time. On a terminal it is rewritten in place, with a permanent line
// at evaluations and at the end; elsewhere a line at step 1, every `log_every` steps, at
// evaluations and at the end.
class ProgressLine {
 public:
  ProgressLine(std::string job_name, int64_t steps, int log_every);
  // Starts the clock of the time elapsed.
  void Start();
  // After step r (evaluated when `eval` is not null).
  void Print(const StepResult& r, const EvalResult* eval);

 private:
  std::string job_name_;
  int64_t steps_;
  int log_every_;
  bool tty_;
  double started_ = 0;
  double smoothed_step_seconds_ = 0;
  double last_eval_loss_ = -1;
  double last_eval_bpb_ = -1;
};

}  // namespace strata::train
