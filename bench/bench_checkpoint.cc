// bench_checkpoint: sharded checkpoints (docs/sharded_checkpoints.md), two measurements in one run.
//
// 1. Write bandwidth. A synthetic MoE model whose checkpoint is about 1 GiB (4 MoE layers x 44
//    experts of 256x1024, each with its two Adam moments, plus the dense state) is checkpointed by
//    N = 1, 2, 4 checkpoint::CheckpointManagers at once, N threads of this process: writer k holds
//    a contiguous range of the experts (ModelOptions first/num_local_experts) and the dense share
//    DealDenseParameters deals it, writes the shard r<k>, and writer 0 commits the set r0..r{N-1}.
//    The baseline, in the same run, is ONE manager writing the same bytes from one model holding
//    every expert: what rank 0 wrote alone before checkpoints were sharded (it also paid a gather
//    of every expert to rank 0, which this baseline leaves out, so the baseline is generous). The
//    time runs from the first Save call until the committer's Wait returns (snapshot, extents,
//    fdatasync, local manifests, prepared reports, global manifest). For scale, fio writes the
//    same bytes to the same folder (1 MiB blocks, io_uring, O_DIRECT, queue depth 32) in each
//    round, unless --no-fio. Each run writes a fresh folder, so nothing is only referenced: every
//    byte is written. Verified after every run:
//    CheckpointManager::Verify of the folder passes, and a resume into a fresh model holding every
//    expert (reading each from the shard that has it) gives back every parameter and both Adam
//    moments bitwise, and the optimizer's step count; otherwise the run fails.
// 2. Stall per checkpoint. The same model trained by train::Trainer (IN_MEMORY), K = N M + 1 steps
//    with a checkpoint every M steps (N checkpoints, 3 x 16 by default: M steps outlast a persist)
//    and K steps without, each in a fresh process, alternating, both traced. Printed: the mean
//    step time without checkpoints; save, the trainer's "checkpoint save" span (Save's own time:
//    the manifest, what it copies itself, starting the writer); snapshot, the writer's "checkpoint
//    snapshot" span (its copy of the state into host buffers, while the next step's forward and
//    backward run); fence, the trainer's "checkpoint fence" spans (the next step's update waiting
//    for that copy), per checkpoint; persist, the writer's "checkpoint persist" span (the
//    background write and commit); the stall, how long the training thread stood still for each
//    checkpoint: the gap between one step's end and the next step's start at checkpoint steps less
//    the same gap at other steps (Save itself, and its wait for the previous persist if one still
//    ran; the gap after the last checkpoint, which also holds the final evaluation, is left out),
//    plus the fence; and the cost, (time with - time without) / checkpoints over the same
//    steps, which also counts the snapshot and the persist slowing the steps beside them (on 2
//    cores they share the cores with training). Both as a share of the mean step time; the goal is
//    a stall under 5% of a step.
//
//   build/bin/bench_checkpoint [--dir DIR] [--writers 1,2,4] [--rounds R] [--experts E]
//                              [--layers L] [--d-model C] [--d-expert H] [--every M]
//                              [--checkpoints N] [--batch B] [--part write|stall] [--small]
//                              [--no-fio] [--json]
//
// Medians over --rounds (3). The folders live under --dir (default $TMPDIR, else /tmp, which must
// support O_DIRECT) and are deleted afterwards.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/blas_report.h"
#include "checkpoint/manager.h"
#include "core/common/json.h"
#include "core/common/thread_pool.h"
#include "proto/config_io.h"
#include "train/trainer.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string dir;
  std::vector<int> writers = {1, 2, 4};
  int rounds = 3;
  int layers = 4, experts = 44, d_model = 256, d_expert = 1024, seq_len = 64;
  int batch = 8;
  int every = 16;       // checkpoint every M steps (part 2): more steps than a persist takes
  int checkpoints = 3;  // checkpoints in the timed run (part 2): K = checkpoints * every + 1
  bool small = false;
  bool fio = true;
  bool json = false;
  std::string part;  // "write" or "stall": only that part; empty: both
};

config::JobConfig Config(const Options& o, const std::string& data, int steps) {
  const std::string text = absl::StrFormat(
      R"pb(
        name: "bench_checkpoint"
        seed: 11
        model {
          vocab_size: 256
          seq_len: %d
          d_model: %d
          n_layers: %d
          n_heads: 4
          moe_every: 1
          moe {
            num_experts: %d
            top_k: 2
            d_expert: %d
            gate { capacity_factor_train: 0 capacity_factor_eval: 0 }
          }
        }
        data { path: "%s" format: BYTES eval_fraction: 0.05 }
        train { steps: %d global_batch: %d lr: 0.001 warmup_steps: 1 eval_every: 0 }
      )pb",
      o.seq_len, o.d_model, o.layers, o.experts, o.d_expert, data, std::max(1, steps), o.batch);
  auto cfg = config::ParseJobConfig(text, "bench_checkpoint", "");
  CHECK(cfg.ok()) << cfg.status();
  return *cfg;
}

// Fills every gradient with values fixed by the parameter's name, then takes one AdamW step: the
// values and both moments then differ from a freshly built model's, and are the same in every
// writer's model that holds the parameter.
void Perturb(ops::Context& ctx, model::MoeTransformer& m, model::AdamW& opt) {
  for (model::Parameter* p : m.Parameters()) {
    uint64_t s = std::hash<std::string>()(p->name) | 1;
    float* g = p->grad.f32();
    for (int64_t i = 0; i < p->grad.numel(); ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift64
      g[i] = static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) / (1 << 23);
    }
  }
  opt.Step(ctx, 1e-3, 1.0);
}

struct Model {
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<model::AdamW> opt;
};

StatusOr<Model> Build(ops::Context& ctx, const config::JobConfig& cfg, int64_t first,
                      int64_t count) {
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.seed = cfg.seed();
  mo.first_local_expert = first;
  mo.num_local_experts = count;
  Model m;
  ASSIGN_OR_RETURN(m.model, model::MoeTransformer::Create(ctx, mo));
  m.opt = std::make_unique<model::AdamW>(m.model->Parameters(), model::AdamWOptions{});
  return m;
}

// The tensors of `m` by parameter name: value, first and second moment.
std::map<std::string, std::vector<const Tensor*>> TensorsByName(const Model& m) {
  std::map<std::string, std::vector<const Tensor*>> out;
  const auto& ps = m.opt->params();
  for (size_t i = 0; i < ps.size(); ++i) {
    out[ps[i]->name] = {&ps[i]->value, &m.opt->first_moment(i), &m.opt->second_moment(i)};
  }
  return out;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.f32(), b.f32(), static_cast<size_t>(a.numel()) * sizeof(float)) == 0;
}

struct WriteResult {
  double seconds = 0;
  double snapshot_seconds = 0;  // until the slowest writer's Save returned
  uint64_t bytes = 0;           // stored bytes of the checkpoint (CheckpointManager::List)
  uint64_t tensor_bytes = 0;    // bytes of values and moments the writers hold
  int64_t compared = 0;         // tensors compared bitwise after the resume
  std::string error;
};

// One checkpoint of the model written by `n` writers (n = 0: the baseline, one manager of the
// single-process shard p0 holding every expert), checked and resumed.
WriteResult WriteOnce(const Options& o, const config::JobConfig& cfg, const std::string& dir, int n,
                      ThreadPool& pool) {
  // Every run starts from the same heap: what earlier runs freed goes back to the kernel, so each
  // run's snapshot buffers fault in fresh pages, as a training process's first checkpoint does.
  malloc_trim(0);
  WriteResult r;
  auto fail = [&](const std::string& what, const Status& s) {
    r.error = absl::StrCat(what, ": ", s.message());
    return r;
  };
  const int writers = std::max(1, n);
  const int64_t E = o.experts;
  ops::Context build_ctx{&pool};
  std::vector<Model> models;
  for (int k = 0; k < writers; ++k) {
    const int64_t first = E * k / writers, end = E * (k + 1) / writers;
    auto m = Build(build_ctx, cfg, first, n == 0 ? -1 : end - first);
    if (!m.ok()) return fail("building the model", m.status());
    Perturb(build_ctx, *m->model, *m->opt);
    models.push_back(*std::move(m));
  }
  const std::vector<std::set<std::string>> dealt =
      checkpoint::DealDenseParameters(*models[0].model, writers);
  std::vector<checkpoint::CheckpointShare> shares(writers);
  for (int k = 0; k < writers; ++k) {
    if (n == 0) break;  // the baseline: the one-process share, everything
    shares[k].dense = dealt[k];
    shares[k].workers = writers;
    if (k == 0) {
      for (int w = 0; w < writers; ++w) shares[k].shards.push_back(absl::StrCat("r", w));
    }
  }
  for (int k = 0; k < writers; ++k) {
    const std::set<std::string> dense_names = [&] {
      std::set<std::string> s;
      for (const model::Parameter* p : models[k].model->DenseParameters()) s.insert(p->name);
      return s;
    }();
    for (const model::Parameter* p : models[k].opt->params()) {
      const bool written = !dense_names.count(p->name) || n == 0 || dealt[k].count(p->name);
      if (written) r.tensor_bytes += 3 * static_cast<uint64_t>(p->value.numel()) * sizeof(float);
    }
  }
  // The committer opens first: it clears reports a previous job left.
  std::vector<std::unique_ptr<checkpoint::CheckpointManager>> managers;
  for (int k = 0; k < writers; ++k) {
    checkpoint::CheckpointOptions co;
    co.dir = dir;
    co.shard = n == 0 ? "p0" : absl::StrCat("r", k);
    co.committer = k == 0;
    co.keep = 1;
    auto m = checkpoint::CheckpointManager::Open(co, /*must_exist=*/false);
    if (!m.ok()) return fail("opening the checkpoint folder", m.status());
    managers.push_back(*std::move(m));
  }

  // Every writer on its own thread with its own one-thread context, released together.
  std::vector<std::unique_ptr<ThreadPool>> pools;
  std::vector<ops::Context> ctxs;
  for (int k = 0; k < writers; ++k) pools.push_back(std::make_unique<ThreadPool>(1));
  for (int k = 0; k < writers; ++k) ctxs.push_back(ops::Context{pools[k].get()});
  std::atomic<bool> go{false};
  std::vector<Status> status(writers);
  std::vector<Clock::time_point> saved(writers), done(writers);
  std::vector<std::thread> threads;
  for (int k = 0; k < writers; ++k) {
    threads.emplace_back([&, k] {
      while (!go.load()) std::this_thread::yield();
      Status s =
          managers[k]->Save(1, cfg, *models[k].model, *models[k].opt, nullptr, ctxs[k], shares[k]);
      saved[k] = Clock::now();
      if (s.ok()) s = managers[k]->Wait();
      status[k] = s;
      done[k] = Clock::now();
    });
  }
  const Clock::time_point t0 = Clock::now();
  go = true;
  for (auto& t : threads) t.join();
  r.seconds = std::chrono::duration<double>(done[0] - t0).count();
  r.snapshot_seconds =
      std::chrono::duration<double>(*std::max_element(saved.begin(), saved.end()) - t0).count();
  for (int k = 0; k < writers; ++k) {
    if (!status[k].ok()) return fail(absl::StrCat("writer ", k), status[k]);
  }
  managers.clear();

  std::vector<std::string> report;
  if (Status s = checkpoint::CheckpointManager::Verify(dir, -1, &report); !s.ok()) {
    return fail("verifying the folder (" + absl::StrJoin(report, "; ") + ")", s);
  }
  auto list = checkpoint::CheckpointManager::List(dir);
  if (!list.ok()) return fail("listing the folder", list.status());
  if (list->size() != 1 || (*list)[0].step != 1 ||
      (*list)[0].shards.size() != static_cast<size_t>(writers)) {
    r.error = absl::StrFormat("expected one checkpoint of step 1 in %d shards, the folder lists %d",
                              writers, list->size());
    return r;
  }
  r.bytes = (*list)[0].stored_bytes;
  if (r.bytes < r.tensor_bytes) {
    r.error = absl::StrFormat("the checkpoint stores %d bytes, fewer than the %d bytes written",
                              r.bytes, r.tensor_bytes);
    return r;
  }

  // Resume into a fresh model holding every expert, from the shards that hold them.
  auto fresh = Build(build_ctx, cfg, 0, -1);
  if (!fresh.ok()) return fail("building the resumed model", fresh.status());
  const auto got = TensorsByName(*fresh);
  std::map<std::string, std::vector<const Tensor*>> want;
  for (const Model& m : models) {
    for (auto& [name, tensors] : TensorsByName(m)) want.emplace(name, tensors);
  }
  // The check can fail: before the resume, the fresh values differ from the written ones.
  if (SameBytes(*got.begin()->second[0], *want.at(got.begin()->first)[0])) {
    r.error = "the perturbed model equals a fresh one: the resume check would prove nothing";
    return r;
  }
  {
    checkpoint::CheckpointOptions co;
    co.dir = dir;
    co.shard = n == 0 ? "p0" : "r0";
    auto reader = checkpoint::CheckpointManager::Open(co, /*must_exist=*/true);
    if (!reader.ok()) return fail("opening the folder to resume", reader.status());
    auto step = (*reader)->Resume(cfg, *fresh->model, *fresh->opt, nullptr, build_ctx);
    if (!step.ok()) return fail("resuming", step.status());
    if (*step != 1) {
      r.error = absl::StrFormat("resumed step %d, wrote step 1", *step);
      return r;
    }
  }
  if (fresh->opt->steps() != models[0].opt->steps()) {
    r.error = absl::StrFormat("resumed optimizer steps %d, wrote %d", fresh->opt->steps(),
                              models[0].opt->steps());
    return r;
  }
  static const char* kKinds[] = {"value", "first moment", "second moment"};
  for (const auto& [name, tensors] : got) {
    auto w = want.find(name);
    if (w == want.end()) {
      r.error = "no writer held " + name;
      return r;
    }
    for (int kind = 0; kind < 3; ++kind) {
      if (!SameBytes(*tensors[kind], *w->second[kind])) {
        r.error =
            absl::StrFormat("resumed %s of %s differs from what was written", kKinds[kind], name);
        return r;
      }
      ++r.compared;
    }
  }
  return r;
}

struct TrainRun {
  std::vector<double> step_s, gap_s;  // per step: its own time; the gap before the next step
  double span_s = 0;                  // from the end of step 1 to the end of the last step
  // The trainer's own spans (--trace): the writer's snapshot copy, its persist and commit, and
  // the trainer's waits for the snapshot before the next update (absent where it had not to wait).
  std::vector<double> save_s, snapshot_s, persist_s, fence_s;
  std::string error;
};

// The durations, in seconds, of the spans of a Chrome trace whose names start with `name`.
std::vector<double> SpanSeconds(const std::string& trace, const std::string& name) {
  std::vector<double> out;
  const std::string key = "\"name\":\"" + name;
  for (size_t at = trace.find(key); at != std::string::npos; at = trace.find(key, at + 1)) {
    const size_t end = trace.find('}', at);
    out.push_back(JsonNumber(trace.substr(at, end - at), "dur") / 1e6);
  }
  return out;
}

// K steps of the trainer in a fresh process, checkpointing every `every` steps into `ckdir`
// (0: none).
TrainRun Train(const Options& o, const std::string& data, const std::string& ckdir, int every) {
  const int K = o.checkpoints * o.every + 1;
  // The child would otherwise share the heap this process freed, and pay a copy-on-write fault
  // for each page of it that it reuses, which a training process does not.
  malloc_trim(0);
  const std::string out = InChildProcess([&]() -> std::string {
    train::TrainOptions to;
    to.config = Config(o, data, K);
    if (every > 0) {
      to.config.mutable_checkpoint()->set_dir(ckdir);
      to.config.mutable_checkpoint()->set_every(every);
      to.config.mutable_checkpoint()->set_keep(1);
    }
    to.progress = false;
    // Traced with and without checkpoints alike, so the tracer's cost is in both.
    to.trace_path = absl::StrCat(ckdir, ".trace.json");
    std::string lines;
    Clock::time_point start = Clock::now();
    to.on_step = [&](const train::StepResult& r) {
      lines += absl::StrFormat("%d %.9g %.9g\n", r.step, r.seconds,
                               std::chrono::duration<double>(Clock::now() - start).count());
      return Status();
    };
    auto t = train::Trainer::Create(to);
    if (!t.ok()) return absl::StrCat("error ", t.status().message());
    start = Clock::now();
    if (Status s = (*t)->Run(); !s.ok()) return absl::StrCat("error ", s.message());
    return lines;
  });
  std::ifstream trace_file(absl::StrCat(ckdir, ".trace.json"));
  const std::string trace((std::istreambuf_iterator<char>(trace_file)),
                          std::istreambuf_iterator<char>());
  std::filesystem::remove(absl::StrCat(ckdir, ".trace.json"));
  TrainRun run;
  if (out.empty() || out.rfind("error ", 0) == 0) {
    run.error = out.empty() ? "the training process died" : out.substr(6);
    return run;
  }
  std::vector<double> seconds, at;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() != 3) {
      run.error = absl::StrCat("unexpected output: ", line);
      return run;
    }
    seconds.push_back(std::stod(f[1]));
    at.push_back(std::stod(f[2]));
  }
  if (static_cast<int>(seconds.size()) != K) {
    run.error = absl::StrFormat("%d steps reported, expected %d", seconds.size(), K);
    return run;
  }
  // The gap after step s (1-based): from its callback to the next one, less the next step's time.
  for (int s = 1; s < K; ++s) {
    run.step_s.push_back(seconds[s]);
    run.gap_s.push_back(at[s] - at[s - 1] - seconds[s]);
  }
  run.span_s = at[K - 1] - at[0];
  run.snapshot_s = SpanSeconds(trace, "checkpoint snapshot");
  run.persist_s = SpanSeconds(trace, "checkpoint persist");
  run.fence_s = SpanSeconds(trace, "checkpoint fence");
  run.save_s = SpanSeconds(trace, "checkpoint save");
  if (every > 0 && (static_cast<int>(run.snapshot_s.size()) != o.checkpoints ||
                    static_cast<int>(run.persist_s.size()) != o.checkpoints)) {
    run.error = absl::StrFormat("the trace holds %d snapshot and %d persist spans, expected %d",
                                run.snapshot_s.size(), run.persist_s.size(), o.checkpoints);
  }
  return run;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? std::nan("") : s / static_cast<double>(v.size());
}

int Main(int argc, char** argv) {
  Options o;
  o.dir = ScratchDir();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return FlagValue("bench_checkpoint", argc, argv, &i); };
    int n = 0;
    if (a == "--json") {
      o.json = true;
    } else if (a == "--small") {
      o.small = true;
      o.rounds = 1;
      o.layers = 2;
      o.experts = 8;
      o.d_model = 32;
      o.d_expert = 64;
      o.seq_len = 16;
      o.batch = 4;
      o.every = 2;
      o.checkpoints = 2;
    } else if (a == "--part") {
      o.part = value();
      if (o.part != "write" && o.part != "stall") {
        std::fprintf(stderr, "bench_checkpoint: --part is write or stall\n");
        return 2;
      }
    } else if (a == "--no-fio") {
      o.fio = false;
    } else if (a == "--dir") {
      o.dir = value();
    } else if (a == "--writers") {
      o.writers.clear();
      for (absl::string_view w : absl::StrSplit(value(), ',')) {
        if (!absl::SimpleAtoi(w, &n) || n < 1) {
          std::fprintf(stderr, "bench_checkpoint: --writers takes positive integers: 1,2,4\n");
          return 2;
        }
        o.writers.push_back(n);
      }
    } else if ((a == "--rounds" || a == "--experts" || a == "--layers" || a == "--d-model" ||
                a == "--d-expert" || a == "--checkpoints" || a == "--every" || a == "--batch") &&
               absl::SimpleAtoi(value(), &n) && n >= 1) {
      if (a == "--rounds") o.rounds = n;
      if (a == "--experts") o.experts = n;
      if (a == "--layers") o.layers = n;
      if (a == "--d-model") o.d_model = n;
      if (a == "--d-expert") o.d_expert = n;
      if (a == "--every") o.every = n;
      if (a == "--batch") o.batch = n;
      if (a == "--checkpoints") o.checkpoints = n;
    } else {
      std::fprintf(stderr,
                   "usage: bench_checkpoint [--dir DIR] [--writers 1,2,4] [--rounds R] "
                   "[--experts E] [--layers L] [--d-model C] [--d-expert H] [--checkpoints N] "
                   "[--every M] [--batch B] [--part write|stall] [--small] [--no-fio] [--json]\n");
      return 2;
    }
  }
  if (o.every < 2) {
    std::fprintf(stderr,
                 "bench_checkpoint: --every must be at least 2 (steps between checkpoints)\n");
    return 2;
  }
  if (o.checkpoints < 2) {
    std::fprintf(stderr,
                 "bench_checkpoint: --checkpoints must be at least 2 (the gap after the last one "
                 "also holds the final evaluation and is not counted)\n");
    return 2;
  }
  for (int w : o.writers) {
    if (w > o.experts) {
      std::fprintf(stderr, "bench_checkpoint: %d writers for %d experts: each needs one\n", w,
                   o.experts);
      return 2;
    }
  }
  const std::string dir = o.dir + "/bench_checkpoint." + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string data = dir + "/text.txt";
  std::ofstream(data) << WordCorpus(1 << 20);
  const config::JobConfig cfg = Config(o, data, 1);
  ThreadPool pool(static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))));
  auto cleanup_and_fail = [&](const std::string& what) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", what.c_str());
    std::filesystem::remove_all(dir);
    return 1;
  };

  if (o.fio && o.part != "stall" &&
      !FioAvailable("bench_checkpoint", "to leave fio's write rate out")) {
    return cleanup_and_fail("fio is missing");
  }
  const BlasReport blas = MeasureBlas(static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  if (!o.json) {
    std::printf(
        "bench_checkpoint: %s; folders in %s; model %d layers x %d experts of %dx%d, %d rounds "
        "(medians)\n",
        HostDescription().c_str(), o.dir.c_str(), o.layers, o.experts, o.d_model, o.d_expert,
        o.rounds);
    PrintBlasReport(blas);
  }
  if (o.part != "stall") {
    // Part 1: writers 0 (the baseline) and each count, in alternating order from round to round.
    std::vector<int> counts = {0};
    counts.insert(counts.end(), o.writers.begin(), o.writers.end());
    std::map<int, std::vector<double>> seconds, save_seconds;
    std::map<int, uint64_t> bytes;
    int64_t compared = 0;
    std::vector<double> fio_gbps;
    for (int round = 0; round < o.rounds; ++round) {
      std::vector<int> order = counts;
      if (round % 2 == 1) std::reverse(order.begin(), order.end());
      for (int n : order) {
        const std::string ck = absl::StrCat(dir, "/ck", n, "-", round);
        const WriteResult w = WriteOnce(o, cfg, ck, n, pool);
        std::filesystem::remove_all(ck);
        if (!w.error.empty()) {
          return cleanup_and_fail(absl::StrFormat(
              "%s: %s", n == 0 ? "baseline" : absl::StrCat(n, " writers"), w.error));
        }
        seconds[n].push_back(w.seconds);
        save_seconds[n].push_back(w.snapshot_seconds);
        bytes[n] = w.bytes;
        compared += w.compared;
      }
      if (o.fio) {  // the baseline's bytes, once this round has written them
        fio_gbps.push_back(RunFio(dir + "/bench_checkpoint.fio", "write", 1 << 20, bytes[0], 32,
                                  /*fixed_buffers=*/false));
        std::filesystem::remove(dir + "/bench_checkpoint.fio");
      }
    }
    const double base_gbps = static_cast<double>(bytes[0]) / MedianOf(seconds[0]) / 1e9;
    if (!o.json) {
      std::printf(
          "write bandwidth of one checkpoint (first Save to the committer's Wait, the writers' "
          "snapshot copies included; save_s: until the last Save returned), median of %d\n",
          o.rounds);
      std::printf("%-22s %14s %9s %8s %9s %11s\n", "writers", "bytes", "seconds", "GB/s", "of base",
                  "save_s");
    }
    for (int n : counts) {
      const double s = MedianOf(seconds[n]);
      const double gbps = static_cast<double>(bytes[n]) / s / 1e9;
      if (o.json) {
        JsonWriter j;
        j.BeginObject()
            .Field("part", "write")
            .Field("writers", static_cast<int64_t>(n == 0 ? 1 : n))
            .Field("baseline", n == 0)
            .Field("bytes", bytes[n])
            .Field("seconds", s)
            .Field("gbps", gbps)
            .Field("ratio", gbps / base_gbps)
            .Field("save_s", MedianOf(save_seconds[n]))
            .Field("rounds", static_cast<int64_t>(o.rounds));
        AddBlasFields(j, blas);
        j.EndObject();
        std::printf("%s\n", j.str().c_str());
      } else {
        std::printf("%-22s %14llu %9.3f %8.3f %8.2fx %11.3f\n",
                    n == 0 ? "1 (baseline: one rank)" : absl::StrCat(n, " (sharded)").c_str(),
                    static_cast<unsigned long long>(bytes[n]), s, gbps, gbps / base_gbps,
                    MedianOf(save_seconds[n]));
      }
    }
    if (!o.json && o.fio) {
      std::printf("fio write of the same bytes to this folder: %.3f GB/s\n", MedianOf(fio_gbps));
    }
    if (!o.json) {
      std::printf("verified: every folder passes Verify; %lld tensors resumed bitwise equal\n",
                  static_cast<long long>(compared));
    }
  }

  if (o.part != "write") {
    // Part 2: the trainer with and without checkpoints, alternating.
    std::vector<double> step_s, stall_s, cost_s, save_s, snapshot_s, persist_s, fence_s;
    for (int round = 0; round < o.rounds; ++round) {
      TrainRun with, without;
      for (int k = 0; k < 2; ++k) {
        const bool checkpointing = (k + round) % 2 == 0;
        const std::string ck = absl::StrCat(dir, "/train-", round);
        TrainRun t = Train(o, data, ck, checkpointing ? o.every : 0);
        if (!t.error.empty()) {
          return cleanup_and_fail(absl::StrFormat("training %s checkpoints: %s",
                                                  checkpointing ? "with" : "without", t.error));
        }
        if (checkpointing) {
          std::vector<std::string> report;
          if (Status s = checkpoint::CheckpointManager::Verify(ck, -1, &report); !s.ok()) {
            return cleanup_and_fail(
                absl::StrCat("the trainer's checkpoints do not verify: ", s.message(), " (",
                             absl::StrJoin(report, "; "), ")"));
          }
          auto list = checkpoint::CheckpointManager::List(ck);
          const int64_t last = static_cast<int64_t>(o.checkpoints) * o.every;
          if (!list.ok() || list->empty() || list->back().step != last) {
            return cleanup_and_fail(absl::StrFormat(
                "the trainer's folder should hold the checkpoint of step %d", last));
          }
          std::filesystem::remove_all(ck);
          with = std::move(t);
        } else {
          without = std::move(t);
        }
      }
      // Gaps after checkpoint steps against the other gaps of the same run. The last gap holds
      // the final evaluation (after the last step, which follows the last checkpoint): left out.
      std::vector<double> at_ckpt, other;
      for (size_t i = 0; i + 1 < with.gap_s.size(); ++i) {
        const int step = static_cast<int>(i) + 1;
        (step % o.every == 0 ? at_ckpt : other).push_back(with.gap_s[i]);
      }
      step_s.push_back(Mean(without.step_s));
      double fence = 0;
      for (double f : with.fence_s) fence += f;
      fence /= o.checkpoints;
      fence_s.push_back(fence);
      stall_s.push_back(Mean(at_ckpt) - Mean(other) + fence);
      cost_s.push_back((with.span_s - without.span_s) / o.checkpoints);
      snapshot_s.push_back(Mean(with.snapshot_s));
      save_s.push_back(Mean(with.save_s));
      persist_s.push_back(Mean(with.persist_s));
    }
    const double step = MedianOf(step_s), stall = MedianOf(stall_s), cost = MedianOf(cost_s);
    const double snapshot = MedianOf(snapshot_s), persist = MedianOf(persist_s);
    const double fence = MedianOf(fence_s), save = MedianOf(save_s);
    const int K = o.checkpoints * o.every + 1;
    if (o.json) {
      JsonWriter j;
      j.BeginObject()
          .Field("part", "stall")
          .Field("steps", static_cast<int64_t>(K))
          .Field("every", static_cast<int64_t>(o.every))
          .Field("step_s", step)
          .Field("snapshot_s", snapshot)
          .Field("fence_s", fence)
          .Field("save_s", save)
          .Field("stall_s", stall)
          .Field("stall_fraction", stall / step)
          .Field("cost_s", cost)
          .Field("cost_fraction", cost / step)
          .Field("persist_s", persist)
          .Field("rounds", static_cast<int64_t>(o.rounds));
      AddBlasFields(j, blas);
      j.EndObject();
      std::printf("%s\n", j.str().c_str());
    } else {
      std::printf(
          "stall per checkpoint: trainer, batch %d x %d tokens, %d steps with a checkpoint every "
          "%d "
          "and %d without, means per run, median of %d\n",
          o.batch, o.seq_len, K, o.every, K, o.rounds);
      std::printf("%-7s %8s %8s %12s %9s %9s %9s %9s %9s %11s\n", "", "step_ms", "save_ms",
                  "snapshot_ms", "fence_ms", "stall_ms", "of step", "cost_ms", "of step",
                  "persist_ms");
      auto row = [](const std::string& label, double st, double sv, double sn, double f, double sl,
                    double c, double p) {
        std::printf("%-7s %8.1f %8.1f %12.1f %9.1f %9.1f %8.1f%% %9.1f %8.1f%% %11.1f\n",
                    label.c_str(), 1e3 * st, 1e3 * sv, 1e3 * sn, 1e3 * f, 1e3 * sl, 100 * sl / st,
                    1e3 * c, 100 * c / st, 1e3 * p);
      };
      if (o.rounds > 1) {  // each round too: the cost compares two processes and varies the most
        for (int round = 0; round < o.rounds; ++round) {
          row(absl::StrCat("round ", round + 1), step_s[round], save_s[round], snapshot_s[round],
              fence_s[round], stall_s[round], cost_s[round], persist_s[round]);
        }
      }
      row("median", step, save, snapshot, fence, stall, cost, persist);
      std::printf("goal: a stall under 5%% of a step%s\n",
                  stall / step < 0.05 ? "" : " (not met on this machine)");
    }
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::ChooseBlasKernelAtStart("bench_checkpoint", argv);
  return strata::bench::Main(argc, argv);
}
