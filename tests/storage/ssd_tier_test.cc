// The SSD tier's parts with the real kernel interfaces: CRC-32C, the extent allocator, io_uring
// transfers into O_DIRECT files (registered and unregistered buffers), corruption and truncation
// detection, injected disk-full errors, the per-request completion callback
// that lets reads check CRCs while later extents are in flight, and huge-page I/O memory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "storage/crc32c.h"
#include "storage/extent_allocator.h"
#include "storage/io_memory.h"
#include "storage/ssd_tier.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

using strata::testing::TempDir;

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 B.4 and the classic check value.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), inc(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(inc.data(), 32), 0x46DD794Eu);
  // Continuation equals one pass, at every split point.
  std::string s = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    EXPECT_EQ(Crc32c(Crc32c(s.data(), cut), s.data() + cut, s.size() - cut),
              Crc32c(s.data(), s.size()));
  }
  EXPECT_EQ(Crc32cPortable(0, "123456789", 9), 0xE3069283u);
}

// The hardware path (three interleaved streams joined by shift tables) against the byte-at-a-time
// table: random lengths, start alignments and incoming CRCs, every length at the edges of the
// 3 x 8 KiB and 3 x 256 byte blocks, and a whole expert-sized extent.
TEST(Crc32cTest, FastPathMatchesTheTableOnRandomLengthsAndAlignments) {
  if (!Crc32cIsHardwareAccelerated()) {
    GTEST_SKIP() << "no SSE4.2: Crc32c is the table path itself";
  }
  const size_t extent = 33574912;  // an expert of 1024 x 4096, rounded up to 4 KiB
  std::mt19937_64 gen(42);
  std::vector<uint8_t> buf(extent + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(gen());
  std::vector<size_t> lengths;
  for (size_t edge : {size_t{3 * 256}, size_t{3 * 8192}, size_t{2 * 3 * 8192} + 3 * 256}) {
    for (size_t d = 0; d <= 17; ++d) {
      lengths.push_back(edge + d);
      lengths.push_back(edge - d);
    }
  }
  for (int i = 0; i < 400; ++i) lengths.push_back(gen() % (5 * 3 * 8192));
  for (int i = 0; i < 8; ++i) lengths.push_back(gen() % (2 << 20));
  for (size_t n : lengths) {
    const size_t offset = gen() % 64;
    const auto crc = static_cast<uint32_t>(gen());
    ASSERT_EQ(Crc32c(crc, buf.data() + offset, n), Crc32cPortable(crc, buf.data() + offset, n))
        << "length " << n << " at offset " << offset << " after CRC " << crc;
  }
  EXPECT_EQ(Crc32c(buf.data() + 8, extent), Crc32cPortable(0, buf.data() + 8, extent));
}

TEST(ExtentAllocatorTest, FirstFitCoalescingGrowthAndCapacity) {
  ExtentAllocator a(4096, /*file_bytes=*/64 * 1024, /*capacity=*/96 * 1024, /*grow=*/16 * 1024);
  ExtentAllocator::Growth g;
  auto e1 = a.Allocate(5000, &g);  // rounds up to 8 KiB; grows file 0 to 16 KiB
  ASSERT_TRUE(e1.ok());
  EXPECT_EQ(*e1, (Extent{0, 0, 8192}));
  ASSERT_TRUE(g.needed);
  EXPECT_EQ(g.new_size, 16384u);
  a.CommitGrowth(g);
  auto e2 = a.Allocate(8192, &g);  // fits in the grown tail: no growth
  ASSERT_TRUE(e2.ok());
  EXPECT_FALSE(g.needed);
  EXPECT_EQ(*e2, (Extent{0, 8192, 8192}));
  auto e3 = a.Allocate(4096, &g);
  ASSERT_TRUE(e3.ok() && g.needed);
  a.CommitGrowth(g);
  EXPECT_EQ(a.used_bytes(), 20480u);
  a.Release(*e1);
  a.Release(*e2);  // coalesces with e1 into one 16 KiB run
  auto e4 = a.Allocate(16384, &g);
  ASSERT_TRUE(e4.ok());
  EXPECT_FALSE(g.needed);
  EXPECT_EQ(*e4, (Extent{0, 0, 16384}));
  // Too big for a file; then the capacity runs out.
  EXPECT_TRUE(absl::IsInvalidArgument(a.Allocate(65 * 1024, &g).status()));
  std::vector<Extent> more;
  while (true) {
    auto e = a.Allocate(16384, &g);
    if (!e.ok()) {
      EXPECT_TRUE(absl::IsResourceExhausted(e.status())) << e.status();
      EXPECT_NE(e.status().message().find("ssd_capacity_bytes"), std::string::npos);
      break;
    }
    a.CommitGrowth(g);
    more.push_back(*e);
    ASSERT_LT(more.size(), 10u);
  }
  EXPECT_LE(a.used_bytes(), 96u * 1024);
  // Rebuilding from the index: used extents must not overlap.
  ExtentAllocator b(4096, 64 * 1024, 0);
  b.AdoptFile(0, 32768);
  EXPECT_TRUE(b.MarkUsed(Extent{0, 4096, 8192}).ok());
  EXPECT_FALSE(b.MarkUsed(Extent{0, 8192, 4096}).ok());
  EXPECT_FALSE(b.MarkUsed(Extent{1, 0, 4096}).ok());
}

// Page-aligned buffer.
struct Aligned {
  explicit Aligned(size_t n) : size(n), p(static_cast<char*>(std::aligned_alloc(4096, n))) {}
  ~Aligned() { std::free(p); }
  size_t size;
  char* p;
};

std::unique_ptr<SsdTier> OpenTier(const std::string& dir, FaultInjectingIo** fault = nullptr,
                                  uint64_t capacity = 0) {
  UringOptions uo;
  uo.queue_depth = 4;
  uo.block_bytes = 8192;  // small, so one extent is many pieces in flight
  auto io = MakeUringIo(uo);
  EXPECT_TRUE(io.ok()) << io.status();
  std::unique_ptr<BlockIo> base = *std::move(io);
  if (fault != nullptr) {
    auto f = std::make_unique<FaultInjectingIo>(std::move(base));
    *fault = f.get();
    base = std::move(f);
  }
  SsdOptions so;
  so.dir = dir;
  so.file_bytes = 1 << 20;
  so.capacity_bytes = capacity;
  so.grow_bytes = 64 * 1024;
  auto t = SsdTier::Open(so, std::move(base));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

TEST(SsdTierTest, RoundTripRegisteredAndUnregistered) {
  TempDir dir;
  auto tier = OpenTier(dir.path());
  ASSERT_TRUE(tier);
  Aligned reg(1 << 18), plain(1 << 18);
  tier->RegisterRegions({iovec{reg.p, reg.size}});
  std::mt19937 gen(1);
  for (Aligned* buf : {&reg, &plain}) {
    for (uint64_t bytes : {1ull, 4095ull, 4096ull, 70001ull, 200000ull}) {
      for (uint64_t i = 0; i < bytes; ++i) buf->p[i] = static_cast<char>(gen());
      std::vector<char> expect(buf->p, buf->p + bytes);
      auto e = tier->Write(buf->p, bytes);
      ASSERT_TRUE(e.ok()) << e.status();
      EXPECT_EQ(e->extent.length % 4096, 0u);
      EXPECT_EQ(e->crc, Crc32c(expect.data(), bytes));
      std::memset(buf->p, 0, buf->size);
      ASSERT_TRUE(tier->Read(*e, buf->p, "test tensor").ok());
      EXPECT_EQ(0, std::memcmp(buf->p, expect.data(), bytes)) << bytes;
    }
  }
  EXPECT_TRUE(tier->io().registered());
  EXPECT_GT(tier->stats().bytes_written, 0u);
  ASSERT_TRUE(tier->Sync().ok());
}

TEST(SsdTierTest, ReadManyMatchesWhatWasWrittenAndNamesACorruptOne) {
  TempDir dir;
  auto tier = OpenTier(dir.path());
  ASSERT_TRUE(tier);
  constexpr int kN = 9;  // more extents than the queue depth (4), each of several blocks
  const uint64_t bytes = 30000;
  std::vector<std::unique_ptr<Aligned>> bufs;
  std::vector<std::vector<char>> expect(kN);
  std::vector<StoredExtent> stored(kN);
  std::vector<SsdTier::WriteItem> writes;
  std::mt19937 gen(7);
  for (int i = 0; i < kN; ++i) bufs.push_back(std::make_unique<Aligned>(32768));
  for (int i = 0; i < kN; ++i) {
    for (uint64_t b = 0; b < bytes; ++b) bufs[i]->p[b] = static_cast<char>(gen());
    expect[i].assign(bufs[i]->p, bufs[i]->p + bytes);
    writes.push_back({bufs[i]->p, bytes, &stored[i]});
  }
  ASSERT_TRUE(tier->WriteMany(writes).ok());
  std::vector<std::string> names;
  for (int i = 0; i < kN; ++i) names.push_back("tensor " + std::to_string(i));
  std::vector<SsdTier::ReadItem> reads;
  for (int i = 0; i < kN; ++i) {
    std::memset(bufs[i]->p, 0, bufs[i]->size);
    reads.push_back({&stored[i], bufs[i]->p, &names[i]});
  }
  ASSERT_TRUE(tier->ReadMany(reads).ok());
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(0, std::memcmp(bufs[i]->p, expect[i].data(), bytes)) << i;
  }
  ASSERT_TRUE(tier->Sync().ok());
  {  // Corrupt extent 5 only.
    std::fstream f(tier->FilePath(stored[5].extent.file),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(stored[5].extent.offset + 100));
    f.put(static_cast<char>(expect[5][100] ^ 1));
  }
  Status s = tier->ReadMany(reads);
  ASSERT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("tensor 5 is corrupt"), std::string::npos) << s;
}

// Eight requests of 1 to 10 pages, back to back in a real O_DIRECT file, written from `src` and
// read into `dst`, for a UringIo with a queue of 3 and 8 KiB pieces: requests of up to 5 pieces,
// more pieces than the queue holds.
struct PieceRequests {
  static constexpr uint64_t kLengths[] = {4096, 40960, 8192, 12288, 36864, 4096, 20480, 8192};
  static constexpr uint64_t kTotal = [] {
    uint64_t total = 0;
    for (uint64_t n : kLengths) total += n;
    return total;
  }();

  explicit PieceRequests(const std::string& dir)
      : path(dir + "/blocks.bin"),
        fd(::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644)),
        src(kTotal),
        dst(kTotal) {
    UringOptions uo;
    uo.queue_depth = 3;
    uo.block_bytes = 8192;
    io = MakeUringIo(uo);
    uint64_t off = 0;
    for (uint64_t n : kLengths) {
      writes.push_back(IoRequest{fd, off, src.p + off, n, true, &path});
      reads.push_back(IoRequest{fd, off, dst.p + off, n, false, &path});
      off += n;
    }
  }
  ~PieceRequests() {
    if (fd >= 0) ::close(fd);
  }
  void Fill(uint32_t seed) {
    std::mt19937 gen(seed);
    for (uint64_t i = 0; i < kTotal; ++i) src.p[i] = static_cast<char>(gen());
  }

  std::string path;
  int fd;
  Aligned src, dst;
  std::vector<IoRequest> writes, reads;
  StatusOr<std::unique_ptr<BlockIo>> io;
};

// The completion callback of BlockIo::Run, on a real file through io_uring: it fires exactly once
// per request, only when all of that request's bytes are in its buffer (checked against what was
// written, inside the callback), never for a request that failed, and its error becomes Run's.
TEST(BlockIoTest, DoneFiresOncePerRequestWithItsBytesInPlace) {
  TempDir dir;
  PieceRequests f(dir.path());
  ASSERT_GE(f.fd, 0);
  ASSERT_TRUE(f.io.ok()) << f.io.status();
  const uint64_t total = PieceRequests::kTotal;
  auto& io = f.io;
  auto& reads = f.reads;
  const std::string& path = f.path;
  const int fd = f.fd;
  char* dst = f.dst.p;
  const char* src = f.src.p;
  f.Fill(3);
  ASSERT_TRUE((*io)->Run(f.writes).ok());
  std::vector<int> calls(reads.size(), 0);
  std::memset(dst, 0, total);
  Status s = (*io)->Run(reads, [&](size_t i) -> Status {
    ++calls[i];
    const IoRequest& r = reads[i];
    EXPECT_EQ(0, std::memcmp(dst + r.offset, src + r.offset, r.length)) << "request " << i;
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i], 1) << "request " << i;
  EXPECT_EQ(0, std::memcmp(dst, src, total));

  // The callback's error is Run's; the other requests still complete.
  std::memset(dst, 0, total);
  std::fill(calls.begin(), calls.end(), 0);
  s = (*io)->Run(reads, [&](size_t i) -> Status {
    ++calls[i];
    return i == 4 ? absl::DataLossError("request 4 rejected") : absl::OkStatus();
  });
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("request 4 rejected"), std::string::npos) << s;
  for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i], 1) << "request " << i;
  EXPECT_EQ(0, std::memcmp(dst, src, total));

  // A request past the end of the file fails and gets no callback; the one before it does.
  std::vector<IoRequest> past = {reads[0], IoRequest{fd, total + 65536, dst, 4096, false, &path}};
  std::fill(calls.begin(), calls.end(), 0);
  s = (*io)->Run(past, [&](size_t i) -> Status {
    ++calls[i];
    return absl::OkStatus();
  });
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(calls[0], 1);
  EXPECT_EQ(calls[1], 0);
}

// The `sent` callback of BlockIo::Run (a write's checksum overlaps its transfer): once per
// request, after all of its pieces went to the kernel and before its transfer is reported done,
// so the first request's comes before any completion; its error is Run's, and the writes still
// land (read back with pread). The same through a FaultInjectingIo in front.
TEST(BlockIoTest, SentFiresOncePerRequestBeforeItCompletes) {
  TempDir dir;
  PieceRequests f(dir.path());
  ASSERT_GE(f.fd, 0);
  ASSERT_TRUE(f.io.ok()) << f.io.status();
  const size_t n = f.writes.size();
  FaultInjectingIo faulty(std::move(*f.io));
  for (int round = 0; round < 2; ++round) {
    f.Fill(5 + round);
    std::vector<std::string> events;
    std::vector<int> sent(n, 0), done(n, 0);
    Status s = faulty.Run(
        f.writes,
        [&](size_t i) -> Status {
          ++done[i];
          EXPECT_EQ(sent[i], 1) << "request " << i << " completed before it was sent";
          events.push_back(absl::StrCat("done ", i));
          return absl::OkStatus();
        },
        [&](size_t i) -> Status {
          ++sent[i];
          EXPECT_EQ(done[i], 0) << "request " << i;
          events.push_back(absl::StrCat("sent ", i));
          return round == 1 && i == 3 ? absl::InternalError("checksum 3 failed") : absl::OkStatus();
        });
    if (round == 0) {
      ASSERT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.message(), "checksum 3 failed") << s;
    }
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(sent[i], 1) << "request " << i;
      EXPECT_EQ(done[i], 1) << "request " << i;
    }
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(events.front(), "sent 0");  // while it is in flight, not after the batch
    ASSERT_EQ(::pread(f.fd, f.dst.p, PieceRequests::kTotal, 0),
              static_cast<ssize_t>(PieceRequests::kTotal));
    EXPECT_EQ(0, std::memcmp(f.dst.p, f.src.p, PieceRequests::kTotal)) << "round " << round;
  }
}

// The VmFlags line of the mapping that holds `p` in /proc/self/smaps.
std::string VmFlagsOf(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      inside = addr >= lo && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(IoBufferTest, SizesAlignmentZeroFillAndHugePageAdvice) {
  for (uint64_t bytes :
       {1ull, 4096ull, 70000ull, (2ull << 20) - 1, 2ull << 20, (2ull << 20) + 1, 33574912ull}) {
    auto b = IoBuffer::Allocate(bytes);
    ASSERT_TRUE(b.ok()) << b.status();
    const bool huge = bytes >= (2ull << 20);
    const uint64_t unit = huge ? (2ull << 20) : 4096;
    EXPECT_EQ(b->size(), (bytes + unit - 1) / unit * unit) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % unit, 0u) << bytes;
    EXPECT_EQ(b->huge_pages(), huge) << bytes;
    // Zero-filled and writable to its last byte.
    EXPECT_EQ(b->data()[0], 0);
    EXPECT_EQ(b->data()[b->size() - 1], 0);
    std::memset(b->data(), 0x7f, b->size());
    if (huge) {
      // MADV_HUGEPAGE shows as "hg" among the mapping's flags (whether the kernel then backs it
      // with huge pages depends on its THP setting and free memory).
      EXPECT_NE(VmFlagsOf(b->data()).find(" hg"), std::string::npos) << VmFlagsOf(b->data());
    }
  }
  // Moving hands the memory over; the moved-from buffer is empty.
  auto a = IoBuffer::Allocate(4096);
  ASSERT_TRUE(a.ok());
  char* p = a->data();
  IoBuffer moved = *std::move(a);
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(moved.size(), 4096u);
}

TEST(SsdTierTest, FlippedByteIsDetectedAndNamed) {
  TempDir dir;
  auto tier = OpenTier(dir.path());
  Aligned buf(65536);
  std::memset(buf.p, 0x5a, buf.size);
  auto e = tier->Write(buf.p, 50000);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(tier->Sync().ok());
  {  // Flip one byte in the middle of the extent, through the normal file system.
    std::fstream f(tier->FilePath(e->extent.file), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(e->extent.offset + 12345));
    f.put(0x5b);
  }
  Status s = tier->Read(*e, buf.p, "layer 1 expert 2 weights v3");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsDataLoss(s));
  EXPECT_NE(s.message().find("layer 1 expert 2 weights v3"), std::string::npos) << s;
  EXPECT_NE(s.message().find("data-00000.bin"), std::string::npos) << s;
}

TEST(SsdTierTest, TruncatedFileIsAClearError) {
  TempDir dir;
  auto tier = OpenTier(dir.path());
  Aligned buf(65536);
  std::memset(buf.p, 1, buf.size);
  auto e = tier->Write(buf.p, 65536);
  ASSERT_TRUE(e.ok());
  // Cut the file in the middle of the extent: the read comes back short, is requeued for the
  // rest, and then finds nothing.
  ASSERT_EQ(0, ::truncate(tier->FilePath(e->extent.file).c_str(),
                          static_cast<off_t>(e->extent.offset + 20480)));
  Status s = tier->Read(*e, buf.p, "a tensor");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("shorter than the index"), std::string::npos) << s;
}

// A file cut short while the tier was closed: reopened, the extents beyond its end are named
// without reading, and the ones before it still read.
TEST(SsdTierTest, ExtentBeyondAFileCutShortIsNamedAfterReopening) {
  TempDir dir;
  StoredExtent kept, lost;
  Aligned buf(65536);
  {
    auto tier = OpenTier(dir.path());
    std::memset(buf.p, 3, buf.size);
    auto a = tier->Write(buf.p, 65536);
    auto b = tier->Write(buf.p, 65536);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(tier->Sync().ok());
    kept = *a;
    lost = *b;
  }
  ASSERT_EQ(lost.extent.offset, kept.extent.offset + 65536);
  const std::string file = dir.File("data-00000.bin");
  ASSERT_EQ(0, ::truncate(file.c_str(), static_cast<off_t>(lost.extent.offset)));
  EXPECT_EQ(SsdTier::DataFiles(dir.path()), std::vector<std::string>{file});
  auto tier = OpenTier(dir.path());
  EXPECT_TRUE(tier->InFiles(kept.extent));
  EXPECT_FALSE(tier->InFiles(lost.extent));
  EXPECT_TRUE(tier->Read(kept, buf.p, "kept").ok());
  Status s = tier->Verify(lost, "layer 2 expert 1 weights v4");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("layer 2 expert 1 weights v4"), std::string::npos) << s;
  EXPECT_NE(s.message().find(file), std::string::npos) << s;
  EXPECT_NE(s.message().find(absl::StrFormat("holds only %d bytes", lost.extent.offset)),
            std::string::npos)
      << s;
  EXPECT_EQ(tier->stats().reads, 1u) << "the extent beyond the end was not read";
}

TEST(SsdTierTest, DiskFullIsResourceExhaustedAndReleasesSpace) {
  TempDir dir;
  FaultInjectingIo* fault = nullptr;
  auto tier = OpenTier(dir.path(), &fault);
  Aligned buf(1 << 16);
  std::memset(buf.p, 3, buf.size);
  auto ok = tier->Write(buf.p, 1 << 16);
  ASSERT_TRUE(ok.ok());
  const uint64_t used = tier->used_bytes();
  fault->set_write_budget(fault->bytes_written());  // the disk is now full
  auto full = tier->Write(buf.p, 1 << 16);
  ASSERT_FALSE(full.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(full.status())) << full.status();
  EXPECT_NE(full.status().message().find("full"), std::string::npos);
  EXPECT_EQ(tier->used_bytes(), used) << "a failed write must give its extent back";
  ASSERT_TRUE(tier->Read(*ok, buf.p, "earlier tensor").ok()) << "earlier data still readable";
  // A full disk when a file has to grow.
  fault->set_write_budget(-1);
  fault->set_allocate_budget(0);
  std::vector<StoredExtent> all;
  Status grow_error;
  for (int i = 0; i < 64 && grow_error.ok(); ++i) {
    auto e = tier->Write(buf.p, 1 << 16);
    if (e.ok())
      all.push_back(*e);
    else
      grow_error = e.status();
  }
  EXPECT_TRUE(absl::IsResourceExhausted(grow_error)) << grow_error;
  EXPECT_NE(grow_error.message().find("fallocate"), std::string::npos) << grow_error;
}

TEST(SsdTierTest, ReopenAdoptsFiles) {
  TempDir dir;
  StoredExtent kept;
  {
    auto tier = OpenTier(dir.path());
    Aligned buf(8192);
    std::memset(buf.p, 9, buf.size);
    auto e = tier->Write(buf.p, 8192);
    ASSERT_TRUE(e.ok());
    kept = *e;
    ASSERT_TRUE(tier->Sync().ok());
  }
  auto tier = OpenTier(dir.path());
  ASSERT_TRUE(tier->MarkUsed(kept.extent).ok());
  Aligned buf(8192);
  ASSERT_TRUE(tier->Read(kept, buf.p, "kept").ok());
  EXPECT_EQ(buf.p[100], 9);
  // New writes do not land on the kept extent.
  auto e = tier->Write(buf.p, 8192);
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(e->extent == kept.extent);
}

}  // namespace
}  // namespace strata::storage
