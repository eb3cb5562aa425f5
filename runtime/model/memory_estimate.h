// How much memory and disk a job needs, from its config alone, and whether this machine has it.
//
// What it counts, before anything is allocated, for one `strata train` / `strata worker` process
// over the whole run:
// - the parameters, their gradients and the two AdamW moments (4 floats per parameter); in
//   storage.mode TIERED only the dense ones, since expert state lives in the tiered store;
// - the activations the model allocates once for a batch of global_batch sequences (every block's
//   saved tensors, the attention matrices, the MoE dispatch buffers, the logits), and with bf16
//   GEMMs the scratch of the largest GEMM's rounded operands;
// - TIERED: the store's device and host tiers, which on a machine without a GPU are host memory:
//   their budgets, or all expert state where a budget is 0 (unlimited);
// - the process itself (libraries, thread stacks): a fixed kProcessOverheadBytes on top; the
//   mapped data file is not counted (its pages can be dropped).
//
// Where it lives and why:
// - Beside the model it counts (runtime/model), so that it follows what the model allocates:
//   tests build the model from the configs it estimates and compare the parameter counts exactly.
//   docs/storage.md ("Measurements behind the design") compares it with real runs.
// - Its functions take a JobConfig and stay in namespace strata::config with the config's other
//   functions (proto/config_io.h); field validation there does not call them: whether a config
//   fits a machine is each caller's check.
//
// Workers and disk:
// - One of W workers holds less: its expert-parallel group's share of the experts and 1/W of the
//   batch; in an elastic job with checkpoints rank 0 also keeps every expert with its Adam moments
//   (EstimateWorkerMemory, an upper bound per worker).
// - The machine check is the caller's: `strata check` and `strata train` for one process, a
//   worker for its share, `strata launch` for its N local workers together; a coordinator trains
//   nothing.
// - Disk: a TIERED job's SSD tier holds every expert's four tensors, the versions its checkpoints
//   pin and, for an elastic worker, its copy shelf (EstimateDisk); the trainer and `strata check`
//   compare that with the free space where it goes (CheckDisk), so a job that would fill the disk
//   is refused at its start.
//
// Threads: pure functions of the config, except AvailableHostMemory, AvailableDiskBytes and
// CheckDiskHere, which read this machine. Safe to call from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/common/bytes.h"
#include "core/common/status.h"
#include "proto/config.pb.h"

namespace strata::config {

struct MemoryEstimate {
  // Elements (floats) of the model's parameters: everything but the experts (embeddings,
  // attention, norms, routers, dense FFNs, the output head), and the experts of all MoE layers.
  int64_t dense_parameters = 0;
  int64_t expert_parameters = 0;
  int64_t parameters() const;

  // Bytes held in host memory (on a GPU, train.device "cuda", in device memory instead).
  uint64_t parameter_bytes = 0;  // parameter values held by the model
  uint64_t gradient_bytes = 0;   // their gradients
  uint64_t optimizer_bytes = 0;  // AdamW's first and second moments
  // train.precision BF16 (AUTO on a GPU): the bf16 copies of the GEMM weights the model holds,
  // counted as 2 bytes for every parameter it holds (an upper bound: biases, norms, position
  // embeddings and routers have none).
  uint64_t compute_copy_bytes = 0;
  uint64_t activation_bytes = 0;  // buffers for one batch, the token ids included
  uint64_t store_bytes = 0;       // TIERED: the device and host tiers' expert slots
  // One of several workers of an elastic IN_MEMORY job with one expert-parallel group: the
  // rollback copy of its state, the buddy copies of elastic.replicas workers' experts (after their
  // latest two updates) and, during a re-form, the state handed over (values and Adam moments).
  uint64_t elastic_copy_bytes = 0;
  // A worker of several with its model on a GPU: the page-locked host buffers its exchanges go
  // through (data parallelism's gradient buckets, the expert exchange's rows of one layer).
  uint64_t staging_bytes = 0;
  uint64_t total_bytes = 0;  // the sum of the eight above
  // What is in host memory: all of total_bytes on the CPU; on a GPU the TIERED store's host tier,
  // the elastic copies and staging_bytes (the rest of total_bytes is in device memory).
  uint64_t host_bytes = 0;

  // TIERED: expert weights, gradients and Adam moments, held on the SSD tier.
  uint64_t expert_state_bytes = 0;
  // TIERED: dense parameters with gradients and Adam state, kept in the device tier for good.
  uint64_t dense_state_bytes = 0;
  // The figures are for a model on a GPU (train.device is not "cpu"): only host_bytes is compared
  // with host memory.
  bool on_gpu = false;
};

// The estimate of a normalised config (see Normalize). Saturates at UINT64_MAX / INT64_MAX rather
// than overflowing, whatever the config holds.
MemoryEstimate EstimateMemory(const JobConfig& config);

// What one of `workers` workers of the job holds at most (workers <= 1: EstimateMemory). Its
// expert_parameters stay the model's; the byte figures are the worker's. `elastic`: a worker of a
// coordinator's job, which keeps copies of its state for a later generation when its layout does
// (elastic_copy_bytes: in memory, or for a TIERED worker the dense part of them, its experts'
// copies being on its SSD; other layouts go back to a checkpoint, each worker reading its own
// share); a `strata worker --store` worker keeps none.
MemoryEstimate EstimateWorkerMemory(const JobConfig& config, int workers, bool elastic = true);

// One line per figure, human-readable ("parameters  1.2 M (4.6 MiB) ..."), for `strata check`.
std::string FormatMemoryEstimate(const MemoryEstimate& estimate);

// "1.5 GiB", "512 B" (core/common/bytes.h).
using ::strata::FormatBytes;

// Bytes a new process can still allocate here without swapping: /proc/meminfo's MemAvailable
// (sysconf's available pages where that is missing), lowered to the room left under a cgroup v2
// memory.max (its inactive page cache, which the kernel drops first, not counted as used). 0
// when none of these can be read.
uint64_t AvailableHostMemory();

// What a strata process holds whatever the config: code and data of its libraries (CUDA, gRPC,
// RocksDB, OpenBLAS), thread stacks and pools (docs/storage.md, "Measurements behind the
// design", says what it was measured from).
inline constexpr uint64_t kProcessOverheadBytes = uint64_t{256} << 20;

// RESOURCE_EXHAUSTED when `processes` processes of this estimate need more host memory than
// `available_bytes` once kProcessOverheadBytes is added to each (not checked when available_bytes
// is 0 or the estimate is for GPU memory); INVALID_ARGUMENT, naming the field, when a TIERED
// storage.device_budget_bytes cannot hold the dense state. The message names `source`, gives the
// figures and says which fields to lower.
[[nodiscard]] Status CheckMemory(const JobConfig& config, const MemoryEstimate& estimate,
                                 uint64_t available_bytes, const std::string& source,
                                 int processes = 1);

// What a TIERED job writes to disk, from its config alone: an upper bound of the bytes its SSD
// tier's files take (allocated with fallocate, so this is what the disk loses) and of its copy
// shelf's. Tensors are counted as the store lays them out (storage/ssd_tier.h,
// storage/extent_allocator.h): each rounded up to kDiskGranuleBytes, packed first-fit into files
// of storage.ssd_file_bytes that grow kDiskGrowBytes at a time, no tensor split between files (so
// a file holds floor(ssd_file_bytes / tensor) of them and the rest of it is lost).
//   - live state: 4 tensors per expert (weights, gradient — a gradient spills when the host tier
//     is full — Adam m and v);
//   - checkpoints (checkpoint.dir and checkpoint.every set; the SSD tier then lives in
//     checkpoint.dir): max(1, checkpoint.keep) + 1 versions of every expert's weights and moments
//     (the oldest is removed only after the newest commits) and of the dense state, whose tensors
//     are counted as a granule each on top of their bytes; checkpoints may share versions with the
//     live state, which this does not assume;
//   - an elastic TIERED worker's copy shelf (config::CopiesLagSteps > 0, more than one worker):
//     two versions of its own experts and of elastic.replicas other workers' (weights and
//     moments), in files of the shelf's own (1 GiB, under storage.ssd_dir, else $TMPDIR).
// storage.ssd_capacity_bytes, when set, bounds the SSD tier (a job that needs more fails when the
// tier is full, which the check does not predict).
struct DiskEstimate {
  // The folder the SSD tier's files go to (checkpoint.dir, else storage.ssd_dir, else $TMPDIR or
  // /tmp, where a temporary folder is made) and the bytes they take there.
  std::string ssd_dir;
  bool temporary = false;            // ssd_dir is the parent of a temporary folder removed at exit
  uint64_t expert_tensor_bytes = 0;  // one expert tensor on disk (rounded up to the granule)
  int64_t experts = 0;               // experts of all MoE layers this process's store holds
  uint64_t expert_bytes = 0;         // the live state's files
  uint64_t checkpoint_bytes = 0;     // what the checkpoints add to them
  uint64_t ssd_bytes = 0;            // the SSD tier's files: both, bounded by ssd_capacity_bytes
  bool capped = false;               // ssd_bytes is storage.ssd_capacity_bytes
  // What writes in flight add for a moment: each writes a new version before the old one's
  // extent is freed, storage.ssd_threads + 2 at once (the ssd stage, the copy stage and a
  // checkpoint), which may grow a data file. CheckDisk asks for it on top of ssd_bytes.
  uint64_t in_flight_bytes = 0;
  // The copy shelf's folder (the parent of its private folder) and its files.
  std::string copies_dir;
  uint64_t copy_bytes = 0;
};

// SSD-tier layout constants, as storage/ssd_tier.h and storage/extent_allocator.h have them (proto
// cannot include storage): the O_DIRECT granule and the step in which a data file grows.
inline constexpr uint64_t kDiskGranuleBytes = 4096;
inline constexpr uint64_t kDiskGrowBytes = uint64_t{64} << 20;

// The disk need of one of `workers` processes of the job (its share of the experts; `elastic` as
// in EstimateWorkerMemory). All zero for an IN_MEMORY job. Saturates like EstimateMemory.
DiskEstimate EstimateDisk(const JobConfig& config, int workers = 1, bool elastic = true);

// "disk: 40.0 GiB in /tmp (SSD tier: expert state 40.0 GiB + checkpoints 0 B) + ...", for
// `strata check`; empty for a job that writes nothing.
std::string FormatDiskEstimate(const DiskEstimate& estimate);

// Bytes an unprivileged process may still write on the file system of `path` (statvfs: f_bavail
// x f_frsize) — of `path`'s nearest existing ancestor when it does not exist yet ("" is the
// current folder). 0 when none can be read.
uint64_t AvailableDiskBytes(const std::string& path);

// RESOURCE_EXHAUSTED when the SSD tier's files need more than `available_bytes` (which includes
// what files already in its folder hold: a resumed job reuses them), or the copy shelf more than
// `copies_available_bytes` — nullopt when the shelf is on the SSD tier's file system, whose
// available_bytes then has to hold both. Not checked when available_bytes is 0 (not known). The
// message names `source`, the folder, the figures in human units, the fields that drive them and
// how to make room.
[[nodiscard]] Status CheckDisk(const JobConfig& config, const DiskEstimate& estimate,
                               uint64_t available_bytes, const std::string& source,
                               std::optional<uint64_t> copies_available_bytes = std::nullopt);

// CheckDisk against this machine: AvailableDiskBytes of both folders (one figure when they are on
// one file system), plus what the SSD tier's data files (data-*.bin) already in its folder or two
// levels below take, which the tier reuses (not for the parent of a temporary folder).
[[nodiscard]] Status CheckDiskHere(const JobConfig& config, const DiskEstimate& estimate,
                                   const std::string& source);

}  // namespace strata::config
