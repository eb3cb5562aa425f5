// The tiered store with tiny budgets, so every path runs: SSD write-back of dirty evictions,
// reads with CRC checks, generated initial values, device copies, gradient write-backs, LFU with
// decay, concurrent use against a shadow copy, and corruption reported with the tensor's name.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "storage/tiered_store.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

using strata::testing::TempDir;

constexpr uint64_t kFloats = 4096;  // 16 KiB tensors
constexpr uint64_t kBytes = kFloats * 4;

float InitValue(const TensorKey& k, uint64_t i) {
  return static_cast<float>(k.layer * 1000 + k.expert) + static_cast<float>(i) * 1e-3f;
}

class TieredStoreTest : public ::testing::Test {
 protected:
  // Writing back ahead of eviction is off unless asked for: most tests count exact writes.
  std::unique_ptr<TieredExpertStore> Make(int device_slots, int host_slots, int threads = 1,
                                          bool clean_ahead = false) {
    StoreOptions o;
    o.clean_ahead = clean_ahead;
    o.tensor_bytes = kBytes;
    o.device_budget_bytes = device_slots * kBytes;
    o.host_budget_bytes = host_slots * kBytes;
    o.device_budget = &device_budget_;
    o.host_budget = &host_budget_;
    o.ssd.dir = dir_.path();
    o.ssd.file_bytes = 8 << 20;
    o.ssd.grow_bytes = 1 << 20;
    o.io.queue_depth = 8;
    o.io.block_bytes = 8192;
    o.compute_threads = threads;
    o.initializer = [](const TensorKey& k, float* p) {
      for (uint64_t i = 0; i < kFloats; ++i) p[i] = InitValue(k, i);
    };
    auto s = TieredExpertStore::Create(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  TempDir dir_;
  MemoryBudget device_budget_{"device", 64 * kBytes};
  MemoryBudget host_budget_{"host", 64 * kBytes};
};

TEST_F(TieredStoreTest, GeneratedValuesUpdatesAndEvictionsRoundTrip) {
  auto store = Make(/*device=*/3, /*host=*/7, /*threads=*/1, /*clean_ahead=*/true);
  ASSERT_TRUE(store);
  // 12 experts' weights: far more than either tier holds. First read: generated values.
  for (int e = 0; e < 12; ++e) {
    TensorKey k{1, e, TensorKind::kWeights};
    auto p = store->AcquireDevice(k);
    ASSERT_TRUE(p.ok()) << p.status();
    for (uint64_t i = 0; i < kFloats; i += 511) ASSERT_EQ((*p)[i], InitValue(k, i));
    store->ReleaseDevice(k, false);
    auto m = store->AcquireHost(TensorKey{1, e, TensorKind::kAdamM});
    ASSERT_TRUE(m.ok());
    EXPECT_EQ((*m)[7], 0.0f);  // moments start at zero
    store->ReleaseHost(TensorKey{1, e, TensorKind::kAdamM}, false);
  }
  // Update every expert on the host (the optimizer's path); evictions must write them back.
  for (int e = 0; e < 12; ++e) {
    TensorKey k{1, e, TensorKind::kWeights};
    auto p = store->AcquireHost(k);
    ASSERT_TRUE(p.ok()) << p.status();
    for (uint64_t i = 0; i < kFloats; ++i) (*p)[i] = static_cast<float>(e * 7 + i % 13);
    store->ReleaseHost(k, true);
  }
  StoreStats s = store->TakeStats();
  EXPECT_GT(s.host.evictions, 0u);
  EXPECT_GT(s.ssd.bytes_in, 0u) << "dirty evictions must reach the SSD tier";
  // Read them all back through the device tier, in reverse order.
  for (int e = 11; e >= 0; --e) {
    TensorKey k{1, e, TensorKind::kWeights};
    auto p = store->AcquireDevice(k);
    ASSERT_TRUE(p.ok()) << p.status();
    for (uint64_t i = 0; i < kFloats; ++i) ASSERT_EQ((*p)[i], static_cast<float>(e * 7 + i % 13));
    store->ReleaseDevice(k, false);
  }
  s = store->TakeStats();
  EXPECT_GT(s.ssd.bytes_out, 0u);
  EXPECT_LE(s.device.used_bytes, 3 * kBytes);
  EXPECT_LE(s.host.used_bytes, 7 * kBytes);
  EXPECT_LE(device_budget_.peak(), 3 * kBytes) << "the device tier went over its budget";
  EXPECT_LE(host_budget_.peak(), 7 * kBytes) << "the host tier went over its budget";
}

TEST_F(TieredStoreTest, GradientsWriteBackAndDiscard) {
  auto store = Make(3, 7);
  for (int e = 0; e < 6; ++e) {
    TensorKey g{0, e, TensorKind::kGrad};
    auto p = store->AcquireDevice(g, /*zero=*/true);
    ASSERT_TRUE(p.ok());
    for (uint64_t i = 0; i < kFloats; ++i) ASSERT_EQ((*p)[i], 0.0f);
    for (uint64_t i = 0; i < kFloats; ++i) (*p)[i] = static_cast<float>(e + 1);
    store->ReleaseDevice(g, true);
    store->WriteBack(g);
  }
  ASSERT_TRUE(store->DrainWriteBacks().ok());
  for (int e = 0; e < 6; ++e) {
    TensorKey g{0, e, TensorKind::kGrad};
    auto p = store->AcquireHost(g);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)[100], static_cast<float>(e + 1));
    store->ReleaseHost(g, false);
    store->Discard(g);
    auto z = store->AcquireHost(g);
    ASSERT_TRUE(z.ok());
    EXPECT_EQ((*z)[100], 0.0f) << "a discarded gradient reads as zero";
    store->ReleaseHost(g, false);
    store->Discard(g);
  }
}

TEST_F(TieredStoreTest, DiscardUnlessFreesWhatGoesButWhatACheckpointReferences) {
  auto store = Make(3, 7);
  // 10 experts' weights written on the host: most are evicted to the SSD tier.
  for (int e = 0; e < 10; ++e) {
    TensorKey k{0, e, TensorKind::kWeights};
    auto p = store->AcquireHost(k);
    ASSERT_TRUE(p.ok()) << p.status();
    for (uint64_t i = 0; i < kFloats; ++i) (*p)[i] = static_cast<float>(e * 3 + i % 11);
    store->ReleaseHost(k, true);
  }
  // A checkpoint's reference on expert 0's version (it went to the SSD tier first).
  std::vector<float> copy(kFloats);
  TieredExpertStore::Snapshot held;
  ASSERT_TRUE(
      store->SnapshotTensor(TensorKey{0, 0, TensorKind::kWeights}, copy.data(), &held).ok());
  ASSERT_TRUE(held.has_stored);
  store->WaitIdle();
  const uint64_t used = store->ssd().used_bytes();
  const uint64_t host_used = store->TakeStats().host.used_bytes;
  // Experts 0-4 go. The 7 host slots hold 3-9 (equally hot, so 0-2 were evicted, oldest first):
  // the extents of 1 and 2 are freed, and the host slots of 3 and 4; expert 0's extent stays while
  // the checkpoint holds it.
  EXPECT_EQ(store->DiscardUnless([](const TensorKey& k) { return k.expert >= 5; }), 5);
  EXPECT_EQ(used - store->ssd().used_bytes(), 2 * kBytes);
  EXPECT_EQ(host_used - store->TakeStats().host.used_bytes, 2 * kBytes);
  std::unique_ptr<float, decltype(&std::free)> buf(
      static_cast<float*>(std::aligned_alloc(4096, held.stored.extent.length)), &std::free);
  ASSERT_TRUE(store->ssd().Read(held.stored, buf.get(), "held").ok());
  for (uint64_t i = 0; i < kFloats; ++i) ASSERT_EQ(buf.get()[i], static_cast<float>(i % 11));
  store->UnrefVersion(TensorKey{0, 0, TensorKind::kWeights}, held.version);
  EXPECT_EQ(used - store->ssd().used_bytes(), 3 * kBytes);
  // A discarded tensor reads as never written, from the initializer in place now; a kept one keeps
  // its value.
  store->set_initializer([](const TensorKey& k, float* p) {
    for (uint64_t i = 0; i < kFloats; ++i) p[i] = -InitValue(k, i);
  });
  const TensorKey gone{0, 2, TensorKind::kWeights}, kept{0, 7, TensorKind::kWeights};
  auto p = store->AcquireHost(gone);
  ASSERT_TRUE(p.ok()) << p.status();
  for (uint64_t i = 0; i < kFloats; i += 97) ASSERT_EQ((*p)[i], -InitValue(gone, i));
  store->ReleaseHost(gone, false);
  p = store->AcquireHost(kept);
  ASSERT_TRUE(p.ok()) << p.status();
  for (uint64_t i = 0; i < kFloats; i += 97) ASSERT_EQ((*p)[i], static_cast<float>(21 + i % 11));
  store->ReleaseHost(kept, false);
}

TEST_F(TieredStoreTest, LfuKeepsTheHotEntryAndDecayLetsItGo) {
  auto store = Make(3, 7);
  const TensorKey hot{2, 0, TensorKind::kAdamV};
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(store->AcquireHost(hot).ok());
    store->ReleaseHost(hot, false);
  }
  // Stream 20 other tensors through the 7 host slots, twice each: the hot one stays.
  for (int round = 0; round < 2; ++round) {
    for (int e = 1; e <= 20; ++e) {
      TensorKey k{2, e, TensorKind::kAdamV};
      ASSERT_TRUE(store->AcquireHost(k).ok());
      store->ReleaseHost(k, false);
    }
  }
  store->TakeStats();
  ASSERT_TRUE(store->AcquireHost(hot).ok());
  store->ReleaseHost(hot, false);
  EXPECT_EQ(store->TakeStats().host.hits, 1u) << "LFU evicted the hottest entry";
  // Decay (every 10 steps x 0.5): after 60 steps its 21 hits are worth 21/64 < 1, below a fresh
  // entry used once, so it is the next victim.
  for (int s = 0; s < 60; ++s) store->EndStep();
  for (int e = 21; e <= 28; ++e) {
    TensorKey k{2, e, TensorKind::kAdamV};
    ASSERT_TRUE(store->AcquireHost(k).ok());
    store->ReleaseHost(k, false);
    ASSERT_TRUE(store->AcquireHost(k).ok());  // two hits each
    store->ReleaseHost(k, false);
  }
  store->TakeStats();
  ASSERT_TRUE(store->AcquireHost(hot).ok());
  store->ReleaseHost(hot, false);
  EXPECT_EQ(store->TakeStats().host.misses, 1u) << "decayed hits should have let it be evicted";
}

TEST_F(TieredStoreTest, EquallyColdEntriesLeaveLeastRecentlyUsedFirst) {
  auto store = Make(3, 7);
  // Seven tensors with one hit each, used in descending key order: expert 7 is the oldest.
  for (int e = 7; e >= 1; --e) {
    TensorKey k{1, e, TensorKind::kGrad};
    ASSERT_TRUE(store->AcquireHost(k).ok());
    store->ReleaseHost(k, true);
  }
  // An eighth needs a slot: the victim is the least recently used of the equally cold, expert 7
  // (not the lowest key, expert 1), and it is written to the SSD tier first (it is dirty).
  const TensorKey fresh{1, 8, TensorKind::kGrad};
  ASSERT_TRUE(store->AcquireHost(fresh).ok());
  store->ReleaseHost(fresh, false);
  store->TakeStats();
  ASSERT_TRUE(store->AcquireHost(TensorKey{1, 1, TensorKind::kGrad}).ok());
  store->ReleaseHost(TensorKey{1, 1, TensorKind::kGrad}, false);
  StoreStats s = store->TakeStats();
  EXPECT_EQ(s.host.hits, 1u) << "the most recently used of the cold entries was evicted";
  auto old = store->AcquireHost(TensorKey{1, 7, TensorKind::kGrad});
  ASSERT_TRUE(old.ok()) << old.status();
  store->ReleaseHost(TensorKey{1, 7, TensorKind::kGrad}, false);
  s = store->TakeStats();
  EXPECT_EQ(s.host.misses, 1u) << "the least recently used entry should have been evicted";
  EXPECT_GT(s.ssd.bytes_out, 0u) << "it came back from the SSD tier";
}

// Is `key` resident on the host? Acquires it and reads the hit/miss counter (then it is used).
bool Resident(TieredExpertStore& store, const TensorKey& key) {
  store.TakeStats();
  EXPECT_TRUE(store.AcquireHost(key).ok());
  store.ReleaseHost(key, false);
  return store.TakeStats().host.hits == 1;
}

TEST_F(TieredStoreTest, PlannedEntriesLeaveFirstLatestNextUseFirst) {
  auto store = Make(3, 7);
  // Seven moments with hits 2..8 (hotter than any fresh tensor), expert 1 the coldest.
  for (int e = 1; e <= 7; ++e) {
    TensorKey k{1, e, TensorKind::kAdamM};
    for (int h = 0; h <= e; ++h) {
      ASSERT_TRUE(store->AcquireHost(k).ok());
      store->ReleaseHost(k, true);
    }
  }
  // The plan: experts 5, 6, 7 are next used at 3, 1, 2; the others have no plan.
  const TensorKey m5{1, 5, TensorKind::kAdamM}, m6{1, 6, TensorKind::kAdamM},
      m7{1, 7, TensorKind::kAdamM};
  store->SetNextUse(std::span<const TensorKey>(&m5, 1), 3);
  store->SetNextUse(std::span<const TensorKey>(&m6, 1), 1);
  store->SetNextUse(std::span<const TensorKey>(&m7, 1), 2);
  // Two fresh tensors need slots: LFU alone would evict experts 1 and 2; the plan evicts 5
  // (needed latest) and then 7, although they are the hottest, and writes them back.
  for (int e = 8; e <= 9; ++e) {
    TensorKey k{1, e, TensorKind::kGrad};
    ASSERT_TRUE(store->AcquireHost(k).ok());
    store->ReleaseHost(k, true);
  }
  EXPECT_EQ(store->TakeStats().ssd.bytes_in, 2 * kBytes) << "two dirty victims written back";
  EXPECT_TRUE(Resident(*store, TensorKey{1, 1, TensorKind::kAdamM}));
  EXPECT_TRUE(Resident(*store, TensorKey{1, 2, TensorKind::kAdamM}));
  EXPECT_TRUE(Resident(*store, m6)) << "needed soonest of the planned: kept";
  EXPECT_FALSE(Resident(*store, m5)) << "needed latest: evicted first";
  EXPECT_FALSE(Resident(*store, m7)) << "needed second latest: evicted second";
}

TEST_F(TieredStoreTest, AConditionalPrefetchTakesOnlyTheSlotOfStateNeededLater) {
  auto store = Make(3, 7);
  auto moment = [](int e) { return TensorKey{1, e, TensorKind::kAdamM}; };
  for (int e = 1; e <= 7; ++e) {  // seven dirty moments fill the host tier, none planned
    ASSERT_TRUE(store->AcquireHost(moment(e)).ok());
    store->ReleaseHost(moment(e), true);
  }
  const TensorKey w{1, 20, TensorKind::kWeights};
  store->TakeStats();
  // Needed at 5, with nothing planned: dropped, nothing evicted.
  EXPECT_EQ(store->PrefetchHost(std::span<const TensorKey>(&w, 1), 5), 1);
  store->WaitIdle();
  EXPECT_EQ(store->TakeStats().host.evictions, 0u);
  // Expert 3 is planned for 10, expert 4 for 4: only 3 is needed after 5, and goes (written back,
  // being dirty); the weights come in, and 4 stays.
  const TensorKey m3 = moment(3), m4 = moment(4);
  store->SetNextUse(std::span<const TensorKey>(&m3, 1), 10);
  store->SetNextUse(std::span<const TensorKey>(&m4, 1), 4);
  EXPECT_EQ(store->PrefetchHost(std::span<const TensorKey>(&w, 1), 5), 1);
  store->WaitIdle();
  StoreStats s = store->TakeStats();
  EXPECT_EQ(s.host.evictions, 1u);
  EXPECT_EQ(s.ssd.bytes_in, kBytes);
  EXPECT_TRUE(Resident(*store, w));
  EXPECT_TRUE(Resident(*store, m4));
  // A hint dropped for want of room leaves nobody waiting: the tensor loads when acquired.
  const TensorKey w2{1, 21, TensorKind::kWeights};
  EXPECT_EQ(store->PrefetchHost(std::span<const TensorKey>(&w2, 1), 100), 1);
  store->WaitIdle();
  EXPECT_EQ(store->TakeStats().host.evictions, 0u) << "nothing is planned after 100";
  auto p = store->AcquireHost(w2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[5], InitValue(w2, 5));
  store->ReleaseHost(w2, false);
  EXPECT_FALSE(Resident(*store, m3)) << "the planned moment made room for the hint";
}

TEST_F(TieredStoreTest, IdleSsdThreadsWriteTheNextVictimsBackAhead) {
  auto store = Make(3, 7, 1, /*clean_ahead=*/true);
  // Seven dirty tensors fill the host tier, expert 1 the least recently used.
  auto value = [](int e, uint64_t i) { return static_cast<float>(e * 100 + i % 17); };
  for (int e = 1; e <= 7; ++e) {
    TensorKey k{1, e, TensorKind::kGrad};
    auto p = store->AcquireHost(k);
    ASSERT_TRUE(p.ok()) << p.status();
    for (uint64_t i = 0; i < kFloats; ++i) (*p)[i] = value(e, i);
    store->ReleaseHost(k, true);
  }
  store->WaitIdle();
  // The next ssd_threads + 1 = 5 victims, experts 1-5, were written back; 6 and 7 were not, and
  // nothing was evicted: all seven are still resident.
  StoreStats s = store->TakeStats();
  EXPECT_EQ(s.ssd.bytes_in, 5 * kBytes);
  EXPECT_EQ(s.host.evictions, 0u);
  // Seven fresh tensors take their slots (as cold, and more recent); every value comes back from
  // the SSD tier bit for bit, and no tensor was written twice (an eviction of a cleaned entry
  // writes nothing). Each waits for the write-backs ahead it started: an eviction that finds
  // every dirty victim being written takes a clean, newer entry instead (a fresh one here), which
  // would leave one of 1-7 resident and make the count of reads below depend on timing.
  for (int e = 8; e <= 14; ++e) {
    ASSERT_TRUE(store->AcquireHost(TensorKey{1, e, TensorKind::kGrad}).ok());
    store->ReleaseHost(TensorKey{1, e, TensorKind::kGrad}, false);
    store->WaitIdle();
  }
  for (int e = 1; e <= 7; ++e) {
    TensorKey k{1, e, TensorKind::kGrad};
    auto p = store->AcquireHost(k);
    ASSERT_TRUE(p.ok()) << p.status();
    for (uint64_t i = 0; i < kFloats; ++i) ASSERT_EQ((*p)[i], value(e, i)) << e << " " << i;
    store->ReleaseHost(k, false);
  }
  store->WaitIdle();
  s = store->TakeStats();
  EXPECT_EQ(s.ssd.bytes_in, 2 * kBytes) << "experts 6 and 7, once each";
  EXPECT_EQ(s.ssd.bytes_out, 7 * kBytes);
}

TEST_F(TieredStoreTest, ConcurrentUseMatchesAShadowCopy) {
  constexpr int kThreads = 3;
  auto store = Make(2 * kThreads + 1, 4 * kThreads + 3, kThreads, /*clean_ahead=*/true);
  ASSERT_TRUE(store);
  constexpr int kExperts = 24;
  // Each thread owns experts e % kThreads == t and keeps a shadow of their weights' first value.
  std::atomic<int> failures{0};
  auto work = [&](int t) {
    std::mt19937 gen(t);
    std::map<int, float> shadow;
    for (int e = t; e < kExperts; e += kThreads)
      shadow[e] = InitValue(TensorKey{0, e, TensorKind::kWeights}, 0);
    for (int it = 0; it < 300; ++it) {
      const int e = t + kThreads * static_cast<int>(gen() % (kExperts / kThreads));
      const TensorKey w{0, e, TensorKind::kWeights};
      switch (gen() % 3) {
        case 0: {  // read on the device, with a prefetch of the next one
          TensorKey next{0, (e + kThreads) % kExperts, TensorKind::kWeights};
          store->PrefetchDevice(std::span<const TensorKey>(&next, 1));
          auto p = store->AcquireDevice(w);
          if (!p.ok() || (*p)[0] != shadow[e]) failures++;
          store->ReleaseDevice(w, false);
          break;
        }
        case 1: {  // update on the host
          auto p = store->AcquireHost(w);
          if (!p.ok()) {
            failures++;
            break;
          }
          (*p)[0] += 1.0f;
          shadow[e] = (*p)[0];
          store->ReleaseHost(w, true);
          break;
        }
        case 2: {  // a gradient round trip
          const TensorKey g{0, e, TensorKind::kGrad};
          auto p = store->AcquireDevice(g, true);
          if (!p.ok()) {
            failures++;
            break;
          }
          (*p)[5] = static_cast<float>(it);
          store->ReleaseDevice(g, true);
          store->WriteBack(g);
          auto h = store->AcquireHost(g);
          if (!h.ok() || (*h)[5] != static_cast<float>(it)) failures++;
          if (h.ok()) store->ReleaseHost(g, false);
          store->Discard(g);
          break;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(device_budget_.peak(), (2 * kThreads + 1) * kBytes);
}

TEST_F(TieredStoreTest, TooSmallBudgetsAreClearErrors) {
  StoreOptions o;
  o.tensor_bytes = kBytes;
  o.device_budget_bytes = 2 * kBytes;
  o.host_budget_bytes = 64 * kBytes;
  o.ssd.dir = dir_.path();
  o.compute_threads = 2;
  auto s = TieredExpertStore::Create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("storage.device_budget_bytes"), std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("at least 5"), std::string::npos) << s.status();
}

TEST_F(TieredStoreTest, CorruptExtentIsReportedWithTheTensorAndFile) {
  auto store = Make(3, 7);
  const TensorKey victim{3, 1, TensorKind::kWeights};
  {
    auto p = store->AcquireHost(victim);
    ASSERT_TRUE(p.ok());
    (*p)[0] = 42.0f;
    store->ReleaseHost(victim, true);
  }
  // Push it out to the SSD tier.
  for (int e = 10; e < 20; ++e) {
    TensorKey k{3, e, TensorKind::kAdamM};
    ASSERT_TRUE(store->AcquireHost(k).ok());
    store->ReleaseHost(k, false);
  }
  std::vector<float> copy(kFloats);
  TieredExpertStore::Snapshot snap;
  ASSERT_TRUE(store->SnapshotTensor(victim, copy.data(), &snap).ok());
  ASSERT_TRUE(snap.has_stored) << "the tensor should have been written to the SSD tier";
  {
    std::fstream f(store->ssd().FilePath(snap.stored.extent.file),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(snap.stored.extent.offset + 8));
    f.put('\x7f');
  }
  store->UnrefVersion(victim, snap.version);
  auto p = store->AcquireDevice(victim);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::IsDataLoss(p.status())) << p.status();
  EXPECT_NE(p.status().message().find("layer 3 expert 1 weights"), std::string::npos) << p.status();
  EXPECT_NE(p.status().message().find("data-00000.bin"), std::string::npos) << p.status();
}

}  // namespace
}  // namespace strata::storage
