// bench_moe_layer: one MoE layer, forward + backward, against its limit and a naive baseline.
//
// For each shape (tokens, d_model, d_hidden, experts, k, shared experts), plain top-k gate,
// dropless, GELU FFN experts with biases (the shared experts: one FFN of shared * d_hidden on every
// token), the same thread count everywhere:
//   strata   MoeLayer::Forward + Backward (gate, permutation, grouped experts, combine, gate grad)
//   sgemm    only the layer's GEMMs: the router's three over every token and the six of each
//            expert (and the shared FFN's on every token), on exactly the row counts the routing
//            produced and the layer's own weights, under three thread schedules (OpenBLAS's own
//            threads, each GEMM split over the pool, experts in per-thread groups with the
//            router's GEMMs split over the pool); the fastest is the limit
//   (with shared experts, the layer a second way too: the shared FFN as one more task of the
//   expert groups, MoeLayer::set_shared_in_expert_groups, against its default of an FFN split
//   over the pool after the routed experts; printed on the row's comment line)
//   torch    the naive PyTorch layer (a Python loop over experts, index_select / index_add; see
//            torch_moe_baseline.py) in Debian's python3-torch
// GFLOP/s counts the layer's GEMMs: 6 * d_model * tokens * experts (the router) + 12 * d_model *
// d_hidden * (routed rows + tokens * shared) per iteration.
// Timing on a shared machine: a shape is measured in --rounds rounds, each a fresh strata process
// (the layer and the sgemm schedules in alternating blocks of individually timed iterations, see
// RunShape) followed by a PyTorch process; each column is the median over rounds of its medians.
// Peak memory (VmHWM) is per process, so per shape.
// Every run checks the layer's output on sampled tokens against a per-token double-precision
// recomputation (#wrong).
#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "core/common/clock.h"
#include "core/common/json.h"
#include "kernels/cpu/gemm.h"
#include "runtime/model/moe_layer.h"

namespace strata::bench {

// The benchmarked layer: top-k gate (dropless), GELU FFN experts with biases, experts [first,
// first + count) of `experts`, every parameter initialised from seed 1 (moe_layer_workers.cc).
std::unique_ptr<model::MoeLayer> MakeBenchLayer(ops::Context& ctx, int64_t tokens, int64_t d_model,
                                                int64_t d_hidden, int64_t experts, int k,
                                                int64_t first, int64_t count, int shared = 0);
// bench_moe_layer --workers N (moe_layer_workers.cc).
// shape: tokens per worker, d_model, d_hidden, experts, k; all zero for the default.
int RunWorkersBench(int workers, int chunks, int rounds, int iters, bool json, bool small,
                    const int64_t shape[5]);

namespace {

struct Shape {
  int64_t tokens, d_model, d_hidden, experts;
  int k;
  int shared = 0;  // shared experts of d_hidden each, as one FFN on every token
};

struct Options {
  bool json = false;
  int threads = 0;
  int iters = 2;   // timed iterations per block
  int blocks = 2;  // alternating blocks per column within a round
  int rounds = 3;  // rounds, each a strata process then a PyTorch process
  int warmup = 1;
  bool torch = true;
  std::string python;
  // The last two are fine-grained layers of today's models: top-8 of 64 narrow experts with a
  // shared one (DeepSeek-MoE), and top-8 of 256.
  std::vector<Shape> shapes = {{2048, 512, 1024, 16, 2},
                               {4096, 1024, 4096, 64, 2},
                               {4096, 1024, 1024, 8, 1},
                               {4096, 1024, 256, 64, 8, 1},
                               {4096, 1024, 128, 256, 8, 0}};
};

struct Row {
  Shape s;
  double ms = 0, gflops = 0, sgemm_ms = 0, torch_ms = NAN, peak_mb = 0, torch_peak_mb = NAN;
  double shared_in_groups_ms = NAN;       // the layer with its shared experts in the expert groups
  std::vector<double> sgemm_by_schedule;  // in Schedule order
  std::string sgemm_schedule;             // the fastest, taken as the limit
  int64_t routed = 0;
  int wrong = 0, checked = 0;
  bool grouped = false;  // how the layer ran its experts
  std::string torch_note;
};

double Gelu(double v) {
  return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
}

// How the expert GEMMs of the baseline share the threads.
enum class Schedule {
  kOpenBlasThreads,  // experts in order, each GEMM one cblas_sgemm on OpenBLAS's own threads
  kSplitGemms,       // experts in order, each GEMM split over strata's pool (cpu::Gemm)
  kExpertGroups,     // each thread runs a contiguous group of experts, GEMMs single-threaded
};
const char* ScheduleName(Schedule s) {
  switch (s) {
    case Schedule::kOpenBlasThreads:
      return "openblas_threads";
    case Schedule::kSplitGemms:
      return "split_gemms";
    case Schedule::kExpertGroups:
      return "expert_groups";
  }
  return "?";
}

// The layer's GEMMs alone: the router's three over every token, with the layer's router weight
// (logits = x Wr^T; backward dWr += dlogits^T x, dx += dlogits Wr), and the six of each expert's
// forward and backward, on exactly the routed row counts, with the layer's own weight and gradient
// tensors and one contiguous block of rows per expert (as the layer has): forward h = x W1^T,
// y = h W2^T; backward dW2 += dy^T h, dh = dy W2, dW1 += dh^T x, dx = dh W1. Nothing else: no
// softmax or top-k, permutation, bias, activation or combine.
class ExpertGemms {
 public:
  ExpertGemms(const Shape& s, model::MoeLayer& layer, const std::vector<int64_t>& rows,
              ThreadPool& pool)
      : s_(s),
        layer_(layer),
        rows_(rows),
        pool_(pool),
        tok_x_(s.tokens * s.d_model, 0.01f),
        logits_(s.tokens * s.experts, 0.f),
        dlogits_(s.tokens * s.experts, 0.01f),
        tok_dx_(s.tokens * s.d_model, 0.f) {
    // The shared FFN is one more "expert" of shared * d_hidden on every token.
    if (s.shared > 0) rows_.push_back(s.tokens);
    const int64_t n = static_cast<int64_t>(rows_.size());
    first_.assign(n + 1, 0);
    for (int64_t e = 0; e < n; ++e) first_[e + 1] = first_[e] + rows_[e];
    const int64_t R = first_.back();
    x_.assign(R * s.d_model, 0.01f);
    h_.assign(R * s.d_hidden * std::max(1, s.shared), 0.01f);
    y_.assign(R * s.d_model, 0.f);
    dy_.assign(R * s.d_model, 0.01f);
    dx_.assign(R * s.d_model, 0.f);
    // Contiguous expert groups with about R / threads rows each.
    const int threads = pool.num_threads();
    cut_.assign(threads + 1, n);
    cut_[0] = 0;
    for (int t = 1, e = 0; t < threads; ++t) {
      while (e < n && first_[e + 1] * threads <= t * R) ++e;
      cut_[t] = e;
    }
  }

  // One forward + backward of the router's and every expert's GEMMs under `schedule` (the
  // router's are whole-batch GEMMs: split over the pool, or on OpenBLAS's threads).
  void Run(Schedule schedule) {
    const bool openblas = schedule == Schedule::kOpenBlasThreads;
    if (openblas) cpu::SetBlasThreads(pool_.num_threads());
    Router(openblas, /*forward=*/true);
    if (schedule == Schedule::kExpertGroups) {
      pool_.Run([&](int tid, int) {
        for (int64_t e = cut_[tid]; e < cut_[tid + 1]; ++e) RunExpert(e, schedule, true);
      });
    } else {
      for (int64_t e = 0; e < static_cast<int64_t>(rows_.size()); ++e) {
        RunExpert(e, schedule, false);
      }
    }
    Router(openblas, /*forward=*/false);
    cpu::SetBlasThreads(1);
  }

 private:
  void Router(bool openblas, bool forward) {
    const int64_t T = s_.tokens, C = s_.d_model, E = s_.experts;
    model::Parameter& wr = static_cast<model::SoftmaxGate&>(layer_.gate()).router();
    auto gemm = [&](bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* Cm, int64_t ldc) {
      if (openblas) {
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    M, N, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
      } else {
        cpu::Gemm<float>(pool_, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
      }
    };
    if (forward) {
      gemm(false, true, T, E, C, tok_x_.data(), C, wr.value.f32(), C, 0.f, logits_.data(), E);
      return;
    }
    gemm(true, false, E, C, T, dlogits_.data(), E, tok_x_.data(), C, 1.f, wr.grad.f32(), C);
    gemm(false, false, T, C, E, dlogits_.data(), E, wr.value.f32(), C, 1.f, tok_dx_.data(), C);
  }

  void RunExpert(int64_t e, Schedule schedule, bool single_thread) {
    const bool shared = e == s_.experts;
    const int64_t n = rows_[e], C = s_.d_model, H = s_.d_hidden * (shared ? s_.shared : 1);
    if (n == 0) return;
    auto& f = shared ? *layer_.shared()
                     : static_cast<model::FfnExpert&>(layer_.expert(static_cast<int>(e)));
    const float* w1 = f.w1().value.f32();
    const float* w2 = f.w2().value.f32();
    float* dw1 = f.w1().grad.f32();
    float* dw2 = f.w2().grad.f32();
    float* xe = x_.data() + first_[e] * C;
    float* he = h_.data() + first_[e] * s_.d_hidden * std::max(1, s_.shared);
    float* ye = y_.data() + first_[e] * C;
    float* dye = dy_.data() + first_[e] * C;
    float* dxe = dx_.data() + first_[e] * C;
    auto gemm = [&](bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* Cm, int64_t ldc) {
      if (schedule == Schedule::kOpenBlasThreads) {
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    M, N, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
      } else if (single_thread) {
        cpu::GemmSerial<float>(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
      } else {
        cpu::Gemm<float>(pool_, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
      }
    };
    gemm(false, true, n, H, C, xe, C, w1, C, 0.f, he, H);    // h = x W1^T
    gemm(false, true, n, C, H, he, H, w2, H, 0.f, ye, C);    // y = h W2^T
    gemm(true, false, C, H, n, dye, C, he, H, 1.f, dw2, H);  // dW2 += dy^T h
    gemm(false, false, n, H, C, dye, C, w2, H, 0.f, he, H);  // dh = dy W2
    gemm(true, false, H, C, n, he, H, xe, C, 1.f, dw1, C);   // dW1 += dh^T x
    gemm(false, false, n, C, H, he, H, w1, C, 0.f, dxe, C);  // dx = dh W1
  }

  const Shape& s_;
  model::MoeLayer& layer_;
  std::vector<int64_t> rows_;
  ThreadPool& pool_;
  std::vector<int64_t> first_, cut_;
  std::vector<float> tok_x_, logits_, dlogits_, tok_dx_;  // the router's, one row per token
  std::vector<float> x_, h_, y_, dy_, dx_;
};

// GFLOP of the layer's GEMMs in one forward + backward: the router's (every token against every
// expert), routed rows through d_hidden-wide experts and every token through the shared FFN.
double ExpertGflop(const Shape& s, int64_t routed) {
  return (6.0 * s.d_model * s.experts * static_cast<double>(s.tokens) +
          12.0 * s.d_model * s.d_hidden *
              (static_cast<double>(routed) + static_cast<double>(s.tokens) * s.shared)) *
         1e-9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Row RunShape(const Shape& s, const Options& o, ThreadPool& pool) {
  Row row;
  row.s = s;
  ops::Context ctx{&pool};
  {
    auto layer_owner = MakeBenchLayer(ctx, s.tokens, s.d_model, s.d_hidden, s.experts, s.k, 0,
                                      s.experts, s.shared);
    model::MoeLayer& layer = *layer_owner;
    Tensor x = Tensor::Empty({s.tokens, s.d_model}), y = Tensor::Empty({s.tokens, s.d_model});
    Tensor dy = Tensor::Empty({s.tokens, s.d_model}), dx = Tensor::Empty({s.tokens, s.d_model});
    std::mt19937 gen(7);
    std::normal_distribution<float> nd(0, 1);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(gen);
    for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(gen);
    const model::GateCall call{true, 0};
    auto layer_step = [&] {
      layer.Forward(ctx, x, y, call);
      layer.Backward(ctx, x, dy, dx);
    };
    for (int i = 0; i < std::max(1, o.warmup); ++i) layer_step();
    // The routing (and so the GEMM shapes) is fixed by x and the router: take it from the warm-up.
    ExpertGemms gemms(s, layer, layer.stats().load, pool);
    const Schedule schedules[] = {Schedule::kOpenBlasThreads, Schedule::kSplitGemms,
                                  Schedule::kExpertGroups};
    for (Schedule sched : schedules) gemms.Run(sched);  // warm up
    // Interleave: one layer step, then one run of each baseline schedule, `iters` times, so a
    // slow spell of the machine hits every column alike. Medians of each.
    // Alternate blocks (strata, then each sgemm schedule) for o.blocks rounds, so a slow spell of
    // a shared machine hits every column alike. Each block starts with one untimed iteration,
    // which absorbs the hand-over (cold caches, the previous block's threads still spinning), then
    // times o.iters iterations one by one; each column reports the median of its timed ones.
    std::vector<double> layer_ms, in_groups_ms;
    std::vector<std::vector<double>> sched_ms(3);
    auto block = [&](std::vector<double>* out, const auto& fn) {
      fn();
      for (int i = 0; i < o.iters; ++i) out->push_back(MedianMs(1, fn));
    };
    for (int b = 0; b < o.blocks; ++b) {
      block(&layer_ms, layer_step);
      if (s.shared > 0) {
        layer.set_shared_in_expert_groups(true);
        block(&in_groups_ms, layer_step);
        layer.set_shared_in_expert_groups(false);
      }
      for (int k = 0; k < 3; ++k) block(&sched_ms[k], [&] { gemms.Run(schedules[k]); });
    }
    row.ms = Median(layer_ms);
    if (s.shared > 0) row.shared_in_groups_ms = Median(in_groups_ms);
    row.sgemm_ms = 1e300;
    for (int k = 0; k < 3; ++k) {
      row.sgemm_by_schedule.push_back(Median(sched_ms[k]));
      if (row.sgemm_by_schedule[k] < row.sgemm_ms) {
        row.sgemm_ms = row.sgemm_by_schedule[k];
        row.sgemm_schedule = ScheduleName(schedules[k]);
      }
    }
    row.peak_mb = PeakRssMb();
    // Check the output of a forward pass on sampled tokens against a recomputation in double:
    // router, top-k choice, and each chosen expert's FFN.
    layer.Forward(ctx, x, y, call);
    const model::Routing& r = layer.routing();
    auto& gate = static_cast<model::SoftmaxGate&>(layer.gate());
    for (int64_t t = 0; t < s.tokens; t += std::max<int64_t>(1, s.tokens / 16)) {
      std::vector<double> ref(s.d_model, 0.0);
      // Recompute the router for this token; the selected experts must agree.
      std::vector<double> logit(s.experts);
      double mx = -1e300;
      for (int64_t e = 0; e < s.experts; ++e) {
        double v = 0;
        for (int64_t c = 0; c < s.d_model; ++c) {
          v += double(gate.router().value.f32()[e * s.d_model + c]) * x.f32()[t * s.d_model + c];
        }
        logit[e] = v;
        mx = std::max(mx, v);
      }
      double z = 0;
      for (double v : logit) z += std::exp(v - mx);
      double wsum = 0;
      for (int j = 0; j < s.k; ++j) wsum += std::exp(logit[r.expert.i32()[t * s.k + j]] - mx) / z;
      // ref += w * FFN_f(x_t), for an FFN of width H.
      auto add_ffn = [&](model::FfnExpert& f, int64_t H, double w) {
        std::vector<double> act(H);
        for (int64_t h = 0; h < H; ++h) {
          double v = f.b1()->value.f32()[h];
          for (int64_t c = 0; c < s.d_model; ++c) {
            v += double(f.w1().value.f32()[h * s.d_model + c]) * x.f32()[t * s.d_model + c];
          }
          act[h] = Gelu(v);
        }
        for (int64_t c = 0; c < s.d_model; ++c) {
          double v = f.b2()->value.f32()[c];
          for (int64_t h = 0; h < H; ++h) v += double(f.w2().value.f32()[c * H + h]) * act[h];
          ref[c] += w * v;
        }
      };
      for (int j = 0; j < s.k; ++j) {
        const int e = r.expert.i32()[t * s.k + j];
        const double wj = std::exp(logit[e] - mx) / z / (s.k > 1 ? wsum : 1.0);
        add_ffn(static_cast<model::FfnExpert&>(layer.expert(e)), s.d_hidden, wj);
      }
      if (s.shared > 0) add_ffn(*layer.shared(), s.shared * s.d_hidden, 1.0);
      double err = 0, norm = 0;
      for (int64_t c = 0; c < s.d_model; ++c) {
        err = std::max(err, std::abs(ref[c] - y.f32()[t * s.d_model + c]));
        norm = std::max(norm, std::abs(ref[c]));
      }
      ++row.checked;
      row.wrong += err > 1e-4 * (1 + norm);
    }
    for (int64_t n : layer.stats().load) row.routed += n;
    row.grouped = layer.last_run_grouped();
  }
  row.gflops = ExpertGflop(s, row.routed) / (row.ms * 1e-3);
  return row;
}

// One round of a shape: the strata measurements in a fresh child process (so its peak memory is
// its own), then the PyTorch baseline in its own process. No two measurements share the machine.
Row MeasureRound(const Shape& s, const Options& o, int threads) {
  const std::string out = InChildProcess([&] {
    ThreadPool pool(threads);
    Row r = RunShape(s, o, pool);
    JsonWriter j;
    j.BeginObject()
        .Field("ms", r.ms)
        .Field("sgemm_ms", r.sgemm_ms)
        .Field("in_groups", r.shared_in_groups_ms)
        .Field("s0", r.sgemm_by_schedule[0])
        .Field("s1", r.sgemm_by_schedule[1])
        .Field("s2", r.sgemm_by_schedule[2])
        .Field("peak_mb", r.peak_mb)
        .Field("routed", r.routed)
        .Field("wrong", r.wrong)
        .Field("checked", r.checked)
        .Field("grouped", r.grouped ? 1 : 0)
        .EndObject();
    return j.str();
  });
  Row row;
  row.s = s;
  if (out.empty()) {
    row.wrong = 1;
    row.torch_note = "the measurement process failed";
    return row;
  }
  row.ms = JsonNumber(out, "ms");
  row.shared_in_groups_ms = JsonNumber(out, "in_groups");
  row.sgemm_by_schedule = {JsonNumber(out, "s0"), JsonNumber(out, "s1"), JsonNumber(out, "s2")};
  row.peak_mb = JsonNumber(out, "peak_mb");
  row.routed = static_cast<int64_t>(JsonNumber(out, "routed"));
  row.wrong = static_cast<int>(JsonNumber(out, "wrong"));
  row.checked = static_cast<int>(JsonNumber(out, "checked"));
  row.grouped = JsonNumber(out, "grouped") > 0;
  if (o.torch) {
    int status = 0;
    const std::string t = Capture(
        absl::StrFormat("%s %s/bench_moe_torch.py --tokens %d --d_model %d --d_hidden %d "
                        "--experts %d --k %d --shared %d --threads %d --iters %d "
                        "--warmup %d",
                        o.python, ExecutableDir(), s.tokens, s.d_model, s.d_hidden, s.experts, s.k,
                        s.shared, threads, o.iters * o.blocks, std::max(1, o.warmup)),
        &status);
    row.torch_ms = JsonNumber(t, "ms");
    row.torch_peak_mb = JsonNumber(t, "peak_rss_mb");
    if (!std::isfinite(row.torch_ms)) {
      row.torch_note = t.find("error") != std::string::npos ? t : "the PyTorch baseline failed";
    }
  }
  return row;
}

// o.rounds rounds of MeasureRound; every time is the median over rounds.
Row MeasureShape(const Shape& s, const Options& o, int threads) {
  std::vector<Row> rounds;
  for (int r = 0; r < o.rounds; ++r) rounds.push_back(MeasureRound(s, o, threads));
  Row row = rounds[0];
  auto median_of = [&](auto get) {
    std::vector<double> v;
    for (const Row& r : rounds) {
      if (!std::isfinite(get(r))) return std::nan("");  // a round without this measurement
      v.push_back(get(r));
    }
    return Median(v);
  };
  row.ms = median_of([](const Row& r) { return r.ms; });
  row.torch_ms = median_of([](const Row& r) { return r.torch_ms; });
  row.shared_in_groups_ms = median_of([](const Row& r) { return r.shared_in_groups_ms; });
  row.sgemm_ms = 1e300;
  for (int k = 0; k < 3; ++k) {
    row.sgemm_by_schedule[k] = median_of([k](const Row& r) { return r.sgemm_by_schedule[k]; });
    if (row.sgemm_by_schedule[k] < row.sgemm_ms) {
      row.sgemm_ms = row.sgemm_by_schedule[k];
      row.sgemm_schedule = ScheduleName(static_cast<Schedule>(k));
    }
  }
  for (const Row& r : rounds) {
    row.peak_mb = std::max(row.peak_mb, r.peak_mb);
    row.torch_peak_mb = std::max(row.torch_peak_mb, r.torch_peak_mb);
    row.wrong = std::max(row.wrong, r.wrong);
    if (row.torch_note.empty()) row.torch_note = r.torch_note;
  }
  row.gflops = ExpertGflop(s, row.routed) / (row.ms * 1e-3);
  return row;
}

int Main(int argc, char** argv) {
  Options o;
  int workers = 0, chunks = 2;
  bool small = false;
  int64_t worker_shape[5] = {0, 0, 0, 0, 0};
  o.python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](int* out) {
      if (i + 1 >= argc || !absl::SimpleAtoi(argv[++i], out) || *out < 0) {
        std::fprintf(stderr, "bench_moe_layer: %s needs a non-negative integer\n", a.c_str());
        std::exit(2);
      }
    };
    if (a == "--json")
      o.json = true;
    else if (a == "--threads")
      value(&o.threads);
    else if (a == "--iters")
      value(&o.iters);
    else if (a == "--warmup")
      value(&o.warmup);
    else if (a == "--rounds")
      value(&o.rounds);
    else if (a == "--blocks")
      value(&o.blocks);
    else if (a == "--no-torch")
      o.torch = false;
    else if (a == "--python" && i + 1 < argc)
      o.python = argv[++i];
    else if (a == "--small") {
      o.shapes = {{512, 128, 256, 8, 2}};
      small = true;
    } else if (a == "--workers")
      value(&workers);
    else if (a == "--chunks")
      value(&chunks);
    else if (a == "--shape" && i + 1 < argc) {
      Shape s{};
      const int n = std::sscanf(argv[++i], "%ld,%ld,%ld,%ld,%d,%d", &s.tokens, &s.d_model,
                                &s.d_hidden, &s.experts, &s.k, &s.shared);
      if ((n != 5 && n != 6) || s.tokens < 1 || s.d_model < 1 || s.d_hidden < 1 || s.experts < 1 ||
          s.k < 1 || s.k > 8 || s.k > s.experts || s.shared < 0 || s.shared > 64) {
        std::fprintf(stderr,
                     "bench_moe_layer: --shape wants TOKENS,D_MODEL,D_HIDDEN,EXPERTS,K[,SHARED] "
                     "with 1 <= K <= min(8, EXPERTS) and 0 <= SHARED <= 64\n");
        return 2;
      }
      o.shapes = {s};
      worker_shape[0] = s.tokens;
      worker_shape[1] = s.d_model;
      worker_shape[2] = s.d_hidden;
      worker_shape[3] = s.experts;
      worker_shape[4] = s.k;
    } else {
      std::fprintf(stderr,
                   "usage: bench_moe_layer [--json] [--threads T] [--iters N] [--blocks N] "
                   "[--rounds N] [--warmup N] "
                   "[--no-torch] [--python PATH] [--small] [--shape T,C,H,E,K]\n"
                   "       bench_moe_layer --workers N [--chunks K] [--rounds N] [--iters N] "
                   "[--small] [--json]\n");
      return 2;
    }
  }
  if (workers > 0) {
    if (o.shapes.size() == 1 && o.shapes[0].shared > 0) {
      std::fprintf(stderr, "bench_moe_layer: --workers does not take shared experts\n");
      return 2;
    }
    return RunWorkersBench(workers, std::max(1, chunks), std::max(1, o.rounds),
                           std::max(1, o.iters * 3), o.json, small, worker_shape);
  }
  if (o.threads == 0) o.threads = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (o.iters < 1) o.iters = 1;
  if (o.rounds < 1) o.rounds = 1;
  if (o.blocks < 1) o.blocks = 1;
  const BlasReport blas = MeasureBlas(o.threads);
  if (!o.json) {
    std::printf("# bench_moe_layer: MoE layer forward+backward, top-k gate, dropless, %d threads\n",
                o.threads);
    std::printf("# host: %s\n", HostDescription().c_str());
    PrintBlasReport(blas);
    std::printf(
        "# GFLOP/s counts the layer's GEMMs (router 6 * d_model * tokens * experts, experts 12 * "
        "d_model * d_hidden * (routed rows + tokens * shared)); sgemm: those GEMMs alone; of_best: "
        "GFLOP/s over the best kernel's sgemm above\n");
    std::printf("%6s %7s %8s %7s %2s %6s | %9s %8s %7s | %9s %8s | %9s %8s | %7s %6s\n", "tokens",
                "d_model", "d_hidden", "experts", "k", "shared", "strata_ms", "GFLOP/s", "of_best",
                "sgemm_ms", "x_sgemm", "torch_ms", "speedup", "peak_MB", "#wrong");
  }
  int failures = 0;
  for (const Shape& s : o.shapes) {
    Row r = MeasureShape(s, o, o.threads);
    failures += r.wrong;
    const double over = r.ms / r.sgemm_ms;
    const double speedup = r.torch_ms / r.ms;
    const double of_best = blas.OfBest(r.gflops);
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("tokens", s.tokens)
          .Field("d_model", s.d_model)
          .Field("d_hidden", s.d_hidden)
          .Field("experts", s.experts)
          .Field("k", s.k)
          .Field("shared", s.shared)
          .Field("threads", o.threads)
          .Field("ms", r.ms)
          .Field("gflops", r.gflops)
          .Field("of_best_sgemm", of_best)
          .Field("sgemm_ms", r.sgemm_ms)
          .Field("sgemm_schedule", r.sgemm_schedule)
          .Field("sgemm_openblas_threads_ms", r.sgemm_by_schedule[0])
          .Field("sgemm_split_gemms_ms", r.sgemm_by_schedule[1])
          .Field("sgemm_expert_groups_ms", r.sgemm_by_schedule[2])
          .Field("time_over_sgemm", over)
          .Field("shared_in_groups_ms", r.shared_in_groups_ms)
          .Field("torch_ms", r.torch_ms)
          .Field("speedup_over_torch", speedup)
          .Field("peak_rss_mb", r.peak_mb)
          .Field("torch_peak_rss_mb", r.torch_peak_mb)
          .Field("checked", r.checked)
          .Field("wrong", r.wrong);
      AddBlasFields(j, blas);
      j.EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf(
          "%6lld %7lld %8lld %7lld %2d %6d | %9.1f %8.1f %7.2f | %9.1f %8.3f | %9.1f %8.2f | "
          "%7.0f %6d\n",
          (long long)s.tokens, (long long)s.d_model, (long long)s.d_hidden, (long long)s.experts,
          s.k, s.shared, r.ms, r.gflops, of_best, r.sgemm_ms, over, r.torch_ms, speedup, r.peak_mb,
          r.wrong);
      std::printf(
          "#   sgemm schedules (ms): openblas_threads %.1f, split_gemms %.1f, expert_groups "
          "%.1f; strata ran %s\n",
          r.sgemm_by_schedule[0], r.sgemm_by_schedule[1], r.sgemm_by_schedule[2],
          r.grouped ? "expert groups" : "split GEMMs");
      if (s.shared > 0) {
        std::printf(
            "#   shared experts as a task of the expert groups: %.1f ms (%.3f x the default "
            "above)\n",
            r.shared_in_groups_ms, r.shared_in_groups_ms / r.ms);
      }
      if (!r.torch_note.empty()) std::printf("# torch: %s\n", r.torch_note.c_str());
    }
    std::fflush(stdout);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::ChooseBlasKernelAtStart("bench_moe_layer", argv);
  return strata::bench::Main(argc, argv);
}
