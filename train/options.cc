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
  ASSIGN_OR_RETURN(const Device device, Device::Parse(cfg.train().device()));
  if (!device.is_cpu() && (options.worker.world_size > 1 || options.worker.elastic)) {
    return absl::UnimplementedError(absl::StrFormat(
        "train.device %s: a model on a GPU trains in one process (strata train) for now; "
        "workers train on the CPU (train.device \"cpu\")",
        cfg.train().device()));
  }
  return absl::OkStatus();
}

}  // namespace strata::train
