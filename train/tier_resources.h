// TierResources: what a TIERED worker makes once and every store it makes in turn (a re-form's
// too) shares — the device and host memory budgets, and the temporary folder of its SSD tier.
//
// - The device budget is charged for good with the dense parameters, their gradients and Adam
//   state; the stores' slots take what is left.
// - A job without checkpoint.dir and storage.ssd_dir keeps its SSD tier in a PrivateFolder under
//   $TMPDIR (else /tmp), made on first need and removed when the TierResources goes.
//
// Ownership and threads: the trainer owns it and destroys it after its stores and checkpoint
// manager (which charge the budgets and use the folder). Only the trainer's thread calls it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "checkpoint/manager.h"
#include "core/common/status.h"
#include "core/device/device.h"
#include "proto/config.pb.h"
#include "runtime/model/transformer.h"
#include "scheduler/tiered_scheduler.h"
#include "storage/private_folder.h"

namespace strata::train {

class TierResources {
 public:
  using WrapIo =
      std::function<std::unique_ptr<storage::BlockIo>(std::unique_ptr<storage::BlockIo>)>;

  // TIERED without checkpoint.dir and storage.ssd_dir.
  static bool NeedsTempSsdFolder(const config::JobConfig& config);
  [[nodiscard]] Status EnsureTempSsdFolder();
  // The budgets of storage.device_budget_bytes and host_budget_bytes, once (later calls do
  // nothing); INVALID_ARGUMENT when the device budget cannot hold `model`'s dense state.
  [[nodiscard]] Status EnsureBudgets(const config::StorageConfig& storage,
                                     const model::MoeTransformer& model);
  // A store's options (after EnsureBudgets). Its SSD tier: the checkpoint shard's when there are
  // `checkpoints`, else storage.ssd_dir (in `worker_subdir` below it when that is not empty:
  // workers on one machine keep their experts apart), else the temporary folder.
  [[nodiscard]] StatusOr<scheduler::TieredOptions> OptionsFor(
      const config::JobConfig& config, int threads, const WrapIo& wrap_io,
      checkpoint::CheckpointManager* checkpoints, const std::string& worker_subdir);

 private:
  // In destruction order: the budgets, then the folder.
  std::unique_ptr<storage::PrivateFolder> temp_ssd_dir_;
  std::unique_ptr<MemoryBudget> device_budget_, host_budget_;
  uint64_t dense_state_bytes_ = 0;  // charged to device_budget_ for good
};

}  // namespace strata::train
