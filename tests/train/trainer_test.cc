// The trainer end to end on a tiny config: the loss falls, runs are bitwise reproducible, the
// metrics file has what it promises, and the learning-rate schedule is as documented.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

using strata::testing::ReadFile;
using strata::testing::TempDir;
using strata::testing::WriteFile;

config::JobConfig TinyJob(const std::string& data_path, int threads) {
  config::JobConfig cfg = strata::testing::TinyMoeJob(data_path, R"pb(
    train { steps: 60 global_batch: 8 lr: 0.003 warmup_steps: 10 eval_every: 20 eval_batches: 2 }
  )pb");
  cfg.mutable_train()->set_threads(threads);
  return cfg;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override { WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(60000)); }
  std::unique_ptr<Trainer> Make(int threads, const std::string& metrics = "") {
    TrainOptions o;
    o.config = TinyJob(dir_.File("text.txt"), threads);
    o.metrics_path = metrics;
    o.progress = false;
    auto t = Trainer::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  TempDir dir_;
};

TEST_F(TrainerTest, LossFalls) {
  auto t = Make(2);
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->Run().ok());
  const auto& h = t->history();
  ASSERT_EQ(h.size(), 60u);
  EXPECT_NEAR(h.front().loss, std::log(256.0), 0.5);  // uniform over bytes at the start
  double last10 = 0;
  for (size_t i = h.size() - 10; i < h.size(); ++i) last10 += h[i].loss / 10;
  EXPECT_LT(last10, h.front().loss - 2.0) << "the model did not learn the synthetic grammar";
  ASSERT_EQ(t->evals().size(), 3u);  // steps 20, 40, 60
  EXPECT_LT(t->evals().back().second.loss, t->evals().front().second.loss);
  EXPECT_NEAR(t->evals().back().second.bits_per_byte, t->evals().back().second.loss / std::log(2.0),
              1e-12);
}

TEST_F(TrainerTest, SameSeedAndThreadsGiveBitwiseIdenticalLosses) {
  for (int threads : {1, 2}) {
    auto a = Make(threads), b = Make(threads);
    ASSERT_TRUE(a && b);
    ASSERT_TRUE(a->Run().ok());
    ASSERT_TRUE(b->Run().ok());
    ASSERT_EQ(a->history().size(), b->history().size());
    for (size_t i = 0; i < a->history().size(); ++i) {
      const double la = a->history()[i].loss, lb = b->history()[i].loss;
      EXPECT_EQ(0, std::memcmp(&la, &lb, sizeof(double)))
          << "threads " << threads << " step " << i + 1 << ": " << la << " vs " << lb;
    }
    for (size_t i = 0; i < a->evals().size(); ++i) {
      EXPECT_EQ(a->evals()[i].second.loss, b->evals()[i].second.loss);
    }
    // And the parameters end up identical.
    const auto& pa = a->model().Parameters();
    const auto& pb = b->model().Parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(pa[i]->value.f32(), pb[i]->value.f32(), pa[i]->value.bytes()))
          << pa[i]->name;
    }
  }
}

TEST_F(TrainerTest, ThreadCountChangesOnlyRounding) {
  auto a = Make(1), b = Make(3);
  ASSERT_TRUE(a && b);
  for (int s = 0; s < 5; ++s) {
    auto ra = a->Step(), rb = b->Step();
    ASSERT_TRUE(ra.ok() && rb.ok());
    EXPECT_NEAR(ra->loss, rb->loss, 1e-4 * ra->loss);
  }
}

TEST_F(TrainerTest, MetricsFileHasOneObjectPerStepWithTheDocumentedKeys) {
  const std::string path = dir_.File("metrics.jsonl");
  auto t = Make(2, path);
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->Run().ok());
  std::vector<std::string> lines = absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 60u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    EXPECT_EQ(l.front(), '{');
    EXPECT_EQ(l.back(), '}');
    EXPECT_NE(l.find(absl::StrCat("\"step\":", i + 1, ",")), std::string::npos) << l;
    for (const char* key : {"\"loss\":", "\"aux_loss\":", "\"tokens_per_s\":", "\"moe\":[",
                            "\"load\":[", "\"dropped\":", "\"layer\":0", "\"layer\":1"}) {
      EXPECT_NE(l.find(key), std::string::npos) << key << " missing in " << l;
    }
    const bool eval = (i + 1) % 20 == 0;
    EXPECT_EQ(l.find("\"eval_loss\":") != std::string::npos, eval) << l;
    EXPECT_EQ(l.find("\"eval_bits_per_byte\":") != std::string::npos, eval) << l;
    // The logged loss is the step's loss.
    const double logged = std::strtod(l.c_str() + l.find("\"loss\":") + 7, nullptr);
    EXPECT_NEAR(logged, t->history()[i].loss, 1e-6 * logged);
    // The load histogram sums to the dispatched rows: at most k * tokens (capacity drops).
    const size_t lb = l.find("\"load\":[") + 8;
    std::vector<std::string> counts = absl::StrSplit(l.substr(lb, l.find(']', lb) - lb), ',');
    int64_t total = 0;
    for (const auto& c : counts) total += std::stoll(c);
    EXPECT_LE(total, 2 * 8 * 32);
    EXPECT_GT(total, 8 * 32);
  }
}

TEST_F(TrainerTest, AWorkerThatIsNotElasticCanNeitherJoinNorReform) {
  TrainOptions o;
  o.config = TinyJob(dir_.File("text.txt"), 1);
  o.progress = false;
  o.worker.rejoin = true;  // joining a running job without being elastic
  auto refused = Trainer::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("elastic"), std::string::npos) << refused.status();

  auto t = Make(1);
  ASSERT_TRUE(t);
  const Status reform = t->Reform(WorkerOptions());
  EXPECT_EQ(reform.code(), absl::StatusCode::kFailedPrecondition) << reform;
  // Refused before anything changed: it still trains.
  ASSERT_TRUE(t->Step().ok());
  EXPECT_EQ(t->step(), 1);
}

TEST(LearningRateTest, WarmupThenCosine) {
  config::TrainConfig t;
  t.set_lr(1.0f);
  t.set_warmup_steps(10);
  t.set_steps(110);
  t.set_min_lr_ratio(0.1f);
  EXPECT_DOUBLE_EQ(Trainer::LearningRate(t, 0), 0.1);
  EXPECT_DOUBLE_EQ(Trainer::LearningRate(t, 9), 1.0);
  EXPECT_NEAR(Trainer::LearningRate(t, 10), 1.0, 1e-12);
  EXPECT_NEAR(Trainer::LearningRate(t, 60), 0.55, 1e-7);  // halfway: (1 + 0.1) / 2 (float 0.1)
  EXPECT_NEAR(Trainer::LearningRate(t, 110), 0.1, 1e-7);
  t.set_schedule(config::TrainConfig::CONSTANT);
  EXPECT_DOUBLE_EQ(Trainer::LearningRate(t, 100), 1.0);
}

TEST(TrainerErrorsTest, MissingDataFileFailsBeforeTraining) {
  TrainOptions o;
  o.config = TinyJob("/nonexistent/strata/data.txt", 1);
  auto t = Trainer::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("/nonexistent/strata/data.txt"), std::string::npos);
}

TEST(TrainerErrorsTest, UnwritableMetricsFileFailsBeforeTraining) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  TrainOptions o;
  o.config = TinyJob(dir.File("text.txt"), 1);
  o.metrics_path = dir.File("no/such/folder/m.jsonl");
  auto t = Trainer::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("--metrics-out"), std::string::npos) << t.status();
}

// Where a process trains: train.device as given, except a worker's bare "cuda", which takes the
// GPU of its index on its machine. Each expected index worked out by hand from the rule in
// train/options.h.
TEST(TrainingDeviceTest, ABareCudaPlacesEachWorkerOnTheGpuOfItsLocalRank) {
  const auto place = [](const std::string& device, int rank, int world, bool elastic,
                        int local_rank, int local_size, int gpus) {
    TrainOptions o;
    o.config.mutable_train()->set_device(device);
    o.config.mutable_parallel()->set_local_size(local_size);
    o.worker.rank = rank;
    o.worker.world_size = world;
    o.worker.elastic = elastic;
    o.worker.local_rank = local_rank;
    auto d = TrainingDevice(o, gpus);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? d->ToString() : std::string("error");
  };
  // One process: "cuda" is cuda:0, whatever the GPUs, unless given its local rank.
  EXPECT_EQ(place("cuda", 0, 1, false, -1, 0, 4), "cuda:0");
  EXPECT_EQ(place("cuda", 0, 1, false, 2, 0, 4), "cuda:2");
  // Static workers: rank mod GPUs, or (rank mod local_size) mod GPUs.
  EXPECT_EQ(place("cuda", 5, 8, false, -1, 0, 4), "cuda:1");
  EXPECT_EQ(place("cuda", 6, 8, false, -1, 4, 4), "cuda:2");
  EXPECT_EQ(place("cuda", 6, 8, false, -1, 4, 2), "cuda:0");
  EXPECT_EQ(place("cuda", 3, 4, false, -1, 0, 1), "cuda:0");
  // A given local rank wins over the rank.
  EXPECT_EQ(place("cuda", 0, 4, false, 3, 0, 2), "cuda:1");
  // Elastic workers: their local rank (0 when not given), never their changing rank.
  EXPECT_EQ(place("cuda", 3, 4, true, -1, 0, 4), "cuda:0");
  EXPECT_EQ(place("cuda", 0, 1, true, 3, 0, 4), "cuda:3");
  // An index given, or the CPU, is kept; no GPU leaves cuda:0 for the model to refuse.
  EXPECT_EQ(place("cuda:2", 1, 4, false, -1, 0, 4), "cuda:2");
  EXPECT_EQ(place("cpu", 1, 4, false, 1, 0, 4), "cpu");
  EXPECT_EQ(place("cuda", 1, 4, false, -1, 0, 0), "cuda:0");

  TrainOptions bad;
  bad.config.mutable_train()->set_device("gpu");
  EXPECT_FALSE(TrainingDevice(bad, 1).ok());
}

TEST(TrainerErrorsTest, AGpuWorkerWhereThereIsNoGpuFailsBeforeConnecting) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  TrainOptions o;
  o.config = TinyJob(dir.File("text.txt"), 1);
  o.config.mutable_train()->set_device("cuda");
  o.progress = false;
  // Rank 1 of 2 with no store: were the device not checked first, connecting would fail instead.
  o.worker.rank = 1;
  o.worker.world_size = 2;
  auto t = Trainer::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_NE(t.status().message().find("train.device cuda: this process puts its model on cuda:0"),
            std::string::npos)
      << t.status();
  o.worker.local_rank = -2;
  EXPECT_EQ(Trainer::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::train
