// The parameters a worker holds, as raw float32 files, for comparison by tests and tools
// (TrainOptions::export_params_dir).
//
// - One file per parameter, DIR/<name>.f32, little-endian float32 in the parameter's layout.
// - Called by the trainer's thread at the end of Run; it reads the model and the store only.
#pragma once

#include <string>

#include "core/common/status.h"
#include "runtime/model/transformer.h"
#include "scheduler/tiered_scheduler.h"

namespace strata::train {

struct ParameterExport {
  bool dense = true;       // this worker writes the dense parameters (rank 0)
  std::string expert_dir;  // where its experts go: DIR, or DIR/copy<g> for the copies of group g
};

// Writes the dense parameters (when share.dense) into `dir` and this worker's experts — in the
// model, or from `tiered`'s store (null: in memory) — into share.expert_dir, making both folders.
[[nodiscard]] Status ExportParameters(const std::string& dir, const ParameterExport& share,
                                      model::MoeTransformer& model,
                                      scheduler::TieredExpertScheduler* tiered);

}  // namespace strata::train
