// EvaluateCheckpoint: a checkpoint's model measured on a token file (`strata eval`)
//
// - The checkpoint's model config and seed come from its manifest
//   (CheckpointManager::ReadModelConfig); the model is built with every expert in memory on
//   `device` and its weights are read from whichever shards hold them (ReadWeights), so a
//   checkpoint written by any number of workers, IN_MEMORY or TIERED, evaluates the same.
// - Every window of seq_len + 1 tokens of the file (window w starts at token w * seq_len, as the
//   trainer's held-out windows do from the start of the held-out tail) is evaluated, `batch`
//   windows per forward pass, in the gate's evaluation mode keyed by the checkpoint's step: a
//   file holding a job's held-out tail, evaluated with the job's global_batch, gives the trainer's
//   own evaluation of that step when its eval batches cover the tail once.
// - The loss is the mean cross-entropy in nats per token (summed per batch as the trainer sums
//   it); bits per byte for a BYTES file.
//
// Threads: runs on the caller's thread, the ops fanned out over a pool of its own; `progress` is
// called on the caller's thread after every batch.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include <memory>

#include "checkpoint/manager.h"
#include "core/common/status.h"
#include "core/common/thread_pool.h"
#include "proto/config.pb.h"
#include "runtime/model/transformer.h"

namespace strata::train {

// A checkpoint's model built for up to `max_batch` sequences a pass on `device`, every expert in
// memory, its weights read (EvaluateCheckpoint, GenerateFromCheckpoint). It owns its pool, whose
// threads run its ops; one thread at a time uses it.
struct CheckpointModel {
  checkpoint::CheckpointManager::ModelOfCheckpoint checkpoint;
  std::unique_ptr<ThreadPool> pool;
  ops::Context ctx;
  std::unique_ptr<model::MoeTransformer> model;
};
[[nodiscard]] StatusOr<std::unique_ptr<CheckpointModel>> LoadCheckpointModel(
    const std::string& dir, int64_t step, int64_t max_batch, int threads,
    const std::string& device);

struct CheckpointEvalOptions {
  std::string checkpoint_dir;
  int64_t step = -1;        // the checkpoint of this step; -1: the newest
  config::DataConfig data;  // path and format; eval_fraction is not used (every window counts)
  int64_t batch = 8;        // windows per forward pass, at least 1
  int64_t max_windows = 0;  // evaluate only the first N windows; 0: all
  int threads = 0;          // CPU threads; 0: every core
  std::string device = "cpu";
  // After each batch: windows done so far, of `total`.
  std::function<void(int64_t done, int64_t total)> progress;
};

struct CheckpointEval {
  int64_t step = 0;  // of the checkpoint evaluated
  int workers = 1;   // how many processes wrote it
  int64_t parameters = 0;
  int64_t windows = 0;
  int64_t tokens = 0;  // windows * seq_len: the predictions scored
  double loss = 0;     // nats per token
  double bits_per_byte = std::numeric_limits<double>::quiet_NaN();  // BYTES files only
  double seconds = 0;
};

[[nodiscard]] StatusOr<CheckpointEval> EvaluateCheckpoint(const CheckpointEvalOptions& options);

}  // namespace strata::train
