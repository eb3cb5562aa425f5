// The job of the tiered-training tests (CPU and GPU): 2 blocks of 8 experts, 12 steps, experts in
// the tiered store with the given budgets (0: unlimited), on `data`, with `threads` compute
// threads.
#pragma once

#include <cstdint>
#include <string>

#include <gtest/gtest.h>
#include "proto/config_io.h"

namespace strata::testing {

inline config::JobConfig TieredJob(const std::string& data, uint64_t device_budget,
                                   uint64_t host_budget, int threads) {
  auto cfg = config::ParseJobConfig(
      R"pb(
        name: "tiered"
        seed: 11
        model {
          seq_len: 16
          d_model: 32
          n_layers: 2
          n_heads: 2
          moe {
            num_experts: 8
            top_k: 2
            d_expert: 32
            gate { capacity_factor_train: 1.5 }
          }
        }
        data { path: "x" eval_fraction: 0.1 }
        train { steps: 12 global_batch: 8 lr: 0.004 warmup_steps: 2 eval_every: 6 eval_batches: 2 }
        storage { mode: TIERED io_block_bytes: 8192 history_prefetch: 3 }
      )pb",
      "tiered.textproto", "");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  cfg->mutable_data()->set_path(data);
  cfg->mutable_train()->set_threads(threads);
  cfg->mutable_storage()->set_device_budget_bytes(device_budget);
  cfg->mutable_storage()->set_host_budget_bytes(host_budget);
  return *cfg;
}

}  // namespace strata::testing
