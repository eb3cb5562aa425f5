// The step's seams (train/step_seams.h) and the step around them: the one-process gradient sync's
// norm against a hand-computed sum, and a diverging loss stopping the step before its update in
// memory and in the tiered store, checked against a run that stopped one step earlier.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/common/thread_pool.h"
#include "proto/config_io.h"
#include "tests/test_util.h"
#include "train/step_seams.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;
using strata::testing::WriteFile;

// An ExpertState whose store holds gradients with a known sum of squares.
class StoreWithGradients final : public ExpertState {
 public:
  explicit StoreWithGradients(double sq) : sq_(sq) {}
  Status status() const override { return absl::OkStatus(); }
  double GradSumSquares() const override { return sq_; }
  Status Update(double, double, int64_t) override { return absl::OkStatus(); }
  bool TakeStats(storage::StoreStats*) override { return false; }
  Status Finish() override { return absl::OkStatus(); }
  void Quiesce() override {}

 private:
  double sq_;
};

TEST(LocalGradientsTest, TheNormIsTheOptimizersGradientsPlusTheStoresAndTheLossIsKept) {
  ThreadPool pool(2);
  ops::Context ctx;
  ctx.pool = &pool;
  auto a = model::MakeParameter("a", Shape{3}, model::Init::kZeros, 0, false);
  auto b = model::MakeParameter("b", Shape{2}, model::Init::kZeros, 0, false);
  const float ga[] = {1, -2, 3}, gb[] = {0.5f, 4};
  std::memcpy(a->grad.f32(), ga, sizeof(ga));
  std::memcpy(b->grad.f32(), gb, sizeof(gb));
  model::AdamW optimizer({a.get(), b.get()}, model::AdamWOptions());
  LocalGradients local(&ctx, &optimizer);
  EXPECT_EQ(local.loss_scale(), 1.0);

  // 1 + 4 + 9 + 0.25 + 16 = 30.25, and the store's 2.5 on top.
  auto tiered = local.Finish(/*step=*/1, 3.5, 0.25, StoreWithGradients(2.5));
  ASSERT_TRUE(tiered.ok()) << tiered.status();
  EXPECT_EQ(tiered->grad_sum_squares, 32.75);
  EXPECT_EQ(tiered->loss, 3.5);
  EXPECT_EQ(tiered->z_loss, 0.25);
  auto in_memory = local.Finish(/*step=*/1, 3.5, 0.25, InMemoryExperts());
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  EXPECT_EQ(in_memory->grad_sum_squares, 30.25);

  double sums[2] = {1.5, -7};
  ASSERT_TRUE(local.SumOverWorkers(1, sums, 2).ok());
  EXPECT_EQ(sums[0], 1.5);
  EXPECT_EQ(sums[1], -7);
  EXPECT_EQ(local.TakeCommSeconds(), 0);
}

config::JobConfig DivergingJob(const std::string& data, bool tiered) {
  auto cfg = config::ParseJobConfig(
      R"pb(
        name: "diverging"
        seed: 7
        model {
          seq_len: 16
          d_model: 32
          n_layers: 2
          n_heads: 2
          moe { num_experts: 4 top_k: 2 d_expert: 32 }
        }
        data { path: "x" eval_fraction: 0.1 }
        train {
          steps: 40
          global_batch: 8
          lr: 100000
          warmup_steps: 0
          grad_clip: 0
          eval_every: 0
          threads: 2
        }
      )pb",
      "diverging.textproto", "");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  cfg->mutable_data()->set_path(data);
  if (tiered) {
    cfg->mutable_storage()->set_mode(config::StorageConfig::TIERED);
    cfg->mutable_storage()->set_io_block_bytes(8192);
  }
  return *cfg;
}

class DivergingLossTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(20000)); }
  std::unique_ptr<Trainer> Make() {
    TrainOptions o;
    o.config = DivergingJob(dir_.File("text.txt"), GetParam());
    o.progress = false;
    auto t = Trainer::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  TempDir dir_;
};

TEST_P(DivergingLossTest, StopsTheStepBeforeItsUpdateNamingTheLossTheStepAndTheRate) {
  std::unique_ptr<Trainer> diverged = Make();
  ASSERT_NE(diverged, nullptr);
  Status failed;
  while (failed.ok() && diverged->step() < 40) failed = diverged->Step().status();
  ASSERT_FALSE(failed.ok()) << "the loss stayed finite for 40 steps at lr 100000";
  const int64_t k = diverged->step() + 1;  // the step that failed
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(failed.message().find("the training loss became"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find(absl::StrCat(" at step ", k, ";")), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("lower train.lr (now 100000)"), std::string::npos) << failed;
  EXPECT_EQ(diverged->history().size(), static_cast<size_t>(k - 1));

  // A run stopped after step k - 1 holds the same parameters: the failed step updated nothing.
  std::unique_ptr<Trainer> reference = Make();
  ASSERT_NE(reference, nullptr);
  for (int64_t s = 1; s < k; ++s) ASSERT_TRUE(reference->Step().ok());
  const auto& want = reference->model().Parameters();
  const auto& got = diverged->model().Parameters();
  ASSERT_EQ(want.size(), got.size());
  int compared = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!want[i]->value.defined()) continue;  // a tiered expert lives in the store
    ASSERT_EQ(want[i]->value.numel(), got[i]->value.numel()) << want[i]->name;
    EXPECT_EQ(std::memcmp(want[i]->value.f32(), got[i]->value.f32(),
                          want[i]->value.numel() * sizeof(float)),
              0)
        << want[i]->name;
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, DivergingLossTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "tiered" : "in_memory"; });

}  // namespace
}  // namespace strata::train
