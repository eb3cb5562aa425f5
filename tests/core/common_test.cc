// ThreadPool partitioning and reentrancy, counter-based RNG, JSON writer, byte sizes, Shape/Tensor
// views.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/bytes.h"
#include "core/common/clock.h"
#include "core/common/json.h"
#include "core/common/rng.h"
#include "core/common/thread_pool.h"
#include "core/device/device.h"

namespace strata {
namespace {

TEST(ThreadPoolTest, ParallelForCoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 7}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 5, 64, 1000, 12345}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << i;
    }
  }
}

TEST(ThreadPoolTest, SlicesAreStaticAndContiguous) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.PartsFor(10, 1), 3);
  EXPECT_EQ(pool.PartsFor(10, 4), 3);
  EXPECT_EQ(pool.PartsFor(10, 6), 2);
  EXPECT_EQ(pool.PartsFor(10, 100), 1);
  std::vector<std::pair<int64_t, int64_t>> slices(3, {-1, -1});
  pool.ParallelForSlices(10, 1, [&](int part, int64_t b, int64_t e) { slices[part] = {b, e}; });
  EXPECT_EQ(slices[0], (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(slices[1], (std::pair<int64_t, int64_t>{3, 6}));
  EXPECT_EQ(slices[2], (std::pair<int64_t, int64_t>{6, 10}));
}

TEST(ThreadPoolTest, NestedCallsRunInlineAndManyDispatchesComplete) {
  ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  for (int round = 0; round < 2000; ++round) {
    pool.ParallelFor(4, 1, [&](int64_t b, int64_t e) {
      pool.ParallelFor(3, 1, [&](int64_t b2, int64_t e2) { total.fetch_add((e - b) * (e2 - b2)); });
    });
  }
  EXPECT_EQ(total.load(), 2000 * 4 * 3);
}

TEST(RngTest, DrawsArePureFunctionsWithSaneMoments) {
  const uint64_t key = rng::Key(1, 2, 3, 4);
  EXPECT_EQ(rng::Bits(key, 99), rng::Bits(rng::Key(1, 2, 3, 4), 99));
  EXPECT_NE(rng::Key(1, 2, 3, 4), rng::Key(1, 2, 3, 5));
  double sum = 0, sum2 = 0, usum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double z = rng::Normal(key, i);
    sum += z;
    sum2 += z * z;
    double u = rng::Uniform(key, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    usum += u;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum2 / n, 1.0, 0.01);
  EXPECT_NEAR(usum / n, 0.5, 0.005);
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) seen.insert(rng::Below(key, i, 10));
  EXPECT_EQ(seen.size(), 10u);
}

TEST(JsonWriterTest, NestedValuesAndEscapes) {
  JsonWriter j;
  j.BeginObject().Field("a", 1).Field("s", std::string("q\"\n")).Key("arr").IntArray({1, 2});
  j.Field("nan", std::nan("")).Field("x", 0.5).Key("o").BeginObject().Field("b", true).EndObject();
  j.EndObject();
  EXPECT_EQ(j.str(), R"({"a":1,"s":"q\"\n","arr":[1,2],"nan":null,"x":0.5,"o":{"b":true}})");
}

TEST(BytesTest, ParseBytesReadsWhatUsersTypeAndRefusesTheRest) {
  const std::pair<const char*, uint64_t> good[] = {{"1048576", 1048576},
                                                   {"0", 0},
                                                   {"512KiB", 512 * 1024},
                                                   {"512 kib", 512 * 1024},
                                                   {"1.5 GiB", 3ull << 29},
                                                   {"16G", 16ull << 30},
                                                   {"100 B", 100},
                                                   {" 2M ", 2ull << 20},
                                                   {"1T", 1ull << 40},
                                                   {"0.5K", 512},
                                                   {"16777215 TiB", 18446742974197923840ull}};
  for (const auto& [text, want] : good) {
    auto v = ParseBytes(text);
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(*v, want) << text;
  }
  for (const char* text :
       {"", "GiB", "-1", "1.5", "0.3K", "12 MB", "1e30", "ten", "1 GiB x", "nan", "16777216 TiB"}) {
    auto v = ParseBytes(text);
    EXPECT_FALSE(v.ok()) << "'" << text << "' read as " << (v.ok() ? *v : 0);
    if (!v.ok()) {
      EXPECT_NE(v.status().message().find("is not a size"), std::string::npos) << v.status();
    }
  }
  EXPECT_EQ(FormatBytes(3ull << 29), "1.5 GiB");
}

TEST(ClockTest, FormatDuration) {
  EXPECT_EQ(FormatDuration(42.4), "42s");
  EXPECT_EQ(FormatDuration(187), "3m07s");
  EXPECT_EQ(FormatDuration(3725), "1h02m");
}

TEST(TensorTest, ViewsShareStorageAndZeroRowViewsWork) {
  Tensor t = Tensor::Zeros({4, 3});
  EXPECT_EQ(t.numel(), 12);
  Tensor rows = t.Rows(1, 3);
  rows.f32()[0] = 5.0f;
  EXPECT_EQ(t.f32()[3], 5.0f);
  EXPECT_EQ(rows.shape(), Shape({2, 3}));
  Tensor empty = t.Rows(2, 2);
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.Rows(0, 0).numel(), 0);
  Tensor v = t.View(6, {2, 3});
  EXPECT_EQ(v.f32(), t.f32() + 6);
  EXPECT_EQ(t.Reshape({3, 4}).dim(1), 4);
}

TEST(MemoryBudgetTest, HardLimitIsAnError) {
  MemoryBudget budget("device", 1000);
  auto a = Tensor::TryEmpty({100}, DType::kF32, Device::Cpu(), &budget);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(budget.used(), 400u);
  auto b = Tensor::TryEmpty({200}, DType::kF32, Device::Cpu(), &budget);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(b.status()));
  EXPECT_NE(b.status().message().find("device"), std::string::npos);
  *a = Tensor();
  EXPECT_EQ(budget.used(), 0u);
  EXPECT_EQ(budget.peak(), 400u);
}

TEST(TensorTest, ToAndCopyFromMakeIndependentCopies) {
  Tensor a = Tensor::Empty({2, 3});
  for (int i = 0; i < 6; ++i) a.f32()[i] = static_cast<float>(i) * 1.5f;
  Tensor same = a.To(Device::Cpu());
  EXPECT_EQ(same.f32(), a.f32());  // already there: the same storage
  Tensor b = Tensor::Zeros({2, 3});
  b.CopyFrom(a);
  a.f32()[4] = -1;
  EXPECT_EQ(b.f32()[4], 6.0f);
  b.SetZero();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(b.f32()[i], 0.0f);
}

TEST(BufferTest, PinnedHostMemoryIsHostMemoryUnderTheBudget) {
  MemoryBudget budget("host", 1 << 20);
  auto buf = Buffer::AllocatePinned(4096, &budget);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_TRUE((*buf)->device().is_cpu());
  EXPECT_EQ((*buf)->pinned(), CudaDeviceCount() > 0);  // page-locked only where a GPU can use it
  EXPECT_EQ(budget.used(), 4096u);
  static_cast<char*>((*buf)->data())[4095] = 7;  // it is ordinary, writable host memory
  EXPECT_FALSE(Buffer::AllocatePinned(2 << 20, &budget).ok());
  buf->reset();
  EXPECT_EQ(budget.used(), 0u);
}

TEST(BufferTest, AGpuThatIsNotThereIsAClearErrorAndChargesNothing) {
  const int gpus = CudaDeviceCount();
  MemoryBudget budget("device", 1 << 20);
  auto t = Tensor::TryEmpty({16}, DType::kF32, Device::Cuda(gpus), &budget);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find(absl::StrCat("cuda:", gpus)), std::string::npos)
      << t.status();
  EXPECT_EQ(budget.used(), 0u);
}

TEST(CopyStreamTest, OnTheCpuCopiesAreDoneWhenEnqueued) {
  auto stream = CopyStream::Create(Device::Cpu());
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<int32_t> src(1000), dst(1000, 0);
  for (int i = 0; i < 1000; ++i) src[i] = i * 7 - 3;
  ASSERT_TRUE((*stream)->CopyAsync(dst.data(), src.data(), src.size() * 4).ok());
  CopyEvent done;
  ASSERT_TRUE((*stream)->Record(&done).ok());
  EXPECT_TRUE(done.Done());
  ASSERT_TRUE((*stream)->Wait(done).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  EXPECT_EQ(dst, src);
}

}  // namespace
}  // namespace strata
