// Training with experts in the tiered store and the model on a GPU: device slots in HBM, host slots
// page-locked, the SSD tier below.
//
// - Budgets far below the experts' state (device 3 slots, host 7, of 64 expert tensors) give
//   losses, held-out losses and dense parameters bitwise identical to unlimited budgets on the
//   same GPU: the tiers change where a value is, never the value.
// - Against in-memory training on the same GPU the losses agree within 2e-4 relative, the bound
//   tiered_training_test.cc holds on the CPU, for the same reasons: in memory the experts run as
//   grouped GEMMs and the AdamW step runs on the GPU, while the store's experts run one GEMM each
//   and take their AdamW step on the host (ZeRO-Offload style), whose float arithmetic rounds
//   differently from the GPU's kernel by an ulp; the gradient norm is summed in another order.
//
// Skips where no CUDA device is present.
#include <gtest/gtest.h>

#include <cstring>

#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiered_job.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;
using strata::testing::WriteFile;

constexpr int kSteps = 12;

// The CPU tests' job on the first GPU. Its pool has 2 threads, but the experts run from one (one
// stream), so the store's smallest budgets are one thread's: 3 device and 7 host slots.
config::JobConfig GpuTieredJob(
    const std::string& data, uint64_t device_budget, uint64_t host_budget,
    config::TrainConfig::Precision precision = config::TrainConfig::FP32) {
  config::JobConfig cfg = strata::testing::TieredJob(data, device_budget, host_budget, 2);
  cfg.mutable_train()->set_device("cuda:0");
  cfg.mutable_train()->set_precision(precision);  // FP32 unless asked: the bounds are fp32's
  return cfg;
}

struct GpuRun {
  std::vector<double> losses, evals;
  std::vector<std::vector<float>> dense;  // copied to the host
  uint64_t ssd_bytes_in = 0, device_evictions = 0, host_evictions = 0;
  uint64_t slot_bytes = 0, dense_bytes = 0, expert_tensors = 0;
  int device_slots = 0, host_slots = 0;
};

GpuRun Train(const config::JobConfig& cfg) {
  GpuRun run;
  TrainOptions o;
  o.config = cfg;
  o.progress = false;
  auto t = Trainer::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return run;
  Trainer& tr = **t;
  const Status s = tr.Run();
  EXPECT_TRUE(s.ok()) << s;
  for (const auto& r : tr.history()) {
    run.losses.push_back(r.loss);
    run.ssd_bytes_in += r.store.ssd.bytes_in;
    run.device_evictions += r.store.device.evictions;
    run.host_evictions += r.store.host.evictions;
  }
  for (const auto& e : tr.evals()) run.evals.push_back(e.second.loss);
  for (model::Parameter* p : tr.model().DenseParameters()) {
    std::vector<float> host(p->value.numel());
    p->value.CopyToHost(host.data());
    run.dense.push_back(std::move(host));
  }
  if (auto* sch = tr.tiered()) {
    run.slot_bytes = (sch->expert_floats() * 4 + 4095) / 4096 * 4096;
    run.expert_tensors = 4ull * sch->moe_layers() * sch->num_experts(0);
    run.device_slots = sch->store().device_slots();
    run.host_slots = sch->store().host_slots();
  }
  run.dense_bytes = model::CountScalars(tr.model().DenseParameters()) * 4 * 4;
  return run;
}

class TieredTrainingGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device: this test runs on a machine with an NVIDIA GPU";
    }
    WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(40000));
  }
  TempDir dir_;
};

// In fp32 and in bf16 (whose tiered experts round their fp32 weights at every GEMM).
TEST_F(TieredTrainingGpuTest, BudgetsFarBelowTheStateGiveTheBitsOfUnlimitedOnes) {
  for (auto precision : {config::TrainConfig::FP32, config::TrainConfig::BF16}) {
    SCOPED_TRACE(config::TrainConfig::Precision_Name(precision));
    const std::string data = dir_.File("text.txt");
    const GpuRun unlimited = Train(GpuTieredJob(data, 0, 0, precision));
    ASSERT_EQ(unlimited.losses.size(), static_cast<size_t>(kSteps));
    // The smallest budgets the store accepts for one compute thread: 3 device slots, 7 host slots.
    const uint64_t device = unlimited.dense_bytes + 3 * unlimited.slot_bytes;
    const uint64_t host = 7 * unlimited.slot_bytes;
    const GpuRun tiny = Train(GpuTieredJob(data, device, host, precision));
    ASSERT_EQ(tiny.losses.size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(tiny.device_slots, 3);
    EXPECT_EQ(tiny.host_slots, 7);
    // 64 expert tensors: more than 8 times either tier.
    EXPECT_GE(tiny.expert_tensors, 8u * 7u);
    EXPECT_GT(tiny.ssd_bytes_in, 0u) << "the tiny budgets should have read back through the SSD";
    EXPECT_GT(tiny.device_evictions, 0u);
    EXPECT_GT(tiny.host_evictions, 0u);
    EXPECT_EQ(unlimited.ssd_bytes_in, 0u) << "unlimited budgets should never spill";
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_EQ(0, std::memcmp(&tiny.losses[i], &unlimited.losses[i], sizeof(double)))
          << "step " << i + 1 << ": " << tiny.losses[i] << " vs " << unlimited.losses[i];
    }
    EXPECT_EQ(tiny.evals, unlimited.evals);
    ASSERT_EQ(tiny.dense.size(), unlimited.dense.size());
    for (size_t i = 0; i < tiny.dense.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(tiny.dense[i].data(), unlimited.dense[i].data(),
                               tiny.dense[i].size() * sizeof(float)))
          << "dense parameter " << i;
    }
    EXPECT_LT(tiny.losses.back(), tiny.losses.front());
  }
}

TEST_F(TieredTrainingGpuTest, MatchesInMemoryGpuTrainingClosely) {
  const std::string data = dir_.File("text.txt");
  config::JobConfig in_memory = GpuTieredJob(data, 0, 0);
  in_memory.mutable_storage()->set_mode(config::StorageConfig::IN_MEMORY);
  const GpuRun memory = Train(in_memory);
  const GpuRun tiered = Train(GpuTieredJob(data, 0, 0));
  ASSERT_EQ(memory.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(tiered.losses.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_NEAR(tiered.losses[i], memory.losses[i], 2e-4 * memory.losses[i]) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace strata::train
