// Training with experts in the tiered store: budgets far below the experts' state give losses
// bitwise identical to unlimited budgets; the budgets hold; LAZY updates fewer experts; shared
// experts stay dense state, out of the store.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiered_job.h"
#include "train/trainer.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;
using strata::testing::WriteFile;

constexpr int kThreads = 2;

config::JobConfig TieredJob(const std::string& data, uint64_t device_budget, uint64_t host_budget) {
  return strata::testing::TieredJob(data, device_budget, host_budget, kThreads);
}

struct RunResult {
  std::vector<double> losses, evals;
  std::vector<std::vector<float>> dense;
  storage::StoreStats totals;
  uint64_t expert_state_bytes = 0, slot_bytes = 0, dense_bytes = 0;
  int device_slots = 0, host_slots = 0;
  uint64_t backward_hinted = 0;  // tensors the scheduler asked for during backward
};

RunResult Train(const config::JobConfig& cfg) {
  RunResult run;
  TrainOptions o;
  o.config = cfg;
  o.progress = false;
  auto t = Trainer::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return run;
  Trainer& tr = **t;
  Status s = tr.Run();
  EXPECT_TRUE(s.ok()) << s;
  for (const auto& r : tr.history()) {
    run.losses.push_back(r.loss);
    auto add = [](storage::TierStats& a, const storage::TierStats& b) {
      a.hits += b.hits;
      a.misses += b.misses;
      a.bytes_in += b.bytes_in;
      a.bytes_out += b.bytes_out;
      a.evictions += b.evictions;
    };
    add(run.totals.device, r.store.device);
    add(run.totals.host, r.store.host);
    add(run.totals.ssd, r.store.ssd);
  }
  for (const auto& e : tr.evals()) run.evals.push_back(e.second.loss);
  for (model::Parameter* p : tr.model().DenseParameters()) {
    run.dense.emplace_back(p->value.f32(), p->value.f32() + p->value.numel());
  }
  auto* sch = tr.tiered();
  run.slot_bytes = (sch->expert_floats() * 4 + 4095) / 4096 * 4096;
  run.expert_state_bytes = 4 * sch->expert_floats() * 4 * 2 * 8;  // 4 kinds, 2 layers, 8 experts
  run.dense_bytes = model::CountScalars(tr.model().DenseParameters()) * 4 * 4;
  run.device_slots = sch->store().device_slots();
  run.host_slots = sch->store().host_slots();
  run.backward_hinted = sch->backward_hinted();
  return run;
}

// The losses of `cfg` trained with every expert in memory (no store).
std::vector<double> InMemoryLosses(config::JobConfig cfg) {
  cfg.mutable_storage()->set_mode(config::StorageConfig::IN_MEMORY);
  TrainOptions o;
  o.config = cfg;
  o.progress = false;
  auto t = Trainer::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return {};
  Status s = (*t)->Run();
  EXPECT_TRUE(s.ok()) << s;
  std::vector<double> losses;
  for (const auto& r : (*t)->history()) losses.push_back(r.loss);
  return losses;
}

class TieredTrainingTest : public ::testing::Test {
 protected:
  void SetUp() override { WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(40000)); }
  TempDir dir_;
};

TEST_F(TieredTrainingTest, TinyBudgetsGiveBitwiseIdenticalLosses) {
  const std::string data = dir_.File("text.txt");
  const RunResult unlimited = Train(TieredJob(data, 0, 0));
  ASSERT_EQ(unlimited.losses.size(), 12u);
  // The smallest budgets the store accepts for 2 threads: 5 device slots, 11 host slots.
  const uint64_t slot = unlimited.slot_bytes;
  const uint64_t device = unlimited.dense_bytes + 5 * slot;
  const uint64_t host = 11 * slot;
  const RunResult tiny = Train(TieredJob(data, device, host));
  ASSERT_EQ(tiny.losses.size(), 12u);
  EXPECT_EQ(tiny.device_slots, 5);
  EXPECT_EQ(tiny.host_slots, 11);
  // The experts' state is far larger than either tier.
  EXPECT_GE(tiny.expert_state_bytes, 8 * (device - unlimited.dense_bytes));
  EXPECT_GE(tiny.expert_state_bytes, 2 * host);
  // It really went through the SSD tier.
  EXPECT_GT(tiny.totals.ssd.bytes_in, 0u);
  EXPECT_GT(tiny.totals.ssd.bytes_out, 0u);
  EXPECT_GT(tiny.totals.host.evictions, 0u);
  EXPECT_GT(tiny.totals.device.evictions, 0u);
  EXPECT_EQ(unlimited.totals.ssd.bytes_in, 0u) << "unlimited budgets should never spill";
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(0, std::memcmp(&tiny.losses[i], &unlimited.losses[i], sizeof(double)))
        << "step " << i + 1 << ": " << tiny.losses[i] << " vs " << unlimited.losses[i];
  }
  ASSERT_EQ(tiny.evals.size(), unlimited.evals.size());
  for (size_t i = 0; i < tiny.evals.size(); ++i) EXPECT_EQ(tiny.evals[i], unlimited.evals[i]);
  for (size_t i = 0; i < tiny.dense.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(tiny.dense[i].data(), unlimited.dense[i].data(),
                             tiny.dense[i].size() * sizeof(float)));
  }
  EXPECT_LT(tiny.losses.back(), tiny.losses.front());

  // The experts' optimizer step overlapped with the next forward (the default) and done before
  // it give the same bits: no forward reads an expert before its update is complete.
  // The serial run also uses one ssd stage thread instead of the default 4 (and the tiny host
  // tier has fewer free slots than the default's threads, so they queue for slots): how many
  // transfers are in flight changes timing and eviction, never values.
  config::JobConfig serial = TieredJob(data, device, host);
  serial.mutable_storage()->set_overlap_optimizer(false);
  serial.mutable_storage()->set_ssd_threads(1);
  const RunResult in_order = Train(serial);
  ASSERT_EQ(in_order.losses.size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(0, std::memcmp(&in_order.losses[i], &tiny.losses[i], sizeof(double)))
        << "step " << i + 1 << ": " << in_order.losses[i] << " vs " << tiny.losses[i];
  }
  EXPECT_EQ(in_order.evals, tiny.evals);
}

TEST_F(TieredTrainingTest, PrefetchDuringBackwardKeepsTheBits) {
  // With 2 compute and 2 ssd threads, a host tier of 40 slots leaves room for
  // (40 / 2 - 4 x 2 - 3 - 2) / 3 = 2 experts ahead (storage.backward_prefetch's rule): ask for 2,
  // against 0 (off). The 64 expert tensors do not fit in those 40 slots.
  const std::string data = dir_.File("text.txt");
  const RunResult unlimited = Train(TieredJob(data, 0, 0));
  ASSERT_EQ(unlimited.losses.size(), 12u);
  const uint64_t slot = unlimited.slot_bytes;
  auto job = [&](int backward_prefetch, config::StorageConfig::ExpertUpdate update) {
    config::JobConfig c = TieredJob(data, unlimited.dense_bytes + 8 * slot, 40 * slot);
    c.mutable_storage()->set_ssd_threads(2);
    c.mutable_storage()->set_backward_prefetch(backward_prefetch);
    c.mutable_storage()->set_expert_update(update);
    return c;
  };
  for (auto update : {config::StorageConfig::DENSE, config::StorageConfig::LAZY}) {
    SCOPED_TRACE(update == config::StorageConfig::DENSE ? "DENSE" : "LAZY");
    const RunResult off = Train(job(0, update));
    const RunResult on = Train(job(2, update));
    ASSERT_EQ(off.losses.size(), 12u);
    ASSERT_EQ(on.losses.size(), 12u);
    EXPECT_EQ(on.host_slots, 40);
    // The state (64 tensors) is larger than the host tier (40): it went through the SSD tier.
    EXPECT_GT(on.totals.host.evictions, 0u);
    EXPECT_GT(on.totals.ssd.bytes_out, 0u);
    for (size_t i = 0; i < 12; ++i) {
      EXPECT_EQ(0, std::memcmp(&on.losses[i], &off.losses[i], sizeof(double)))
          << "step " << i + 1 << ": " << on.losses[i] << " vs " << off.losses[i];
      if (update == config::StorageConfig::DENSE) {
        EXPECT_EQ(0, std::memcmp(&on.losses[i], &unlimited.losses[i], sizeof(double)))
            << "step " << i + 1;
      }
    }
    EXPECT_EQ(on.evals, off.evals);
    // The hint fetched state during backward (what it saves in time is bench_out_of_core's to
    // show; here it must change nothing but timing).
    EXPECT_GT(on.backward_hinted, 0u);
    EXPECT_EQ(off.backward_hinted, 0u);
  }
}

TEST_F(TieredTrainingTest, MatchesInMemoryTrainingClosely) {
  // In memory, experts run with split GEMMs and the gradient norm is summed in another order, so
  // only rounding may differ.
  const std::string data = dir_.File("text.txt");
  const std::vector<double> in_memory = InMemoryLosses(TieredJob(data, 0, 0));
  ASSERT_EQ(in_memory.size(), 12u);
  const RunResult tiered = Train(TieredJob(data, 0, 0));
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_NEAR(tiered.losses[i], in_memory[i], 2e-4 * tiered.losses[i]) << i;
  }
}

TEST_F(TieredTrainingTest, SharedExpertsStayDenseAndTrainAsInMemory) {
  // Shared experts are dense parameters: the model keeps them and its AdamW updates them; the
  // store holds only the routed experts. 2 shared experts of width 32 make one FFN of width 64
  // per MoE block: 64*32 + 64 + 32*64 + 32 = 4192 parameters, twice.
  const std::string data = dir_.File("text.txt");
  auto with_shared = [](config::JobConfig c) {
    c.mutable_model()->mutable_moe()->set_num_shared_experts(2);
    c.mutable_model()->mutable_moe()->set_shared_d_expert(32);
    return c;
  };
  const RunResult plain = Train(TieredJob(data, 0, 0));
  const RunResult unlimited = Train(with_shared(TieredJob(data, 0, 0)));
  ASSERT_EQ(unlimited.losses.size(), 12u);
  EXPECT_EQ(unlimited.dense_bytes, plain.dense_bytes + 2 * 4192 * 16);
  EXPECT_EQ(unlimited.expert_state_bytes, plain.expert_state_bytes);
  // The smallest budgets, as above: bitwise the same training through the SSD tier.
  const uint64_t slot = unlimited.slot_bytes;
  const RunResult tiny =
      Train(with_shared(TieredJob(data, unlimited.dense_bytes + 5 * slot, 11 * slot)));
  ASSERT_EQ(tiny.losses.size(), 12u);
  EXPECT_GT(tiny.totals.ssd.bytes_out, 0u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(0, std::memcmp(&tiny.losses[i], &unlimited.losses[i], sizeof(double)))
        << "step " << i + 1 << ": " << tiny.losses[i] << " vs " << unlimited.losses[i];
  }
  // In memory, where one AdamW updates every parameter: only rounding differs (see above).
  const std::vector<double> in_memory = InMemoryLosses(with_shared(TieredJob(data, 0, 0)));
  ASSERT_EQ(in_memory.size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_NEAR(tiny.losses[i], in_memory[i], 2e-4 * tiny.losses[i]) << i;
  }
}

TEST_F(TieredTrainingTest, LazyUpdatesOnlyExpertsWithGradients) {
  // 16 tokens a step, top-1 of 8 experts: most steps leave some expert without a token.
  config::JobConfig dense = TieredJob(dir_.File("text.txt"), 0, 0);
  dense.mutable_train()->set_global_batch(1);
  dense.mutable_model()->mutable_moe()->set_top_k(1);
  config::JobConfig lazy = dense;
  lazy.mutable_storage()->set_expert_update(config::StorageConfig::LAZY);
  const RunResult d = Train(dense), l = Train(lazy);
  ASSERT_EQ(d.losses.size(), 12u);
  ASSERT_EQ(l.losses.size(), 12u);
  EXPECT_EQ(d.losses[0], l.losses[0]) << "the first step's loss precedes any update";
  EXPECT_NE(d.losses, l.losses) << "skipping experts without tokens must change training";
  // DENSE fetches weights, m and v of all 16 experts every step; LAZY only of those with tokens.
  const uint64_t dense_host = d.totals.host.hits + d.totals.host.misses;
  const uint64_t lazy_host = l.totals.host.hits + l.totals.host.misses;
  EXPECT_LT(lazy_host, dense_host);
}

TEST_F(TieredTrainingTest, AGpuConfigOnAMachineWithoutOneIsAClearError) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU: tiered_training_gpu_test";
  config::JobConfig cfg = TieredJob(dir_.File("text.txt"), 0, 0);
  cfg.mutable_train()->set_device("cuda:0");
  TrainOptions o;
  o.config = cfg;
  o.progress = false;
  auto t = Trainer::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_NE(t.status().message().find("model on cuda:0"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("train on the CPU device or on a machine with an NVIDIA GPU"),
            std::string::npos)
      << t.status();
}

TEST_F(TieredTrainingTest, BudgetTooSmallForDenseStateIsAClearError) {
  TrainOptions o;
  o.config = TieredJob(dir_.File("text.txt"), 4096, 0);
  auto t = Trainer::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("storage.device_budget_bytes"), std::string::npos)
      << t.status();
  EXPECT_NE(t.status().message().find("dense parameters"), std::string::npos) << t.status();
}

}  // namespace
}  // namespace strata::train
