// The real `strata` binary: usage errors, config errors with file/line/field, and a short run.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/device/device.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(30000));
    WriteFile(dir_.File("ok.textproto"),
              "model { seq_len: 16 d_model: 16 n_layers: 1 n_heads: 2\n"
              "        moe { num_experts: 2 d_expert: 16 } }\n"
              "data { path: \"text.txt\" }\n"
              "train { steps: 100 global_batch: 4 eval_every: 2 eval_batches: 1 threads: 1 }\n");
  }
  TempDir dir_;
};

TEST_F(CliTest, NoArgumentsPrintsUsage) {
  auto r = RunCommand(kStrata);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("usage: strata COMMAND"), std::string::npos) << r.output;
  auto v = RunCommand(kStrata + " version");
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_NE(v.output.find("backends: cpu"), std::string::npos) << v.output;
}

// The OpenBLAS kernel this CPU should run, from the flags Linux lists in /proc/cpuinfo (it lists
// AVX and AVX-512 only where it saves their registers) and OpenBLAS's kernel list: independent of
// the cpuid code in kernels/cpu/blas_kernel.cc. "" where /proc/cpuinfo has no flags (not x86-64).
std::string BestKernelFromProcCpuinfo() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    for (auto w : absl::StrSplit(line.substr(line.find(':') + 1), ' ', absl::SkipEmpty())) {
      flags.insert(std::string(w));
    }
    break;
  }
  auto has = [&](std::initializer_list<const char*> names) {
    return std::all_of(names.begin(), names.end(), [&](const char* n) { return flags.count(n); });
  };
  if (flags.empty()) return "";
  const bool avx512 = has({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"});
  if (avx512 && has({"avx512_bf16"})) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (has({"avx2", "fma"})) return "Haswell";
  if (has({"avx"})) return "Sandybridge";
  return "Prescott";
}

// The environment of a strata run with only the given BLAS settings (the machine's own
// OPENBLAS_CORETYPE and strata's marker removed).
std::string BlasEnv(const std::string& settings) {
  return "env -u OPENBLAS_CORETYPE -u STRATA_BLAS_KERNEL -u STRATA_OPENBLAS_CORETYPE_SET " +
         settings + " ";
}

// Forced onto OpenBLAS's oldest x86-64 kernel (what Debian 12's OpenBLAS picks by itself on CPUs
// newer than its table), `strata version` says so and warns; STRATA_BLAS_KERNEL=best re-executes
// strata on the best kernel, and a training run's log names it.
TEST_F(CliTest, VersionReportsAnOldBlasKernelAndStrataSwitchesToTheBest) {
  const std::string best = BestKernelFromProcCpuinfo();
  if (best.empty() || best == "Prescott") GTEST_SKIP() << "this CPU runs nothing above Prescott";

  auto forced = RunCommand(BlasEnv("OPENBLAS_CORETYPE=Prescott") + kStrata + " version");
  EXPECT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_NE(forced.output.find("blas: OpenBLAS"), std::string::npos) << forced.output;
  EXPECT_NE(forced.output.find("kernel Prescott (SSE3), set by OPENBLAS_CORETYPE=Prescott"),
            std::string::npos)
      << forced.output;
  EXPECT_NE(forced.output.find("warning: OpenBLAS runs its Prescott kernel (SSE3), below the best "
                               "this CPU runs, " +
                               best),
            std::string::npos)
      << forced.output;

  auto fixed = RunCommand(BlasEnv("OPENBLAS_CORETYPE=Prescott STRATA_BLAS_KERNEL=best") + kStrata +
                          " version");
  EXPECT_EQ(fixed.exit_code, 0) << fixed.output;
  EXPECT_NE(fixed.output.find("kernel " + best + " ("), std::string::npos) << fixed.output;
  EXPECT_NE(fixed.output.find("chosen by strata in place of Prescott"), std::string::npos)
      << fixed.output;
  EXPECT_EQ(fixed.output.find("warning:"), std::string::npos) << fixed.output;
  EXPECT_NE(fixed.output.find("\nsgemm rows: "), std::string::npos) << fixed.output;

  // Left to itself (no OPENBLAS_CORETYPE), strata runs the best kernel: OpenBLAS's own choice
  // when it is as good, or strata's.
  auto own = RunCommand(BlasEnv("") + kStrata + " version");
  EXPECT_EQ(own.exit_code, 0) << own.output;
  EXPECT_EQ(own.output.find("warning:"), std::string::npos) << own.output;
  const bool openblas_best = own.output.find(": the best for this CPU") != std::string::npos;
  const bool strata_chose = own.output.find("kernel " + best + " (") != std::string::npos &&
                            own.output.find("chosen by strata") != std::string::npos;
  EXPECT_TRUE(openblas_best || strata_chose) << own.output;

  // A run's log names the kernel (and warns), and so does `strata check`. Training runs on the
  // oldest kernel, which every x86-64 CPU runs.
  auto run = RunCommand(BlasEnv("OPENBLAS_CORETYPE=Prescott") + kStrata +
                        " train --steps 2 --quiet --config " + dir_.File("ok.textproto"));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("blas: OpenBLAS 0"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("kernel Prescott (SSE3), set by OPENBLAS_CORETYPE=Prescott"),
            std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("blas: OpenBLAS runs its Prescott kernel"), std::string::npos)
      << run.output;
  auto check = RunCommand(BlasEnv("OPENBLAS_CORETYPE=Prescott") + kStrata + " check --config " +
                          dir_.File("ok.textproto"));
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find("# blas: OpenBLAS"), std::string::npos) << check.output;
  EXPECT_NE(check.output.find("# warning: OpenBLAS runs its Prescott kernel"), std::string::npos)
      << check.output;

  auto bad = RunCommand(BlasEnv("STRATA_BLAS_KERNEL=fastest") + kStrata + " version");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("STRATA_BLAS_KERNEL='fastest' is not a policy: use auto"),
            std::string::npos)
      << bad.output;
}

TEST_F(CliTest, UsageErrorsExitTwoAndNameTheFlag) {
  auto r = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") + " --stpes 3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("unknown flag --stpes"), std::string::npos) << r.output;
  auto n = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") + " --steps many");
  EXPECT_EQ(n.exit_code, 2);
  EXPECT_NE(n.output.find("--steps 'many' must be an integer"), std::string::npos) << n.output;
  auto m = RunCommand(kStrata + " train --steps 3");
  EXPECT_EQ(m.exit_code, 2);
  EXPECT_NE(m.output.find("--config FILE is required"), std::string::npos) << m.output;
  auto u = RunCommand(kStrata + " trian");
  EXPECT_EQ(u.exit_code, 2);
  EXPECT_NE(u.output.find("unknown command 'trian'"), std::string::npos) << u.output;
}

TEST_F(CliTest, BadConfigFailsBeforeTrainingWithFileLineAndField) {
  const std::string bad = dir_.File("bad.textproto");
  WriteFile(bad,
            "data { path: \"text.txt\" }\n"
            "model {\n"
            "  moe { num_experts: 2 top_k: 3 }\n"
            "}\n");
  const std::string metrics = dir_.File("m.jsonl");
  auto r = RunCommand(kStrata + " train --config " + bad + " --metrics-out " + metrics);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(bad + ":3:24: field model.moe.top_k"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("top_k = 3 is larger than num_experts = 2"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(metrics)) << "training started despite the bad config";

  WriteFile(bad, "data { path: \"text.txt\" }\nmodel { d_model: \"wide\" }\n");
  auto t = RunCommand(kStrata + " train --config " + bad);
  EXPECT_EQ(t.exit_code, 1);
  EXPECT_NE(t.output.find(bad + ":2:"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("field d_model"), std::string::npos) << t.output;
}

TEST_F(CliTest, TrainsWritesMetricsAndReportsHeldOutLoss) {
  const std::string metrics = dir_.File("m.jsonl");
  auto r = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") +
                      " --steps 4 --threads 2 --metrics-out " + metrics);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("done: 4 steps, held-out loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 4/4"), std::string::npos) << r.output;
  std::vector<std::string> lines = absl::StrSplit(ReadFile(metrics), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 4u);
  auto c = RunCommand(kStrata + " check --config " + dir_.File("ok.textproto"));
  EXPECT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("valid"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("d_expert: 16"), std::string::npos) << c.output;
}

// A one-worker elastic job under `strata coordinator`: once it finished, `strata status` shows
// each MoE layer's load balance at the last step, with the figures the worker's metrics line of
// that step gives — recomputed here from its expert loads (one worker, dropless: the loads are
// the routed counts) and, where the line carries them, its own balance fields.
TEST_F(CliTest, StatusShowsTheMoeLoadBalanceOfTheLastStep) {
  constexpr int kSteps = 3;
  WriteFile(dir_.File("moe.textproto"),
            "model { seq_len: 16 d_model: 16 n_layers: 2 n_heads: 2\n"
            "        moe { num_experts: 4 top_k: 1 d_expert: 16\n"
            "              gate { bias_update_rate: 0.01 } } }\n"
            "data { path: \"text.txt\" }\n"
            "train { steps: 3 global_batch: 4 eval_every: 0 threads: 1 }\n");
  const std::string env = "cd " + dir_.path() + " && STRATA_JOB_TOKEN=secret exec " + kStrata;
  const std::string clog = dir_.File("coordinator.log");
  const pid_t coordinator = fork();
  if (coordinator == 0) {
    const std::string cmd = env +
                            " coordinator --dir record --config moe.textproto --workers 1 "
                            "--listen 127.0.0.1:0 --keep-serving > " +
                            clog + " 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string address;
  for (int i = 0; i < 600 && address.empty(); ++i) {
    const std::string log = ReadFile(clog);
    const size_t at = log.find("listening on ");
    if (at != std::string::npos) address = log.substr(at + 13, log.find(' ', at + 13) - at - 13);
    if (address.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (address.empty()) kill(coordinator, SIGKILL);
  ASSERT_FALSE(address.empty()) << ReadFile(clog);
  auto worker = RunCommand(env + " worker --coordinator " + address +
                           " --config moe.textproto --id w0 --quiet --metrics-out m.jsonl");
  auto status = RunCommand(env + " status " + address);
  kill(coordinator, SIGTERM);
  strata::testing::WaitExit(coordinator);
  ASSERT_EQ(worker.exit_code, 0) << worker.output;
  ASSERT_EQ(status.exit_code, 0) << status.output;
  EXPECT_NE(status.output.find(absl::StrCat("load balance at step ", kSteps)), std::string::npos)
      << status.output;

  std::vector<std::string> lines =
      absl::StrSplit(ReadFile(dir_.File("m.jsonl")), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), static_cast<size_t>(kSteps));
  const std::string& last = lines.back();
  ASSERT_EQ(strata::testing::IntField(last, "step"), kSteps);
  // Each entry of the line's "moe" array: {"layer":B,"load":[...],...}.
  int layers = 0;
  for (size_t at = last.find("{\"layer\":"); at != std::string::npos;
       at = last.find("{\"layer\":", at + 1), ++layers) {
    const std::string entry = last.substr(at, last.find('}', at) - at);
    const int64_t block = strata::testing::IntField(entry, "layer");
    const size_t open = entry.find("\"load\":[") + 8;
    std::vector<double> load;
    for (absl::string_view n :
         absl::StrSplit(entry.substr(open, entry.find(']', open) - open), ',', absl::SkipEmpty())) {
      load.push_back(std::stod(std::string(n)));
    }
    ASSERT_EQ(load.size(), 4u) << entry;
    double sum = 0, peak = 0, squares = 0;
    for (double l : load) sum += l, peak = std::max(peak, l);
    const double mean = sum / 4;
    for (double l : load) squares += (l - mean) * (l - mean);
    const double max_over_mean = peak / mean, cv = std::sqrt(squares / 4) / mean;
    // The status line of this block: "  moe layer B: max/mean load X, cv Y, bias [L, H]".
    const std::string head = absl::StrCat("  moe layer ", block, ": max/mean load ");
    const size_t line_at = status.output.find(head);
    ASSERT_NE(line_at, std::string::npos) << status.output;
    const size_t line_end = status.output.find('\n', line_at);
    const std::string shown =
        status.output.substr(line_at + head.size(), line_end - line_at - head.size());
    double shown_mom = 0, shown_cv = 0, shown_lo = 0, shown_hi = 0;
    const int got = std::sscanf(shown.c_str(), "%lf, cv %lf, bias [%lf, %lf]", &shown_mom,
                                &shown_cv, &shown_lo, &shown_hi);
    ASSERT_GE(got, 2) << shown;
    EXPECT_NEAR(shown_mom, max_over_mean, 0.0051) << shown;
    EXPECT_NEAR(shown_cv, cv, 0.0051) << shown;
    // The metrics line's own balance fields, where it has them.
    if (entry.find("\"max_over_mean\":") != std::string::npos) {
      EXPECT_NEAR(shown_mom, strata::testing::DoubleField(entry, "max_over_mean"), 0.0051);
      EXPECT_NEAR(shown_cv, strata::testing::DoubleField(entry, "cv"), 0.0051);
    }
    if (entry.find("\"bias_min\":") != std::string::npos) {
      ASSERT_EQ(got, 4) << "the metrics line has a bias range, the status line none: " << shown;
      const double lo = strata::testing::DoubleField(entry, "bias_min");
      const double hi = strata::testing::DoubleField(entry, "bias_max");
      EXPECT_NEAR(shown_lo, lo, 0.0051 * std::max(1e-3, std::abs(lo))) << shown;
      EXPECT_NEAR(shown_hi, hi, 0.0051 * std::max(1e-3, std::abs(hi))) << shown;
    }
  }
  EXPECT_EQ(layers, 2) << last;
}

// Workers on GPUs where there is none: `strata launch` says so once and starts no worker; a
// static worker stops before it connects (rank 1 of 2 alone: it would otherwise wait for rank 0).
TEST_F(CliTest, GpuWorkersWhereThereIsNoGpuAreAClearErrorBeforeAnyWorkerStarts) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  auto l = RunCommand(kStrata + " launch --config " + dir_.File("ok.textproto") +
                      " --workers 2 --device cuda --coordinator-dir " + dir_.File("coord"));
  EXPECT_EQ(l.exit_code, 1) << l.output;
  EXPECT_NE(l.output.find("--device cuda: the workers would train on GPUs, but this machine has "
                          "no CUDA device"),
            std::string::npos)
      << l.output;
  EXPECT_EQ(l.output.find("worker-0"), std::string::npos) << "a worker started: " << l.output;
  auto w = RunCommand(kStrata + " worker --config " + dir_.File("ok.textproto") +
                      " --rank 1 --world-size 2 --store " + dir_.File("store") +
                      " --device cuda --local-rank 3");
  EXPECT_EQ(w.exit_code, 1) << w.output;
  EXPECT_NE(w.output.find("train.device cuda: this process puts its model on cuda:"),
            std::string::npos)
      << w.output;
  auto bad =
      RunCommand(kStrata + " worker --config " + dir_.File("ok.textproto") +
                 " --rank 1 --world-size 2 --store " + dir_.File("store") + " --local-rank -1");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--local-rank"), std::string::npos) << bad.output;
}

TEST_F(CliTest, AGpuDeviceThatIsNotThereIsAClearErrorBeforeTraining) {
  const std::string metrics = dir_.File("m.jsonl");
  auto r = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") +
                      " --device cuda:999 --metrics-out " + metrics);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model on cuda:999"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train on the CPU device"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(metrics)) << "training started on a missing GPU";
  auto u = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") + " --device gpu");
  EXPECT_EQ(u.exit_code, 2) << u.output;
  EXPECT_NE(u.output.find("--device: unknown device 'gpu'"), std::string::npos) << u.output;
}

// --precision overrides train.precision: bf16 on the CPU trains (emulated) and its losses differ
// from fp32's by rounding only; a value that is not one of auto/fp32/bf16 is a usage error.
TEST_F(CliTest, PrecisionFlagTrainsInBf16OrSaysWhatItTakes) {
  const std::string base = kStrata + " train --config " + dir_.File("ok.textproto") +
                           " --steps 2 --quiet --metrics-out ";
  auto f = RunCommand(base + dir_.File("fp32.jsonl") + " --precision FP32");
  ASSERT_EQ(f.exit_code, 0) << f.output;
  auto b = RunCommand(base + dir_.File("bf16.jsonl") + " --precision bf16");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  auto loss = [](const std::string& file) {
    const std::string text = ReadFile(file);
    const size_t at = text.find("\"loss\":");
    EXPECT_NE(at, std::string::npos) << text;
    return at == std::string::npos ? 0.0 : std::stod(text.substr(at + 7));
  };
  const double l32 = loss(dir_.File("fp32.jsonl")), l16 = loss(dir_.File("bf16.jsonl"));
  EXPECT_NE(l16, l32) << "--precision bf16 changed nothing";
  EXPECT_NEAR(l16, l32, 1e-2 * l32);
  auto u = RunCommand(base + dir_.File("x.jsonl") + " --precision fp16");
  EXPECT_EQ(u.exit_code, 2) << u.output;
  EXPECT_NE(u.output.find("--precision: 'fp16' is not one of auto, fp32, bf16"), std::string::npos)
      << u.output;
}

TEST_F(CliTest, MissingDataFileSaysHowToMakeIt) {
  WriteFile(dir_.File("nodata.textproto"), "data { path: \"absent.txt\" }\n");
  auto r = RunCommand(kStrata + " train --config " + dir_.File("nodata.textproto"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("absent.txt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("prepare"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
