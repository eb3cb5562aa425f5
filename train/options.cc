#include "train/options.h"

#include "absl/strings/str_format.h"
#include "core/device/device.h"
#include "proto/config_io.h"
#include "runtime/model/memory_estimate.h"
#include "train/elastic/elastic_state.h"

namespace strata::train {

std::pair<int64_t, int64_t> BatchShare(int64_t global_batch, int workers, int rank) {
  const int64_t first = global_batch * rank / workers;
  return {first, global_batch * (rank + 1) / workers - first};
}

Status CheckWorkerLayout(const config::JobConfig& cfg, const WorkerOptions& w, int ep) {
  const int W = w.world_size;
  const config::ParallelConfig& par = cfg.parallel();
  if (w.rank < 0 || w.rank >= W) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--rank %d is outside [0, %d) for --world-size %d", w.rank, W, W));
  }
  if (w.store == nullptr) return absl::InvalidArgumentError("a distributed worker needs a store");
  if (cfg.train().global_batch() < W) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "train.global_batch = %d gives %d workers less than one sequence each; raise it to at "
        "least %d",
        cfg.train().global_batch(), W, W));
  }
  // (A later generation of an elastic job whose groups changed size places experts anew.)
  if (ep > 1 && !w.rejoin && par.experts_per_worker_size() > 0 &&
      par.experts_per_worker_size() != ep) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parallel.experts_per_worker has %d entries but expert-parallel groups have %d workers",
        par.experts_per_worker_size(), ep));
  }
  if (ep > 1 && cfg.model().moe().num_experts() < ep && par.experts_per_worker_size() == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "moe.num_experts = %d is fewer than the %d workers of an expert-parallel group; lower "
        "parallel.expert_parallel or give parallel.experts_per_worker",
        cfg.model().moe().num_experts(), ep));
  }
  if (par.local_size() > 0 && ep > 1 && ep % par.local_size() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parallel.local_size = %d does not divide the %d workers of an expert-parallel group; "
        "give the ranks per node (a divisor of %d) or 0 for a flat all-to-all",
        par.local_size(), ep, ep));
  }
  return absl::OkStatus();
}

Status CheckTrainOptions(const TrainOptions& options) {
  const config::JobConfig& cfg = options.config;
  RETURN_IF_ERROR(config::ValidateJobConfig(cfg, "job config"));
  // This process's share of the job against this machine's memory, before anything is allocated.
  RETURN_IF_ERROR(
      config::CheckMemory(cfg,
                          config::EstimateWorkerMemory(cfg, std::max(1, options.worker.world_size),
                                                       options.worker.elastic),
                          config::AvailableHostMemory(), "job config"));
  if (options.worker.rejoin && !options.worker.elastic) {
    return absl::InvalidArgumentError(
        "WorkerOptions: rejoin (joining a running job) is set but elastic is not; a worker joins a "
        "running job only through its coordinator (strata worker --coordinator), which sets both");
  }
  if (!options.init_from.empty() && options.resume) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--init-from %s and --resume: a resume takes its weights from the checkpoint; give one",
        options.init_from));
  }
  // An elastic job learns at its start what its layout needs to re-form, not at its first failure.
  if (options.worker.elastic) RETURN_IF_ERROR(CheckElastic(cfg));
  if (options.worker.local_rank < -1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WorkerOptions: local_rank %d; give a worker's index on its machine (0 or more), or -1 "
        "to derive it from its rank",
        options.worker.local_rank));
  }
  // A GPU that is not there stops a worker before it connects to the others.
  return TrainingDeviceHere(options).status();
}

StatusOr<Device> TrainingDeviceHere(const TrainOptions& options) {
  ASSIGN_OR_RETURN(const Device device, TrainingDevice(options));
  if (!device.is_cpu() && device.index >= CudaDeviceCount()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "train.device %s: this process puts its model on %s, but %s; train on the CPU device "
        "or on a machine with an NVIDIA GPU (--device cpu, cuda or cuda:N)",
        options.config.train().device(), device.ToString(), CudaDeviceDescription(device.index)));
  }
  return device;
}

StatusOr<Device> TrainingDevice(const TrainOptions& options, int gpus) {
  const std::string& text = options.config.train().device();
  ASSIGN_OR_RETURN(const Device device, Device::Parse(text));
  const WorkerOptions& w = options.worker;
  // One process alone is on GPU 0 unless it was given its index on the machine.
  if (text != "cuda" || (w.world_size <= 1 && !w.elastic && w.local_rank < 0)) return device;
  if (gpus < 0) gpus = CudaDeviceCount();
  if (gpus == 0) return device;
  int local = w.local_rank;
  if (local < 0) {
    const int per_node = options.config.parallel().local_size();
    local = w.elastic ? 0 : per_node > 0 ? w.rank % per_node : w.rank;
  }
  return Device::Cuda(local % gpus);
}

}  // namespace strata::train
