// bench_comm: strata's collectives against raw Gloo, on the same buffers in the same processes.
//
// For 2 and 4 worker processes on this machine (loopback TCP) and per-rank buffers of --min-bytes
// to --max-bytes (x4 steps), it times all-to-all-v with an even split and all-reduce (float sum):
// strata's Communicator (ConnectGloo) and Gloo's own gloo::alltoallv / gloo::allreduce (its ring)
// on a second Gloo context that connects the same processes. The two alternate sample by sample;
// a sample is `reps` back-to-back calls after a barrier (many for small messages, so that the
// barrier's skew does not dominate), its time is the slowest rank's, and a row reports the median
// of --iters samples. Columns as in nccl-tests: algbw = bytes / time with bytes the per-rank
// buffer; busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for all-to-all;
// fraction_of_raw = busbw / raw_busbw (target: at least 0.95). #wrong counts the elements, over
// every rank, of strata's result that differ from a reference each rank computes locally (every
// input is a function of (rank, index)); the check runs on an untimed first call of each size,
// and Gloo's result is checked the same way (the program fails when either is wrong).
//
//   build/bin/bench_comm [--workers 2,4] [--min-bytes B] [--max-bytes B] [--iters N]
//                        [--ops alltoallv,allreduce] [--small] [--json]
//
// Defaults: 1 KiB to 64 MiB, 15 samples, both ops, 2 and 4 workers (about a minute on 2 cores);
// --small: up to 256 KiB, 3 samples (a few seconds, for CI).
//
// The program runs its workers itself: it starts one copy of itself per rank (with --worker), and
// they meet through a file store in a temporary folder under $TMPDIR (or /tmp).
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "core/common/json.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"

namespace strata::bench {
namespace {

struct Options {
  std::vector<int> workers = {2, 4};
  std::vector<std::string> ops = {"alltoallv", "allreduce"};
  uint64_t min_bytes = 1 << 10;
  uint64_t max_bytes = 64 << 20;
  int iters = 15;
  bool json = false;
  // Set in the worker processes only.
  int rank = -1;
  int world = 0;
  std::string dir;
};

// Inputs are small integers, so every sum is exact in float whatever its order and a result can
// be compared bit for bit with a reference.
float AllReduceInput(int rank, uint64_t i) {
  return static_cast<float>((static_cast<uint64_t>(rank) * 7919 + i) % 4093);
}
float AllToAllInput(int src, int dst, uint64_t i) {
  return static_cast<float>(
      (static_cast<uint64_t>(src) * 131 + static_cast<uint64_t>(dst) * 17 + i) % 8191);
}

using Clock = std::chrono::steady_clock;

// One row of the table as rank 0 computes it.
struct Row {
  std::string op;
  uint64_t bytes = 0, count = 0;
  int workers = 0, reps = 0;
  double time_us = 0, raw_time_us = 0;
  int64_t wrong = 0, raw_wrong = 0;
};

double BusFactor(const std::string& op, int n) {
  return op == "allreduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

std::string RowJson(const Row& r) {
  const double algbw = static_cast<double>(r.bytes) / (r.time_us * 1e3);
  const double raw_algbw = static_cast<double>(r.bytes) / (r.raw_time_us * 1e3);
  const double busbw = algbw * BusFactor(r.op, r.workers);
  const double raw_busbw = raw_algbw * BusFactor(r.op, r.workers);
  JsonWriter j;
  j.BeginObject()
      .Field("op", r.op)
      .Field("bytes", r.bytes)
      .Field("count", r.count)
      .Field("workers", r.workers)
      .Field("time_us", r.time_us)
      .Field("algbw", algbw)
      .Field("busbw", busbw)
      .Field("raw_time_us", r.raw_time_us)
      .Field("raw_busbw", raw_busbw)
      .Field("fraction_of_raw", busbw / raw_busbw)
      .Field("wrong", r.wrong)
      .Field("raw_wrong", r.raw_wrong)
      .Field("reps", r.reps)
      .EndObject();
  return j.str();
}

// ---- Worker ----------------------------------------------------------------------------------

class Worker {
 public:
  Worker(const Options& o, std::unique_ptr<comm::Communicator> comm,
         std::shared_ptr<gloo::rendezvous::Context> raw)
      : o_(o), comm_(std::move(comm)), raw_(std::move(raw)) {}

  // Every size of one op; rank 0 appends the rows to `rows`.
  bool Run(const std::string& op, std::vector<Row>* rows) {
    for (uint64_t bytes = o_.min_bytes; bytes <= o_.max_bytes; bytes *= 4) {
      Row row;
      if (!(op == "allreduce" ? AllReduce(bytes, &row) : AllToAll(bytes, &row))) return false;
      if (o_.rank == 0) rows->push_back(row);
    }
    return true;
  }

 private:
  bool Check(const Status& s, const char* what) {
    if (s.ok()) return true;
    std::fprintf(stderr, "bench_comm rank %d: %s: %s\n", o_.rank, what,
                 std::string(s.message()).c_str());
    return false;
  }

  static int64_t Wrong(const std::vector<float>& got, const std::vector<float>& want) {
    int64_t n = 0;
    for (size_t i = 0; i < got.size(); ++i) n += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
    return n;
  }

  // Calls per sample: enough for a sample of a small message to last well over a barrier's skew.
  static int Reps(uint64_t bytes) {
    return static_cast<int>(std::clamp<uint64_t>((256 << 10) / bytes, 1, 64));
  }

  // Times `iters` samples of each, alternating which goes first; per-rank times in seconds.
  template <typename Strata, typename Raw, typename Prepare>
  bool Time(int reps, Prepare&& prepare, Strata&& strata, Raw&& raw, std::vector<double>* ts,
            std::vector<double>* tr) {
    auto sample = [&](bool use_strata) {
      prepare(use_strata);
      if (!Check(comm_->Barrier(), "Barrier")) return false;
      const auto t0 = Clock::now();
      for (int k = 0; k < reps; ++k) {
        if (use_strata ? !strata() : !raw()) return false;
      }
      (use_strata ? ts : tr)
          ->push_back(std::chrono::duration<double>(Clock::now() - t0).count() / reps);
      return true;
    };
    for (int it = 0; it < o_.iters; ++it) {
      const bool strata_first = it % 2 == 0;
      if (!sample(strata_first) || !sample(!strata_first)) return false;
    }
    return true;
  }

  // Gathers every rank's sample times and wrong counts; on rank 0 fills the row's times (median
  // over samples of the slowest rank) and totals.
  bool Summarize(const std::vector<double>& ts, const std::vector<double>& tr, int64_t wrong,
                 int64_t raw_wrong, Row* row) {
    std::vector<double> mine = ts;
    mine.insert(mine.end(), tr.begin(), tr.end());
    mine.push_back(static_cast<double>(wrong));
    mine.push_back(static_cast<double>(raw_wrong));
    std::vector<double> all(mine.size() * static_cast<size_t>(o_.world));
    if (!Check(comm_->AllGather(mine.data(), mine.size() * sizeof(double), all.data()),
               "AllGather")) {
      return false;
    }
    const size_t n = ts.size();
    std::vector<double> slow_s(n, 0), slow_r(n, 0);
    row->wrong = row->raw_wrong = 0;
    for (int r = 0; r < o_.world; ++r) {
      const double* p = all.data() + static_cast<size_t>(r) * mine.size();
      for (size_t i = 0; i < n; ++i) {
        slow_s[i] = std::max(slow_s[i], p[i]);
        slow_r[i] = std::max(slow_r[i], p[n + i]);
      }
      row->wrong += static_cast<int64_t>(p[2 * n]);
      row->raw_wrong += static_cast<int64_t>(p[2 * n + 1]);
    }
    row->time_us = 1e6 * MedianOf(slow_s);
    row->raw_time_us = 1e6 * MedianOf(slow_r);
    row->workers = o_.world;
    return true;
  }

  bool AllReduce(uint64_t bytes, Row* row) {
    const size_t n = bytes / sizeof(float);
    const int w = o_.world;
    std::vector<float> input(n), want(n, 0.f), mine(n), raw(n);
    for (size_t i = 0; i < n; ++i) input[i] = AllReduceInput(o_.rank, i);
    for (int r = 0; r < w; ++r) {
      for (size_t i = 0; i < n; ++i) want[i] += AllReduceInput(r, i);
    }
    auto strata = [&] { return Check(comm_->AllReduce(mine.data(), n), "AllReduce"); };
    auto gloo = [&] {
      try {
        gloo::AllreduceOptions opts(raw_);
        opts.setOutput(raw.data(), n);
        opts.setReduceFunction(
            static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
        opts.setTag(raw_tag_++);
        gloo::allreduce(opts);
        return true;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_comm rank %d: gloo::allreduce: %s\n", o_.rank, e.what());
        return false;
      }
    };
    // The untimed first call of each is the one checked.
    mine = input;
    raw = input;
    if (!strata() || !gloo()) return false;
    const int64_t wrong = Wrong(mine, want), raw_wrong = Wrong(raw, want);
    // Every sample starts from the inputs again (outside the timing). Within a sample the calls
    // of a small message sum sums, up to inf after many: no slower path on x86 (unlike
    // denormals), and the same for both.
    auto prepare = [&](bool use_strata) { (use_strata ? mine : raw) = input; };
    std::vector<double> ts, tr;
    const int reps = Reps(bytes);
    if (!Time(reps, prepare, strata, gloo, &ts, &tr)) return false;
    row->op = "allreduce";
    row->bytes = bytes;
    row->count = n;
    row->reps = reps;
    return Summarize(ts, tr, wrong, raw_wrong, row);
  }

  bool AllToAll(uint64_t bytes, Row* row) {
    const int w = o_.world;
    const size_t per = bytes / sizeof(float) / static_cast<size_t>(w);
    const size_t n = per * static_cast<size_t>(w);
    std::vector<float> send(n), want(n), mine(n), raw(n);
    for (int d = 0; d < w; ++d) {
      for (size_t i = 0; i < per; ++i) send[d * per + i] = AllToAllInput(o_.rank, d, i);
    }
    for (int s = 0; s < w; ++s) {
      for (size_t i = 0; i < per; ++i) want[s * per + i] = AllToAllInput(s, o_.rank, i);
    }
    const std::vector<int64_t> counts(w, static_cast<int64_t>(per));
    auto strata = [&] {
      return Check(comm_->AllToAllV(send.data(), counts, mine.data(), counts), "AllToAllV");
    };
    auto gloo = [&] {
      try {
        gloo::AlltoallvOptions opts(raw_);
        opts.setInput(send.data(), counts);
        opts.setOutput(raw.data(), counts);
        opts.setTag(raw_tag_++);
        gloo::alltoallv(opts);
        return true;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_comm rank %d: gloo::alltoallv: %s\n", o_.rank, e.what());
        return false;
      }
    };
    if (!strata() || !gloo()) return false;
    const int64_t wrong = Wrong(mine, want), raw_wrong = Wrong(raw, want);
    std::vector<double> ts, tr;
    const int reps = Reps(bytes);
    if (!Time(
            reps, [](bool) {}, strata, gloo, &ts, &tr))
      return false;
    row->op = "alltoallv";
    row->bytes = n * sizeof(float);
    row->count = n;
    row->reps = reps;
    return Summarize(ts, tr, wrong, raw_wrong, row);
  }

  const Options& o_;
  std::unique_ptr<comm::Communicator> comm_;
  std::shared_ptr<gloo::rendezvous::Context> raw_;
  uint32_t raw_tag_ = 0;
};

int WorkerMain(const Options& o) {
  auto store = comm::MakeFileStore(o.dir + "/store");
  if (!store.ok()) {
    std::fprintf(stderr, "bench_comm rank %d: %s\n", o.rank,
                 std::string(store.status().message()).c_str());
    return 1;
  }
  comm::CommOptions co;
  co.rank = o.rank;
  co.world_size = o.world;
  co.timeout = std::chrono::seconds(120);
  auto comm = comm::ConnectGloo(comm::MakePrefixStore(*store, "strata/"), co);
  if (!comm.ok()) {
    std::fprintf(stderr, "bench_comm rank %d: %s\n", o.rank,
                 std::string(comm.status().message()).c_str());
    return 1;
  }
  // Gloo's own context for the baseline: its own file store, device and connections.
  std::shared_ptr<gloo::rendezvous::Context> raw;
  try {
    std::filesystem::create_directories(o.dir + "/gloo");
    gloo::rendezvous::FileStore gloo_store(o.dir + "/gloo");
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = gloo::transport::tcp::CreateDevice(attr);
    raw = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world);
    raw->setTimeout(co.timeout);
    raw->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm rank %d: Gloo's context: %s\n", o.rank, e.what());
    return 1;
  }
  Worker worker(o, *std::move(comm), raw);
  std::vector<Row> rows;
  for (const std::string& op : o.ops) {
    if (!worker.Run(op, &rows)) return 1;
  }
  if (o.rank == 0) {
    std::ofstream out(o.dir + "/rows.jsonl");
    for (const Row& r : rows) out << RowJson(r) << "\n";
    if (!out) return 1;
  }
  return 0;
}

// ---- Driver ----------------------------------------------------------------------------------

std::string JsonString(const std::string& json, const std::string& key) {
  const std::string k = "\"" + key + "\":\"";
  const size_t p = json.find(k);
  if (p == std::string::npos) return "";
  return json.substr(p + k.size(), json.find('"', p + k.size()) - p - k.size());
}

// Runs `world` workers and returns their rows (JSON lines); false when a worker failed.
bool RunWorkers(const Options& o, int world, std::vector<std::string>* rows) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/bench_comm.XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) {
    std::perror("bench_comm: mkdtemp");
    return false;
  }
  const std::string dir = templ;
  const std::string self = "/proc/self/exe";
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {"bench_comm",
                                     "--worker",
                                     std::to_string(r),
                                     "--world",
                                     std::to_string(world),
                                     "--dir",
                                     dir,
                                     "--min-bytes",
                                     std::to_string(o.min_bytes),
                                     "--max-bytes",
                                     std::to_string(o.max_bytes),
                                     "--iters",
                                     std::to_string(o.iters),
                                     "--ops",
                                     absl::StrJoin(o.ops, ",")};
    const pid_t pid = fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(self.c_str(), argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    waitpid(pids[i], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "bench_comm: worker %zu of %d failed (status %d)\n", i, world, status);
      // The others would wait for it until their timeout.
      if (ok) {
        for (size_t j = 0; j < pids.size(); ++j) {
          if (j != i) kill(pids[j], SIGKILL);
        }
      }
      ok = false;
    }
  }
  if (ok) {
    std::ifstream in(dir + "/rows.jsonl");
    std::string line;
    while (std::getline(in, line)) rows->push_back(line);
  }
  std::filesystem::remove_all(dir);
  return ok;
}

bool ParseInts(const std::string& s, std::vector<int>* out) {
  out->clear();
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(p, &v) || v < 1) return false;
    out->push_back(v);
  }
  return !out->empty();
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return FlagValue("bench_comm", argc, argv, &i); };
    if (a == "--json") {
      o.json = true;
    } else if (a == "--small") {
      o.max_bytes = 256 << 10;
      o.iters = 3;
    } else if (a == "--workers") {
      if (!ParseInts(value(), &o.workers)) {
        std::fprintf(stderr, "bench_comm: --workers takes a list like 2,4\n");
        return 2;
      }
    } else if (a == "--ops") {
      o.ops = absl::StrSplit(value(), ',');
      for (const std::string& op : o.ops) {
        if (op != "alltoallv" && op != "allreduce") {
          std::fprintf(stderr, "bench_comm: --ops takes alltoallv and/or allreduce\n");
          return 2;
        }
      }
    } else if (a == "--min-bytes") {
      o.min_bytes = std::stoull(value());
    } else if (a == "--max-bytes") {
      o.max_bytes = std::stoull(value());
    } else if (a == "--iters") {
      o.iters = std::stoi(value());
    } else if (a == "--worker") {
      o.rank = std::stoi(value());
    } else if (a == "--world") {
      o.world = std::stoi(value());
    } else if (a == "--dir") {
      o.dir = value();
    } else {
      std::fprintf(stderr,
                   "usage: bench_comm [--workers 2,4] [--min-bytes B] [--max-bytes B] [--iters N] "
                   "[--ops alltoallv,allreduce] [--small] [--json]\n");
      return 2;
    }
  }
  if (o.iters < 1 || o.min_bytes < 64 || o.max_bytes < o.min_bytes) {
    std::fprintf(stderr, "bench_comm: need --iters >= 1 and 64 <= --min-bytes <= --max-bytes\n");
    return 2;
  }
  if (o.rank >= 0) return WorkerMain(o);

  if (!o.json) {
    std::printf(
        "bench_comm: %s; loopback TCP; %d samples per row (median of the slowest rank); "
        "bytes = per-rank buffer\n",
        HostDescription().c_str(), o.iters);
    std::printf("%-9s %7s %10s %9s %10s %8s %8s %10s %9s %8s %6s\n", "op", "workers", "size(B)",
                "count", "time(us)", "algbw", "busbw", "raw(us)", "raw_busbw", "of_raw", "#wrong");
  }
  bool failed = false, below = false;
  for (int w : o.workers) {
    std::vector<std::string> rows;
    if (!RunWorkers(o, w, &rows)) {
      failed = true;
      continue;
    }
    for (const std::string& r : rows) {
      const double frac = JsonNumber(r, "fraction_of_raw");
      const auto wrong = static_cast<int64_t>(JsonNumber(r, "wrong"));
      const auto raw_wrong = static_cast<int64_t>(JsonNumber(r, "raw_wrong"));
      below |= frac < 0.95;
      if (wrong != 0 || raw_wrong != 0) {
        failed = true;
        std::fprintf(stderr, "bench_comm: wrong results (strata %ld, Gloo %ld elements): %s\n",
                     static_cast<long>(wrong), static_cast<long>(raw_wrong), r.c_str());
      }
      if (o.json) {
        std::printf("%s\n", r.c_str());
      } else {
        std::printf("%-9s %7d %10.0f %9.0f %10.1f %8.3f %8.3f %10.1f %9.3f %7.0f%% %6ld\n",
                    JsonString(r, "op").c_str(), w, JsonNumber(r, "bytes"), JsonNumber(r, "count"),
                    JsonNumber(r, "time_us"), JsonNumber(r, "algbw"), JsonNumber(r, "busbw"),
                    JsonNumber(r, "raw_time_us"), JsonNumber(r, "raw_busbw"), 100 * frac,
                    static_cast<long>(wrong));
      }
      std::fflush(stdout);
    }
  }
  if (!o.json) {
    std::printf("GB/s = 1e9 bytes/s; target: strata at least 95%% of raw Gloo's busbw%s\n",
                below ? " (some rows are below it)" : "");
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::Main(argc, argv); }
