// bench_out_of_core: training throughput with experts in the tiered store under budgets far below
// the experts' state, against the same model trained in memory, in the same run.
//
// The config is examples/larger_than_memory/config.textproto (4 MoE layers x 32 experts of
// 256x512; 514 MiB of expert weights, gradients and Adam moments against a 64 MiB device budget
// and a 192 MiB host cache), at the example's batch and at larger ones, where compute per step
// grows and the I/O per step does not. For each batch, in every round, a fresh process trains in
// memory and a fresh one trains TIERED (warm-up steps, then timed steps; medians), alternating, so
// both see the same machine. Printed per batch:
//   tokens_per_s / in_memory_tokens_per_s and their ratio (fraction_of_in_memory);
//   compute_s: the in-memory step time; io_s: the step's SSD bytes read and written at the
//     bandwidths fio reaches on the same folder (io_uring, O_DIRECT, queue depth 32, 1 MiB)
//     in this run; the lower bound of a step is max(compute_s, io_s), and over_lower_bound is
//     the tiered step time over it;
//   stall_fraction: the share of compute-thread time spent waiting for the store.
// Targets: fraction_of_in_memory >= 0.9 where compute_s > io_s; over_lower_bound <= 1.2.
//
// --device cuda (or cuda:N) trains every run with the model on that GPU (default: the config's
// train.device, the CPU for the example): the device tier is HBM and the host tier page-locked. The
// host<->device link is then a third bound: link_s, the step's bytes into and out of the device
// tier at the rates of 256 MiB pinned copies measured in the same run (printed under each row, and
// in --json with the GPU's name); the lower bound is max(compute_s, io_s, link_s), and with
// --config the I/O bound max(io_s, link_s).
//
//   build/bin/bench_out_of_core [--batches 16,64] [--steps N] [--warmup N] [--rounds R]
//                               [--small] [--no-fio] [--json]
//
// The training data is synthetic text (throughput does not depend on it). The SSD tier lives
// under $TMPDIR (or /tmp).
//
// --config PATH measures any config TIERED only: a model whose expert state does not fit in RAM
// (examples/larger_than_ram) has no in-memory twin to compare with. Per batch (the config's
// global_batch unless --batches says), fresh processes train it as configured (checkpoints off,
// train.steps = warm-up + timed steps), and it prints tokens/s, the SSD bytes read and written per
// step, io_s at fio's bandwidth on the SSD tier's folder measured in the same run, the step time
// over that I/O bound (over_io_bound; compute is not known without the twin, so the bound is io_s
// alone; goal <= 1.2), the stall fraction, the share of experts a step routed to (what LAZY
// updates step), and the training process's peak RSS (VmHWM) against this machine's MemTotal.
// The SSD tier goes to a folder of its own under storage.ssd_dir (else $TMPDIR), removed after
// every run; the disk check of `strata train` runs first. The data is the config's when its file
// exists, else synthetic text. With --small the config keeps its structure (layers, experts,
// top_k, batch, update rule) at d_model 64, d_expert 128 and seq_len <= 32, with budgets of
// 12 device and 48 host expert slots (a smoke run for CI machines):
//   build/bin/bench_out_of_core --config examples/larger_than_ram/config.textproto
//                               [--steps N] [--warmup N] [--rounds R] [--small] [--json]
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "core/common/clock.h"
#include "core/common/heap.h"
#include "core/common/json.h"
#include "core/device/device.h"
#include "proto/config_io.h"
#include "runtime/model/memory_estimate.h"
#include "train/trainer.h"

namespace strata::bench {
namespace {

struct Options {
  std::vector<int> batches = {16, 64};
  int steps = 6;
  int warmup = 2;
  int rounds = 2;
  bool small = false;
  bool fio = true;
  bool json = false;
  std::string dir;
  std::string config;  // --config: TIERED only, of this config
  bool batches_given = false;
  std::string device;  // --device: train.device of every run (empty: the config's)
};

// The example's config: from $STRATA_SOURCE_DIR (a package's share/strata) or this source tree.
std::string ExampleConfig() {
  const char* e = std::getenv("STRATA_SOURCE_DIR");
  return std::string(e != nullptr && *e != '\0' ? e : STRATA_SOURCE_DIR) +
         "/examples/larger_than_memory/config.textproto";
}

// The host<->device link of a GPU: the rates of 256 MiB copies between page-locked host memory
// and device memory on one copy stream (the store's copy path; best of 3 each way), and the GPU's
// description. Measured in a child process: the parent must not start CUDA before it forks the
// trainers' processes.
struct Link {
  double h2d_gbps = 0, d2h_gbps = 0;
  std::string gpu;
  std::string error;
};

Link MeasureLink(Device device) {
  Link link;
  if (device.is_cpu()) return link;
  const std::string out = InChildProcess([&]() -> std::string {
    const size_t bytes = size_t{256} << 20;
    auto host = Buffer::AllocatePinned(bytes);
    auto dev = Buffer::Allocate(device, bytes);
    auto stream = CopyStream::Create(device);
    if (!host.ok() || !dev.ok() || !stream.ok()) {
      return absl::StrCat("error ", !host.ok()  ? host.status().message()
                                    : !dev.ok() ? dev.status().message()
                                                : stream.status().message());
    }
    std::memset((*host)->data(), 1, bytes);
    double best[2] = {0, 0};
    for (int rep = 0; rep < 4; ++rep) {  // the first of each way warms up
      for (int way = 0; way < 2; ++way) {
        void* dst = way == 0 ? (*dev)->data() : (*host)->data();
        const void* src = way == 0 ? (*host)->data() : (*dev)->data();
        const double t0 = NowSeconds();
        if (!(*stream)->CopyAsync(dst, src, bytes).ok() || !(*stream)->Synchronize().ok()) {
          return std::string("error a copy failed");
        }
        if (rep > 0) best[way] = std::max(best[way], bytes / (NowSeconds() - t0) / 1e9);
      }
    }
    return absl::StrFormat("%.9g %.9g %s", best[0], best[1], CudaDeviceDescription(device.index));
  });
  if (out.rfind("error ", 0) == 0 || out.empty()) {
    link.error = out.empty() ? "the copy process died" : out.substr(6);
    return link;
  }
  std::vector<std::string> parts = absl::StrSplit(out, absl::MaxSplits(' ', 2));
  if (parts.size() != 3) {
    link.error = "unexpected output: " + out;
    return link;
  }
  link.h2d_gbps = std::stod(parts[0]);
  link.d2h_gbps = std::stod(parts[1]);
  link.gpu = parts[2];
  return link;
}

// The --config job at a small scale: its structure at d_model 64, d_expert 128, seq_len <= 32,
// with 12 device slots beside its dense state and 48 host slots.
void ScaleDown(config::JobConfig& cfg) {
  config::ModelConfig* m = cfg.mutable_model();
  m->set_seq_len(std::min(m->seq_len(), 32));
  m->set_d_model(64);
  if (64 % m->n_heads() != 0) m->set_n_heads(4);
  m->set_d_ff(std::min(m->d_ff(), 256));
  m->mutable_moe()->set_d_expert(128);
  cfg.mutable_storage()->clear_ssd_file_bytes();
  const uint64_t slot = config::EstimateDisk(cfg).expert_tensor_bytes;
  cfg.mutable_storage()->set_device_budget_bytes(config::EstimateMemory(cfg).dense_state_bytes +
                                                 12 * slot);
  cfg.mutable_storage()->set_host_budget_bytes(48 * slot);
}

// The job of --config as it is measured: no checkpoints, the SSD tier in `ssd_dir`, the data
// `data`.
config::JobConfig ConfigOf(const Options& o, const std::string& data, const std::string& ssd_dir,
                           int batch) {
  auto loaded = config::LoadJobConfig(o.config);
  CHECK(loaded.ok()) << loaded.status();
  config::JobConfig cfg = *loaded;
  cfg.clear_checkpoint();
  cfg.mutable_data()->set_path(data);
  cfg.mutable_train()->set_steps(o.warmup + o.steps);
  cfg.mutable_train()->set_global_batch(batch);
  cfg.mutable_train()->set_eval_every(0);
  cfg.mutable_storage()->set_mode(config::StorageConfig::TIERED);
  cfg.mutable_storage()->set_ssd_dir(ssd_dir);
  if (!o.device.empty()) cfg.mutable_train()->set_device(o.device);
  if (o.small) ScaleDown(cfg);
  return cfg;
}

config::JobConfig Config(const Options& o, const std::string& data, int batch, bool tiered) {
  auto loaded = config::LoadJobConfig(ExampleConfig());
  CHECK(loaded.ok()) << loaded.status();
  config::JobConfig cfg = *loaded;
  cfg.mutable_data()->set_path(data);
  cfg.mutable_train()->set_steps(o.warmup + o.steps);
  cfg.mutable_train()->set_global_batch(batch);
  cfg.mutable_train()->set_eval_every(0);
  if (!o.device.empty()) cfg.mutable_train()->set_device(o.device);
  if (o.small) {  // a smoke run: the same structure, a fraction of the size
    config::ModelConfig* m = cfg.mutable_model();
    m->set_seq_len(32);
    m->set_d_model(64);
    m->mutable_moe()->set_num_experts(8);
    m->mutable_moe()->set_d_expert(128);
    const uint64_t slot = ((2 * 64 * 128 + 64 + 128) * 4 + 4095) / 4096 * 4096;
    cfg.mutable_storage()->set_device_budget_bytes((4ull << 20) + 12 * slot);
    cfg.mutable_storage()->set_host_budget_bytes(48 * slot);
  }
  if (!tiered) {
    cfg.mutable_storage()->Clear();  // IN_MEMORY, no budgets
  }
  return cfg;
}

struct RunFigures {
  double step_s = 0, stall_s = 0, read_bytes = 0, write_bytes = 0;
  double h2d_bytes = 0, d2h_bytes = 0;  // into and out of the device tier
  int64_t tokens = 0;
  double routed = 0;    // share of the experts a step routed a token to (median)
  double peak_rss = 0;  // bytes, the training process's VmHWM
  std::string error;
};

// Trains `cfg` in a child process; medians over the timed steps.
RunFigures TrainConfig(const Options& o, const config::JobConfig& cfg) {
  const std::string out = InChildProcess([&]() -> std::string {
    train::TrainOptions to;
    to.config = cfg;
    to.progress = false;
    auto t = train::Trainer::Create(to);
    if (!t.ok()) return absl::StrCat("error ", t.status().message());
    std::vector<double> step, stall, rd, wr, h2d, d2h, routed;
    int64_t tokens = 0;
    for (int i = 0; i < o.warmup + o.steps; ++i) {
      auto r = (*t)->Step();
      if (!r.ok()) return absl::StrCat("error ", r.status().message());
      if (i < o.warmup) continue;
      step.push_back(r->seconds);
      stall.push_back(r->store.stall_seconds / (*t)->context().pool->num_threads());
      rd.push_back(static_cast<double>(r->store.ssd.bytes_out));
      wr.push_back(static_cast<double>(r->store.ssd.bytes_in));
      h2d.push_back(static_cast<double>(r->store.device.bytes_in));
      d2h.push_back(static_cast<double>(r->store.device.bytes_out));
      tokens = r->tokens;
      int64_t experts = 0, used = 0;
      for (const model::MoeStats& m : r->moe) {
        experts += static_cast<int64_t>(m.load.size());
        used += std::count_if(m.load.begin(), m.load.end(), [](int64_t n) { return n > 0; });
      }
      routed.push_back(experts > 0 ? static_cast<double>(used) / experts : std::nan(""));
    }
    return absl::StrFormat("%.9g %.9g %.9g %.9g %d %.9g %.9g %.9g %.9g", MedianOf(step),
                           MedianOf(stall), MedianOf(rd), MedianOf(wr), tokens, MedianOf(routed),
                           PeakRssMb() * (1 << 20), MedianOf(h2d), MedianOf(d2h));
  });
  RunFigures f;
  if (out.rfind("error ", 0) == 0 || out.empty()) {
    f.error = out.empty() ? "the training process died" : out.substr(6);
    return f;
  }
  std::vector<std::string> parts = absl::StrSplit(out, ' ');
  if (parts.size() != 9) {
    f.error = "unexpected output: " + out;
    return f;
  }
  f.step_s = std::stod(parts[0]);
  f.stall_s = std::stod(parts[1]);
  f.read_bytes = std::stod(parts[2]);
  f.write_bytes = std::stod(parts[3]);
  f.tokens = std::stoll(parts[4]);
  f.routed = std::stod(parts[5]);
  f.peak_rss = std::stod(parts[6]);
  f.h2d_bytes = std::stod(parts[7]);
  f.d2h_bytes = std::stod(parts[8]);
  return f;
}

RunFigures Train(const Options& o, const std::string& data, int batch, bool tiered) {
  return TrainConfig(o, Config(o, data, batch, tiered));
}

// fio at 1 MiB, queue depth 32, O_DIRECT, io_uring, in `dir`: GB/s.
double Fio(const std::string& dir, const std::string& rw) {
  return RunFio(dir + "/bench_out_of_core.fio", rw, 1 << 20, 256 << 20, 32, false);
}

// One round of fio (write, then read) in `dir`, appended to the figures of the rounds before.
void FioRound(const std::string& dir, std::vector<double>* read, std::vector<double>* write) {
  write->push_back(Fio(dir, "write"));
  read->push_back(Fio(dir, "read"));
  std::filesystem::remove(dir + "/bench_out_of_core.fio");
}

struct Row {
  int batch = 0;
  int64_t tokens = 0;
  std::vector<double> mem_step, tier_step, stall, rd, wr, h2d, d2h;
};

// The larger of two bounds, either of which may be unknown (NaN).
double MaxKnown(double a, double b) {
  if (!std::isfinite(a)) return b;
  if (!std::isfinite(b)) return a;
  return std::max(a, b);
}

// A step's host<->device copy time at the link's rates (NaN on the CPU, where the device tier is
// host memory and has no link).
double LinkSeconds(const Link& link, const Row& r) {
  if (link.h2d_gbps <= 0 || link.d2h_gbps <= 0) return std::nan("");
  return MedianOf(r.h2d) / (link.h2d_gbps * 1e9) + MedianOf(r.d2h) / (link.d2h_gbps * 1e9);
}

// The link's figures for a row of --json, and its line of the header.
void AddLinkFields(JsonWriter& j, const Link& link, const Row& r) {
  if (link.gpu.empty()) return;
  j.Field("gpu", link.gpu)
      .Field("h2d_gbps", link.h2d_gbps)
      .Field("d2h_gbps", link.d2h_gbps)
      .Field("h2d_bytes_per_step", MedianOf(r.h2d))
      .Field("d2h_bytes_per_step", MedianOf(r.d2h))
      .Field("link_s", LinkSeconds(link, r));
}
// Under a row of the table: the step's copies over the link and their time at its rates.
void PrintLinkRow(const Link& link, const Row& r) {
  if (link.gpu.empty()) return;
  std::printf("       link: %.0f MB host -> device, %.0f MB device -> host a step; link_s %.3f\n",
              MedianOf(r.h2d) / 1e6, MedianOf(r.d2h) / 1e6, LinkSeconds(link, r));
}
void PrintLink(const Link& link) {
  if (link.gpu.empty()) return;
  std::printf(
      "device: %s; pinned host -> device %.1f GB/s, device -> pinned host %.1f GB/s "
      "(256 MiB copies on one stream)\n",
      link.gpu.c_str(), link.h2d_gbps, link.d2h_gbps);
}

// The link of `device` (nothing on the CPU), its line printed unless `json`; null, with the
// reason printed, when it cannot be measured.
std::optional<Link> LinkOf(const std::string& device, bool json) {
  Link link = MeasureLink(*Device::Parse(device));
  if (!link.error.empty()) {
    std::fprintf(stderr, "bench_out_of_core: device %s: %s\n", device.c_str(), link.error.c_str());
    return std::nullopt;
  }
  if (!json) PrintLink(link);
  return link;
}

// MemTotal of /proc/meminfo, in bytes (0 when it cannot be read).
double MemTotalBytes() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemTotal:", 0) == 0) return std::stod(line.substr(9)) * 1024;
  }
  return 0;
}

// --config: TIERED only.
int RunConfig(Options o) {
  auto loaded = config::LoadJobConfig(o.config);
  if (!loaded.ok()) {
    std::fprintf(stderr, "bench_out_of_core: %s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  if (!o.batches_given) o.batches = {loaded->train().global_batch()};
  // The SSD tier and fio in a folder of the bench's own where the config puts its tier.
  const std::string parent =
      loaded->storage().ssd_dir().empty() ? o.dir : loaded->storage().ssd_dir();
  const std::string dir = parent + "/bench_out_of_core." + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  std::string data = loaded->data().path();
  const bool own_data = !std::filesystem::exists(data);
  if (own_data) {
    data = dir + "/text.txt";
    WriteSyntheticText(data, 4 << 20);
  }
  const std::string ssd = dir + "/ssd";
  const config::JobConfig first = ConfigOf(o, data, ssd, o.batches[0]);
  const config::DiskEstimate disk = config::EstimateDisk(first);
  const double mem_total = MemTotalBytes();
  const uint64_t state = config::EstimateMemory(first).expert_state_bytes;
  const BlasReport blas = MeasureBlas(static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  if (!o.json) {
    std::printf(
        "bench_out_of_core --config %s%s: %s; TIERED only; expert state %s (%.2fx MemTotal %s), "
        "SSD tier %s, host budget %s, device budget %s; SSD tier and fio in %s (%s free); data "
        "%s; %d warm-up + %d timed steps, %d rounds\n",
        o.config.c_str(), o.small ? " --small" : "", HostDescription().c_str(),
        config::FormatBytes(state).c_str(), state / mem_total,
        config::FormatBytes(static_cast<uint64_t>(mem_total)).c_str(),
        config::FormatBytes(disk.ssd_bytes).c_str(),
        config::FormatBytes(first.storage().host_budget_bytes()).c_str(),
        config::FormatBytes(first.storage().device_budget_bytes()).c_str(), dir.c_str(),
        config::FormatBytes(config::AvailableDiskBytes(dir)).c_str(),
        own_data ? "synthetic" : data.c_str(), o.warmup, o.steps, o.rounds);
    PrintBlasReport(blas);
  }
  const std::string device = first.train().device();
  const std::optional<Link> measured = LinkOf(device, o.json);
  if (!measured) {
    std::filesystem::remove_all(dir);
    return 1;
  }
  const Link& link = *measured;
  std::vector<Row> rows(o.batches.size());
  std::vector<double> fio_read, fio_write, routed(o.batches.size()), rss(o.batches.size());
  for (int round = 0; round < o.rounds; ++round) {
    if (o.fio) FioRound(dir, &fio_read, &fio_write);
    for (size_t b = 0; b < o.batches.size(); ++b) {
      Row& r = rows[b];
      r.batch = o.batches[b];
      const RunFigures f = TrainConfig(o, ConfigOf(o, data, ssd, r.batch));
      std::filesystem::remove_all(ssd);
      if (!f.error.empty()) {
        std::fprintf(stderr, "bench_out_of_core: %s batch %d: %s\n", o.config.c_str(), r.batch,
                     f.error.c_str());
        std::filesystem::remove_all(dir);
        return 1;
      }
      r.tokens = f.tokens;
      r.tier_step.push_back(f.step_s);
      r.stall.push_back(f.stall_s);
      r.rd.push_back(f.read_bytes);
      r.wr.push_back(f.write_bytes);
      r.h2d.push_back(f.h2d_bytes);
      r.d2h.push_back(f.d2h_bytes);
      routed[b] = f.routed;
      rss[b] = std::max(rss[b], f.peak_rss);
    }
  }
  std::filesystem::remove_all(dir);

  const double fr = MedianOf(fio_read), fw = MedianOf(fio_write);
  if (!o.json) {
    if (o.fio) std::printf("fio on this folder: read %.3f GB/s, write %.3f GB/s\n", fr, fw);
    std::printf("%6s %10s %9s %9s %8s %15s %7s %7s %14s %7s\n", "batch", "tok/s", "step_s", "io_s",
                "over_io", "SSD rd/wr MB", "stall", "routed", "peak RSS", "target");
  }
  for (size_t b = 0; b < rows.size(); ++b) {
    const Row& r = rows[b];
    const double tier = MedianOf(r.tier_step), rd = MedianOf(r.rd), wr = MedianOf(r.wr);
    const double io = o.fio ? rd / (fr * 1e9) + wr / (fw * 1e9) : std::nan("");
    // On a GPU the bound is the slower of the SSD and the host<->device link. A step that moved
    // nothing (its state fit in the host cache and HBM) has no I/O bound.
    const double bound = MaxKnown(io, LinkSeconds(link, r));
    const double over = bound > 0 ? tier / bound : std::nan(""), stall = MedianOf(r.stall) / tier;
    const bool met = std::isfinite(over) && over <= 1.2 && rss[b] < mem_total;
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("config", o.config)
          .Field("small", o.small)
          .Field("batch", r.batch)
          .Field("tokens_per_step", r.tokens)
          .Field("tokens_per_s", r.tokens / tier)
          .Field("step_s", tier)
          .Field("io_s", io)
          .Field("over_io_bound", over)
          .Field("stall_fraction", stall)
          .Field("routed_expert_fraction", routed[b])
          .Field("ssd_read_bytes_per_step", rd)
          .Field("ssd_write_bytes_per_step", wr)
          .Field("fio_read_gbps", fr)
          .Field("fio_write_gbps", fw)
          .Field("expert_state_bytes", static_cast<int64_t>(state))
          .Field("ssd_tier_bytes", static_cast<int64_t>(disk.ssd_bytes))
          .Field("peak_rss_bytes", static_cast<int64_t>(rss[b]))
          .Field("mem_total_bytes", static_cast<int64_t>(mem_total))
          .Field("peak_rss_of_ram", rss[b] / mem_total)
          .Field("rounds", o.rounds)
          .Field("device", device);
      AddLinkFields(j, link, r);
      AddBlasFields(j, blas);
      j.EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf(
          "%6d %10.1f %9.3f %9.3f %8.2f %7.0f/%-7.0f %6.0f%% %6.0f%% %5.2f GiB %3.0f%% %7s\n",
          r.batch, r.tokens / tier, tier, io, over, rd / 1e6, wr / 1e6, 100 * stall,
          100 * routed[b], rss[b] / (1 << 30), 100 * rss[b] / mem_total, met ? "met" : "missed");
      PrintLinkRow(link, r);
    }
  }
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  o.dir = ScratchDir();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return FlagValue("bench_out_of_core", argc, argv, &i); };
    int n = 0;
    if (a == "--json") {
      o.json = true;
    } else if (a == "--small") {
      o.small = true;
      o.batches = {4};
      o.steps = 2;
      o.warmup = 1;
      o.rounds = 1;
    } else if (a == "--no-fio") {
      o.fio = false;
    } else if (a == "--config") {
      o.config = value();
    } else if (a == "--device") {
      o.device = value();
      if (!Device::Parse(o.device).ok()) {
        std::fprintf(stderr, "bench_out_of_core: --device %s: use cpu, cuda or cuda:N\n",
                     o.device.c_str());
        return 2;
      }
    } else if (a == "--batches") {
      o.batches_given = true;
      o.batches.clear();
      for (absl::string_view b : absl::StrSplit(value(), ',')) {
        if (!absl::SimpleAtoi(b, &n) || n < 1) {
          std::fprintf(stderr, "bench_out_of_core: --batches takes positive integers: 16,64\n");
          return 2;
        }
        o.batches.push_back(n);
      }
    } else if ((a == "--steps" || a == "--warmup" || a == "--rounds") &&
               absl::SimpleAtoi(value(), &n) && n >= (a == "--warmup" ? 0 : 1)) {
      (a == "--steps" ? o.steps : a == "--warmup" ? o.warmup : o.rounds) = n;
    } else {
      std::fprintf(stderr,
                   "usage: bench_out_of_core [--config PATH] [--device cpu|cuda|cuda:N] "
                   "[--batches 16,64] [--steps N] [--warmup N] [--rounds R] [--small] "
                   "[--no-fio] [--json]\n");
      return 2;
    }
  }
  if (o.fio && !FioAvailable("bench_out_of_core", "to skip the I/O lower bound")) return 1;
  if (!o.config.empty()) return RunConfig(o);
  const std::string dir = o.dir + "/bench_out_of_core." + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string data = dir + "/text.txt";
  WriteSyntheticText(data, 4 << 20);

  const BlasReport blas = MeasureBlas(static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  if (!o.json) {
    std::printf(
        "bench_out_of_core: %s; SSD tier and fio in %s; %d warm-up + %d timed steps, "
        "%d rounds\n",
        HostDescription().c_str(), o.dir.c_str(), o.warmup, o.steps, o.rounds);
    PrintBlasReport(blas);
  }
  const std::string device = Config(o, data, o.batches[0], true).train().device();
  const std::optional<Link> measured = LinkOf(device, o.json);
  if (!measured) {
    std::filesystem::remove_all(dir);
    return 1;
  }
  const Link& link = *measured;
  std::vector<Row> rows(o.batches.size());
  std::vector<double> fio_read, fio_write;
  for (int round = 0; round < o.rounds; ++round) {
    if (o.fio) FioRound(dir, &fio_read, &fio_write);
    for (size_t b = 0; b < o.batches.size(); ++b) {
      Row& r = rows[b];
      r.batch = o.batches[b];
      // Alternate which goes first, so neither always runs on a warmer machine.
      for (int k = 0; k < 2; ++k) {
        const bool tiered = (k + round) % 2 == 0;
        const RunFigures f = Train(o, data, r.batch, tiered);
        if (!f.error.empty()) {
          std::fprintf(stderr, "bench_out_of_core: batch %d %s: %s\n", r.batch,
                       tiered ? "TIERED" : "IN_MEMORY", f.error.c_str());
          return 1;
        }
        r.tokens = f.tokens;
        if (tiered) {
          r.tier_step.push_back(f.step_s);
          r.stall.push_back(f.stall_s);
          r.rd.push_back(f.read_bytes);
          r.wr.push_back(f.write_bytes);
          r.h2d.push_back(f.h2d_bytes);
          r.d2h.push_back(f.d2h_bytes);
        } else {
          r.mem_step.push_back(f.step_s);
        }
      }
    }
  }
  std::filesystem::remove_all(dir);

  const double fr = MedianOf(fio_read), fw = MedianOf(fio_write);
  if (!o.json) {
    if (o.fio) std::printf("fio on this folder: read %.3f GB/s, write %.3f GB/s\n", fr, fw);
    std::printf("%6s %10s %10s %8s %9s %9s %9s %8s %10s %7s %7s\n", "batch", "tok/s", "in-mem",
                "of mem", "step_s", "compute_s", "io_s", "over_lb", "SSD rd/wr MB", "stall",
                "target");
  }
  for (const Row& r : rows) {
    const double tier = MedianOf(r.tier_step), mem = MedianOf(r.mem_step);
    const double rd = MedianOf(r.rd), wr = MedianOf(r.wr);
    const double io = o.fio ? rd / (fr * 1e9) + wr / (fw * 1e9) : std::nan("");
    // On a GPU the experts' copies between host and device are a third bound.
    const double link_s = LinkSeconds(link, r);
    const double bound = MaxKnown(MaxKnown(mem, io), link_s);
    const double tps = r.tokens / tier, mem_tps = r.tokens / mem;
    const double frac = tps / mem_tps, over = tier / bound, stall = MedianOf(r.stall) / tier;
    const bool compute_bound = mem >= MaxKnown(io, link_s) || !std::isfinite(MaxKnown(io, link_s));
    const bool met = over <= 1.2 && (!compute_bound || frac >= 0.9);
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("batch", r.batch)
          .Field("tokens_per_step", r.tokens)
          .Field("tokens_per_s", tps)
          .Field("in_memory_tokens_per_s", mem_tps)
          .Field("fraction_of_in_memory", frac)
          .Field("step_s", tier)
          .Field("compute_s", mem)
          .Field("io_s", io)
          .Field("over_lower_bound", over)
          .Field("stall_fraction", stall)
          .Field("ssd_read_bytes_per_step", rd)
          .Field("ssd_write_bytes_per_step", wr)
          .Field("fio_read_gbps", fr)
          .Field("fio_write_gbps", fw)
          .Field("rounds", o.rounds)
          .Field("device", device);
      AddLinkFields(j, link, r);
      AddBlasFields(j, blas);
      j.EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("%6d %10.0f %10.0f %7.0f%% %9.3f %9.3f %9.3f %8.2f %5.0f/%-5.0f %6.0f%% %7s\n",
                  r.batch, tps, mem_tps, 100 * frac, tier, mem, io, over, rd / 1e6, wr / 1e6,
                  100 * stall, met ? "met" : "missed");
      PrintLinkRow(link, r);
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::ChooseBlasKernelAtStart("bench_out_of_core", argv);
  strata::KeepLargeBlocksOffTheHeap();  // as the strata binary does: peak RSS is reported
  return strata::bench::Main(argc, argv);
}
