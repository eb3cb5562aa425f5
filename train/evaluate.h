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
// - Offloaded (OffloadOptions, SE-MoE's inference with ring memory): the experts stay in a tiered
//   store instead of memory. Its device tier is a ring of expert slots (`device_bytes`) the MoE
//   layers' experts pass through in layer order: the experts a layer's gate picked are fetched as
//   soon as it routes, and while a layer computes, the next layer's experts that its routing
//   history predicts (the last layer's forward predicts the first layer's, for the next pass);
//   below it `host_bytes` of host memory (pinned with CUDA), below that an SSD folder. The dense
//   weights, the activations and the KV cache are outside these budgets. The checkpoint's experts
//   go into the store one at a time when the model loads (none is ever whole in memory beside
//   another). The results are bit for bit those of the model in memory on the CPU, where both
//   run each expert as one task (moe_layer.h); on a GPU the in-memory model runs a layer's experts
//   as one grouped GEMM instead, which may round differently.
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
#include "scheduler/tiered_scheduler.h"

namespace strata::train {

// Where the experts of an offloaded model live (see above). Off by default: every expert in
// memory.
struct OffloadOptions {
  bool enabled = false;
  uint64_t device_bytes = 0;  // the ring of expert slots; 0: unlimited
  uint64_t host_bytes = 0;    // 0: unlimited
  // Where the SSD tier's folder goes (one of this process's own, removed at the end; on a disk
  // that supports O_DIRECT, not tmpfs); "": $TMPDIR, else /tmp.
  std::string ssd_dir;
  // Experts of the next layer fetched by routing history while a layer computes (0: none).
  uint32_t history_prefetch = 4;
  uint64_t io_block_bytes = 1 << 20;  // one SSD request, a multiple of 4096
};

// What offloading did over a model's passes so far.
struct OffloadReport {
  uint64_t ssd_bytes_read = 0;   // SSD tier -> host tier
  uint64_t device_bytes_in = 0;  // host tier -> device slots
  uint64_t routed = 0;           // experts routed, one per layer and pass
  uint64_t guessed = 0;          // of them, named by the history prefetch before their gate routed
  uint64_t resident = 0;         // of the others, still in the ring from an earlier pass
  double stall_seconds = 0;      // compute threads waiting for an expert, summed
  double load_seconds = 0;       // writing the checkpoint's experts into the store
  uint64_t expert_bytes = 0;     // the experts' weights in all
};

// A checkpoint's model built for up to `max_batch` sequences a pass on `device`, its weights read
// (EvaluateCheckpoint, GenerateFromCheckpoint): every expert in memory, or with `offload` in a
// tiered store attached to the model as its residency. It owns its pool, whose threads run its
// ops, and its store; one thread at a time uses it.
struct CheckpointModel {
  CheckpointModel();
  ~CheckpointModel();
  checkpoint::CheckpointManager::ModelOfCheckpoint checkpoint;
  std::string name;  // for messages: "checkpoint 30 in 'ckpt'"
  std::unique_ptr<ThreadPool> pool;
  ops::Context ctx;
  std::unique_ptr<model::MoeTransformer> model;
  // After every pass (Forward or Decode): the offloaded store's first error, and the end of the
  // pass's step (routing history decays). OK without offloading.
  [[nodiscard]] Status EndPass();
  // Zero without offloading.
  OffloadReport offload_report() const;
  // The offloaded experts' store and its budgets and folder (null in memory); declared after the
  // model, so it goes first: its scheduler reads the model's parameter list.
  struct Offload;
  std::unique_ptr<Offload> offload;
};
[[nodiscard]] StatusOr<std::unique_ptr<CheckpointModel>> LoadCheckpointModel(
    const std::string& dir, int64_t step, int64_t max_batch, int threads, const std::string& device,
    const OffloadOptions& offload = {});

struct CheckpointEvalOptions {
  std::string checkpoint_dir;
  int64_t step = -1;        // the checkpoint of this step; -1: the newest
  config::DataConfig data;  // path and format; eval_fraction is not used (every window counts)
  int64_t batch = 8;        // windows per forward pass, at least 1
  int64_t max_windows = 0;  // evaluate only the first N windows; 0: all
  int threads = 0;          // CPU threads; 0: every core
  std::string device = "cpu";
  OffloadOptions offload;
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
  OffloadReport offload;  // with OffloadOptions::enabled
};

[[nodiscard]] StatusOr<CheckpointEval> EvaluateCheckpoint(const CheckpointEvalOptions& options);

}  // namespace strata::train
