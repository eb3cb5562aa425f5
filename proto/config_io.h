// Reading a JobConfig from text format, with errors that name the file, line and field.
//
// LoadJobConfig parses, validates and normalises in one go, so the rest of strata only ever sees
// a config in which every value is legal and every derived default (d_ff, d_expert, top_k by gate
// type, the data paths relative to the config file) has been filled in.
//
// Pure functions of their arguments (LoadJobConfig also reads the file): any thread may call them
// at once. Results are returned by value; nothing is kept.
#pragma once

#include <string>

#include "core/common/status.h"
#include "proto/config.pb.h"

namespace strata::config {

// Reads FILE, parses it, normalises it and validates its fields. Relative paths (data.path,
// storage.ssd_dir, checkpoint.dir) are resolved against the folder of FILE. Errors
// (INVALID_ARGUMENT; NOT_FOUND for a missing or unopenable file, DATA_LOSS for a failed read) list
// every problem found, one per line, as "FILE:LINE:COLUMN: field a.b.c: what is wrong; how to fix
// it". FILE must be a regular text file: a folder, a FIFO, a device or binary content is refused
// with a clear error. Checks neither the storage budgets against the model nor the machine's
// memory: both are CheckMemory's (runtime/model/memory_estimate.h).
[[nodiscard]] StatusOr<JobConfig> LoadJobConfig(const std::string& path);

// The same from text already in memory; `source` names it in errors and `base_dir` resolves
// relative paths ("" leaves them as they are).
[[nodiscard]] StatusOr<JobConfig> ParseJobConfig(const std::string& text, const std::string& source,
                                                 const std::string& base_dir);

// Validates every field of a config built or modified in code (e.g. after command-line overrides).
// The storage budgets against the model's dense state and the job against this machine's memory
// are CheckMemory's (runtime/model/memory_estimate.h), which the subcommands and the trainer call
// after it, before anything is allocated. Errors name the field but no line (INVALID_ARGUMENT).
// The config must already be normalised (see Normalize).
[[nodiscard]] Status ValidateJobConfig(const JobConfig& config, const std::string& source);

// Validates only the model part (for code that builds a model without a job).
[[nodiscard]] Status ValidateModelConfig(const ModelConfig& model, const std::string& source);

// Fills in derived defaults: d_ff = 4 * d_model when 0, d_expert = d_ff when 0, top_k from the gate
// type when not set. Idempotent.
void Normalize(JobConfig* config);

// Text format of a config, for logs and the metrics header.
std::string ToText(const JobConfig& config);

// How many steps before the last step boundary (the step every member of an elastic job finished)
// a new generation may go on from its workers' copies, without a checkpoint: a TIERED job with
// buddy copies (elastic.replicas > 0, one expert-parallel group, no experts_per_worker) refreshes
// them every elastic.replica_every steps from the state before an update, so up to that many; 0
// for every other job (an IN_MEMORY job's copies hold the boundary's state or the step after).
int64_t CopiesLagSteps(const JobConfig& config);

// Whether a model computes its GEMMs in bf16 (model::ModelOptions::bf16) for train.precision
// `precision` on a GPU (on_gpu) or the CPU: BF16, or AUTO on a GPU.
inline bool Bf16Gemms(TrainConfig::Precision precision, bool on_gpu) {
  return precision == TrainConfig::BF16 || (precision == TrainConfig::AUTO && on_gpu);
}

// True when layer `layer` (0-based) of the model has an MoE FFN.
inline bool IsMoeLayer(const ModelConfig& model, int layer) {
  return model.moe_every() > 0 && (layer + 1) % model.moe_every() == 0;
}

}  // namespace strata::config
