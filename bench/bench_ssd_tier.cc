// bench_ssd_tier: read and write bandwidth of strata's SSD tier against fio on the same file
// system.
//
// For each transfer size — 1 MiB blocks and the extents of two expert sizes — the tier writes and
// reads `--mib` MiB as extents of that size through its batched path (SsdTier::WriteMany /
// ReadMany: io_uring, O_DIRECT, registered buffers, queue depth 32, 1 MiB requests, CRC-32C of
// every extent computed and checked inside the timing), and fio does the same with its io_uring
// engine (--direct=1 --iodepth=32 --fixedbufs, bs = the extent size) on a file in the same folder.
// A cloud disk is noisy, so the two alternate within each of --rounds rounds and the medians are
// compared.
//
//   build/bin/bench_ssd_tier [--dir DIR] [--mib N] [--rounds R] [--io-block B] [--queue-depth Q]
//                            [--fio-mem huge|malloc] [--small] [--no-fio] [--json]
//
// The tier sends each extent as one request (storage.io_block_bytes = the largest extent, as fio
// sends one request of bs bytes); --io-block 1048576 measures the default 1 MiB requests.
// --queue-depth sets the tier's and fio's queue depth alike.
//
// The folder defaults to $TMPDIR (or /tmp), where the SSD tier lives unless storage.ssd_dir says
// otherwise; it must support O_DIRECT (not tmpfs).
//
// fio gets huge pages, as the tier has (storage/io_memory.h): with 4 KiB pages every direct
// transfer pins and maps one page per 4 KiB, which on the reference VM costs fio a third to a half
// of its 1 MiB read rate,
// and the table would compare the tier with fio's buffers rather than with the disk. fio has no
// option for transparent huge pages, so it gets hugetlb pages: `--iomem=mmaphuge` without a file,
// which maps its buffer anonymously with MAP_HUGETLB. That needs only 2 MiB pages in the kernel's
// pool (/proc/sys/vm/nr_hugepages), no hugetlbfs mount: a file on a mount would hold its pages
// after a killed fio until someone deleted it, an anonymous mapping gives them back when fio
// exits. (`--iomem=shmhuge` works too, but a SysV segment of a killed fio may outlive it the same
// way.) The bench tops the pool up to what fio's largest buffer needs (about (iodepth + 1) x bs,
// see FioHugePages), and puts nr_hugepages back when it ends, also on an
// error or SIGINT / SIGTERM. Where it cannot (not root, or the kernel finds too few free 2 MiB
// pages), it says how to reserve them and runs fio with malloc buffers; the table's "fio mem"
// column says which memory fio used. --fio-mem malloc asks for malloc buffers.
#include <fcntl.h>
#include <signal.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "core/common/clock.h"
#include "core/common/json.h"
#include "storage/block_io.h"
#include "storage/io_memory.h"
#include "storage/ssd_tier.h"

namespace strata::bench {
namespace {

struct Size {
  std::string name;
  uint64_t bytes;  // one extent (a multiple of 4 KiB)
};

// An FFN expert's blob as the tiered store keeps it: 2 x d_model x d_expert weights plus biases.
uint64_t ExpertBytes(uint64_t d_model, uint64_t d_expert) {
  const uint64_t b = (2 * d_model * d_expert + d_model + d_expert) * sizeof(float);
  return (b + storage::kSsdGranule - 1) / storage::kSsdGranule * storage::kSsdGranule;
}

struct Options {
  std::string dir;
  uint64_t mib = 512;
  int rounds = 5;
  bool json = false;
  bool fio = true;
  uint32_t queue_depth = 32;
  uint64_t io_block = 0;  // 0: the largest extent
  bool fio_huge = true;   // huge pages for fio's buffers where they can be reserved
};

constexpr uint64_t kHugePage = uint64_t{2} << 20;
constexpr const char* kNrHugePages = "/proc/sys/vm/nr_hugepages";

// fio's queue depth at bs: fio registers one buffer of iodepth x bs, and io_uring takes at most
// 1 GiB per buffer.
uint64_t FioDepth(const Options& o, uint64_t bs) {
  return std::max<uint64_t>(1, std::min<uint64_t>(o.queue_depth, (1ull << 30) / bs));
}

// 2 MiB pages that fio maps at bs with --iomem=mmaphuge: (iodepth + 1) x bs plus 4 KiB - 1 for
// O_DIRECT alignment, rounded up to whole huge pages, and one page more. Found by bisecting
// nr_hugepages with fio 3.33 (1 MiB at depth 32: 18 pages; 33574912 bytes at depth 31: 514);
// two pages of slack for other versions.
uint64_t FioHugePages(const Options& o, uint64_t bs) {
  return ((FioDepth(o, bs) + 1) * bs + 4095 + kHugePage - 1) / kHugePage + 1 + 2;
}

// One fio job on `file`, at bs = the extent size.
double Fio(const Options& o, const std::string& file, const std::string& rw, uint64_t bs,
           uint64_t total) {
  return RunFio(file, rw, bs, total, FioDepth(o, bs), /*fixed_buffers=*/true,
                o.fio_huge ? "mmaphuge" : "");
}

// A number from /proc (nr_hugepages) or the value of `key` in /proc/meminfo; -1 when unreadable.
int64_t ReadProcNumber(const char* path, const char* key = nullptr) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (key == nullptr) return std::stoll(line);
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::strlen(key)));
  }
  return -1;
}

// nr_hugepages as it was before the bench raised it (-1: untouched), for the exit paths: a
// signal handler may only write it back with write(2).
volatile sig_atomic_t saved_nr_hugepages = -1;

bool WriteNrHugePages(int64_t n) {
  char text[32];
  const int len = std::snprintf(text, sizeof(text), "%lld\n", static_cast<long long>(n));
  const int fd = ::open(kNrHugePages, O_WRONLY);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text, static_cast<size_t>(len)) == len;
  ::close(fd);
  return ok;
}

void RestoreOnSignal(int sig) {
  if (saved_nr_hugepages >= 0) WriteNrHugePages(saved_nr_hugepages);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Huge pages in the kernel's pool for fio, given back (nr_hugepages restored) when destroyed.
class HugePageReservation {
 public:
  // At least `pages` free 2 MiB pages, raising nr_hugepages if needed; false with *why (what
  // failed and how to set it up by hand) when the pool cannot be made large enough.
  bool Reserve(uint64_t pages, std::string* why) {
    const int64_t nr = ReadProcNumber(kNrHugePages);
    const int64_t free = ReadProcNumber("/proc/meminfo", "HugePages_Free:");
    const auto want = static_cast<int64_t>(pages);
    const std::string how = absl::StrFormat(
        "to give fio huge pages, reserve them before the run, as root: echo %d > %s (and "
        "echo %d > %s after it); the bench does this itself when run as root",
        std::max<int64_t>(nr, 0) + want, kNrHugePages, std::max<int64_t>(nr, 0), kNrHugePages);
    if (nr < 0 || free < 0) {
      *why = absl::StrCat("cannot read ", kNrHugePages, " or /proc/meminfo; ", how);
      return false;
    }
    if (free >= want) return true;
    saved_nr_hugepages = static_cast<sig_atomic_t>(nr);
    ::signal(SIGINT, RestoreOnSignal);
    ::signal(SIGTERM, RestoreOnSignal);
    if (!WriteNrHugePages(nr + want - free)) {
      const int err = errno;
      saved_nr_hugepages = -1;  // unchanged: nothing to restore
      Restore();
      *why = absl::StrCat("cannot write ", kNrHugePages, " (", std::strerror(err), "); ", how);
      return false;
    }
    const int64_t now_free = ReadProcNumber("/proc/meminfo", "HugePages_Free:");
    if (now_free < want) {
      Restore();
      *why = absl::StrFormat(
          "the kernel found only %d of the %d free 2 MiB pages fio needs (memory too "
          "fragmented); %s, or right after boot",
          now_free, want, how);
      return false;
    }
    return true;
  }
  ~HugePageReservation() { Restore(); }

 private:
  void Restore() {
    if (saved_nr_hugepages >= 0 && !WriteNrHugePages(saved_nr_hugepages)) {
      std::fprintf(stderr, "bench_ssd_tier: could not restore %s to %d: %s\n", kNrHugePages,
                   static_cast<int>(saved_nr_hugepages), std::strerror(errno));
    }
    saved_nr_hugepages = -1;
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
  }
};

struct Row {
  std::string op, size_name;
  uint64_t block_bytes = 0;
  std::vector<double> strata, fio;
};

int Main(int argc, char** argv) {
  Options o;
  o.dir = ScratchDir();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return FlagValue("bench_ssd_tier", argc, argv, &i); };
    if (a == "--json") {
      o.json = true;
    } else if (a == "--small") {
      o.mib = 64;
      o.rounds = 1;
    } else if (a == "--no-fio") {
      o.fio = false;
    } else if (a == "--dir") {
      o.dir = value();
    } else if (a == "--mib") {
      o.mib = std::stoull(value());
    } else if (a == "--io-block") {
      o.io_block = std::stoull(value());
    } else if (a == "--queue-depth") {
      o.queue_depth = static_cast<uint32_t>(std::stoul(value()));
    } else if (a == "--rounds") {
      o.rounds = std::stoi(value());
    } else if (a == "--fio-mem") {
      const std::string mem = value();
      if (mem != "huge" && mem != "malloc") {
        std::fprintf(stderr, "bench_ssd_tier: --fio-mem is huge or malloc, not '%s'\n",
                     mem.c_str());
        return 2;
      }
      o.fio_huge = mem == "huge";
    } else {
      std::fprintf(stderr,
                   "usage: bench_ssd_tier [--dir DIR] [--mib N] [--rounds R] [--io-block B] "
                   "[--queue-depth Q] [--fio-mem huge|malloc] [--small] [--no-fio] [--json]\n");
      return 2;
    }
  }
  if (o.fio && !FioAvailable("bench_ssd_tier", "to measure the tier alone")) return 1;
  const std::string dir = o.dir + "/bench_ssd_tier." + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  // The folder goes on every way out (declared before the tier, so it outlives its files).
  struct RemoveOnExit {
    std::string dir;
    ~RemoveOnExit() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove_dir{dir};
  const uint64_t total = o.mib << 20;

  std::vector<Size> sizes = {{"1 MiB block", 1 << 20},
                             {"expert 256x512", ExpertBytes(256, 512)},
                             {"expert 1024x4096", ExpertBytes(1024, 4096)}};

  const uint64_t max_extent = std::max_element(sizes.begin(), sizes.end(), [](auto& a, auto& b) {
                                return a.bytes < b.bytes;
                              })->bytes;
  HugePageReservation huge_pages;
  if (o.fio && o.fio_huge) {
    uint64_t pages = 0;
    for (const Size& s : sizes) pages = std::max(pages, FioHugePages(o, s.bytes));
    std::string why;
    if (!huge_pages.Reserve(pages, &why)) {
      std::fprintf(stderr, "bench_ssd_tier: fio runs with malloc buffers, not huge pages: %s\n",
                   why.c_str());
      o.fio_huge = false;
    }
  }
  const char* fio_mem = o.fio_huge ? "huge" : "malloc";
  if (o.io_block == 0) o.io_block = max_extent;
  storage::UringOptions uo;
  uo.queue_depth = o.queue_depth;
  // One request per extent, as fio sends one request of bs bytes: storage.io_block_bytes at least
  // the largest extent (the default, 1 MiB, splits larger extents into 1 MiB requests).
  uo.block_bytes = o.io_block;
  auto io = storage::MakeUringIo(uo);
  if (!io.ok()) {
    std::fprintf(stderr, "bench_ssd_tier: %s\n", std::string(io.status().message()).c_str());
    return 1;
  }
  storage::SsdOptions so;
  so.dir = dir;
  so.file_bytes = 4ull << 30;
  auto tier = storage::SsdTier::Open(so, *std::move(io));
  if (!tier.ok()) {
    std::fprintf(stderr, "bench_ssd_tier: %s\n", std::string(tier.status().message()).c_str());
    return 1;
  }
  // One registered buffer for all extents, filled with random bytes (no zero pages).
  const uint64_t arena_bytes = std::max(total, max_extent) + max_extent;
  auto arena_buf = storage::IoBuffer::Allocate(arena_bytes);
  if (!arena_buf.ok()) {
    std::fprintf(stderr, "bench_ssd_tier: %s\n", std::string(arena_buf.status().message()).c_str());
    return 1;
  }
  char* arena = arena_buf->data();
  std::mt19937_64 gen(1);
  for (uint64_t i = 0; i < arena_bytes / 8; ++i) {
    const uint64_t v = gen();
    std::memcpy(arena + 8 * i, &v, 8);
  }
  (*tier)->RegisterRegions({iovec{arena, arena_bytes}});

  std::vector<Row> rows;
  for (const Size& s : sizes) {
    for (const char* op : {"write", "read"}) {
      Row r;
      r.op = op;
      r.size_name = s.name;
      r.block_bytes = s.bytes;
      rows.push_back(r);
    }
  }
  if (!o.json) {
    std::printf(
        "bench_ssd_tier: %s; folder %s; %d MiB per measurement, %d rounds; queue depth %d, "
        "requests of up to %d bytes; fio buffers: %s\n",
        HostDescription().c_str(), o.dir.c_str(), static_cast<int>(o.mib), o.rounds,
        static_cast<int>(o.queue_depth), static_cast<int>(o.io_block),
        !o.fio       ? "none (--no-fio)"
        : o.fio_huge ? "2 MiB huge pages (--iomem=mmaphuge)"
                     : "malloc (4 KiB pages)");
  }
  for (int round = 0; round < o.rounds; ++round) {
    for (size_t si = 0; si < sizes.size(); ++si) {
      const Size& s = sizes[si];
      const uint64_t n = std::max<uint64_t>(1, total / s.bytes);
      const uint64_t bytes = n * s.bytes;
      std::vector<storage::StoredExtent> stored(n);
      std::vector<storage::SsdTier::WriteItem> writes;
      for (uint64_t i = 0; i < n; ++i) writes.push_back({arena + i * s.bytes, s.bytes, &stored[i]});
      // fio's file for this size stays from round to round, as the tier's data file does: after
      // the first round both overwrite blocks they wrote before (on the reference VM fio writes a
      // fresh file at about half the rate at which it overwrites one).
      const std::string fio_file = absl::StrCat(dir, "/fio-", si, ".dat");
      Row& w = rows[2 * si];
      Row& rd = rows[2 * si + 1];
      // write: fio and the tier, in alternating order from round to round
      const bool fio_first = round % 2 == 0;
      if (o.fio && fio_first) w.fio.push_back(Fio(o, fio_file, "write", s.bytes, bytes));
      Stopwatch sw;
      Status st = (*tier)->WriteMany(writes);
      const double ws = sw.Seconds();
      if (o.fio && !fio_first) w.fio.push_back(Fio(o, fio_file, "write", s.bytes, bytes));
      if (!st.ok()) {
        std::fprintf(stderr, "bench_ssd_tier: write failed: %s\n",
                     std::string(st.message()).c_str());
        return 1;
      }
      w.strata.push_back(static_cast<double>(bytes) / ws / 1e9);
      // read: fio (its file was just written) and the tier
      if (o.fio && fio_first) rd.fio.push_back(Fio(o, fio_file, "read", s.bytes, bytes));
      std::vector<std::string> names(1, "bench extent");
      std::vector<storage::SsdTier::ReadItem> reads;
      for (uint64_t i = 0; i < n; ++i)
        reads.push_back({&stored[i], arena + i * s.bytes, &names[0]});
      sw.Reset();
      st = (*tier)->ReadMany(reads);
      const double rs = sw.Seconds();
      if (!st.ok()) {
        std::fprintf(stderr, "bench_ssd_tier: read failed: %s\n",
                     std::string(st.message()).c_str());
        return 1;
      }
      rd.strata.push_back(static_cast<double>(bytes) / rs / 1e9);
      if (o.fio && !fio_first) rd.fio.push_back(Fio(o, fio_file, "read", s.bytes, bytes));
      for (const auto& e : stored) (*tier)->Free(e.extent);
    }
  }
  tier->reset();

  if (!o.json) {
    std::printf("%-6s %-17s %12s %11s %10s %7s %7s\n", "op", "extent", "block_bytes", "strata GB/s",
                "fio GB/s", "fio mem", "of fio");
  }
  bool below = false;
  for (const Row& r : rows) {
    const double g = MedianOf(r.strata), f = MedianOf(r.fio), frac = g / f;
    below |= std::isfinite(frac) && frac < 0.9;
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("op", r.op)
          .Field("extent", r.size_name)
          .Field("block_bytes", r.block_bytes)
          .Field("gbps", g)
          .Field("fio_gbps", f)
          .Field("fraction_of_fio", frac)
          .Field("fio_mem", std::string(o.fio ? fio_mem : "none"))
          .Field("mib", o.mib)
          .Field("rounds", o.rounds)
          .Field("queue_depth", static_cast<int64_t>(o.queue_depth))
          .EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("%-6s %-17s %12llu %11.3f %10.3f %7s %6.0f%%\n", r.op.c_str(),
                  r.size_name.c_str(), static_cast<unsigned long long>(r.block_bytes), g, f,
                  o.fio ? fio_mem : "none", 100 * frac);
    }
  }
  if (!o.json) {
    std::printf("medians of %d rounds; target: at least 90%% of fio%s\n", o.rounds,
                below ? " (some rows are below it)" : "");
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
