// The metrics file's step line, from a step whose figures are set by hand and compared with the
// line written out by hand: the step's fields, a worker's fields, each MoE layer's routing and
// balance (max/mean and cv computed here from the routed counts), a TIERED step's tiers with the
// SSD's rates, and an evaluation. Every figure is chosen to print exactly at 8 significant digits.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>

#include "train/metrics.h"

namespace strata::train {
namespace {

StepResult HandStep() {
  StepResult r;
  r.step = 3;
  r.loss = 2.5;
  r.aux_loss = 0.125;
  r.z_loss = 0.0625;
  r.lr = 0.001;
  r.grad_norm = 1.5;
  r.tokens = 512;
  r.seconds = 0.25;       // 2048 tokens/s, 250 ms
  r.comm_seconds = 0.01;  // 10 ms
  model::MoeStats s;
  s.load = {3, 1};
  s.routed = {3, 1};  // mean 2: max/mean 1.5; deviations +-1: standard deviation 1, cv 0.5
  s.dropped = 2;
  s.dropped_tokens = 1;
  s.capacity = 4;
  s.aux_loss = 1.25;
  s.z_loss = 0.5;
  s.sequence_aux_loss = 0.75;
  r.moe.push_back(s);
  return r;
}

TEST(StepMetricsLineTest, OneProcessInMemoryStep) {
  EXPECT_EQ(StepMetricsLine(HandStep(), {2}, /*sequence_aux_loss=*/false, std::nullopt, nullptr),
            "{\"step\":3,\"loss\":2.5,\"aux_loss\":0.125,\"z_loss\":0.0625,\"lr\":0.001,"
            "\"grad_norm\":1.5,\"tokens\":512,\"tokens_per_s\":2048,\"step_ms\":250,"
            "\"moe\":[{\"layer\":2,\"load\":[3,1],\"dropped\":2,\"dropped_tokens\":1,"
            "\"capacity\":4,\"aux_loss\":1.25,\"z_loss\":0.5,\"max_over_mean\":1.5,\"cv\":0.5}]}");
}

TEST(StepMetricsLineTest, WorkerTieredEvaluatedStepWithBiasAndSequenceLoss) {
  StepResult r = HandStep();
  r.moe[0].has_bias = true;
  r.moe[0].bias_min = -0.25;
  r.moe[0].bias_max = 0.5;
  r.tiered = true;
  r.store.device = {1, 2, 3, 4, 5, 6, 7};
  r.store.host = {8, 9, 10, 11, 12, 13, 14};
  r.store.ssd = {0, 0, 1000000000, 2000000000, 0, 15, 16};
  r.store.ssd_read_seconds = 1;     // 2e9 bytes out: 2 GB/s
  r.store.ssd_write_seconds = 0.5;  // 1e9 bytes in: 2 GB/s
  r.store.stall_seconds = 0.003;
  r.store.background_wait_seconds = 0;
  EvalResult eval;
  eval.loss = 2 * std::log(2.0);  // 1.3862944 nats
  eval.bits_per_byte = 2;
  const WorkerStepFields worker{1, 2, 3, 8, 4, "cuda:1"};
  EXPECT_EQ(StepMetricsLine(r, {5}, /*sequence_aux_loss=*/true, worker, &eval),
            "{\"step\":3,\"loss\":2.5,\"aux_loss\":0.125,\"z_loss\":0.0625,\"lr\":0.001,"
            "\"grad_norm\":1.5,\"tokens\":512,\"tokens_per_s\":2048,\"step_ms\":250,"
            "\"rank\":1,\"workers\":2,\"generation\":3,\"first_sample\":8,\"samples\":4,"
            "\"device\":\"cuda:1\",\"comm_ms\":10,"
            "\"moe\":[{\"layer\":5,\"load\":[3,1],\"dropped\":2,\"dropped_tokens\":1,"
            "\"capacity\":4,\"aux_loss\":1.25,\"z_loss\":0.5,\"sequence_aux_loss\":0.75,"
            "\"max_over_mean\":1.5,\"cv\":0.5,\"bias_min\":-0.25,\"bias_max\":0.5}],"
            "\"tiers\":{\"device\":{\"hits\":1,\"misses\":2,\"bytes_in\":3,\"bytes_out\":4,"
            "\"evictions\":5,\"used_bytes\":6,\"budget_bytes\":7},"
            "\"host\":{\"hits\":8,\"misses\":9,\"bytes_in\":10,\"bytes_out\":11,"
            "\"evictions\":12,\"used_bytes\":13,\"budget_bytes\":14},"
            "\"ssd\":{\"hits\":0,\"misses\":0,\"bytes_in\":1000000000,\"bytes_out\":2000000000,"
            "\"evictions\":0,\"used_bytes\":15,\"budget_bytes\":16,\"read_gbps\":2,"
            "\"write_gbps\":2}},\"stall_ms\":3,\"optimizer_wait_ms\":0,"
            "\"eval_loss\":1.3862944,\"eval_bits_per_byte\":2}");
}

// An evaluation without bits per byte (data that is not byte-level) leaves that field out.
TEST(StepMetricsLineTest, EvaluationWithoutBitsPerByte) {
  EvalResult eval;
  eval.loss = 0.5;
  eval.bits_per_byte = std::nan("");
  StepResult r = HandStep();
  r.moe.clear();
  EXPECT_EQ(StepMetricsLine(r, {}, false, std::nullopt, &eval),
            "{\"step\":3,\"loss\":2.5,\"aux_loss\":0.125,\"z_loss\":0.0625,\"lr\":0.001,"
            "\"grad_norm\":1.5,\"tokens\":512,\"tokens_per_s\":2048,\"step_ms\":250,"
            "\"moe\":[],\"eval_loss\":0.5}");
}

}  // namespace
}  // namespace strata::train
