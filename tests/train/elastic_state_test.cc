// The elastic unit (train/elastic/elastic_state.h) in one process, over a host that is a real model
// and optimizer and, for several workers, threads with real Gloo communicators: the layout facts,
// the rollback copy and the state a generation goes on from, bitwise against blobs read straight
// out of the model, buddy copies that rebuild a lost worker's experts, and a placement from the
// measured loads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "core/common/thread_pool.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"
#include "tests/train/gloo_workers.h"
#include "tests/train/tiny_job.h"
#include "train/elastic/elastic_state.h"

namespace strata::train {
namespace {

constexpr int64_t kExperts = 4;  // TinyMoeJob's

// A worker's model and optimizer, as the trainer would hold them, seen through ElasticHost.
class FakeHost final : public ElasticHost {
 public:
  FakeHost(const config::JobConfig& cfg, int rank, std::vector<int64_t> counts,
           comm::Communicator* world)
      : rank_(rank), counts_(std::move(counts)), world_(world), pool_(1) {
    ctx_.pool = &pool_;
    for (int r = 0; r < rank; ++r) first_ += counts_[r];
    count_ = counts_[rank];
    model::ModelOptions mo;
    mo.config = cfg.model();
    mo.seed = cfg.seed();
    mo.max_batch = 1;
    mo.first_local_expert = first_;
    mo.num_local_experts = count_;
    auto m = model::MoeTransformer::Create(ctx_, mo);
    EXPECT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    optimizer_ = std::make_unique<model::AdamW>(model_->Parameters(), model::AdamWOptions());
  }

  // One AdamW step with gradients that depend on `salt` (values and both moments change), the
  // state after step `step_ + 1`.
  void Update(int salt) {
    int k = 0;
    for (model::Parameter* p : optimizer_->params()) {
      float* g = p->grad.f32();
      for (int64_t i = 0; i < p->grad.numel(); ++i) {
        g[i] = 0.01f * static_cast<float>((k++ * 7 + salt) % 13 - 6);
      }
    }
    optimizer_->Step(ctx_, 1e-2, 1.0);
    ++step_;
  }

  // Blobs read straight out of the model: each parameter's value, first and second moment.
  std::vector<float> DenseBlob() const { return BlobOf(model_->DenseParameters()); }
  std::vector<float> ExpertBlob(int64_t e) const {
    std::vector<float> out;
    for (const auto& ref : model_->moe_layers()) {
      const std::vector<float> b = BlobOf(ref.layer->expert(e).Parameters());
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(counts_.size()); }
  ops::Context& context() override { return ctx_; }
  int64_t step() const override { return step_; }
  model::MoeTransformer* model() const override { return model_.get(); }
  model::AdamW* optimizer() const override { return optimizer_.get(); }
  scheduler::TieredExpertScheduler* scheduler() const override { return nullptr; }
  comm::Communicator* world() const override { return world_; }
  const std::vector<int64_t>& experts_per_worker() const override { return counts_; }
  int64_t first_expert() const override { return first_; }
  int64_t num_experts() const override { return count_; }
  std::unique_ptr<storage::TieredExpertStore> ReleaseStore() override { return nullptr; }
  StatusOr<StoreMover> MakeStoreMover(std::unique_ptr<storage::TieredExpertStore>) override {
    return absl::UnimplementedError("in memory: no store to move");
  }

  // A generation of one worker holding every expert (the survivor of a failure).
  void AloneWithEveryExpert() {
    counts_ = {kExperts};
    rank_ = 0;
    world_ = nullptr;
  }

 private:
  std::vector<float> BlobOf(const std::vector<model::Parameter*>& ps) const {
    std::vector<float> out;
    const auto& all = optimizer_->params();
    for (const model::Parameter* p : ps) {
      const size_t i = static_cast<size_t>(std::find(all.begin(), all.end(), p) - all.begin());
      EXPECT_LT(i, all.size()) << p->name;
      for (const Tensor* t :
           {&p->value, &optimizer_->first_moment(i), &optimizer_->second_moment(i)}) {
        out.insert(out.end(), t->f32(), t->f32() + t->numel());
      }
    }
    return out;
  }

  int rank_;
  std::vector<int64_t> counts_;
  comm::Communicator* world_;
  ThreadPool pool_;
  ops::Context ctx_;
  int64_t first_ = 0, count_ = 0;
  int64_t step_ = 0;
  std::unique_ptr<model::MoeTransformer> model_;
  std::unique_ptr<model::AdamW> optimizer_;
};

config::JobConfig Job(const std::string& sections) {
  return strata::testing::TinyMoeJob("unused.bin", sections);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ElasticLayoutTest, CopiesCheckpointsAndGroupSizesFollowTheConfig) {
  EXPECT_TRUE(KeepsCopies(Job("")));
  EXPECT_TRUE(MovesLiveState(Job("")));
  EXPECT_FALSE(KeepsCopies(Job("parallel { expert_parallel: 2 }")));
  EXPECT_FALSE(KeepsCopies(Job("storage { mode: TIERED } elastic { replicas: 0 }")));
  EXPECT_TRUE(KeepsCopies(Job("storage { mode: TIERED } elastic { replicas: 1 }")));
  EXPECT_FALSE(MovesLiveState(Job("parallel { expert_parallel: 2 experts_per_worker: [1, 3] }")));

  EXPECT_TRUE(CheckElastic(Job("")).ok());
  const Status refused = CheckElastic(Job("parallel { expert_parallel: 2 }"));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("parallel.expert_parallel: 2"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("checkpoint.dir"), std::string::npos) << refused;
  EXPECT_TRUE(
      CheckElastic(Job("parallel { expert_parallel: 2 } checkpoint { dir: \"/c\" every: 5 }"))
          .ok());

  config::ParallelConfig par;
  EXPECT_EQ(*GroupSize(par, 5, false), 5);  // 0: every worker
  par.set_expert_parallel(2);
  EXPECT_EQ(*GroupSize(par, 6, false), 2);
  EXPECT_EQ(*GroupSize(par, 1, false), 1);
  EXPECT_EQ(GroupSize(par, 5, false).status().code(), absl::StatusCode::kInvalidArgument);
  // An elastic generation of 5 takes the smallest larger divisor; 3 of 9 stays 3.
  EXPECT_EQ(*GroupSize(par, 5, true), 5);
  par.set_expert_parallel(3);
  EXPECT_EQ(*GroupSize(par, 8, true), 4);
  EXPECT_EQ(*GroupSize(par, 9, true), 3);
}

TEST(ElasticStateTest, TheRollbackCopyIsTheStateBeforeTheUpdateAndTheGenerationGoesOnFromIt) {
  const config::JobConfig cfg = Job("");
  FakeHost host(cfg, 0, {kExperts}, nullptr);
  ElasticState state(cfg, &host);
  ElasticKeeping keeping(&state, {.copies = true, .loads = false});
  host.Update(1);
  state.SetLive(1);
  const std::vector<float> dense1 = host.DenseBlob(), expert2 = host.ExpertBlob(2);

  // Step 2: the copy before the update, then the update.
  ASSERT_TRUE(keeping.BeforeUpdate().ok());
  host.Update(2);
  keeping.Updated(2, true);
  ASSERT_TRUE(keeping.AfterUpdate({}).ok());
  ASSERT_FALSE(SameBits(host.DenseBlob(), dense1));
  ASSERT_FALSE(SameBits(host.ExpertBlob(2), expert2));

  const Holdings mine = state.HoldingsOfThisWorker();
  EXPECT_EQ(mine.version(0, kDenseItem, HoldingSlot::kLive), 2);
  EXPECT_EQ(mine.version(0, kDenseItem, HoldingSlot::kRollback), 1);
  EXPECT_EQ(mine.version(0, ExpertItem(3), HoldingSlot::kRollback), 1);
  std::vector<float> read(dense1.size());
  state.ReadHeldItem(kDenseItem, 1, mine, read.data());
  EXPECT_TRUE(SameBits(read, dense1));
  read.resize(expert2.size());
  state.ReadHeldItem(ExpertItem(2), 1, mine, read.data());
  EXPECT_TRUE(SameBits(read, expert2));
  state.ReadHeldItem(ExpertItem(2), 2, mine, read.data());
  EXPECT_TRUE(SameBits(read, host.ExpertBlob(2)));

  // The live state goes with a failed re-form: the generation agrees on the copy of step 1.
  state.HoldNothing();
  StatusOr<SyncedState> synced = state.SyncState();
  ASSERT_TRUE(synced.ok()) << synced.status();
  EXPECT_FALSE(synced->from_checkpoint);
  EXPECT_EQ(synced->step, 1);
  EXPECT_EQ(synced->counts, (std::vector<int64_t>{kExperts}));
  EXPECT_TRUE(SameBits(synced->dense, dense1));
  ASSERT_EQ(synced->experts.size(), kExperts * expert2.size());
  EXPECT_TRUE(SameBits(
      {synced->experts.begin() + 2 * expert2.size(), synced->experts.begin() + 3 * expert2.size()},
      expert2));

  // A model built afresh takes it bitwise, moments and step count included; the generation starts
  // from step 1, with no copy of a later step.
  FakeHost fresh(cfg, 0, {kExperts}, nullptr);
  ElasticState next(cfg, &fresh);
  ASSERT_TRUE(next.ImportState(*synced).ok());
  EXPECT_TRUE(SameBits(fresh.DenseBlob(), dense1));
  EXPECT_TRUE(SameBits(fresh.ExpertBlob(2), expert2));
  EXPECT_EQ(fresh.optimizer()->steps(), 1);
  ASSERT_TRUE(next.StartGeneration(1).ok());
  const Holdings started = next.HoldingsOfThisWorker();
  EXPECT_EQ(started.version(0, kDenseItem, HoldingSlot::kLive), 1);
  EXPECT_EQ(started.version(0, kDenseItem, HoldingSlot::kRollback), -1);

  // An IN_MEMORY worker's rollback copy was of its old range: it goes when a generation starts,
  // even at the copy's own step.
  ASSERT_TRUE(state.StartGeneration(1).ok());
  EXPECT_EQ(state.HoldingsOfThisWorker().version(0, kDenseItem, HoldingSlot::kRollback), -1);

  // State for another model is refused, not copied.
  synced->dense.pop_back();
  EXPECT_EQ(next.ImportState(*synced).code(), absl::StatusCode::kInternal);
}

TEST(ElasticStateTest, ASurvivorRebuildsTheLostWorkersExpertsFromItsBuddyCopies) {
  const config::JobConfig cfg = Job("elastic { replicas: 1 }");
  std::vector<float> lost_experts[2];  // worker 1's experts 2 and 3 after its update
  std::vector<float> survivor_dense;
  SyncedState synced;
  Status sync_status = absl::UnknownError("not run");
  strata::testing::RunGlooWorkers(
      2, std::chrono::seconds(30), [&](comm::Communicator* comm, int rank) {
        FakeHost host(cfg, rank, {2, 2}, comm);
        ElasticState state(cfg, &host);
        ElasticKeeping keeping(&state, {.copies = true, .loads = true});
        ASSERT_TRUE(keeping.BeforeUpdate().ok());
        host.Update(10 + rank);
        keeping.Updated(1, true);
        ASSERT_TRUE(keeping.AfterUpdate({}).ok());  // the buddy copies, by one all-to-all
        if (rank == 1) {
          lost_experts[0] = host.ExpertBlob(2);
          lost_experts[1] = host.ExpertBlob(3);
          return;  // worker 1 is gone
        }
        const Holdings held = state.HoldingsOfThisWorker();
        EXPECT_EQ(held.version(0, ExpertItem(2), HoldingSlot::kBuddyLatest), 1);
        EXPECT_EQ(held.version(0, ExpertItem(0), HoldingSlot::kBuddyLatest), -1);
        // Worker 0 goes on alone.
        host.AloneWithEveryExpert();
        survivor_dense = host.DenseBlob();
        StatusOr<SyncedState> s = state.SyncState();
        sync_status = s.status();
        if (s.ok()) synced = std::move(*s);
      });
  ASSERT_TRUE(sync_status.ok()) << sync_status;
  EXPECT_EQ(synced.step, 1);
  EXPECT_EQ(synced.counts, (std::vector<int64_t>{kExperts}));
  EXPECT_TRUE(SameBits(synced.dense, survivor_dense));
  const size_t S = lost_experts[0].size();
  ASSERT_EQ(synced.experts.size(), kExperts * S);
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(
        SameBits({synced.experts.begin() + (2 + k) * S, synced.experts.begin() + (3 + k) * S},
                 lost_experts[k]))
        << "expert " << 2 + k;
  }
}

TEST(ElasticStateTest, AGenerationThatGoesBackToACheckpointIsPlacedByRankZerosMeasuredLoads) {
  config::JobConfig cfg = Job("checkpoint { dir: \"/c\" every: 5 }");
  cfg.mutable_model()->mutable_moe()->set_num_experts(7);
  std::vector<int64_t> counts[3];
  strata::testing::RunGlooWorkers(
      3, std::chrono::seconds(30), [&](comm::Communicator* comm, int rank) {
        FakeHost host(cfg, rank, {3, 2, 2}, comm);
        ElasticState state(cfg, &host);
        ElasticKeeping keeping(&state, {.copies = false, .loads = true});
        // Rank 0 measured the last two experts twenty times as busy as each other one; the others'
        // figures differ, and only rank 0's count.
        model::MoeStats stats;
        stats.load = rank == 0 ? std::vector<int64_t>{1, 1, 1, 1, 1, 20, 20}
                               : std::vector<int64_t>{20, 20, 1, 1, 1, 1, 1};
        ASSERT_TRUE(keeping.AfterUpdate({stats}).ok());
        StatusOr<SyncedState> s = state.PlanFromCheckpoint();
        ASSERT_TRUE(s.ok()) << s.status();
        EXPECT_TRUE(s->from_checkpoint);
        counts[rank] = s->counts;
      });
  // Ranges of at most ceil(7 / 3) = 3 experts: {3, 3, 1} carries at most 3, 22 and 20; every
  // other split puts both busy experts in one range (40 or more), and equal loads would give the
  // lexicographically smallest split, {1, 3, 3}.
  EXPECT_EQ(counts[0], (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(counts[1], counts[0]);
  EXPECT_EQ(counts[2], counts[0]);
}

}  // namespace
}  // namespace strata::train
