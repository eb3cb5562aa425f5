#include "train/tier_resources.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata::train {

bool TierResources::NeedsTempSsdFolder(const config::JobConfig& cfg) {
  return cfg.storage().mode() == config::StorageConfig::TIERED && cfg.checkpoint().dir().empty() &&
         cfg.storage().ssd_dir().empty();
}

Status TierResources::EnsureTempSsdFolder() {
  if (temp_ssd_dir_) return absl::OkStatus();
  // Made with its sweep of the folders of killed runs (storage/private_folder.h). Folders named
  // strata-ssd-XXXXXX by releases before these took a process id and a lock stay: whether a
  // process still has files open in one cannot be known cheaply (remove them by hand when no
  // strata runs).
  const char* base = std::getenv("TMPDIR");
  ASSIGN_OR_RETURN(temp_ssd_dir_, storage::PrivateFolder::Create(base && *base ? base : "/tmp",
                                                                 "strata-ssd-", "the SSD tier"));
  return absl::OkStatus();
}

Status TierResources::EnsureBudgets(const config::StorageConfig& st,
                                    const model::MoeTransformer& model) {
  if (device_budget_) return absl::OkStatus();  // a worker's budgets outlive its stores
  // Dense parameters with their gradients and Adam state live in the device tier for good.
  const uint64_t dense_bytes =
      static_cast<uint64_t>(model::CountScalars(model.DenseParameters())) * sizeof(float) * 4;
  auto device = std::make_unique<MemoryBudget>("device", st.device_budget_bytes());
  if (!device->Reserve(dense_bytes).ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "storage.device_budget_bytes = %d cannot hold the dense parameters with their "
        "gradients and Adam state (%d bytes) and any expert; raise it",
        st.device_budget_bytes(), dense_bytes));
  }
  device_budget_ = std::move(device);
  host_budget_ = std::make_unique<MemoryBudget>("host", st.host_budget_bytes());
  dense_state_bytes_ = dense_bytes;
  return absl::OkStatus();
}

StatusOr<scheduler::TieredOptions> TierResources::OptionsFor(
    const config::JobConfig& cfg, int threads, const WrapIo& wrap_io,
    checkpoint::CheckpointManager* checkpoints, const std::string& worker_subdir) {
  const config::StorageConfig& st = cfg.storage();
  scheduler::TieredOptions to;
  to.storage = st;
  to.seed = cfg.seed();
  to.threads = threads;
  to.device_budget = device_budget_.get();
  to.device_slot_bytes =
      st.device_budget_bytes() == 0 ? 0 : st.device_budget_bytes() - dense_state_bytes_;
  to.host_budget = host_budget_.get();
  to.wrap_io = wrap_io;
  if (checkpoints) {
    to.ssd_dir = cfg.checkpoint().dir();
    to.shared_ssd = checkpoints->ssd();
  } else if (!st.ssd_dir().empty()) {
    to.ssd_dir =
        worker_subdir.empty() ? st.ssd_dir() : absl::StrCat(st.ssd_dir(), "/", worker_subdir);
  } else {
    RETURN_IF_ERROR(EnsureTempSsdFolder());
    to.ssd_dir = temp_ssd_dir_->path();
  }
  return to;
}

}  // namespace strata::train
