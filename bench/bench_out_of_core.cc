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
// Targets: fraction_of_in_memory >= 0.8 where compute_s > io_s; over_lower_bound <= 1.2.
//
//   build/bin/bench_out_of_core [--batches 16,64] [--steps N] [--warmup N] [--rounds R]
//                               [--small] [--no-fio] [--json]
//
// The training data is synthetic text (throughput does not depend on it). The SSD tier lives
// under $TMPDIR (or /tmp).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "core/common/json.h"
#include "proto/config_io.h"
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
};

// Words of English-like text, so the byte-level model sees realistic token statistics.
void WriteSyntheticText(const std::string& path, size_t bytes) {
  static const char* kWords[] = {
      "the",    "of",  "and",  "a",     "to",  "in",    "expert", "is",      "that",
      "memory", "for", "it",   "with",  "as",  "tier",  "on",     "storage", "be",
      "at",     "by",  "this", "had",   "not", "are",   "but",    "from",    "or",
      "have",   "an",  "they", "which", "one", "token", "you",    "were",    "all"};
  std::mt19937 gen(42);
  std::string text;
  while (text.size() < bytes) {
    text += kWords[gen() % (sizeof(kWords) / sizeof(kWords[0]))];
    text += gen() % 9 == 0 ? ".\n" : " ";
  }
  std::ofstream(path) << text;
}

config::JobConfig Config(const Options& o, const std::string& data, int batch, bool tiered) {
  const std::string example =
      std::string(STRATA_SOURCE_DIR) + "/examples/larger_than_memory/config.textproto";
  auto loaded = config::LoadJobConfig(example);
  CHECK(loaded.ok()) << loaded.status();
  config::JobConfig cfg = *loaded;
  cfg.mutable_data()->set_path(data);
  cfg.mutable_train()->set_steps(o.warmup + o.steps);
  cfg.mutable_train()->set_global_batch(batch);
  cfg.mutable_train()->set_eval_every(0);
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
  int64_t tokens = 0;
  std::string error;
};

// Trains in a child process; medians over the timed steps.
RunFigures Train(const Options& o, const std::string& data, int batch, bool tiered) {
  const std::string out = InChildProcess([&]() -> std::string {
    train::TrainOptions to;
    to.config = Config(o, data, batch, tiered);
    to.progress = false;
    auto t = train::Trainer::Create(to);
    if (!t.ok()) return absl::StrCat("error ", t.status().message());
    std::vector<double> step, stall, rd, wr;
    int64_t tokens = 0;
    for (int i = 0; i < o.warmup + o.steps; ++i) {
      auto r = (*t)->Step();
      if (!r.ok()) return absl::StrCat("error ", r.status().message());
      if (i < o.warmup) continue;
      step.push_back(r->seconds);
      stall.push_back(r->store.stall_seconds / (*t)->context().pool->num_threads());
      rd.push_back(static_cast<double>(r->store.ssd.bytes_out));
      wr.push_back(static_cast<double>(r->store.ssd.bytes_in));
      tokens = r->tokens;
    }
    return absl::StrFormat("%.9g %.9g %.9g %.9g %d", MedianOf(step), MedianOf(stall), MedianOf(rd),
                           MedianOf(wr), tokens);
  });
  RunFigures f;
  if (out.rfind("error ", 0) == 0 || out.empty()) {
    f.error = out.empty() ? "the training process died" : out.substr(6);
    return f;
  }
  std::vector<std::string> parts = absl::StrSplit(out, ' ');
  if (parts.size() != 5) {
    f.error = "unexpected output: " + out;
    return f;
  }
  f.step_s = std::stod(parts[0]);
  f.stall_s = std::stod(parts[1]);
  f.read_bytes = std::stod(parts[2]);
  f.write_bytes = std::stod(parts[3]);
  f.tokens = std::stoll(parts[4]);
  return f;
}

// fio at 1 MiB, queue depth 32, O_DIRECT, io_uring, in `dir`: GB/s.
double Fio(const std::string& dir, const std::string& rw) {
  return RunFio(dir + "/bench_out_of_core.fio", rw, 1 << 20, 256 << 20, 32, false);
}

struct Row {
  int batch = 0;
  int64_t tokens = 0;
  std::vector<double> mem_step, tier_step, stall, rd, wr;
};

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
    } else if (a == "--batches") {
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
                   "usage: bench_out_of_core [--batches 16,64] [--steps N] [--warmup N] "
                   "[--rounds R] [--small] [--no-fio] [--json]\n");
      return 2;
    }
  }
  if (o.fio && !FioAvailable("bench_out_of_core", "to skip the I/O lower bound")) return 1;
  const std::string dir = o.dir + "/bench_out_of_core." + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string data = dir + "/text.txt";
  WriteSyntheticText(data, 4 << 20);

  if (!o.json) {
    std::printf(
        "bench_out_of_core: %s; SSD tier and fio in %s; %d warm-up + %d timed steps, "
        "%d rounds\n",
        HostDescription().c_str(), o.dir.c_str(), o.warmup, o.steps, o.rounds);
  }
  std::vector<Row> rows(o.batches.size());
  std::vector<double> fio_read, fio_write;
  for (int round = 0; round < o.rounds; ++round) {
    if (o.fio) {
      fio_write.push_back(Fio(dir, "write"));
      fio_read.push_back(Fio(dir, "read"));
      std::filesystem::remove(dir + "/bench_out_of_core.fio");
    }
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
    const double bound = std::isfinite(io) ? std::max(mem, io) : mem;
    const double tps = r.tokens / tier, mem_tps = r.tokens / mem;
    const double frac = tps / mem_tps, over = tier / bound, stall = MedianOf(r.stall) / tier;
    const bool compute_bound = !std::isfinite(io) || mem > io;
    const bool met = over <= 1.2 && (!compute_bound || frac >= 0.8);
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
          .EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("%6d %10.0f %10.0f %7.0f%% %9.3f %9.3f %9.3f %8.2f %5.0f/%-5.0f %6.0f%% %7s\n",
                  r.batch, tps, mem_tps, 100 * frac, tier, mem, io, over, rd / 1e6, wr / 1e6,
                  100 * stall, met ? "met" : "missed");
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
