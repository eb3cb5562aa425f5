// The tiered scheduler's store handed from one scheduler to another over a shifted range of
// experts, as an elastic re-form does: values written with WriteExpert (whole and in ranges) come
// back bitwise through budgets of a few slots (so they travel through the SSD tier); after the
// hand-over the experts both ranges hold keep their values, an expert new to the range reads as a
// fresh scheduler (and a model owning its parameters) initialises it, and the dropped experts'
// slots and SSD extents are freed except a version a checkpoint still references.
#include "scheduler/tiered_scheduler.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "proto/config_io.h"
#include "tests/test_util.h"

namespace strata::scheduler {
namespace {

using storage::TensorKey;
using storage::TensorKind;
using strata::testing::TempDir;

constexpr uint64_t kSeed = 5;
constexpr uint64_t kSlot = 4096;  // the store's slots: tensors rounded up to 4 KiB
constexpr TensorKind kState[] = {TensorKind::kWeights, TensorKind::kAdamM, TensorKind::kAdamV};

config::JobConfig Job(int d_expert = 6) {
  config::JobConfig job;
  config::ModelConfig& m = *job.mutable_model();
  m.set_vocab_size(17);
  m.set_seq_len(6);
  m.set_d_model(8);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_d_ff(12);
  m.set_moe_every(1);
  m.mutable_moe()->set_num_experts(8);
  m.mutable_moe()->set_top_k(2);
  m.mutable_moe()->set_d_expert(d_expert);
  m.set_init_std(0.3f);
  config::StorageConfig& st = *job.mutable_storage();
  st.set_mode(config::StorageConfig::TIERED);
  st.set_host_budget_bytes(7 * kSlot);  // the least one compute thread needs
  st.set_io_block_bytes(8192);
  config::Normalize(&job);
  return job;
}

// A value of float i of a tensor of (MoE layer, global expert, kind): exact in a float.
float Value(int li, int64_t e, TensorKind kind, int64_t i) {
  return static_cast<float>(((li * 8 + e) * 4 + static_cast<int>(kind)) * 1000 + i);
}
std::vector<float> Values(int li, int64_t e, TensorKind kind, uint64_t n) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = Value(li, e, kind, static_cast<int64_t>(i));
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A worker's model over experts [first, first + count) and the scheduler over it.
struct Worker {
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<TieredExpertScheduler> scheduler;

  std::vector<float> Read(int li, int e, TensorKind kind) {
    std::vector<float> out(scheduler->expert_floats());
    const Status s = scheduler->ReadExpert(li, e, kind, out.data());
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
};

class TieredSchedulerTest : public ::testing::Test {
 protected:
  StatusOr<Worker> Make(const config::JobConfig& job, int64_t first, int64_t count,
                        const std::string& ssd_dir,
                        std::unique_ptr<storage::TieredExpertStore> store = nullptr) {
    Worker w;
    model::ModelOptions mo;
    mo.config = job.model();
    mo.seed = kSeed;
    mo.unbound_experts = true;
    mo.first_local_expert = first;
    mo.num_local_experts = count;
    ASSIGN_OR_RETURN(w.model, model::MoeTransformer::Create(ctx_, mo));
    TieredOptions to;
    to.storage = job.storage();
    to.ssd_dir = ssd_dir;
    to.seed = kSeed;
    to.threads = 1;
    to.device_budget = &device_budget_;
    to.device_slot_bytes = 3 * kSlot;  // the least one compute thread needs
    to.host_budget = &host_budget_;
    ASSIGN_OR_RETURN(w.scheduler, TieredExpertScheduler::Create(*w.model, to, std::move(store)));
    w.model->AttachResidency(w.scheduler.get());
    return w;
  }

  ThreadPool pool_{1};
  ops::Context ctx_{&pool_};
  TempDir dir_, fresh_dir_;
  // Borrowed by the stores: they outlive every worker of a test.
  MemoryBudget device_budget_{"device"}, host_budget_{"host"};
};

TEST_F(TieredSchedulerTest, AStoreHandedToAShiftedRangeKeepsWhatBothHold) {
  const config::JobConfig job = Job();
  // Worker A holds experts [0, 5), B (after the hand-over) [3, 8): 3 and 4 are in both, 0-2 are
  // dropped, 5-7 are new.
  StatusOr<Worker> a = Make(job, 0, 5, dir_.path());
  ASSERT_TRUE(a.ok()) << a.status();
  TieredExpertScheduler& sa = *a->scheduler;
  const uint64_t S = sa.expert_floats();
  const int L = sa.moe_layers();
  ASSERT_EQ(L, 2);
  // Every tensor of A's experts: 30 of them through 7 host slots, the dropped experts last so
  // that some of theirs are resident on the host when the store is handed on.
  for (int e = 4; e >= 0; --e) {
    for (int li = 0; li < L; ++li) {
      for (TensorKind k : kState) {
        ASSERT_TRUE(sa.WriteExpert(li, e, k, Values(li, e, k, S).data()).ok());
      }
    }
  }
  // A range of a kept expert's tensor, and a gradient (a step cut short leaves them).
  std::vector<float> patched = Values(0, 3, TensorKind::kWeights, S);
  const std::vector<float> patch = {-1.5f, -2.5f, -3.5f, -4.5f};
  std::copy(patch.begin(), patch.end(), patched.begin() + 5);
  ASSERT_TRUE(sa.WriteExpertRange(0, 3, TensorKind::kWeights, 5, 4, patch.data()).ok());
  ASSERT_TRUE(
      sa.WriteExpert(0, 3, TensorKind::kGrad, Values(0, 3, TensorKind::kGrad, S).data()).ok());
  EXPECT_GT(sa.store().TakeStats().ssd.bytes_in, 0u) << "the values must have reached the SSD";
  // Everything back, bitwise (kept experts first, dropped last).
  for (int e : {3, 4, 0, 1, 2}) {
    for (int li = 0; li < L; ++li) {
      for (TensorKind k : kState) {
        const bool is_patched = e == 3 && li == 0 && k == TensorKind::kWeights;
        EXPECT_TRUE(SameBits(a->Read(li, e, k), is_patched ? patched : Values(li, e, k, S)))
            << "layer " << li << " expert " << e << " " << storage::KindName(k);
      }
    }
  }
  std::vector<float> part(4);
  ASSERT_TRUE(sa.ReadExpertRange(0, 3, TensorKind::kWeights, 5, 4, part.data()).ok());
  EXPECT_TRUE(SameBits(part, patch));
  EXPECT_EQ(sa.ReadExpert(0, 5, TensorKind::kWeights, part.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sa.WriteExpertRange(0, 0, TensorKind::kWeights, S - 2, 4, patch.data()).code(),
            absl::StatusCode::kInvalidArgument);

  // A checkpoint's reference on one dropped tensor's SSD version; the other dropped tensors'
  // extents (the gradient's too) are what the hand-over must free.
  storage::TieredExpertStore& store_a = sa.store();
  std::vector<TensorKey> dropped = {sa.Key(0, 3, TensorKind::kGrad)};
  for (int e = 0; e < 3; ++e) {
    for (int li = 0; li < L; ++li) {
      for (TensorKind k : kState) dropped.push_back(sa.Key(li, e, k));
    }
  }
  uint64_t freed = 0;
  std::optional<std::pair<TensorKey, storage::TieredExpertStore::Snapshot>> held;
  std::vector<float> copy(S);
  for (const TensorKey& key : dropped) {
    storage::TieredExpertStore::Snapshot snap;
    ASSERT_TRUE(store_a.SnapshotTensor(key, copy.data(), &snap).ok());
    if (!snap.has_stored) continue;
    if (!held && key.kind != TensorKind::kGrad) {
      held.emplace(key, snap);
      continue;
    }
    freed += snap.stored.extent.length;
    store_a.UnrefVersion(key, snap.version);
  }
  ASSERT_TRUE(held.has_value()) << "no dropped tensor reached the SSD tier";
  ASSERT_GT(freed, 0u);
  const uint64_t ssd_before = store_a.ssd().used_bytes();
  const uint64_t host_before = store_a.TakeStats().host.used_bytes;

  std::unique_ptr<storage::TieredExpertStore> store = sa.ReleaseStore();
  ASSERT_TRUE(store);
  a->scheduler.reset();
  a->model.reset();
  StatusOr<Worker> b = Make(job, 3, 5, fresh_dir_.path() + "/unused", std::move(store));
  ASSERT_TRUE(b.ok()) << b.status();
  TieredExpertScheduler& sb = *b->scheduler;
  storage::TieredExpertStore& store_b = sb.store();
  EXPECT_EQ(sb.first_expert(), 3);
  // The dropped experts' extents are free, but for the referenced one, which stays readable; and
  // their host slots are free.
  EXPECT_EQ(store_b.ssd().used_bytes(), ssd_before - freed);
  EXPECT_LT(store_b.TakeStats().host.used_bytes, host_before);
  const storage::StoredExtent& hs = held->second.stored;
  std::unique_ptr<float, decltype(&std::free)> buf(
      static_cast<float*>(std::aligned_alloc(kSlot, hs.extent.length)), &std::free);
  const Status read = store_b.ssd().Read(hs, buf.get(), "the referenced version");
  ASSERT_TRUE(read.ok()) << read;
  const TensorKey hk = held->first;
  EXPECT_TRUE(SameBits(std::vector<float>(buf.get(), buf.get() + S),
                       Values(hk.layer == sb.block_of(0) ? 0 : 1, hk.expert, hk.kind, S)));
  store_b.UnrefVersion(hk, held->second.version);
  EXPECT_EQ(store_b.ssd().used_bytes(), ssd_before - freed - held->second.stored.extent.length);
  // The gradient went with the old scheduler.
  EXPECT_FALSE(store_b.Materialized(sb.Key(0, 0, TensorKind::kGrad)));

  // Experts 3 and 4 (local 0 and 1 now) as written.
  for (int e = 3; e <= 4; ++e) {
    for (int li = 0; li < L; ++li) {
      for (TensorKind k : kState) {
        const bool is_patched = e == 3 && li == 0 && k == TensorKind::kWeights;
        EXPECT_TRUE(SameBits(b->Read(li, e - 3, k), is_patched ? patched : Values(li, e, k, S)))
            << "layer " << li << " expert " << e << " " << storage::KindName(k);
      }
    }
  }
  // Experts 5-7 as a fresh scheduler over the same range has them, and (weights) as a model that
  // owns its experts initialises them.
  StatusOr<Worker> fresh = Make(job, 3, 5, fresh_dir_.path());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  model::ModelOptions owned;
  owned.config = job.model();
  owned.seed = kSeed;
  StatusOr<std::unique_ptr<model::MoeTransformer>> full =
      model::MoeTransformer::Create(ctx_, owned);
  ASSERT_TRUE(full.ok()) << full.status();
  for (int e = 5; e <= 7; ++e) {
    for (int li = 0; li < L; ++li) {
      for (TensorKind k : kState) {
        EXPECT_TRUE(SameBits(b->Read(li, e - 3, k), fresh->Read(li, e - 3, k)))
            << "layer " << li << " expert " << e << " " << storage::KindName(k);
      }
      std::vector<float> init(S);
      const std::vector<model::Parameter*> ps =
          (*full)->moe_layers()[li].layer->expert(e).Parameters();
      for (size_t i = 0; i < ps.size(); ++i) {
        std::memcpy(init.data() + sb.layout().segments[i].offset, ps[i]->value.f32(),
                    ps[i]->value.numel() * sizeof(float));
      }
      EXPECT_TRUE(SameBits(b->Read(li, e - 3, TensorKind::kWeights), init))
          << "layer " << li << " expert " << e;
    }
  }
  // A range written into a new expert: the rest keeps its initial value.
  ASSERT_TRUE(sb.WriteExpertRange(1, 4, TensorKind::kWeights, 2, 4, patch.data()).ok());
  std::vector<float> want = fresh->Read(1, 4, TensorKind::kWeights);
  std::copy(patch.begin(), patch.end(), want.begin() + 2);
  EXPECT_TRUE(SameBits(b->Read(1, 4, TensorKind::kWeights), want));

  // A store goes only to a model whose experts have its tensors' size.
  store = sb.ReleaseStore();
  b->scheduler.reset();
  StatusOr<Worker> other = Make(Job(/*d_expert=*/7), 3, 5, "", std::move(store));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_NE(other.status().message().find("same configuration"), std::string::npos)
      << other.status();
}

}  // namespace
}  // namespace strata::scheduler
