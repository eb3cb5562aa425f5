// The options of a Trainer (trainer.h): the job, where its figures go, and this process's place
// among the workers of a job.
//
// - Plain values and callbacks, copied into the Trainer when it is created.
// - Each callback says on which thread it runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/common/status.h"
#include "core/device/device.h"
#include "proto/config.pb.h"
#include "runtime/comm/store.h"
#include "runtime/model/transformer.h"
#include "storage/block_io.h"
#include "storage/env.h"
#include "train/metrics.h"

namespace strata::train {

// This process as one of several workers (`strata worker`); world_size 1 is a single process.
struct WorkerOptions {
  int rank = 0;
  int world_size = 1;
  std::shared_ptr<comm::Store> store;  // rendezvous of the communicators
  std::string hostname = "127.0.0.1";  // the address peers reach this worker at
  // Called on rank 0, on the thread in Create or Reform, once every worker has connected all its
  // communicators (the store is no longer needed): `strata worker` empties its rendezvous folder,
  // so a later job can use it.
  std::function<void()> after_rendezvous;
  // A job whose membership may change (`strata worker --coordinator`): every step keeps what a
  // later generation needs to go on without this worker or with more — with one expert-parallel
  // group, a copy of this worker's state from before the update and buddy copies of other
  // workers' experts (elastic.replicas; TIERED: on its SSD, every elastic.replica_every steps);
  // with several, every group's copy of each expert. Where those cannot make up the state, and
  // always with experts_per_worker, the job goes back to its newest checkpoint (which it must
  // have unless it keeps buddy copies: Create refuses it without). See elastic/elastic_state.h.
  bool elastic = false;
  // This generation is not the job's first: the workers agree on the newest step whose whole state
  // they still hold, re-place the experts, and move state to where it now lives (a worker that
  // just joined gets all of its state this way).
  bool rejoin = false;
  int64_t generation = 0;  // the membership generation, for metrics
  // A coordinator's job: every worker's id, by rank. Their checkpoint shards are named by it
  // (ShardNameOfWorker), stable across generations; empty: shards are named by rank (r<rank>).
  std::vector<std::string> member_ids;
  // True once a newer generation has formed: connecting this one's communicators gives up. The
  // Trainer calls it on the thread in Create or Reform while each connect runs on a thread of its
  // own, which it leaves behind when this turns true (a Gloo connect cannot be interrupted; the
  // thread may outlive the Trainer). A `store` that consults it too (RunElasticWorker's) calls it
  // from that thread, so it must be thread-safe and own what it reads (by value or shared_ptr).
  std::function<bool()> superseded;
  // This worker's index among the workers on its machine, which places it on a GPU when the
  // config's train.device is "cuda" (no index): cuda:<local_rank mod the GPUs this process sees>.
  // -1: rank mod parallel.local_size (rank where that is 0) for a static job; 0 for an elastic
  // one, whose ranks change with its membership (`strata launch` gives each worker its own).
  int local_rank = -1;
};

// A worker's share of a step's global batch: its first sequence and how many. Every step's
// samples are split over the workers from the step alone (rank r of W takes sequences
// [B r / W, B (r + 1) / W)), so any membership sees each sample of a step exactly once.
std::pair<int64_t, int64_t> BatchShare(int64_t global_batch, int workers, int rank);

// INVALID_ARGUMENT, naming the setting to change, when worker `w` cannot take part in a job of
// `config` with expert-parallel groups of `group_size` (its rank, the batch, the experts or
// parallel.local_size do not fit the workers).
[[nodiscard]] Status CheckWorkerLayout(const config::JobConfig& config, const WorkerOptions& w,
                                       int group_size);

struct TrainOptions {
  config::JobConfig config;  // loaded with config::LoadJobConfig (validated, paths resolved)
  std::string metrics_path;  // JSONL, one object per step; empty for none
  bool progress = true;      // progress line on stderr
  model::ExpertFactory expert_factory;  // null: FFN experts from the config
  storage::Env* env = nullptr;          // null: storage::Env::Default(); must outlive the Trainer
  // Tests wrap the SSD tier's block I/O to inject faults. Called when a tier is opened; the BlockIo
  // it returns may be used from several threads at once (SSD stages, the checkpoint writer).
  std::function<std::unique_ptr<storage::BlockIo>(std::unique_ptr<storage::BlockIo>)> wrap_io;
  // Continue from the newest valid checkpoint in config.checkpoint.dir.
  bool resume = false;
  // Move what config.checkpoint.dir holds aside (to DIR.old-<time>) and train afresh.
  bool start_over = false;
  // Chrome trace-event JSON of compute, SSD I/O, copies, optimizer and checkpoint spans, written
  // when Run returns; empty for none.
  std::string trace_path;
  // Distributed training: the step's batch is split over the workers (see ParallelConfig).
  WorkerOptions worker;
  // Called after every step (its metrics written), on the thread in Run; an error stops training
  // with it.
  std::function<Status(const StepResult&)> on_step;
  // Called after every step with its metrics line (the JSON object --metrics-out writes, without
  // the newline), on the thread in Run, before on_step.
  std::function<void(const std::string& line)> on_metrics_line;
  // On rank 0 (the worker that writes checkpoints), called on the thread in Run (and in Reform, for
  // a commit the previous generation did not report) — not on the checkpoint writer thread — when a
  // checkpoint of `step` is about to be written (committed false), and once Run finds a checkpoint
  // committed (true): after a later step or at the end of training, so the report may lag the
  // commit.
  std::function<void(int64_t step, bool committed)> on_checkpoint;
  // When Run returns, every parameter this worker holds is written to DIR/<name>.f32 (raw
  // little-endian float32; dense parameters by rank 0 only, experts — in memory or from the
  // tiered store — by the leader of their copies, the lowest rank; copy g of an expert, the one of
  // expert-parallel group g > 0, into DIR/copy<g>/<name>.f32). Empty: nothing is written.
  std::string export_params_dir;
  // Before the first step, every parameter this worker holds takes its value from this
  // safetensors file (checkpoint/safetensors.h: an export of a model of the same config); the
  // optimizer starts afresh (fine-tuning). Not with `resume`. Empty: the seed's initialisation.
  std::string init_from;
};

// Checks `options` before anything is built, with errors that name the setting to change: the
// config, this process's share of the job against this machine's memory, a worker's place in an
// elastic job (what its layout needs to re-form, learnt at its start and not at its first
// failure), and the device.
[[nodiscard]] Status CheckTrainOptions(const TrainOptions& options);

// The device this process trains on: train.device, where a worker of several (or of an elastic
// job, or one given its local rank) given "cuda" without an index takes cuda:<local rank mod
// `gpus`> (WorkerOptions::local_rank); `gpus` is how many GPUs this process sees (-1:
// CudaDeviceCount(), asked only then). With no GPU at all "cuda" stays cuda:0, which the model
// refuses with an error naming it.
[[nodiscard]] StatusOr<Device> TrainingDevice(const TrainOptions& options, int gpus = -1);
// TrainingDevice, or FAILED_PRECONDITION naming the setting when this machine has no such GPU.
[[nodiscard]] StatusOr<Device> TrainingDeviceHere(const TrainOptions& options);

}  // namespace strata::train
