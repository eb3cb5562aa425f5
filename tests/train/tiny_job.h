// The small MoE model the trainer's tests train (2 blocks, 4 experts, top-2), on `data_path`,
// with the job's other sections (train, elastic, ...) given by each test in text format.
#pragma once

#include <string>

#include <gtest/gtest.h>
#include "absl/strings/str_cat.h"
#include "proto/config_io.h"
#include "tests/test_util.h"

namespace strata::testing {

inline config::JobConfig TinyMoeJob(const std::string& data_path, const std::string& sections) {
  const std::string model = R"pb(
    name: "tiny"
    seed: 7
    model {
      seq_len: 32
      d_model: 32
      n_layers: 2
      n_heads: 2
      moe_every: 1
      moe {
        num_experts: 4
        top_k: 2
        d_expert: 32
        gate { capacity_factor_train: 1.25 }
      }
    }
    data { path: "set below" eval_fraction: 0.1 }
  )pb";
  auto cfg = config::ParseJobConfig(model + sections, "tiny.textproto", "");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  cfg->mutable_data()->set_path(data_path);
  return *cfg;
}

// TinyMoeJob trained TIERED and expert-parallel over every worker (`strata worker` processes,
// one thread each) for `steps` steps of `global_batch` sequences, with one checkpoint, at the
// last step, in "ckpt" of the folder the workers run in.
inline config::JobConfig TieredShardedJob(const std::string& data_path, int steps,
                                          int global_batch) {
  return TinyMoeJob(data_path, "train { steps: " + std::to_string(steps) +
                                   " global_batch: " + std::to_string(global_batch) +
                                   " threads: 1 eval_every: 0 }\n"
                                   "parallel { expert_parallel: 0 }\n"
                                   "storage { mode: TIERED io_block_bytes: 8192 }\n"
                                   "checkpoint { every: " +
                                   std::to_string(steps) + " dir: \"ckpt\" }\n");
}

// Trains `cfg` in one process (`strata train`) with one checkpoint, at its last step, in
// dir/ckpt.
inline void TrainWithACheckpoint(const TempDir& dir, config::JobConfig cfg) {
  cfg.mutable_checkpoint()->set_every(cfg.train().steps());
  cfg.mutable_checkpoint()->set_dir(dir.File("ckpt"));
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  auto train = RunCommand(
      absl::StrCat(BinDir(), "/strata train --quiet --config ", dir.File("job.textproto")));
  ASSERT_EQ(train.exit_code, 0) << train.output;
}

}  // namespace strata::testing
