// bench_generate: prefill and decode throughput of generation through the KV cache
// (MoeTransformer::Decode, as `strata generate` runs it), in memory and with the experts offloaded
// (train/evaluate.h), against decoding by full-window recomputation (a Forward over every padded
// window for every token: generation without a KV cache), in the same run.
//
// For each config (default: examples/moe_lm and examples/larger_than_memory) a checkpoint is
// trained first (--train-steps steps in memory, into a temporary folder; on the config's data when
// its file exists, else on synthetic text). Then B prompts (--batch) of seq_len / 2 tokens of that
// text are
//   prefilled: one Decode of all their rows (prefill tokens/s), and
//   decoded: seq_len / 2 - 1 more tokens each, greedily, one Decode of B rows per token (decode
//   tokens/s),
// with every expert in memory; by full recomputation (decode only); and offloaded, with the ring
// (device) and host budgets each 2x and 8x below the experts' weights — raised to the store's
// minimum for the compute threads where that is more (the row then says the factor it ran at).
// Each row is measured in fresh processes, --rounds times, after one warm-up pass (of the prompts;
// offloaded, it also leaves experts in the tiers, as a running server has them); medians. Printed
// per row: prefill and decode tokens/s, decode over in-memory decode, the SSD bytes read per
// decoded token, the shares of routed experts the history prefetch had named before their gate
// ran (guessed) and, of the others, still in the ring from an earlier pass (resident), and the
// share of compute-thread time spent waiting for experts (stall seconds / threads / decode
// seconds). Goal: offloaded decode at least 0.8 of in-memory where a token's expert reads fit
// behind its compute.
//
//   build/bin/bench_generate [--config PATH]... [--batch 8] [--threads 2] [--rounds 3]
//                            [--train-steps 30] [--device cpu|cuda] [--json]
// (--device cuda: generation on the GPU, the ring in HBM; the checkpoint trains on the CPU.)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "core/common/bytes.h"
#include "core/common/clock.h"
#include "core/common/json.h"
#include "proto/config_io.h"
#include "storage/private_folder.h"
#include "train/evaluate.h"
#include "train/trainer.h"

namespace strata::bench {
namespace {

struct Options {
  std::vector<std::string> configs;
  int batch = 8;
  int threads = 2;
  int rounds = 3;
  int train_steps = 30;
  std::string device = "cpu";  // where generation runs (the checkpoint trains on the CPU)
  bool json = false;
};

// One row's figures, medians over the rounds.
struct Figures {
  double prefill_tps = 0, decode_tps = 0;
  double ssd_per_token = 0;  // bytes
  double guessed = std::nan(""), resident = std::nan(""), waited = std::nan("");
  std::string error;
};

// The greedy next token of every row in `rows` of logits [*, V].
std::vector<int32_t> Argmax(const std::vector<float>& logits, const std::vector<int64_t>& rows,
                            int64_t V) {
  std::vector<int32_t> out;
  for (int64_t r : rows) {
    const float* p = logits.data() + r * V;
    out.push_back(static_cast<int32_t>(std::max_element(p, p + V) - p));
  }
  return out;
}

// Prefill + decode of `prompts` through the KV cache (full = false) or decode by full-window
// recomputation (full = true), on one line: "prefill_tokens prefill_s decoded_tokens decode_s
// ssd_bytes routed guessed resident stall_s" (by recomputation every generated token counts as
// decoded).
std::string Measure(train::CheckpointModel& m, const std::vector<std::vector<int32_t>>& prompts,
                    bool full) {
  model::MoeTransformer& model = *m.model;
  const int64_t T = model.config().seq_len(), V = model.config().vocab_size();
  const int64_t B = static_cast<int64_t>(prompts.size());
  const int64_t P = static_cast<int64_t>(prompts[0].size()), steps = T - P - 1;
  std::vector<std::vector<int32_t>> seqs = prompts;
  std::vector<float> logits;
  double prefill_s = 0;
  if (full) {
    std::vector<int32_t> tokens(static_cast<size_t>(B * T)), targets(tokens.size(), 0);
    logits.resize(static_cast<size_t>(B * T * V));
    model.Forward(m.ctx, tokens.data(), targets.data(), B, model::GateCall{false, 0});  // warm-up
    const Stopwatch clock;
    for (int64_t s = 0; s <= steps; ++s) {
      std::vector<int64_t> last;
      for (int64_t b = 0; b < B; ++b) {
        std::fill(tokens.begin() + b * T, tokens.begin() + (b + 1) * T, 0);
        std::copy(seqs[b].begin(), seqs[b].end(), tokens.begin() + b * T);
        last.push_back(b * T + static_cast<int64_t>(seqs[b].size()) - 1);
      }
      model.Forward(m.ctx, tokens.data(), targets.data(), B, model::GateCall{false, 0});
      model.logits().CopyToHost(logits.data());
      const std::vector<int32_t> next = Argmax(logits, last, V);
      for (int64_t b = 0; b < B; ++b) seqs[b].push_back(next[b]);
    }
    return absl::StrFormat("0 0 %d %.9g 0 0 0 0 0", B * (steps + 1), clock.Seconds());
  }
  std::vector<int32_t> tokens, slots, positions;
  std::vector<int64_t> last;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < P; ++t) {
      tokens.push_back(seqs[b][t]);
      slots.push_back(static_cast<int32_t>(b));
      positions.push_back(static_cast<int32_t>(t));
    }
    last.push_back(static_cast<int64_t>(tokens.size()) - 1);
  }
  logits.resize(tokens.size() * static_cast<size_t>(V));
  // A warm-up prefill first (the KV cache and scratch are allocated by the first Decode), then
  // the timed one over the same slots from position 0.
  Stopwatch clock;
  for (int pass = 0; pass < 2; ++pass) {
    clock = Stopwatch();
    model.Decode(m.ctx, tokens.data(), slots.data(), positions.data(), B * P)
        .CopyToHost(logits.data());
    if (Status s = m.EndPass(); !s.ok()) return absl::StrCat("error ", s.message());
  }
  prefill_s = clock.Seconds();
  const train::OffloadReport r0 = m.offload_report();
  clock = Stopwatch();
  std::vector<int32_t> next = Argmax(logits, last, V);
  last.clear();
  for (int64_t b = 0; b < B; ++b) last.push_back(b);
  for (int64_t s = 0; s < steps; ++s) {
    tokens = next;
    slots.clear();
    positions.assign(static_cast<size_t>(B), static_cast<int32_t>(P + s));
    for (int64_t b = 0; b < B; ++b) slots.push_back(static_cast<int32_t>(b));
    logits.resize(static_cast<size_t>(B * V));
    model.Decode(m.ctx, tokens.data(), slots.data(), positions.data(), B).CopyToHost(logits.data());
    if (Status st = m.EndPass(); !st.ok()) return absl::StrCat("error ", st.message());
    next = Argmax(logits, last, V);
  }
  const double decode_s = clock.Seconds();
  const train::OffloadReport r1 = m.offload_report();
  return absl::StrFormat("%d %.9g %d %.9g %d %d %d %d %.9g", B * P, prefill_s, B * steps, decode_s,
                         r1.ssd_bytes_read - r0.ssd_bytes_read, r1.routed - r0.routed,
                         r1.guessed - r0.guessed, r1.resident - r0.resident,
                         r1.stall_seconds - r0.stall_seconds);
}

enum class Mode { kMemory, kFull, kOffload };

// One row: fresh processes, o.rounds of them.
Figures Row(const Options& o, const std::string& ckpt, const std::vector<std::vector<int32_t>>& p,
            Mode mode, const train::OffloadOptions& offload) {
  std::vector<double> prefill, decode, ssd, guessed, resident, waited;
  Figures f;
  const int64_t B = static_cast<int64_t>(p.size());
  for (int round = 0; round < o.rounds; ++round) {
    const std::string out = InChildProcess([&]() -> std::string {
      train::OffloadOptions off = offload;
      off.enabled = mode == Mode::kOffload;
      auto m = train::LoadCheckpointModel(ckpt, -1, B, o.threads, o.device, off);
      if (!m.ok()) return absl::StrCat("error ", m.status().message());
      return Measure(**m, p, mode == Mode::kFull);
    });
    if (out.empty() || out.rfind("error ", 0) == 0) {
      f.error = out.empty() ? "the process died" : out.substr(6);
      return f;
    }
    std::vector<double> v;
    for (absl::string_view x : absl::StrSplit(out, ' ')) v.push_back(std::stod(std::string(x)));
    if (v.size() != 9) {
      f.error = "unexpected output: " + out;
      return f;
    }
    if (mode != Mode::kFull) prefill.push_back(v[0] / v[1]);
    decode.push_back(v[2] / v[3]);
    ssd.push_back(v[4] / v[2]);
    if (v[5] > 0) guessed.push_back(v[6] / v[5]);
    if (v[5] > 0) resident.push_back(v[7] / v[5]);
    if (mode == Mode::kOffload) waited.push_back(v[8] / o.threads / v[3]);
  }
  f.prefill_tps = MedianOf(prefill);
  f.decode_tps = MedianOf(decode);
  f.ssd_per_token = MedianOf(ssd);
  f.guessed = MedianOf(guessed);
  f.resident = MedianOf(resident);
  f.waited = MedianOf(waited);
  return f;
}

// The config at `path` with its data (else synthetic text in `dir`), trained for
// o.train_steps steps with a checkpoint at the end in dir/ckpt; the prompts, B windows of
// seq_len / 2 tokens of its text.
Status TrainCheckpoint(const Options& o, const std::string& path, const std::string& dir,
                       std::vector<std::vector<int32_t>>* prompts, uint64_t* expert_bytes,
                       uint64_t* one_expert_bytes) {
  ASSIGN_OR_RETURN(config::JobConfig cfg, config::LoadJobConfig(path));
  if (!std::filesystem::exists(cfg.data().path())) {
    const std::string data = dir + "/text.txt";
    WriteSyntheticText(data, 4 << 20);
    cfg.mutable_data()->set_path(data);
  }
  cfg.mutable_train()->set_steps(o.train_steps);
  cfg.mutable_train()->set_eval_every(0);
  cfg.mutable_train()->set_threads(o.threads);
  cfg.mutable_train()->set_device("cpu");
  cfg.mutable_checkpoint()->set_every(o.train_steps);
  cfg.mutable_checkpoint()->set_dir(dir + "/ckpt");
  const std::string out = InChildProcess([&]() -> std::string {
    train::TrainOptions to;
    to.config = cfg;
    to.progress = false;
    auto t = train::Trainer::Create(to);
    if (!t.ok()) return absl::StrCat("error ", t.status().message());
    Status s = (*t)->Run();
    return s.ok() ? "ok" : absl::StrCat("error ", s.message());
  });
  if (out != "ok") {
    return absl::InternalError(absl::StrCat("training ", path, ": ", out.empty() ? "died" : out));
  }
  std::ifstream in(cfg.data().path(), std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  const int64_t half = cfg.model().seq_len() / 2;
  for (int b = 0; b < o.batch; ++b) {
    const size_t at = (s.size() / static_cast<size_t>(o.batch + 1)) * static_cast<size_t>(b + 1);
    std::vector<int32_t> p;
    for (int64_t t = 0; t < half; ++t) p.push_back(static_cast<unsigned char>(s[at + t]));
    prompts->push_back(p);
  }
  // An expert's weights, from a model of the config (its experts unbound: nothing allocated).
  ThreadPool pool(1);
  ops::Context ctx{&pool};
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.unbound_experts = true;
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeTransformer> m,
                   model::MoeTransformer::Create(ctx, mo));
  model::MoeLayer& first = *m->moe_layers()[0].layer;
  *one_expert_bytes = static_cast<uint64_t>(
      model::ExpertLayout::Of(first.expert(first.first_local_expert()).Parameters()).floats * 4);
  *expert_bytes = *one_expert_bytes * m->moe_layers().size() * first.num_experts();
  return absl::OkStatus();
}

int Run(const Options& o) {
  const BlasReport blas = MeasureBlas(o.threads);
  if (!o.json) PrintBlasReport(blas);
  for (const std::string& path : o.configs) {
    auto dir = storage::PrivateFolder::Create(ScratchDir(), "strata-bench-", "the benchmark");
    if (!dir.ok()) {
      std::fprintf(stderr, "bench_generate: %s\n", dir.status().ToString().c_str());
      return 1;
    }
    std::vector<std::vector<int32_t>> prompts;
    uint64_t expert_bytes = 0, one_expert = 0;
    if (Status s = TrainCheckpoint(o, path, (*dir)->path(), &prompts, &expert_bytes, &one_expert);
        !s.ok()) {
      std::fprintf(stderr, "bench_generate: %s\n", s.ToString().c_str());
      return 1;
    }
    const std::string ckpt = (*dir)->path() + "/ckpt";
    const std::string name = std::filesystem::path(path).parent_path().filename().string();
    // A slot of the store (a 4 KiB multiple), for its minimum slots per compute thread
    // (storage/tiered_store.h).
    const uint64_t slot = (one_expert + 4095) / 4096 * 4096;
    struct RowSpec {
      std::string what;
      Mode mode;
      double below;
    };
    const std::vector<RowSpec> rows = {{"in memory", Mode::kMemory, 0},
                                       {"full recompute", Mode::kFull, 0},
                                       {"offloaded", Mode::kOffload, 2},
                                       {"offloaded", Mode::kOffload, 8}};
    if (!o.json) {
      std::printf("\n%s: %s of expert weights, %d prompts of %zu tokens, %d threads, on %s\n",
                  name.c_str(), FormatBytes(expert_bytes).c_str(), o.batch, prompts[0].size(),
                  o.threads, o.device.c_str());
      std::printf("%-24s %10s %10s %8s %12s %8s %9s %8s\n", "experts", "prefill/s", "decode/s",
                  "vs mem", "SSD/token", "guessed", "resident", "waited");
    }
    double memory_decode = 0;
    for (const RowSpec& r : rows) {
      train::OffloadOptions off;
      std::string what = r.what;
      if (r.mode == Mode::kOffload) {
        const uint64_t want = static_cast<uint64_t>(expert_bytes / r.below);
        off.device_bytes = std::max<uint64_t>(want, (2 * o.threads + 1) * slot);
        off.host_bytes = std::max<uint64_t>(want, (4 * o.threads + 3) * slot);
        what = absl::StrFormat("offloaded %.1fx/%.1fx", expert_bytes / double(off.device_bytes),
                               expert_bytes / double(off.host_bytes));
      }
      const Figures f = Row(o, ckpt, prompts, r.mode, off);
      if (!f.error.empty()) {
        std::fprintf(stderr, "bench_generate: %s, %s: %s\n", name.c_str(), what.c_str(),
                     f.error.c_str());
        return 1;
      }
      if (r.mode == Mode::kMemory) memory_decode = f.decode_tps;
      const double vs = f.decode_tps / memory_decode;
      if (o.json) {
        JsonWriter j;
        j.BeginObject()
            .Field("config", name)
            .Field("experts", what)
            .Field("expert_bytes", expert_bytes)
            .Field("batch", o.batch)
            .Field("threads", o.threads)
            .Field("device", o.device)
            .Field("device_bytes", off.device_bytes)
            .Field("host_bytes", off.host_bytes)
            .Field("prefill_tokens_per_s", f.prefill_tps)
            .Field("decode_tokens_per_s", f.decode_tps)
            .Field("fraction_of_in_memory", vs)
            .Field("ssd_bytes_per_token", f.ssd_per_token)
            .Field("guessed", f.guessed)
            .Field("resident", f.resident)
            .Field("waited", f.waited);
        AddBlasFields(j, blas);
        j.EndObject();
        std::printf("%s\n", j.str().c_str());
        continue;
      }
      auto pct = [](double x) {
        return std::isnan(x) ? std::string("-") : absl::StrFormat("%.0f%%", 100 * x);
      };
      std::printf("%-24s %10s %10.0f %7.2fx %12s %8s %9s %8s\n", what.c_str(),
                  r.mode == Mode::kFull ? "-" : absl::StrFormat("%.0f", f.prefill_tps).c_str(),
                  f.decode_tps, vs,
                  r.mode == Mode::kOffload ? FormatBytes(f.ssd_per_token).c_str() : "-",
                  pct(f.guessed).c_str(), pct(f.resident).c_str(), pct(f.waited).c_str());
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::ChooseBlasKernelAtStart("bench_generate", argv);
  strata::bench::Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return strata::bench::FlagValue("bench_generate", argc, argv, &i); };
    auto number = [&](int lo, int hi) {
      const std::string v = value();
      int n = 0;
      if (!absl::SimpleAtoi(v, &n) || n < lo || n > hi) {
        std::fprintf(stderr, "bench_generate: %s %s must be an integer in [%d, %d]\n", a.c_str(),
                     v.c_str(), lo, hi);
        std::exit(2);
      }
      return n;
    };
    if (a == "--config") {
      o.configs.push_back(value());
    } else if (a == "--batch") {
      o.batch = number(1, 1024);
    } else if (a == "--threads") {
      o.threads = number(1, 256);
    } else if (a == "--rounds") {
      o.rounds = number(1, 100);
    } else if (a == "--train-steps") {
      o.train_steps = number(1, 100000);
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--json") {
      o.json = true;
    } else {
      std::fprintf(stderr,
                   "usage: bench_generate [--config PATH]... [--batch 8] [--threads 2] "
                   "[--rounds 3] [--train-steps 30] [--device cpu|cuda] [--json]\n");
      return 2;
    }
  }
  if (o.configs.empty()) {
    o.configs = {std::string(STRATA_SOURCE_DIR) + "/examples/moe_lm/config.textproto",
                 std::string(STRATA_SOURCE_DIR) + "/examples/larger_than_memory/config.textproto"};
  }
  return strata::bench::Run(o);
}
