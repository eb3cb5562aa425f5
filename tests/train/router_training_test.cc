// Today's routers in whole training runs: DeepSeek-V3's router (sigmoid scores, a loss-free
// balancing bias, group-limited choice, routed scaling, the sequence-wise loss) on the tiny MoE
// model, in memory and with the experts in the tiered store.
//
// - A run stopped after its checkpoint of step 10 and resumed from it continues bitwise: the
//   losses of steps 11-20 and the final selection biases equal an uninterrupted run's (the bias
//   travels in the checkpoint with the dense state). Seen failing with the bias left out of the
//   gate's parameters (the resumed run starts it from zero again).
// - The bias moves (its range is not zero after 20 steps) and the metrics file reports each
//   layer's balance: max/mean load and the coefficient of variation recomputed here from the
//   layer's loads (dropless, one process: the routed loads are the dispatched ones), and the bias
//   range of the step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "proto/config_io.h"
#include "runtime/model/gate.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

using strata::testing::ReadFile;
using strata::testing::TempDir;
using strata::testing::WriteFile;

config::JobConfig ModernJob(const std::string& data, const std::string& mode,
                            const std::string& ckpt_dir) {
  config::JobConfig cfg = strata::testing::TinyMoeJob(data, R"pb(
    train { steps: 20 global_batch: 8 lr: 0.003 warmup_steps: 4 eval_every: 0 threads: 2 }
  )pb");
  config::MoeConfig* moe = cfg.mutable_model()->mutable_moe();
  moe->set_num_experts(8);
  moe->set_top_k(4);
  config::GateConfig* g = moe->mutable_gate();
  g->set_capacity_factor_train(0);
  g->set_score_function(config::GateConfig::SIGMOID);
  g->set_bias_update_rate(0.01f);
  g->set_num_groups(4);
  g->set_topk_groups(2);
  g->set_routed_scaling(2.0f);
  g->set_sequence_aux_loss_coef(0.01f);
  g->set_aux_loss_coef(0);
  if (mode == "TIERED") {
    cfg.mutable_storage()->set_mode(config::StorageConfig::TIERED);
    cfg.mutable_storage()->set_io_block_bytes(8192);
  }
  cfg.mutable_checkpoint()->set_dir(ckpt_dir);
  cfg.mutable_checkpoint()->set_every(10);
  return cfg;
}

std::vector<std::vector<float>> Biases(Trainer& t) {
  std::vector<std::vector<float>> out;
  for (const auto& ref : t.model().moe_layers()) {
    auto& gate = static_cast<model::SoftmaxGate&>(ref.layer->gate());
    const Tensor b = gate.selection_bias()->value.To(Device::Cpu());
    out.emplace_back(b.f32(), b.f32() + b.numel());
  }
  return out;
}

// The number after "key": in `line`, starting at `from`.
double NumberAfter(const std::string& line, const std::string& key, size_t from = 0) {
  const size_t at = line.find("\"" + key + "\":", from);
  EXPECT_NE(at, std::string::npos) << key << " in " << line;
  return at == std::string::npos ? std::nan("") : std::stod(line.substr(at + key.size() + 3));
}

class RouterTrainingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(40000)); }
  TempDir dir_;
};

TEST_P(RouterTrainingTest, ResumedRunContinuesBitwiseWithTheBias) {
  // The uninterrupted run.
  TrainOptions full;
  full.config = ModernJob(dir_.File("text.txt"), GetParam(), dir_.File("full_ck"));
  full.metrics_path = dir_.File("full.jsonl");
  full.progress = false;
  auto a = Trainer::Create(full);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->Run().ok());
  const std::vector<StepResult> want = (*a)->history();
  const auto want_bias = Biases(**a);
  ASSERT_EQ(want.size(), 20u);
  for (const auto& layer : want_bias) {
    const auto [lo, hi] = std::minmax_element(layer.begin(), layer.end());
    EXPECT_GT(*hi - *lo, 0.015f) << "the bias should have moved by several steps of 0.01";
  }

  // The same job stopped once checkpoint 10 is committed, then resumed from it.
  TrainOptions first = full;
  first.config.mutable_checkpoint()->set_dir(dir_.File("ck"));
  first.metrics_path.clear();
  Trainer* stopping = nullptr;
  first.on_step = [&](const StepResult& r) -> Status {
    if (r.step < 11) return absl::OkStatus();
    RETURN_IF_ERROR(stopping->checkpoints()->Wait());  // checkpoint 10 is committed
    return absl::AbortedError("stopped after checkpoint 10");
  };
  {
    auto b = Trainer::Create(first);
    ASSERT_TRUE(b.ok()) << b.status();
    stopping = b->get();
    Status s = (*b)->Run();
    ASSERT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    ASSERT_EQ((*b)->step(), 11);
  }
  TrainOptions resumed = full;
  resumed.config.mutable_checkpoint()->set_dir(dir_.File("ck"));
  resumed.metrics_path.clear();
  resumed.resume = true;
  auto c = Trainer::Create(resumed);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ((*c)->resumed_from(), 10);
  ASSERT_TRUE((*c)->Run().ok());
  const std::vector<StepResult>& got = (*c)->history();
  ASSERT_EQ(got.size(), 10u);
  for (const StepResult& r : got) {
    EXPECT_EQ(r.loss, want[r.step - 1].loss) << "step " << r.step;
    EXPECT_EQ(r.grad_norm, want[r.step - 1].grad_norm) << "step " << r.step;
  }
  EXPECT_EQ(Biases(**c), want_bias);

  // The metrics: each layer's balance from its loads, and the bias range.
  const std::vector<std::string> lines =
      absl::StrSplit(ReadFile(dir_.File("full.jsonl")), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 20u);
  for (const std::string& line : lines) {
    size_t at = line.find("\"moe\":[");
    int layers = 0;
    while ((at = line.find("\"load\":[", at)) != std::string::npos) {
      const size_t end = line.find(']', at);
      std::vector<double> load;
      for (auto v : absl::StrSplit(line.substr(at + 8, end - at - 8), ',')) {
        load.push_back(std::stod(std::string(v)));
      }
      ASSERT_EQ(load.size(), 8u);
      double sum = 0, peak = 0, var = 0;
      for (double l : load) sum += l, peak = std::max(peak, l);
      const double mean = sum / 8;
      for (double l : load) var += (l - mean) * (l - mean) / 8;
      EXPECT_NEAR(NumberAfter(line, "max_over_mean", end), peak / mean, 1e-6) << line;
      EXPECT_NEAR(NumberAfter(line, "cv", end), std::sqrt(var) / mean, 1e-6) << line;
      EXPECT_LE(NumberAfter(line, "bias_min", end), NumberAfter(line, "bias_max", end));
      at = end;
      ++layers;
    }
    EXPECT_EQ(layers, 2) << line;
  }
  // The last step routed with the biases before its own update: within one rate of the final.
  const std::string& last = lines.back();
  const size_t l0 = last.find("\"layer\":");
  EXPECT_NEAR(NumberAfter(last, "bias_max", l0),
              *std::max_element(want_bias[0].begin(), want_bias[0].end()), 0.0100001);
}

INSTANTIATE_TEST_SUITE_P(Modes, RouterTrainingTest, ::testing::Values("IN_MEMORY", "TIERED"));

}  // namespace
}  // namespace strata::train
