// bench_parity: one model trained on two devices side by side, step by step, to explain where
// they part. Both sides build the same model from the same config, seed and batches (the CPU is
// the reference, side A by default). Per step it prints both losses and their difference, how
// many tokens of each MoE layer chose a different set of experts on the two sides, and the first
// parameter, in the model's order, whose gradient differs by more than --tol (max |gA - gB| over
// max |gA|), with how many parameters do.
//
// With --sync, side B starts every step from side A's parameters, so each step's differences are
// that step's alone: the kernels' rounding, and what a routing choice that flips on it adds. If
// the synced run stays within float tolerance while the free run parts, the parting is rounding
// amplified through routing, not a wrong kernel.
//
//   bench_parity [--config FILE] [--steps N] [--a DEVICE] [--b DEVICE] [--threads-a T]
//                [--threads-b T] [--sync] [--bf16] [--tol X] [--json]
//
// --bf16 trains both sides with bf16 GEMMs (train.precision BF16; the CPU emulates the rounding);
// by default both are fp32.
//
// DEVICE is cpu, cuda or cuda:N (default: a = cpu, b = cuda when strata sees a GPU, else cpu with
// one thread against A's two, which already adds in another order). Exit status 0; 2 on bad
// arguments or a config that does not load.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "bench/blas_report.h"
#include "core/common/json.h"
#include "proto/config_io.h"
#include "runtime/data/dataset.h"
#include "runtime/model/adamw.h"
#include "runtime/model/transformer.h"
#include "storage/env.h"

namespace strata::bench {
namespace {

struct Side {
  std::unique_ptr<ThreadPool> pool;
  ops::Context ctx;
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<model::AdamW> opt;
};

StatusOr<Side> MakeSide(const config::JobConfig& cfg, Device device, int threads, bool bf16) {
  Side s;
  s.pool = std::make_unique<ThreadPool>(threads);
  s.ctx = ops::Context{s.pool.get(), nullptr};
  model::ModelOptions options;
  options.config = cfg.model();
  options.seed = cfg.seed();
  options.max_batch = cfg.train().global_batch();
  options.device = device;
  options.bf16 = bf16;
  ASSIGN_OR_RETURN(s.model, model::MoeTransformer::Create(s.ctx, options));
  model::AdamWOptions ao;
  ao.weight_decay = cfg.train().weight_decay();
  s.opt = std::make_unique<model::AdamW>(s.model->Parameters(), ao);
  return s;
}

std::vector<float> HostFloats(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  t.CopyToHost(v.data());
  return v;
}

std::vector<int32_t> HostInts(const Tensor& t) {
  std::vector<int32_t> v(static_cast<size_t>(t.numel()));
  t.CopyToHost(v.data());
  return v;
}

// Tokens whose set of chosen experts differs between the two sides' routing of one MoE layer.
int64_t RoutingDifferences(const model::Routing& a, const model::Routing& b) {
  if (a.tokens != b.tokens || a.k != b.k || !a.expert.defined() || !b.expert.defined()) return -1;
  const std::vector<int32_t> ea = HostInts(a.expert), eb = HostInts(b.expert);
  int64_t differ = 0;
  for (int64_t t = 0; t < a.tokens; ++t) {
    std::set<int32_t> sa(ea.begin() + t * a.k, ea.begin() + (t + 1) * a.k);
    std::set<int32_t> sb(eb.begin() + t * b.k, eb.begin() + (t + 1) * b.k);
    differ += sa != sb;
  }
  return differ;
}

int Usage() {
  std::fprintf(stderr,
               "usage: bench_parity [--config FILE] [--steps N] [--a DEVICE] [--b DEVICE] "
               "[--threads-a T] [--threads-b T] [--sync] [--bf16] [--tol X] [--json]\n");
  return 2;
}

int Main(int argc, char** argv) {
  std::string config_path = std::string(STRATA_SOURCE_DIR) + "/examples/moe_lm/config.textproto";
  int steps = 50, threads_a = 2, threads_b = -1;
  std::string a_text = "cpu", b_text;
  bool sync = false, json = false, bf16 = false;
  double tol = 1e-4;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--config" && has_value) {
      config_path = argv[++i];
    } else if (arg == "--steps" && has_value && absl::SimpleAtoi(argv[i + 1], &steps) &&
               steps > 0) {
      ++i;
    } else if (arg == "--a" && has_value) {
      a_text = argv[++i];
    } else if (arg == "--b" && has_value) {
      b_text = argv[++i];
    } else if (arg == "--threads-a" && has_value && absl::SimpleAtoi(argv[i + 1], &threads_a) &&
               threads_a > 0) {
      ++i;
    } else if (arg == "--threads-b" && has_value && absl::SimpleAtoi(argv[i + 1], &threads_b) &&
               threads_b > 0) {
      ++i;
    } else if (arg == "--tol" && has_value && absl::SimpleAtod(argv[i + 1], &tol) && tol > 0) {
      ++i;
    } else if (arg == "--sync") {
      sync = true;
    } else if (arg == "--bf16") {
      bf16 = true;
    } else if (arg == "--json") {
      json = true;
    } else {
      std::fprintf(stderr, "bench_parity: bad argument '%s'\n", arg.c_str());
      return Usage();
    }
  }
  if (b_text.empty()) b_text = CudaDeviceCount() > 0 ? "cuda" : "cpu";
  if (threads_b < 0) threads_b = b_text == "cpu" && a_text == "cpu" ? 1 : threads_a;
  auto a_device = Device::Parse(a_text), b_device = Device::Parse(b_text);
  if (!a_device.ok() || !b_device.ok()) {
    std::fprintf(
        stderr, "bench_parity: %s\n",
        std::string((a_device.ok() ? b_device.status() : a_device.status()).message()).c_str());
    return 2;
  }
  auto cfg = config::LoadJobConfig(config_path);
  if (!cfg.ok()) {
    std::fprintf(stderr, "bench_parity: %s\n", std::string(cfg.status().message()).c_str());
    return 2;
  }
  auto dataset = data::TokenDataset::Open(cfg->data(), cfg->model().vocab_size(),
                                          cfg->model().seq_len(), storage::Env::Default());
  if (!dataset.ok()) {
    std::fprintf(stderr, "bench_parity: %s\n", std::string(dataset.status().message()).c_str());
    return 2;
  }
  auto a = MakeSide(*cfg, *a_device, threads_a, bf16);
  auto b = a.ok() ? MakeSide(*cfg, *b_device, threads_b, bf16) : a.status();
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "bench_parity: %s\n",
                 std::string((a.ok() ? b.status() : a.status()).message()).c_str());
    return 2;
  }
  const std::vector<model::Parameter*>& pa = a->model->Parameters();
  const std::vector<model::Parameter*>& pb = b->model->Parameters();
  if (!json) {
    std::printf(
        "# bench_parity: %s, %d steps; A %s (%d threads), B %s (%d threads)%s; "
        "gradient tolerance %.1e (max |gA - gB| / max |gA|)\n",
        config_path.c_str(), steps, a_device->ToString().c_str(), threads_a,
        b_device->ToString().c_str(), threads_b,
        sync ? "; B starts every step from A's parameters" : "", tol);
    std::printf("# blas: %s\n", blas::Current().describe.c_str());
    std::printf("%5s %12s %12s %10s | %-24s | %7s | %s\n", "step", "loss_A", "loss_B", "|diff|",
                "tokens routed otherwise", "#grads", "first gradient beyond tolerance");
  }
  const int64_t B = cfg->train().global_batch(), T = cfg->model().seq_len();
  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int step = 0; step < steps; ++step) {
    if (sync) {
      for (size_t p = 0; p < pa.size(); ++p) pb[p]->value.CopyFrom(pa[p]->value);
    }
    (*dataset)->TrainBatch(cfg->seed(), data::TokenDataset::FirstSample(step, B), B, inputs.data(),
                           targets.data());
    const model::GateCall call{true, static_cast<uint64_t>(step)};
    double loss[2];
    Side* sides[2] = {&*a, &*b};
    for (int s = 0; s < 2; ++s) {
      sides[s]->opt->ZeroGrad(sides[s]->ctx);
      loss[s] = sides[s]->model->Forward(sides[s]->ctx, inputs.data(), targets.data(), B, call);
      sides[s]->model->Backward(sides[s]->ctx);
    }
    std::vector<int64_t> routing;
    const auto& la = a->model->moe_layers();
    const auto& lb = b->model->moe_layers();
    for (size_t l = 0; l < la.size() && l < lb.size(); ++l) {
      routing.push_back(RoutingDifferences(la[l].layer->routing(), lb[l].layer->routing()));
    }
    int beyond = 0;
    std::string first;
    double first_err = 0;
    for (size_t p = 0; p < pa.size(); ++p) {
      const std::vector<float> ga = HostFloats(pa[p]->grad), gb = HostFloats(pb[p]->grad);
      double diff = 0, scale = 0;
      for (size_t i = 0; i < ga.size(); ++i) {
        diff = std::max(diff, std::fabs(static_cast<double>(ga[i]) - gb[i]));
        scale = std::max(scale, std::fabs(static_cast<double>(ga[i])));
      }
      const double err = diff / std::max(scale, 1e-30);
      if (err > tol) {
        if (beyond++ == 0) {
          first = pa[p]->name;
          first_err = err;
        }
      }
    }
    for (int s = 0; s < 2; ++s) {
      const double norm = sides[s]->opt->GradNorm(sides[s]->ctx);
      sides[s]->opt->Step(sides[s]->ctx, cfg->train().lr(),
                          ops::ClipScale(norm, cfg->train().grad_clip()));
    }
    std::string routed;
    for (int64_t n : routing) routed += (routed.empty() ? "" : " ") + std::to_string(n);
    if (json) {
      JsonWriter j;
      j.BeginObject()
          .Field("step", static_cast<int64_t>(step))
          .Field("loss_a", loss[0])
          .Field("loss_b", loss[1])
          .Field("loss_diff", std::fabs(loss[0] - loss[1]))
          .Field("grads_beyond_tol", static_cast<int64_t>(beyond))
          .Field("first_grad_beyond_tol", first)
          .Field("first_grad_rel_diff", beyond ? first_err : 0.0)
          .Key("tokens_routed_otherwise")
          .IntArray(routing)
          .EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("%5d %12.7f %12.7f %10.2e | %-24s | %7d | %s\n", step + 1, loss[0], loss[1],
                  std::fabs(loss[0] - loss[1]), routed.c_str(), beyond,
                  beyond ? absl::StrFormat("%s (%.2e)", first, first_err).c_str() : "-");
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::ChooseBlasKernelAtStart("bench_parity", argv);
  return strata::bench::Main(argc, argv);
}
