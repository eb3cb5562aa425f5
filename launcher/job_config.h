// The job's config as the coordinator owns it: which fields belong to the job (every worker must
// train with the same value) and which to the machine a worker runs on, and how two configs'
// job parts differ.
//
// The coordinator records the effective job config — the config file with the launch's job-level
// overrides (steps, checkpoint folder and interval) applied and the data path made absolute — and
// hands it to every worker that joins without a config of its own. A worker that brings one, and
// the coordinator at every Join, compare job parts and refuse a difference, naming the fields.
//
// Pure functions over values; any thread may call them.
#pragma once

#include <string>
#include <vector>

#include "core/common/status.h"
#include "proto/config.pb.h"

namespace strata::launcher {

// The per-machine fields, which stay local to each worker: train.threads, train.device,
// data.path (a worker on another machine may keep the token file elsewhere) and
// storage.ssd_dir (the tiered store's local scratch folder). Everything else in a JobConfig
// belongs to the job.
void ClearMachineFields(config::JobConfig* config);

// `config` without its per-machine fields.
config::JobConfig JobPart(const config::JobConfig& config);

// The fields whose values differ between the job parts of `job` and `mine`, one line each:
// "train.lr: 0.001 (job) vs 0.01 (this worker)". A field left out counts as its default. Empty
// when the job parts agree.
std::vector<std::string> JobDifferences(const config::JobConfig& job,
                                        const config::JobConfig& mine);

// The coordinator's check of a joiner: `worker_text` (WorkerInfo.job_config) against the job's
// config text. FAILED_PRECONDITION naming every differing field, INVALID_ARGUMENT when
// `worker_text` is empty or does not parse.
[[nodiscard]] Status CheckJoinerConfig(const std::string& job_text, const std::string& worker_id,
                                       const std::string& worker_text);

}  // namespace strata::launcher
