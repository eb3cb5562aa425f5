// bench_tier_gpu: the tiered store with its device tier on the GPU (StoreOptions::device =
// cuda:0), against raw CUDA copies and fio in the same run.
//
//   h2d          The store's copy path up: AcquireDevice, one at a time in cyclic order, of
//                --tensors tensors of --tensor-mib MiB that are resident in the pinned host tier
//                (the device tier holds 3, so every acquire copies: the copy stage's
//                cudaMemcpyAsync on its own stream, then a stream sync). Baseline: the same copies
//                with cudaMemcpyAsync from a cudaHostAlloc buffer into cudaMalloc memory on a
//                non-blocking stream, synchronized after each.
//   d2h          Write-backs: that many dirty gradients in HBM (AcquireDevice zero=true +
//                ReleaseDevice modified, untimed), then WriteBack of each and DrainWriteBacks.
//                Baseline: the same raw copies, device -> pinned host.
//   ssd->device  Tensors on the SSD tier only (host tier 7 slots, device tier 3: the minimums for
//                one compute thread, so --tensors must be at least 10), AcquireDevice in cyclic
//                order with PrefetchDevice of the next: every tensor is read from the SSD into a
//                pinned host slot (io_uring, O_DIRECT, CRC-32C checked) and copied into HBM, the
//                two stages overlapping. Baselines: fio reading a file of the same total size in
//                the same folder sequentially (io_uring engine, --direct=1, bs = the store's
//                request size, iodepth = its queue depth, fixed buffers) when fio is on PATH; and
//                the store's own SSD -> host rate alone (the next row).
//   ssd->host    AcquireHost in the same order with PrefetchHost of the next, against fio.
//
// Each measurement moves --tensors x --tensor-mib MiB. After one untimed round, the store and its
// baselines alternate (in rotating order) within each of --rounds rounds; a row compares medians.
// GB/s = 1e9 bytes per second; ratio = strata / baseline. After timing every tensor's bytes are
// compared with the pattern written (#wrong; the program exits 1 if any differs). A failed CUDA
// call or store operation prints what failed and exits 1. Without a GPU it prints one line and
// exits 0.
//
//   build/bin/bench_tier_gpu [--dir DIR] [--tensor-mib M] [--tensors N] [--rounds R] [--json]
//
// The SSD folder is a fresh one under --dir (default $TMPDIR or /tmp), removed at exit; it must
// support O_DIRECT (not tmpfs). The first line names the GPU (with --json, a JSON object with the
// device and the run's parameters; then one object per row).
#include <cuda_runtime.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "core/common/clock.h"
#include "core/common/json.h"
#include "core/device/device.h"
#include "storage/tiered_store.h"

namespace strata::bench {
namespace {

using storage::StoreOptions;
using storage::StoreStats;
using storage::TensorKey;
using storage::TensorKind;
using storage::TieredExpertStore;

#define CUDA_CHECK(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t err_ = (expr);                                                              \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "bench_tier_gpu: %s failed: %s (%s)\n", #expr, cudaGetErrorName(err_), \
                   cudaGetErrorString(err_));                                                     \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// The folder this run made, removed at exit (also when a failure exits early).
std::string* g_made_dir = nullptr;
void RemoveMadeDir() {
  if (g_made_dir == nullptr) return;
  std::error_code ec;
  std::filesystem::remove_all(*g_made_dir, ec);
}

[[noreturn]] void Die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "bench_tier_gpu: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}
void Check(const std::string& what, const Status& s) {
  if (!s.ok()) Die(what, s);
}
template <typename T>
T Value(const std::string& what, StatusOr<T> v) {
  if (!v.ok()) Die(what, v.status());
  return *std::move(v);
}

void Warn(const std::string& what) {
  std::fprintf(stderr, "bench_tier_gpu: warning: %s\n", what.c_str());
}

struct Options {
  std::string dir;  // parent of the run's folder; empty: $TMPDIR or /tmp
  uint64_t tensor_mib = 64;
  int tensors = 16;
  int rounds = 5;
  bool json = false;
};

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Tensor i's contents under `seed`: pseudo-random 64-bit words (no zero pages, nothing repeated
// between tensors). `dst` is 8-byte aligned and `bytes` a multiple of 8.
void Fill(uint64_t seed, int i, void* dst, uint64_t bytes) {
  auto* w = static_cast<uint64_t*>(dst);
  const uint64_t base = Mix(seed * 1000003u + static_cast<uint64_t>(i));
  for (uint64_t j = 0; j < bytes / 8; ++j) w[j] = Mix(base ^ (j * 0xD6E8FEB86659FD93ull));
}

// Compares host memory with the pattern.
bool Matches(uint64_t seed, int i, const void* got, uint64_t bytes, std::vector<uint64_t>* want) {
  want->resize(bytes / 8);
  Fill(seed, i, want->data(), bytes);
  return std::memcmp(got, want->data(), bytes) == 0;
}

struct PinnedFree {
  void operator()(char* p) const { cudaFreeHost(p); }
};
struct DeviceFree {
  void operator()(char* p) const { cudaFree(p); }
};

// n copies of `bytes` from src + i * bytes to dst + i * bytes on `stream`, each synchronized as
// the store's copy stage synchronizes each tensor's copy; GB/s.
double RawCopies(char* dst, const char* src, uint64_t bytes, int n, cudaStream_t stream) {
  Stopwatch sw;
  for (int i = 0; i < n; ++i) {
    const uint64_t off = static_cast<uint64_t>(i) * bytes;
    CUDA_CHECK(cudaMemcpyAsync(dst + off, src + off, bytes, cudaMemcpyDefault, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return static_cast<double>(n) * static_cast<double>(bytes) / sw.Seconds() / 1e9;
}

struct Row {
  std::string op;        // what moves where
  std::string baseline;  // what it is compared with
  std::vector<double> gbps, baseline_gbps;
  int wrong = 0;  // tensors whose bytes differed after the trip
};

// One untimed call of each, then `rounds` rounds with the calls in rotating order.
void Alternate(int rounds, const std::vector<std::function<void(bool timed)>>& fns) {
  for (const auto& f : fns) f(false);
  for (int r = 0; r < rounds; ++r) {
    for (size_t j = 0; j < fns.size(); ++j) fns[(j + static_cast<size_t>(r)) % fns.size()](true);
  }
}

StoreOptions BaseOptions(uint64_t tensor_bytes, const std::string& dir, int device_slots,
                         int host_slots) {
  StoreOptions so;
  so.tensor_bytes = tensor_bytes;
  so.device = Device::Cuda(0);
  const uint64_t slot = (tensor_bytes + 4095) / 4096 * 4096;
  so.device_budget_bytes = static_cast<uint64_t>(device_slots) * slot;
  so.host_budget_bytes = static_cast<uint64_t>(host_slots) * slot;
  so.ssd.dir = dir;
  so.ssd.file_bytes = std::max<uint64_t>(4ull << 30, 2 * slot);
  so.compute_threads = 1;
  return so;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return FlagValue("bench_tier_gpu", argc, argv, &i); };
    if (a == "--json") {
      o.json = true;
    } else if (a == "--dir") {
      o.dir = value();
    } else if (a == "--tensor-mib") {
      o.tensor_mib = std::stoull(value());
    } else if (a == "--tensors") {
      o.tensors = std::stoi(value());
    } else if (a == "--rounds") {
      o.rounds = std::stoi(value());
    } else {
      std::fprintf(stderr,
                   "usage: bench_tier_gpu [--dir DIR] [--tensor-mib M] [--tensors N] [--rounds R] "
                   "[--json]\n");
      return 2;
    }
  }
  if (CudaDeviceCount() == 0) {
    std::string why = CudaDeviceDescription(0);
    const std::string prefix = "no CUDA device (";
    if (why.rfind(prefix, 0) == 0 && why.back() == ')') {
      why = why.substr(prefix.size(), why.size() - prefix.size() - 1);
    }
    std::printf("bench_tier_gpu: no CUDA device (%s); nothing measured\n", why.c_str());
    return 0;
  }
  const StoreOptions defaults;
  const int min_device = defaults.MinDeviceSlots();  // one compute thread
  const int min_host = defaults.MinHostSlots();
  // The SSD measurements need every acquire to miss the host tier: with the tensor being read and
  // the one prefetched in flight, a cycle only a slot or two longer than the tier lets some
  // survive.
  const int min_tensors = min_host + 3;
  if (o.tensor_mib == 0 || o.rounds < 1 || o.tensors < min_tensors) {
    std::fprintf(stderr,
                 "bench_tier_gpu: need --tensor-mib >= 1, --rounds >= 1 and --tensors >= %d (the "
                 "host tier holds %d, and every SSD measurement must read each tensor from the "
                 "SSD)\n",
                 min_tensors, min_host);
    return 2;
  }
  CUDA_CHECK(cudaSetDevice(0));

  const char* tmp = std::getenv("TMPDIR");
  const std::string parent = !o.dir.empty() ? o.dir : tmp != nullptr && *tmp ? tmp : "/tmp";
  std::string tmpl = parent + "/bench_tier_gpu.XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    std::fprintf(stderr, "bench_tier_gpu: cannot make a folder under %s: %s\n", parent.c_str(),
                 std::strerror(errno));
    return 1;
  }
  const std::string dir = tmpl;
  g_made_dir = new std::string(dir);
  std::atexit(RemoveMadeDir);

  const int n = o.tensors;
  const uint64_t bytes = o.tensor_mib << 20;
  const uint64_t total = static_cast<uint64_t>(n) * bytes;
  const double total_d = static_cast<double>(total);
  std::vector<TensorKey> weights, grads;
  for (int i = 0; i < n; ++i) {
    weights.push_back(TensorKey{0, i, TensorKind::kWeights});
    grads.push_back(TensorKey{0, i, TensorKind::kGrad});
  }
  const storage::UringOptions io;  // the store's SSD requests (defaults)
  int fio_status = 0;
  Capture("fio --version 2>&1", &fio_status);
  const bool have_fio = fio_status == 0;

  const std::string device = CudaDeviceDescription(0);
  if (o.json) {
    JsonWriter j;
    j.BeginObject()
        .Field("device", device)
        .Field("host", HostDescription())
        .Field("dir", dir)
        .Field("tensor_bytes", bytes)
        .Field("tensors", n)
        .Field("rounds", o.rounds)
        .Field("io_block_bytes", io.block_bytes)
        .Field("queue_depth", static_cast<int64_t>(io.queue_depth))
        .Field("fio", have_fio)
        .EndObject();
    std::printf("%s\n", j.str().c_str());
  } else {
    std::printf("bench_tier_gpu: %s\n", device.c_str());
    std::printf(
        "host: %s; folder %s; %d tensors of %llu MiB (%llu MiB per measurement); %d rounds; SSD "
        "requests of %llu KiB at queue depth %u\n",
        HostDescription().c_str(), dir.c_str(), n, static_cast<unsigned long long>(o.tensor_mib),
        static_cast<unsigned long long>(total >> 20), o.rounds,
        static_cast<unsigned long long>(io.block_bytes >> 10), io.queue_depth);
  }
  if (!have_fio) std::fprintf(o.json ? stderr : stdout, "fio: not installed\n");
  std::fflush(stdout);

  constexpr uint64_t kWeightSeed = 11, kGradSeed = 12, kSsdSeed = 13;
  std::vector<uint64_t> got(bytes / 8), want;
  Row h2d{"h2d", "cudaMemcpyAsync pinned->device", {}, {}, 0};
  Row d2h{"d2h", "cudaMemcpyAsync device->pinned", {}, {}, 0};
  Row ssd_fio{"ssd->device", have_fio ? "fio read" : "fio read (not installed)", {}, {}, 0};
  Row ssd_alone{"ssd->device", "store ssd->host alone", {}, {}, 0};
  Row host_fio{"ssd->host", have_fio ? "fio read" : "fio read (not installed)", {}, {}, 0};

  // --- (a) host <-> device copies ----------------------------------------------------------
  {
    char* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p), total, cudaHostAllocPortable));
    std::unique_ptr<char, PinnedFree> raw_host(p);
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), total));
    std::unique_ptr<char, DeviceFree> raw_dev(p);
    for (int i = 0; i < n; ++i) Fill(kWeightSeed, i, raw_host.get() + i * bytes, bytes);
    CUDA_CHECK(cudaMemset(raw_dev.get(), 0, total));
    CUDA_CHECK(cudaDeviceSynchronize());
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    {  // h2d: every tensor resident in the pinned host tier; 3 device slots, cyclic order
      auto store = Value("creating the store", TieredExpertStore::Create(BaseOptions(
                                                   bytes, dir + "/h2d", min_device, n + min_host)));
      for (int i = 0; i < n; ++i) {
        float* h = Value("AcquireHost", store->AcquireHost(weights[i]));
        Fill(kWeightSeed, i, h, bytes);
        store->ReleaseHost(weights[i], /*modified=*/true);
      }
      bool warned = false;
      Alternate(
          o.rounds,
          {[&](bool timed) {
             store->TakeStats();
             Stopwatch sw;
             for (const TensorKey& k : weights) {
               Value("AcquireDevice", store->AcquireDevice(k));
               store->ReleaseDevice(k, false);
             }
             const double s = sw.Seconds();
             const StoreStats st = store->TakeStats();
             if (!warned &&
                 (st.device.misses != static_cast<uint64_t>(n) || st.ssd.bytes_out != 0)) {
               Warn(absl::StrFormat("h2d: %d of %d acquires copied, %d bytes read from the SSD",
                                    st.device.misses, n, st.ssd.bytes_out));
               warned = true;
             }
             if (timed) h2d.gbps.push_back(total_d / s / 1e9);
           },
           [&](bool timed) {
             const double g = RawCopies(raw_dev.get(), raw_host.get(), bytes, n, stream);
             if (timed) h2d.baseline_gbps.push_back(g);
           }});
      for (int i = 0; i < n; ++i) {
        float* d = Value("AcquireDevice", store->AcquireDevice(weights[i]));
        CopyBytes(got.data(), d, bytes);
        store->ReleaseDevice(weights[i], false);
        if (!Matches(kWeightSeed, i, got.data(), bytes, &want)) h2d.wrong++;
      }
    }

    {  // d2h: every gradient dirty in HBM (room for all), written back into free host slots
      auto store =
          Value("creating the store", TieredExpertStore::Create(BaseOptions(
                                          bytes, dir + "/d2h", n + min_device, n + min_host)));
      bool warned = false;
      Alternate(
          o.rounds,
          {[&](bool timed) {
             // New gradients (their old host copies are dropped), zeroed by
             // cudaMemset; finished before the timing starts.
             for (const TensorKey& k : grads) {
               Value("AcquireDevice", store->AcquireDevice(k, /*zero=*/true));
               store->ReleaseDevice(k, /*modified=*/true);
             }
             CUDA_CHECK(cudaDeviceSynchronize());
             store->TakeStats();
             Stopwatch sw;
             for (const TensorKey& k : grads) store->WriteBack(k);
             Check("DrainWriteBacks", store->DrainWriteBacks());
             const double s = sw.Seconds();
             const StoreStats st = store->TakeStats();
             if (!warned && (st.device.bytes_out != total || st.ssd.bytes_in != 0)) {
               Warn(absl::StrFormat("d2h: %d of %d bytes written back, %d bytes written to the SSD",
                                    st.device.bytes_out, total, st.ssd.bytes_in));
               warned = true;
             }
             if (timed) d2h.gbps.push_back(total_d / s / 1e9);
           },
           [&](bool timed) {
             const double g = RawCopies(raw_host.get(), raw_dev.get(), bytes, n, stream);
             if (timed) d2h.baseline_gbps.push_back(g);
           }});
      // Check: known values written into HBM (from pinned memory, so each copy has landed when
      // CopyBytes returns), written back, read on the host.
      char* staging = raw_host.get();
      for (int i = 0; i < n; ++i) {
        float* d = Value("AcquireDevice", store->AcquireDevice(grads[i], /*zero=*/true));
        Fill(kGradSeed, i, staging, bytes);
        CopyBytes(d, staging, bytes);
        store->ReleaseDevice(grads[i], /*modified=*/true);
        store->WriteBack(grads[i]);
      }
      Check("DrainWriteBacks", store->DrainWriteBacks());
      for (int i = 0; i < n; ++i) {
        float* h = Value("AcquireHost", store->AcquireHost(grads[i]));
        if (!Matches(kGradSeed, i, h, bytes, &want)) d2h.wrong++;
        store->ReleaseHost(grads[i], false);
      }
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
  }

  // --- (b) SSD -> device ------------------------------------------------------------------------
  {
    auto store =
        Value("creating the store",
              TieredExpertStore::Create(BaseOptions(bytes, dir + "/ssd", min_device, min_host)));
    // Write the tensors (dirty host copies overflow the host tier into the SSD tier), then push
    // the last ones out with as many never-written (clean, zero) tensors as the host tier holds.
    for (int i = 0; i < n; ++i) {
      float* h = Value("AcquireHost", store->AcquireHost(weights[i]));
      Fill(kSsdSeed, i, h, bytes);
      store->ReleaseHost(weights[i], /*modified=*/true);
    }
    for (int j = 0; j < min_host; ++j) {
      const TensorKey filler{1, j, TensorKind::kAdamM};
      Value("AcquireHost", store->AcquireHost(filler));
      store->ReleaseHost(filler, false);
    }
    store->WaitIdle();
    {
      std::vector<float> scratch(bytes / 4);
      int on_ssd = 0;
      for (const TensorKey& k : weights) {
        TieredExpertStore::Snapshot snap;
        Check("SnapshotTensor", store->SnapshotTensor(k, scratch.data(), &snap));
        if (snap.has_stored) {
          on_ssd++;
          store->UnrefVersion(k, snap.version);
        }
      }
      if (on_ssd != n)
        Warn(absl::StrFormat("only %d of %d tensors are on the SSD tier", on_ssd, n));
    }
    bool warned = false;
    auto measure = [&](bool to_device, std::vector<double>* out) {
      store->TakeStats();
      Stopwatch sw;
      auto prefetch = [&](int i) {
        std::span<const TensorKey> one(&weights[i], 1);
        if (to_device) {
          store->PrefetchDevice(one);
        } else {
          store->PrefetchHost(one);
        }
      };
      prefetch(0);
      for (int i = 0; i < n; ++i) {
        if (i + 1 < n) prefetch(i + 1);
        if (to_device) {
          Value("AcquireDevice", store->AcquireDevice(weights[i]));
          store->ReleaseDevice(weights[i], false);
        } else {
          Value("AcquireHost", store->AcquireHost(weights[i]));
          store->ReleaseHost(weights[i], false);
        }
      }
      const double s = sw.Seconds();
      store->WaitIdle();
      const StoreStats st = store->TakeStats();
      if (!warned && st.ssd.bytes_out < total) {
        Warn(absl::StrFormat("%s: %d of %d bytes read from the SSD",
                             to_device ? "ssd->device" : "ssd->host", st.ssd.bytes_out, total));
        warned = true;
      }
      if (out != nullptr) out->push_back(total_d / s / 1e9);
    };
    std::vector<double> to_device, to_host, fio;
    std::vector<std::function<void(bool)>> fns = {
        [&](bool timed) { measure(true, timed ? &to_device : nullptr); },
        [&](bool timed) { measure(false, timed ? &to_host : nullptr); }};
    if (have_fio) {
      fns.push_back([&](bool timed) {
        if (!timed) return;  // fio lays its file out before it measures
        fio.push_back(
            RunFio(dir + "/fio.dat", "read", io.block_bytes, total, io.queue_depth, true));
      });
    }
    Alternate(o.rounds, fns);
    ssd_fio.gbps = to_device;
    ssd_fio.baseline_gbps = fio;
    ssd_alone.gbps = to_device;
    ssd_alone.baseline_gbps = to_host;
    host_fio.gbps = to_host;
    host_fio.baseline_gbps = fio;
    for (int i = 0; i < n; ++i) {
      float* d = Value("AcquireDevice", store->AcquireDevice(weights[i]));
      CopyBytes(got.data(), d, bytes);
      store->ReleaseDevice(weights[i], false);
      if (!Matches(kSsdSeed, i, got.data(), bytes, &want)) ssd_fio.wrong++;
    }
    ssd_alone.wrong = ssd_fio.wrong;
    for (int i = 0; i < n; ++i) {
      float* h = Value("AcquireHost", store->AcquireHost(weights[i]));
      if (!Matches(kSsdSeed, i, h, bytes, &want)) host_fio.wrong++;
      store->ReleaseHost(weights[i], false);
    }
  }

  // --- report --------------------------------------------------------------------------------
  const std::vector<const Row*> rows = {&h2d, &d2h, &ssd_fio, &ssd_alone, &host_fio};
  if (!o.json) {
    std::printf("%-12s %11s  %-32s %13s %7s %7s\n", "op", "strata GB/s", "baseline",
                "baseline GB/s", "ratio", "#wrong");
  }
  int wrong = 0;
  for (const Row* r : rows) {
    const double g = MedianOf(r->gbps), b = MedianOf(r->baseline_gbps), ratio = g / b;
    wrong += r->wrong;
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("op", r->op)
          .Field("baseline", r->baseline)
          .Field("gbps", g)
          .Field("baseline_gbps", b)
          .Field("ratio", ratio)
          .Field("tensor_bytes", bytes)
          .Field("tensors", n)
          .Field("rounds", o.rounds)
          .Field("wrong", r->wrong)
          .EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      const std::string ratio_text =
          std::isfinite(ratio) ? absl::StrFormat("%.0f%%", 100 * ratio) : "n/a";
      const std::string base_text = std::isfinite(b) ? absl::StrFormat("%.2f", b) : "n/a";
      std::printf("%-12s %11.2f  %-32s %13s %7s %7d\n", r->op.c_str(), g, r->baseline.c_str(),
                  base_text.c_str(), ratio_text.c_str(), r->wrong);
    }
  }
  if (!o.json) {
    std::printf(
        "medians of %d rounds; ratio = strata / baseline; #wrong: tensors whose bytes "
        "differed after the trip\n",
        o.rounds);
  }
  if (wrong > 0) {
    std::fprintf(stderr, "bench_tier_gpu: %d tensors came back wrong\n", wrong);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
