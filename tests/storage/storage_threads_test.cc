// Storage objects used from several threads at once, with real threads: a checkpoint's Sync and
// reads of the SSD tier while stage threads write extents that open new data files; writes and
// file growth racing for the last bytes of a FaultInjectingIo budget; two threads replacing the
// same file with Env::WriteFileAtomic. Races here rarely fail a plain build every time; the same
// tests under -fsanitize=thread report them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "storage/block_io.h"
#include "storage/env.h"
#include "storage/io_memory.h"
#include "storage/ssd_tier.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

using strata::testing::TempDir;

// The byte pattern of writer `w`'s `i`-th extent.
char PatternByte(int w, int i, uint64_t at) {
  return static_cast<char>(w * 131 + i * 7 + at % 251);
}

// Data files of one 4 KiB granule, so that every 4 KiB write opens a new file (and the tier's
// per-file tables grow and move) while a checkpoint thread Syncs and a reader reads a file that was
// cut short. Every Sync succeeds, every read names the right file, every extent reads back.
TEST(SsdTierThreadsTest, SyncAndReadsWhileWritesOpenNewFiles) {
  TempDir dir;
  auto io = MakeUringIo(UringOptions{});
  ASSERT_TRUE(io.ok()) << io.status();
  SsdOptions so;
  so.dir = dir.path();
  so.file_bytes = kSsdGranule;
  so.grow_bytes = kSsdGranule;
  auto opened = SsdTier::Open(so, *std::move(io));
  ASSERT_TRUE(opened.ok()) << opened.status();
  SsdTier& tier = **opened;

  // File 0: one extent, then cut to nothing on disk behind the tier's back.
  auto first = IoBuffer::Allocate(kSsdGranule);
  ASSERT_TRUE(first.ok());
  auto cut = tier.Write(first->data(), kSsdGranule);
  ASSERT_TRUE(cut.ok()) << cut.status();
  ASSERT_EQ(cut->extent.file, 0u);
  ASSERT_TRUE(tier.Sync().ok());
  const std::string file0 = dir.path() + "/data-00000.bin";
  ASSERT_EQ(::truncate(file0.c_str(), 0), 0);

  constexpr int kWriters = 2;
  constexpr int kWritesEach = 160;
  std::atomic<int> writers_left{kWriters};
  std::vector<std::vector<StoredExtent>> written(kWriters);
  std::vector<Status> write_errors(kWriters);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      auto buf = IoBuffer::Allocate(kSsdGranule);
      for (int i = 0; i < kWritesEach && buf.ok(); ++i) {
        for (uint64_t b = 0; b < kSsdGranule; ++b) buf->data()[b] = PatternByte(w, i, b);
        auto e = tier.Write(buf->data(), kSsdGranule);
        if (!e.ok()) {
          write_errors[w] = e.status();
          break;
        }
        written[w].push_back(*e);
      }
      --writers_left;
    });
  }
  int syncs = 0;
  Status sync_error;
  std::thread syncer([&] {
    while (writers_left > 0 && sync_error.ok()) {
      sync_error = tier.Sync();
      ++syncs;
    }
  });
  int reads = 0;
  std::vector<std::string> wrong_reads;
  std::thread reader([&] {
    auto buf = IoBuffer::Allocate(kSsdGranule);
    const std::string expected = absl::StrFormat("'%s' at offset 0 returned no bytes", file0);
    while (writers_left > 0 && buf.ok()) {
      Status s = tier.Read(*cut, buf->data(), "the cut tensor");
      ++reads;
      if (!absl::IsDataLoss(s) || s.message().find(expected) == std::string::npos) {
        wrong_reads.push_back(s.ToString());
      }
    }
  });
  for (std::thread& t : threads) t.join();
  syncer.join();
  reader.join();

  for (int w = 0; w < kWriters; ++w) {
    ASSERT_TRUE(write_errors[w].ok()) << "writer " << w << ": " << write_errors[w];
    ASSERT_EQ(written[w].size(), static_cast<size_t>(kWritesEach));
  }
  EXPECT_TRUE(sync_error.ok()) << sync_error;
  EXPECT_GT(syncs, 0);
  EXPECT_GT(reads, 0);
  EXPECT_TRUE(wrong_reads.empty()) << wrong_reads.size() << " of " << reads
                                   << " reads named the wrong file, e.g. " << wrong_reads[0];
  ASSERT_TRUE(tier.Sync().ok());
  // One file per extent: the cut one and every writer's.
  EXPECT_EQ(SsdTier::DataFiles(dir.path()).size(), 1u + kWriters * kWritesEach);
  auto back = IoBuffer::Allocate(kSsdGranule);
  ASSERT_TRUE(back.ok());
  for (int w = 0; w < kWriters; ++w) {
    for (int i = 0; i < kWritesEach; ++i) {
      ASSERT_TRUE(tier.Read(written[w][i], back->data(), "extent").ok());
      for (uint64_t b = 0; b < kSsdGranule; ++b) {
        ASSERT_EQ(back->data()[b], PatternByte(w, i, b)) << "writer " << w << " extent " << i;
      }
    }
  }
}

// A disk that counts the bytes that got past the FaultInjectingIo in front of it and checks, as
// they arrive, that they stay within the budget the test has granted so far.
class CountingIo : public BlockIo {
 public:
  explicit CountingIo(const std::atomic<int64_t>* granted) : granted_(granted) {}
  void RegisterRegions(const std::vector<iovec>&) override {}
  using BlockIo::Run;
  Status Run(std::span<const IoRequest> requests, const RequestDone&) override {
    for (const IoRequest& r : requests) Arrive(static_cast<int64_t>(r.length));
    return absl::OkStatus();
  }
  Status Allocate(int, uint64_t, uint64_t length, const std::string&) override {
    Arrive(static_cast<int64_t>(length));
    return absl::OkStatus();
  }
  Status Sync(int, const std::string&) override { return absl::OkStatus(); }
  bool registered() const override { return false; }

  int64_t arrived() const { return arrived_.load(); }
  int64_t over_budget() const { return over_budget_.load(); }

 private:
  void Arrive(int64_t n) {
    // The grant only grows, and only after a call was refused, so reading it after the bytes are
    // counted can only make this check more lenient.
    if (arrived_.fetch_add(n) + n > granted_->load()) ++over_budget_;
  }
  const std::atomic<int64_t>* granted_;
  std::atomic<int64_t> arrived_{0};
  std::atomic<int64_t> over_budget_{0};
};

// Threads hammer `attempt` (one call of `batch` bytes) on a FaultInjectingIo in front of a
// CountingIo; whenever the budget is used up, a thread whose call was refused grants one more
// batch. Whatever the interleaving, every grant admits exactly one call: the bytes that reach the
// disk never pass the grant.
void RaceForTheBudget(int64_t batch, const std::function<Status(FaultInjectingIo&)>& attempt,
                      const std::function<void(FaultInjectingIo&, int64_t)>& set_budget,
                      const std::function<int64_t(const FaultInjectingIo&)>& used_by_fault) {
  std::atomic<int64_t> granted{0};
  auto counting = std::make_unique<CountingIo>(&granted);
  const CountingIo& disk = *counting;
  FaultInjectingIo fault(std::move(counting));
  // What the fault layer has let through; for allocations only the disk behind it counts them.
  auto used = [&] { return used_by_fault ? used_by_fault(fault) : disk.arrived(); };
  constexpr int kThreads = 4;
  constexpr int kGrants = 200000;
  std::atomic<int> successes{0}, grants{0}, other_errors{0};
  std::mutex grant_mu;  // grants reach the fault layer in the order they were made
  set_budget(fault, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      while (grants.load() < kGrants && std::chrono::steady_clock::now() < deadline) {
        Status s = attempt(fault);
        if (s.ok()) {
          ++successes;
          continue;
        }
        if (!absl::IsResourceExhausted(s)) ++other_errors;
        std::lock_guard<std::mutex> lock(grant_mu);
        if (grants.load() < kGrants && used() >= granted.load()) {
          granted += batch;
          set_budget(fault, granted.load());
          ++grants;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(grants.load(), kGrants) << "the grants did not finish within a minute";
  EXPECT_EQ(other_errors.load(), 0);
  EXPECT_EQ(disk.over_budget(), 0) << "calls got past the budget";
  EXPECT_EQ(disk.arrived(), int64_t{successes.load()} * batch);
  EXPECT_EQ(used(), disk.arrived());
  EXPECT_LE(disk.arrived(), granted.load());
  // The last grant may be left unused when the threads stop.
  EXPECT_GE(successes.load(), kGrants - 1);
  EXPECT_LE(successes.load(), kGrants);
}

TEST(FaultInjectingIoThreadsTest, ConcurrentWritesNeverPassTheWriteBudget) {
  const std::string path = "/ssd/data-00000.bin";
  constexpr int64_t kBatch = 8192;
  const IoRequest write{3, 0, nullptr, kBatch, true, &path};
  RaceForTheBudget(
      kBatch, [&](FaultInjectingIo& f) { return f.Run(std::span<const IoRequest>(&write, 1)); },
      [](FaultInjectingIo& f, int64_t b) { f.set_write_budget(b); },
      [](const FaultInjectingIo& f) { return f.bytes_written(); });
}

TEST(FaultInjectingIoThreadsTest, ConcurrentGrowthNeverPassesTheAllocateBudget) {
  const std::string path = "/ssd/data-00000.bin";
  constexpr int64_t kBatch = 65536;
  RaceForTheBudget(
      kBatch, [&](FaultInjectingIo& f) { return f.Allocate(3, 0, kBatch, path); },
      [](FaultInjectingIo& f, int64_t b) { f.set_allocate_budget(b); }, nullptr);
}

// Two threads replace the same file over and over while a third reads it: every call succeeds
// and every read sees one writer's whole contents, never a mix or a missing file.
TEST(PosixEnvThreadsTest, WriteFileAtomicOfOnePathFromTwoThreads) {
  TempDir dir;
  const std::string p = dir.File("ledger");
  const std::string versions[2] = {std::string(1000, 'a'), std::string(3000, 'b')};
  ASSERT_TRUE(Env::Default()->WriteFileAtomic(p, versions[0]).ok());
  constexpr int kRounds = 60;
  std::atomic<int> writers_left{2};
  std::vector<Status> errors(2);
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < kRounds && errors[w].ok(); ++i) {
        errors[w] = Env::Default()->WriteFileAtomic(p, versions[w]);
      }
      --writers_left;
    });
  }
  int reads = 0;
  std::vector<std::string> torn;
  while (writers_left > 0) {
    auto s = Env::Default()->ReadFile(p);
    ++reads;
    if (!s.ok()) {
      torn.push_back(s.status().ToString());
    } else if (*s != versions[0] && *s != versions[1]) {
      torn.push_back(
          absl::StrFormat("%d bytes starting '%c'", s->size(), s->empty() ? ' ' : (*s)[0]));
    }
  }
  for (std::thread& t : writers) t.join();
  EXPECT_TRUE(errors[0].ok()) << errors[0];
  EXPECT_TRUE(errors[1].ok()) << errors[1];
  EXPECT_TRUE(torn.empty()) << torn.size() << " of " << reads << " reads, e.g. " << torn[0];
  auto last = Env::Default()->ReadFile(p);
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(*last == versions[0] || *last == versions[1]);
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 1) << "a temporary file was left behind";
}

}  // namespace
}  // namespace strata::storage
