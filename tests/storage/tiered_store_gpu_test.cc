// The tiered store with its device tier on a GPU (StoreOptions::device = cuda:0): device slots are
// cudaMalloc memory, host slots are page-locked, and host<->device copies run on the copy stage's
// CUDA stream. Under budgets of a few slots, tensors travel SSD -> pinned host -> HBM and back and
// must arrive bitwise intact (read back from HBM with CopyBytes and compared with a buffer computed
// here); gradients start at zero on the device and their written values survive the trip down to
// the SSD tier and up again; the device tier's HBM is charged to its MemoryBudget and returned, and
// a tier that does not fit is a clear error. Every test skips where no CUDA device is present.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/device/device.h"
#include "storage/tiered_store.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

using strata::testing::TempDir;

// 1 MiB + 28 bytes: not a multiple of 4 KiB, so slots are padded and every copy moves exactly
// the tensor's bytes, not the slot's.
constexpr uint64_t kFloats = (1u << 18) + 7;
constexpr uint64_t kBytes = kFloats * 4;
constexpr uint64_t kSlot = (kBytes + 4095) / 4096 * 4096;  // a tier's slot (4 KiB granules)

// Seeds of the values the tests write.
constexpr uint64_t kInitSeed = 1;    // the initializer (weights never written)
constexpr uint64_t kUpdateSeed = 2;  // weights updated on the host
constexpr uint64_t kGradSeed = 3;    // gradients written on the device

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The bits of element i: a float in [1, 2) whose 23 mantissa bits are pseudo-random, so a lost,
// shifted or stale byte anywhere in the tensor shows (and no value is a NaN or denormal).
uint32_t Bits(const TensorKey& k, uint64_t seed, uint64_t i) {
  const uint64_t tensor =
      Mix(seed * 1000003u + static_cast<uint64_t>(k.layer) * 8191u +
          static_cast<uint64_t>(k.expert) * 131u + static_cast<uint64_t>(k.kind));
  return 0x3F800000u | static_cast<uint32_t>(Mix(tensor ^ i) & 0x7FFFFFu);
}

// The tensor's expected contents, computed here (independently of the store).
std::vector<uint32_t> Expected(const TensorKey& k, uint64_t seed) {
  std::vector<uint32_t> v(kFloats);
  for (uint64_t i = 0; i < kFloats; ++i) v[i] = Bits(k, seed, i);
  return v;
}

// "" when `got` (host memory, kBytes) equals `want` bitwise, else where and how they first differ.
std::string FirstDifference(const void* got, const std::vector<uint32_t>& want) {
  if (std::memcmp(got, want.data(), kBytes) == 0) return "";
  const auto* g = static_cast<const uint32_t*>(got);
  uint64_t i = 0;
  while (g[i] == want[i]) ++i;
  uint64_t wrong = 0;
  for (uint64_t j = i; j < kFloats; ++j) wrong += g[j] != want[j];
  return absl::StrCat("element ", i, " of ", kFloats, " is 0x", absl::Hex(g[i]), ", expected 0x",
                      absl::Hex(want[i]), " (", wrong, " elements differ)");
}

// A device tensor's bytes, copied to the host (a synchronous cudaMemcpy).
std::vector<uint32_t> ReadDevice(const float* device_data) {
  std::vector<uint32_t> v(kFloats);
  CopyBytes(v.data(), device_data, kBytes);
  return v;
}

class TieredStoreGpuTest : public ::testing::Test {
 protected:
  StoreOptions Options(int device_slots, int host_slots, int threads = 1) {
    StoreOptions o;
    o.tensor_bytes = kBytes;
    o.device = Device::Cuda(0);
    o.device_budget_bytes = static_cast<uint64_t>(device_slots) * kSlot;
    o.host_budget_bytes = static_cast<uint64_t>(host_slots) * kSlot;
    o.device_budget = &device_budget_;
    o.host_budget = &host_budget_;
    o.ssd.dir = dir_.path();
    o.ssd.file_bytes = 256 << 20;
    o.ssd.grow_bytes = 16 << 20;
    o.io.queue_depth = 8;
    o.io.block_bytes = 256 << 10;  // several requests per tensor, the last one short
    o.compute_threads = threads;
    o.initializer = [](const TensorKey& k, float* p) {
      for (uint64_t i = 0; i < kFloats; ++i) {
        const uint32_t b = Bits(k, kInitSeed, i);
        std::memcpy(p + i, &b, sizeof(b));
      }
    };
    return o;
  }
  std::unique_ptr<TieredExpertStore> Make(int device_slots, int host_slots, int threads = 1) {
    auto s = TieredExpertStore::Create(Options(device_slots, host_slots, threads));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  // Writes `v` into device memory. The source is page-locked: a cudaMemcpy from pageable memory
  // may return before its DMA has landed, and the store's write-back runs on its own stream,
  // which would not wait for it.
  void WriteDevice(float* device_data, const std::vector<uint32_t>& v) {
    if (staging_ == nullptr) {
      auto b = Buffer::AllocatePinned(kBytes);
      ASSERT_TRUE(b.ok()) << b.status();
      staging_ = *std::move(b);
    }
    std::memcpy(staging_->data(), v.data(), kBytes);
    CopyBytes(device_data, staging_->data(), kBytes);
  }

  TempDir dir_;
  MemoryBudget device_budget_{"hbm", 64 * kSlot};
  MemoryBudget host_budget_{"host", 64 * kSlot};
  std::shared_ptr<Buffer> staging_;
};

TEST_F(TieredStoreGpuTest, WeightsTravelSsdHostDeviceBitwise) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription(0);
  auto store = Make(/*device=*/3, /*host=*/7);
  ASSERT_TRUE(store);
  constexpr int kExperts = 12;  // four times the device tier, almost twice the host tier
  auto key = [](int e) { return TensorKey{1, e, TensorKind::kWeights}; };
  auto acquire_and_check = [&](int e, uint64_t seed, bool prefetch_next) {
    if (prefetch_next) {
      const TensorKey next = key((e + 1) % kExperts);
      store->PrefetchDevice(std::span<const TensorKey>(&next, 1));
    }
    auto p = store->AcquireDevice(key(e));
    ASSERT_TRUE(p.ok()) << key(e).ToString() << ": " << p.status();
    EXPECT_EQ(FirstDifference(ReadDevice(*p).data(), Expected(key(e), seed)), "")
        << key(e).ToString() << " on the device";
    store->ReleaseDevice(key(e), false);
  };

  // 1. Never written: the initializer fills a pinned host slot, the copy stage moves it to HBM.
  for (int e = 0; e < kExperts; ++e) {
    ASSERT_NO_FATAL_FAILURE(acquire_and_check(e, kInitSeed, /*prefetch_next=*/true));
  }
  StoreStats s = store->TakeStats();
  EXPECT_GE(s.device.bytes_in, kExperts * kBytes);
  EXPECT_GT(s.device.evictions, 0u);

  // 2. Updated on the host (the optimizer's path): the host tier overflows, so dirty evictions
  // write them to the SSD tier.
  for (int e = 0; e < kExperts; ++e) {
    auto h = store->AcquireHost(key(e));
    ASSERT_TRUE(h.ok()) << h.status();
    const std::vector<uint32_t> v = Expected(key(e), kUpdateSeed);
    std::memcpy(*h, v.data(), kBytes);
    store->ReleaseHost(key(e), /*modified=*/true);
  }
  s = store->TakeStats();
  EXPECT_GT(s.host.evictions, 0u);
  EXPECT_GT(s.ssd.bytes_in, 0u) << "dirty evictions must reach the SSD tier";

  // 3. Read back on the device: in reverse (the last ones are still on the host, the first ones
  // come from the SSD tier), then in a scattered order with prefetches.
  for (int i = 0; i < kExperts; ++i) {
    ASSERT_NO_FATAL_FAILURE(acquire_and_check(kExperts - 1 - i, kUpdateSeed, false));
  }
  for (int i = 0; i < kExperts; ++i) {
    ASSERT_NO_FATAL_FAILURE(acquire_and_check(i * 5 % kExperts, kUpdateSeed, true));
  }
  s = store->TakeStats();
  EXPECT_GT(s.ssd.bytes_out, 0u) << "some weights should have come back from the SSD tier";
  EXPECT_GT(s.device.evictions, 0u);
  EXPECT_LE(s.device.used_bytes, 3 * kSlot);
  EXPECT_LE(s.host.used_bytes, 7 * kSlot);
  EXPECT_LE(device_budget_.peak(), 3 * kSlot) << "the device tier went over its budget";
  EXPECT_LE(host_budget_.peak(), 7 * kSlot) << "the host tier went over its budget";
}

TEST_F(TieredStoreGpuTest, GradientsStartAtZeroAndSurviveTheTripToSsdBitwise) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription(0);
  auto store = Make(/*device=*/3, /*host=*/7);
  ASSERT_TRUE(store);
  constexpr int kGrads = 6;
  auto grad = [](int e) { return TensorKey{0, e, TensorKind::kGrad}; };
  const std::vector<uint32_t> zeros(kFloats, 0u);

  // Backward: each gradient starts at zero in HBM (on a fresh slot or one that held another
  // gradient) and is written there. From the fourth on the device tier is full of dirty
  // gradients, so acquiring one first moves the oldest down to the host tier.
  for (int e = 0; e < kGrads; ++e) {
    auto p = store->AcquireDevice(grad(e), /*zero=*/true);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(FirstDifference(ReadDevice(*p).data(), zeros), "")
        << grad(e).ToString() << " should start at zero";
    ASSERT_NO_FATAL_FAILURE(WriteDevice(*p, Expected(grad(e), kGradSeed)));
    store->ReleaseDevice(grad(e), /*modified=*/true);
  }
  // The last three are still in HBM (they stay until their slot is needed): write them back.
  for (int e = 0; e < kGrads; ++e) store->WriteBack(grad(e));
  ASSERT_TRUE(store->DrainWriteBacks().ok());

  // Force every gradient down to the SSD tier: 20 weights stream through the 7 host slots, and
  // the gradients, dirty there and colder, are written to the SSD tier and evicted.
  for (int e = 0; e < 20; ++e) {
    const TensorKey w{2, e, TensorKind::kWeights};
    auto p = store->AcquireDevice(w);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(FirstDifference(ReadDevice(*p).data(), Expected(w, kInitSeed)), "") << w.ToString();
    store->ReleaseDevice(w, false);
  }
  StoreStats s = store->TakeStats();
  EXPECT_EQ(s.device.bytes_out, kGrads * kBytes) << "each gradient is copied down from HBM once";
  EXPECT_GE(s.ssd.bytes_in, kGrads * kBytes) << "each gradient is written to the SSD tier";
  std::vector<float> scratch(kFloats);  // SnapshotTensor copies a host-only value here
  for (int e = 0; e < kGrads; ++e) {
    TieredExpertStore::Snapshot snap;
    ASSERT_TRUE(store->SnapshotTensor(grad(e), scratch.data(), &snap).ok());
    EXPECT_TRUE(snap.has_stored) << grad(e).ToString() << " should be on the SSD tier by now";
    if (snap.has_stored) store->UnrefVersion(grad(e), snap.version);
  }

  // Back up to HBM (SSD -> pinned host -> device) and compare bitwise.
  for (int e = 0; e < kGrads; ++e) {
    auto p = store->AcquireDevice(grad(e));
    ASSERT_TRUE(p.ok()) << grad(e).ToString() << ": " << p.status();
    EXPECT_EQ(FirstDifference(ReadDevice(*p).data(), Expected(grad(e), kGradSeed)), "")
        << grad(e).ToString() << " after SSD -> host -> device";
    store->ReleaseDevice(grad(e), false);
  }
  s = store->TakeStats();
  EXPECT_GE(s.ssd.bytes_out, kGrads * kBytes) << "the gradients should come from the SSD tier";
  // The optimizer's view of the same values, on the host.
  for (int e = 0; e < kGrads; ++e) {
    auto h = store->AcquireHost(grad(e));
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(FirstDifference(*h, Expected(grad(e), kGradSeed)), "")
        << grad(e).ToString() << " on the host";
    store->ReleaseHost(grad(e), false);
    store->Discard(grad(e));
  }
}

TEST_F(TieredStoreGpuTest, DeviceTierIsChargedToItsBudgetAndReturned) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription(0);
  {
    auto store = Make(/*device=*/4, /*host=*/8);
    ASSERT_TRUE(store);
    EXPECT_EQ(store->device_slots(), 4);
    EXPECT_EQ(store->host_slots(), 8);
    EXPECT_EQ(device_budget_.used(), 4 * kSlot) << "the device tier's HBM is charged up front";
    EXPECT_EQ(host_budget_.used(), 8 * kSlot);
    // Using the tiers (more tensors than slots, a gradient round trip) does not grow them.
    for (int e = 0; e < 10; ++e) {
      const TensorKey w{0, e, TensorKind::kWeights};
      auto p = store->AcquireDevice(w);
      ASSERT_TRUE(p.ok()) << p.status();
      store->ReleaseDevice(w, false);
      const TensorKey g{0, e, TensorKind::kGrad};
      auto gp = store->AcquireDevice(g, /*zero=*/true);
      ASSERT_TRUE(gp.ok()) << gp.status();
      store->ReleaseDevice(g, /*modified=*/true);
    }
    ASSERT_TRUE(store->DrainWriteBacks().ok());
    EXPECT_EQ(device_budget_.used(), 4 * kSlot);
    EXPECT_EQ(device_budget_.peak(), 4 * kSlot) << "the device tier went over its budget";
    EXPECT_EQ(host_budget_.peak(), 8 * kSlot) << "the host tier went over its budget";
  }
  EXPECT_EQ(device_budget_.used(), 0u) << "the store's HBM should go back to the budget";
  EXPECT_EQ(host_budget_.used(), 0u) << "the store's pinned host memory should go back";
}

TEST_F(TieredStoreGpuTest, DeviceTierThatDoesNotFitIsAClearError) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription(0);
  // The shared HBM budget has room for 2 slots; the tier asks for 4.
  MemoryBudget small("hbm", 2 * kSlot);
  StoreOptions o = Options(/*device=*/4, /*host=*/8);
  o.device_budget = &small;
  auto s = TieredExpertStore::Create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(s.status())) << s.status();
  const std::string m1(s.status().message());
  EXPECT_NE(m1.find("device tier"), std::string::npos) << m1;
  EXPECT_NE(m1.find("cuda:0"), std::string::npos) << m1;
  EXPECT_NE(m1.find("'hbm'"), std::string::npos) << "the budget should be named: " << m1;
  EXPECT_EQ(small.used(), 0u);
  EXPECT_EQ(host_budget_.used(), 0u) << "a failed Create should free the host tier it made";

  // A device budget with room for fewer slots than one compute thread needs (3).
  auto s2 = TieredExpertStore::Create(Options(/*device=*/2, /*host=*/8));
  ASSERT_FALSE(s2.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(s2.status())) << s2.status();
  const std::string m2(s2.status().message());
  EXPECT_NE(m2.find("storage.device_budget_bytes"), std::string::npos) << m2;
  EXPECT_NE(m2.find("at least 3"), std::string::npos) << m2;
  EXPECT_EQ(device_budget_.used(), 0u) << "the refused device tier's HBM should be freed";
  EXPECT_EQ(host_budget_.used(), 0u);

  // A device budget smaller than one tensor.
  StoreOptions tiny = Options(/*device=*/0, /*host=*/8);
  tiny.device_budget_bytes = kSlot / 2;
  auto s3 = TieredExpertStore::Create(tiny);
  ASSERT_FALSE(s3.ok());
  const std::string m3(s3.status().message());
  EXPECT_NE(m3.find("device tier"), std::string::npos) << m3;
  EXPECT_EQ(device_budget_.used(), 0u);
}

TEST_F(TieredStoreGpuTest, ConcurrentComputeThreadsSeeTheirOwnBytes) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << CudaDeviceDescription(0);
  constexpr int kThreads = 3;
  auto store = Make(2 * kThreads + 1, 4 * kThreads + 3, kThreads);
  ASSERT_TRUE(store);
  constexpr int kExperts = 18;  // each thread owns experts e % kThreads == t
  std::atomic<int> failures{0};
  auto work = [&](int t) {
    auto staging = Buffer::AllocatePinned(kBytes);  // see WriteDevice
    if (!staging.ok()) {
      failures++;
      return;
    }
    std::vector<uint32_t> got(kFloats);
    for (int it = 0; it < 30; ++it) {
      const int e = t + kThreads * (it % (kExperts / kThreads));
      // Weights, read on the device with a prefetch of the thread's next expert.
      const TensorKey w{4, e, TensorKind::kWeights};
      const TensorKey next{4, (e + kThreads) % kExperts, TensorKind::kWeights};
      store->PrefetchDevice(std::span<const TensorKey>(&next, 1));
      auto p = store->AcquireDevice(w);
      if (!p.ok()) {
        failures++;
        continue;
      }
      CopyBytes(got.data(), *p, kBytes);
      if (!FirstDifference(got.data(), Expected(w, kInitSeed)).empty()) failures++;
      store->ReleaseDevice(w, false);
      // A gradient written on the device, written back and read on the host.
      const TensorKey g{4, e, TensorKind::kGrad};
      auto gp = store->AcquireDevice(g, /*zero=*/true);
      if (!gp.ok()) {
        failures++;
        continue;
      }
      const std::vector<uint32_t> want = Expected(g, kGradSeed + static_cast<uint64_t>(it));
      std::memcpy((*staging)->data(), want.data(), kBytes);
      CopyBytes(*gp, (*staging)->data(), kBytes);
      store->ReleaseDevice(g, /*modified=*/true);
      store->WriteBack(g);
      auto h = store->AcquireHost(g);
      if (!h.ok() || !FirstDifference(*h, want).empty()) failures++;
      if (h.ok()) store->ReleaseHost(g, false);
      store->Discard(g);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(device_budget_.peak(), (2 * kThreads + 1) * kSlot);
}

}  // namespace
}  // namespace strata::storage
