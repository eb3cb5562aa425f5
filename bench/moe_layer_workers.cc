// bench_moe_layer --workers N: one MoE layer split over N worker processes (expert parallel), each
// with one compute thread, forward + backward, with the dispatch overlap off (1 chunk) and on.
//
// Each worker holds E / N experts and its own tokens; rows travel by all-to-all-v over Gloo (TCP
// on loopback) on the exchange's communication thread. Per step:
//   step_ms     wall time of forward + backward (median over iterations, rank 0)
//   comm_ms     time the communication thread spent in all-to-all-v's
//   exposed_ms  time the compute thread waited for communication
//   compute_ms  step_ms - exposed_ms (gate, permutation, experts, combine)
//   hidden_comm_fraction = 1 - exposed_ms / comm_ms: the share of communication that overlapped
//                          with compute
// Overlap off and on alternate in rounds of fresh processes; each column is the median over rounds.
// #wrong: every worker recomputes its output with all E experts in one process (same initial
// values by name) and counts elements off by more than 1e-4 relative.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "core/common/clock.h"
#include "core/common/json.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"
#include "runtime/model/moe_layer.h"
#include "scheduler/expert_parallel.h"

namespace strata::bench {

struct WorkerShape {
  int64_t tokens = 4096;  // per worker
  int64_t d_model = 1024, d_hidden = 128, experts = 8;
  int k = 2;
};

struct WorkerResult {
  double step_ms = 0, comm_ms = 0, exposed_ms = 0;
  int64_t wrong = 0;
};

std::unique_ptr<model::MoeLayer> MakeBenchLayer(ops::Context& ctx, int64_t tokens, int64_t d_model,
                                                int64_t d_hidden, int64_t experts, int k,
                                                int64_t first, int64_t count, int shared) {
  model::SoftmaxGateOptions g;
  g.d_model = d_model;
  g.num_experts = experts;
  g.k = k;
  g.max_tokens = tokens;
  g.config.set_type(config::GateConfig::TOP_K);
  g.config.set_capacity_factor_train(0);
  g.seed = 1;
  std::vector<std::unique_ptr<model::Expert>> list;
  for (int64_t e = first; e < first + count; ++e) {
    model::FfnOptions f{d_model, d_hidden, ops::Activation::kGelu, true, 0.02f, 0.02f};
    list.push_back(std::make_unique<model::FfnExpert>(absl::StrCat("e", e), f));
  }
  std::unique_ptr<model::FfnExpert> shared_ffn;
  if (shared > 0) {
    shared_ffn = std::make_unique<model::FfnExpert>(
        "shared",
        model::FfnOptions{d_model, shared * d_hidden, ops::Activation::kGelu, true, 0.02f, 0.02f});
  }
  auto layer = std::make_unique<model::MoeLayer>(d_model, tokens, model::MakeGate("gate", g),
                                                 std::move(list), first, Device::Cpu(),
                                                 std::move(shared_ffn));
  for (model::Parameter* p : layer->Parameters()) model::Initialize(ctx, *p, 1);
  return layer;
}

namespace {

std::unique_ptr<model::MoeLayer> MakeLayer(ops::Context& ctx, const WorkerShape& s, int64_t first,
                                           int64_t count) {
  return MakeBenchLayer(ctx, s.tokens, s.d_model, s.d_hidden, s.experts, s.k, first, count, 0);
}

// One worker: returns "step_ms comm_ms exposed_ms wrong" or "error: ...".
std::string RunWorker(const std::string& store_dir, int rank, int workers, int chunks,
                      const WorkerShape& s, int iters) {
  auto base = comm::MakeFileStore(store_dir);
  if (!base.ok()) return absl::StrCat("error: ", base.status().message());
  comm::CommOptions co;
  co.rank = rank;
  co.world_size = workers;
  auto comm = comm::ConnectGloo(*base, co);
  if (!comm.ok()) return absl::StrCat("error: ", comm.status().message());
  ThreadPool pool(1);
  ops::Context ctx{&pool};
  auto placement = scheduler::ExpertPlacement::Even(s.experts, workers);
  if (!placement.ok()) return absl::StrCat("error: ", placement.status().message());
  auto layer = MakeLayer(ctx, s, placement->first(rank), placement->count(rank));
  scheduler::ExpertParallelOptions eo;
  eo.chunks = chunks;
  scheduler::ExpertParallel exchange(comm->get(), *placement, eo);
  layer->AttachExchange(&exchange, 0);

  Tensor x = Tensor::Empty({s.tokens, s.d_model}), y = Tensor::Empty({s.tokens, s.d_model});
  Tensor dy = Tensor::Empty({s.tokens, s.d_model}), dx = Tensor::Empty({s.tokens, s.d_model});
  std::mt19937 gen(100 + rank);
  std::normal_distribution<float> nd(0, 1);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(gen);
  for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(gen);
  const model::GateCall call{true, 0};
  std::vector<double> step, comm_ms, exposed;
  for (int i = 0; i < iters + 1; ++i) {
    (void)comm->get()->Barrier();
    exchange.TakeTimes();
    const double t0 = NowSeconds();
    layer->Forward(ctx, x, y, call);
    layer->Backward(ctx, x, dy, dx);
    const double t = NowSeconds() - t0;
    const scheduler::ExchangeTimes times = exchange.TakeTimes();
    if (i == 0) continue;  // warm-up
    step.push_back(t * 1e3);
    comm_ms.push_back(times.comm_seconds * 1e3);
    exposed.push_back(times.wait_seconds * 1e3);
  }
  if (!exchange.status().ok()) return absl::StrCat("error: ", exchange.status().message());
  // The same tokens through all experts in this process.
  layer->Forward(ctx, x, y, call);
  auto whole = MakeLayer(ctx, s, 0, s.experts);
  Tensor ref = Tensor::Empty({s.tokens, s.d_model});
  whole->Forward(ctx, x, ref, call);
  int64_t wrong = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    const float a = y.f32()[i], b = ref.f32()[i];
    if (!(std::fabs(a - b) <= 1e-4f * std::max(1.0f, std::fabs(b)))) ++wrong;
  }
  return absl::StrFormat("%.4f %.4f %.4f %d", MedianOf(step), MedianOf(comm_ms), MedianOf(exposed),
                         wrong);
}

// Runs `workers` processes once; rank 0's figures, wrong summed over ranks.
bool RunOnce(int workers, int chunks, const WorkerShape& s, int iters, WorkerResult* out,
             std::string* error) {
  char tmpl[] = "/tmp/strata-bench-store-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    *error = "cannot create a temporary store folder";
    return false;
  }
  std::vector<pid_t> pids;
  std::vector<int> fds;
  std::fflush(stdout);
  for (int r = 0; r < workers; ++r) {
    int p[2];
    if (pipe(p) != 0) return false;
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      const std::string res = RunWorker(tmpl, r, workers, chunks, s, iters);
      if (write(p[1], res.data(), res.size()) < 0) _exit(1);
      close(p[1]);
      _exit(0);
    }
    close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  bool ok = true;
  out->wrong = 0;
  for (int r = 0; r < workers; ++r) {
    std::string res;
    char buf[512];
    ssize_t n;
    while ((n = read(fds[r], buf, sizeof(buf))) > 0) res.append(buf, static_cast<size_t>(n));
    close(fds[r]);
    int status = 0;
    waitpid(pids[r], &status, 0);
    WorkerResult w;
    long long wrong = 0;
    if (std::sscanf(res.c_str(), "%lf %lf %lf %lld", &w.step_ms, &w.comm_ms, &w.exposed_ms,
                    &wrong) != 4) {
      *error = absl::StrCat("worker ", r, ": ", res.empty() ? "no result" : res);
      ok = false;
      continue;
    }
    if (r == 0) *out = w;
    out->wrong += wrong;
  }
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  return ok;
}

}  // namespace

int RunWorkersBench(int workers, int chunks, int rounds, int iters, bool json, bool small,
                    const int64_t shape[5]) {
  WorkerShape s;
  if (small) s = WorkerShape{256, 128, 64, 4, 2};
  if (shape[0] > 0) {
    s = WorkerShape{shape[0], shape[1], shape[2], shape[3], static_cast<int>(shape[4])};
  }
  const BlasReport blas = MeasureBlas(workers);
  if (!json) {
    std::printf(
        "# bench_moe_layer --workers %d: one MoE layer over %d processes (1 compute thread each), "
        "forward+backward, all-to-all-v over Gloo/TCP loopback\n",
        workers, workers);
    std::printf("# host: %s\n", HostDescription().c_str());
    PrintBlasReport(blas);
    std::printf(
        "# per worker: %lld tokens, d_model %lld, d_hidden %lld, %lld experts in all, k %d; "
        "overlap on = %d dispatch chunks; medians of %d rounds x %d iterations\n",
        (long long)s.tokens, (long long)s.d_model, (long long)s.d_hidden, (long long)s.experts, s.k,
        chunks, rounds, iters);
    std::printf("%7s %7s %6s | %8s %10s %8s %10s | %6s %6s\n", "workers", "overlap", "chunks",
                "step_ms", "compute_ms", "comm_ms", "exposed_ms", "hidden", "#wrong");
  }
  std::vector<WorkerResult> off, on;
  for (int round = 0; round < rounds; ++round) {
    for (int overlap = 0; overlap < 2; ++overlap) {
      WorkerResult r;
      std::string error;
      if (!RunOnce(workers, overlap ? chunks : 1, s, iters, &r, &error)) {
        std::fprintf(stderr, "bench_moe_layer: %s\n", error.c_str());
        return 1;
      }
      (overlap ? on : off).push_back(r);
    }
  }
  int64_t wrong = 0;
  for (int overlap = 0; overlap < 2; ++overlap) {
    const auto& rs = overlap ? on : off;
    std::vector<double> step, comm, exposed;
    for (const WorkerResult& r : rs) {
      step.push_back(r.step_ms);
      comm.push_back(r.comm_ms);
      exposed.push_back(r.exposed_ms);
      wrong += r.wrong;
    }
    const double step_ms = MedianOf(step), comm_ms = MedianOf(comm), exposed_ms = MedianOf(exposed);
    const double compute_ms = step_ms - exposed_ms;
    const double hidden = comm_ms > 0 ? std::clamp(1.0 - exposed_ms / comm_ms, 0.0, 1.0) : 0.0;
    int64_t row_wrong = 0;
    for (const WorkerResult& r : rs) row_wrong += r.wrong;
    if (json) {
      JsonWriter j;
      j.BeginObject()
          .Field("workers", workers)
          .Field("overlap", overlap == 1)
          .Field("chunks", overlap ? chunks : 1)
          .Field("tokens_per_worker", s.tokens)
          .Field("d_model", s.d_model)
          .Field("d_hidden", s.d_hidden)
          .Field("experts", s.experts)
          .Field("k", s.k)
          .Field("step_ms", step_ms)
          .Field("compute_ms", compute_ms)
          .Field("comm_ms", comm_ms)
          .Field("exposed_comm_ms", exposed_ms)
          .Field("hidden_comm_fraction", hidden)
          .Field("wrong", row_wrong);
      AddBlasFields(j, blas);
      j.EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf("%7d %7s %6d | %8.1f %10.1f %8.1f %10.1f | %5.0f%% %6lld\n", workers,
                  overlap ? "on" : "off", overlap ? chunks : 1, step_ms, compute_ms, comm_ms,
                  exposed_ms, 100 * hidden, (long long)row_wrong);
    }
  }
  if (!json) {
    std::printf("# step time with overlap on / off: %.3f\n", MedianOf([&] {
                                                               std::vector<double> v;
                                                               for (const auto& r : on)
                                                                 v.push_back(r.step_ms);
                                                               return v;
                                                             }()) /
                                                                 MedianOf([&] {
                                                                   std::vector<double> v;
                                                                   for (const auto& r : off)
                                                                     v.push_back(r.step_ms);
                                                                   return v;
                                                                 }()));
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace strata::bench
