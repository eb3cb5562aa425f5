#include "kernels/blas_kernel.h"

#include <cblas.h>
#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/gemm.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

extern char** environ;

namespace strata::blas {
namespace {

constexpr char kPolicyVar[] = "STRATA_BLAS_KERNEL";
constexpr char kCoretypeVar[] = "OPENBLAS_CORETYPE";
constexpr char kMarkerVar[] = "STRATA_OPENBLAS_CORETYPE_SET";
constexpr char kProbeVar[] = "STRATA_SGEMM_PROBE";

// The kernels strata chooses between, best first: one per tier, the ones every x86-64
// DYNAMIC_ARCH build of OpenBLAS since 0.3.10 holds.
constexpr const char* kCandidates[] = {"Cooperlake", "SkylakeX", "Haswell", "Sandybridge",
                                       "Prescott"};

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

#if defined(__x86_64__)
uint64_t Xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

bool CpuCanRun(const CpuFeatures& cpu, int tier) {
  switch (tier) {
    case 5:
      return cpu.avx512 && cpu.avx512_bf16;
    case 4:
      return cpu.avx512;
    case 3:
      return cpu.avx2 && cpu.fma;
    case 2:
      return cpu.avx;
    case 1:
      return cpu.sse3;
    default:
      return false;
  }
}

}  // namespace

CpuFeatures DetectCpu() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.sse3 = c & (1u << 0);
  const bool fma = c & (1u << 12);
  const bool osxsave = c & (1u << 27);
  const bool avx = c & (1u << 28);
  const uint64_t xcr0 = osxsave ? Xgetbv0() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;   // plus opmask and the upper ZMM registers
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  f.avx = avx && os_ymm;
  f.fma = fma && os_ymm;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned ebx = b, edx = d, max_sub = a;
    f.avx2 = f.avx && (ebx & (1u << 5));
    constexpr unsigned kAvx512 = (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);
    f.avx512 = os_zmm && (ebx & kAvx512) == kAvx512;
    f.amx = os_amx && (edx & (1u << 24)) && (edx & (1u << 22));
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      f.avx512_bf16 = f.avx512 && (a & (1u << 5));
    }
  }
#endif
  return f;
}

Library DetectLibrary() {
  Library lib;
  const char* config = openblas_get_config();
  const char* core = openblas_get_corename();
  lib.config = config ? config : "";
  lib.corename = core ? core : "";
  lib.dynamic_arch = absl::StrContains(lib.config, "DYNAMIC_ARCH");
  if (!lib.dynamic_arch) return lib;
  // A DYNAMIC_ARCH build exports one table of function pointers per kernel, gotoblas_<NAME>.
  // When none can be found (a stripped build), assume the standard list; the start check then
  // verifies that the kernel it set is the one OpenBLAS runs.
  for (const char* k : kCandidates) {
    if (dlsym(RTLD_DEFAULT, absl::StrCat("gotoblas_", absl::AsciiStrToUpper(k)).c_str())) {
      lib.kernels.push_back(k);
    }
  }
  if (lib.kernels.empty()) lib.kernels.assign(std::begin(kCandidates), std::end(kCandidates));
  return lib;
}

std::string LibraryVersion(std::string_view config) {
  std::vector<std::string> words =
      absl::StrSplit(absl::string_view(config.data(), config.size()), ' ', absl::SkipEmpty());
  if (words.size() >= 2) return absl::StrCat(words[0], " ", words[1]);
  return words.empty() ? std::string("OpenBLAS") : std::string(words[0]);
}

int KernelTier(std::string_view corename) {
  const std::string n = absl::AsciiStrToLower(std::string(corename));
  for (const char* k : {"cooperlake", "sapphirerapids"}) {
    if (n == k) return 5;
  }
  if (n == "skylakex") return 4;
  for (const char* k : {"haswell", "zen"}) {
    if (n == k) return 3;
  }
  for (const char* k : {"sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"}) {
    if (n == k) return 2;
  }
  for (const char* k : {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "nano",
                        "barcelona", "bobcat", "opteron", "opteron_sse3", "athlon", "katmai",
                        "coppermine", "northwood", "banias"}) {
    if (n == k) return 1;
  }
  return 0;
}

std::string TierName(int tier) {
  switch (tier) {
    case 5:
      return "AVX-512 BF16";
    case 4:
      return "AVX-512";
    case 3:
      return "AVX2";
    case 2:
      return "AVX";
    case 1:
      return "SSE3";
    default:
      return "unknown";
  }
}

std::string BestKernel(const CpuFeatures& cpu, const std::vector<std::string>& available) {
  for (const char* k : kCandidates) {
    const bool held = std::any_of(available.begin(), available.end(), [&](const std::string& a) {
      return absl::EqualsIgnoreCase(a, k);
    });
    if (held && CpuCanRun(cpu, KernelTier(k))) return k;
  }
  return "";
}

StatusOr<Policy> ParsePolicy(std::string_view value) {
  const std::string v = absl::AsciiStrToLower(std::string(value));
  if (v.empty() || v == "auto") return Policy::kAuto;
  if (v == "best") return Policy::kBest;
  if (v == "keep") return Policy::kKeep;
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s='%s' is not a policy: use auto (the default: fix OpenBLAS's own kernel choice, keep a "
      "user's OPENBLAS_CORETYPE), best (the best kernel this CPU runs, even over "
      "OPENBLAS_CORETYPE) or keep (change nothing)",
      kPolicyVar, std::string(value)));
}

StatusOr<Environment> ReadEnvironment() {
  Environment env;
  ASSIGN_OR_RETURN(env.policy, ParsePolicy(Env(kPolicyVar)));
  env.coretype = Env(kCoretypeVar);
  env.set_by_strata = Env(kMarkerVar);
  return env;
}

Choice Choose(const CpuFeatures& cpu, const Library& lib, const Environment& env) {
  Choice c;
  const int used = KernelTier(lib.corename);
  c.describe = absl::StrCat(LibraryVersion(lib.config), ", kernel ", lib.corename);
  if (used > 0) absl::StrAppend(&c.describe, " (", TierName(used), ")");

  // Set by strata: the marker names the kernel it set (and the one before), and still matches.
  std::vector<std::string> marker = absl::StrSplit(env.set_by_strata, absl::MaxSplits(',', 1));
  const bool strata_set =
      !env.coretype.empty() && !marker.empty() && absl::EqualsIgnoreCase(marker[0], env.coretype);
  const bool user_set = !env.coretype.empty() && !strata_set;
  if (strata_set) {
    if (absl::EqualsIgnoreCase(lib.corename, env.coretype)) {
      absl::StrAppend(&c.describe, ", chosen by strata",
                      marker.size() > 1 && !marker[1].empty()
                          ? absl::StrCat(" in place of ", marker[1])
                          : std::string(),
                      " (OPENBLAS_CORETYPE=", env.coretype, ")");
    } else {
      c.warning = absl::StrFormat(
          "strata set OPENBLAS_CORETYPE=%s, but OpenBLAS runs its %s kernel: GEMMs may run below "
          "this CPU's speed; set STRATA_BLAS_KERNEL=keep and OPENBLAS_CORETYPE to a kernel your "
          "OpenBLAS holds",
          env.coretype, lib.corename);
    }
    return c;
  }
  if (user_set) absl::StrAppend(&c.describe, ", set by OPENBLAS_CORETYPE=", env.coretype);

  // The best kernel the CPU runs among all strata knows, and among those this library can switch
  // to (none when it is built for one CPU).
  const std::vector<std::string> all(std::begin(kCandidates), std::end(kCandidates));
  const std::string cpu_best = BestKernel(cpu, all);
  const std::string best = lib.dynamic_arch ? BestKernel(cpu, lib.kernels) : std::string();
  // An unknown kernel name (another architecture, or a newer OpenBLAS) is not judged.
  if (used == 0 || KernelTier(cpu_best) <= used) {
    if (used > 0) absl::StrAppend(&c.describe, ": the best for this CPU");
    return c;
  }
  const std::string below = absl::StrFormat(
      "OpenBLAS runs its %s kernel (%s), below the best this CPU runs, %s (%s): GEMMs run slower "
      "than this CPU can",
      lib.corename, TierName(used), cpu_best, TierName(KernelTier(cpu_best)));
  if (best.empty() || KernelTier(best) <= used) {
    c.warning = absl::StrCat(
        below, "; this OpenBLAS cannot switch to it (",
        lib.dynamic_arch ? "it does not hold that kernel" : "it is built for one CPU",
        "): install Debian's libopenblas0-pthread (a DYNAMIC_ARCH build) or a newer OpenBLAS");
    return c;
  }
  if (user_set && env.policy != Policy::kBest) {
    c.warning = absl::StrCat(below, "; OPENBLAS_CORETYPE=", env.coretype,
                             " is kept: unset it, or set STRATA_BLAS_KERNEL=best to let strata "
                             "choose ",
                             best);
    return c;
  }
  if (env.policy == Policy::kKeep) {
    c.warning = absl::StrCat(below, "; STRATA_BLAS_KERNEL=keep keeps it: unset it to let strata "
                                    "choose ",
                             best);
    return c;
  }
  c.reexec_with = best;
  return c;
}

Status ChooseKernelAtStart(char** argv) {
  if (const std::string probe = Env(kProbeVar); !probe.empty()) {
    std::vector<std::string> parts = absl::StrSplit(probe, ',');
    int threads = 1, n = 1024;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &threads) ||
        !absl::SimpleAtoi(parts[1], &n) || threads < 1 || n < 1) {
      std::fprintf(stderr, "%s='%s' must be THREADS,N\n", kProbeVar, probe.c_str());
      _exit(2);
    }
    std::printf("%.3f\n", MeasureSgemm(threads, n));
    std::fflush(stdout);
    _exit(0);
  }
  ASSIGN_OR_RETURN(Environment env, ReadEnvironment());
  const Library lib = DetectLibrary();
  const Choice c = Choose(DetectCpu(), lib, env);
  if (c.reexec_with.empty()) return absl::OkStatus();
  const std::string old = env.coretype;
  setenv(kCoretypeVar, c.reexec_with.c_str(), 1);
  setenv(kMarkerVar, absl::StrCat(c.reexec_with, ",", lib.corename).c_str(), 1);
  std::fflush(nullptr);
  execv("/proc/self/exe", argv);
  // Still here: the exec failed. Carry on with the kernel OpenBLAS chose, and say so.
  const int err = errno;
  if (old.empty()) {
    unsetenv(kCoretypeVar);
  } else {
    setenv(kCoretypeVar, old.c_str(), 1);
  }
  unsetenv(kMarkerVar);
  std::fprintf(stderr,
               "strata: warning: could not execute /proc/self/exe again to switch OpenBLAS from "
               "its %s kernel to %s (%s); GEMMs run below this CPU's speed\n",
               lib.corename.c_str(), c.reexec_with.c_str(), std::strerror(err));
  return absl::OkStatus();
}

Choice Current() {
  StatusOr<Environment> env = ReadEnvironment();
  Choice c = Choose(DetectCpu(), DetectLibrary(), env.ok() ? *env : Environment{});
  if (!c.reexec_with.empty()) {
    c.warning = absl::StrFormat(
        "OpenBLAS runs its %s kernel, below the best this CPU runs, %s: this program did not "
        "switch it at start; set OPENBLAS_CORETYPE=%s",
        DetectLibrary().corename, c.reexec_with, c.reexec_with);
    c.reexec_with.clear();
  }
  return c;
}

double MeasureSgemm(int threads, int n) {
  threads = std::max(1, threads);
  std::vector<double> gflops(static_cast<size_t>(threads), 0.0);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const size_t count = static_cast<size_t>(n) * static_cast<size_t>(n);
      std::vector<float> a(count), b(count), c(count, 0.f);
      for (size_t i = 0; i < count; ++i) {
        a[i] = static_cast<float>(i % 7) * 0.1f;
        b[i] = static_cast<float>(i % 5) * 0.2f;
      }
      double best = 1e30;
      for (int rep = 0; rep < 4; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        cpu::GemmSerial<float>(false, false, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(),
                               n);
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0) best = std::min(best, s);  // the first warms caches and OpenBLAS's buffers
      }
      // One element against a double-precision sum: every term is non-negative, so float
      // accumulation is within n * 2^-24 of the sum (twice that allowed). A wrong GEMM reads 0.
      double ref = 0;
      const size_t row = static_cast<size_t>(n / 2) * static_cast<size_t>(n), col = n / 3;
      for (int k = 0; k < n; ++k) {
        ref += static_cast<double>(a[row + static_cast<size_t>(k)]) *
               b[static_cast<size_t>(k) * static_cast<size_t>(n) + col];
      }
      if (std::abs(c[row + col] - ref) > 1.2e-7 * n * ref) return;
      gflops[static_cast<size_t>(t)] = 2.0 * n * n * static_cast<double>(n) / best / 1e9;
    });
  }
  for (auto& w : workers) w.join();
  double sum = 0;
  for (double g : gflops) {
    if (g <= 0) return -1;  // a thread's result was wrong
    sum += g;
  }
  return sum;
}

double MeasureBestSgemm(int threads, std::string* kernel, int n) {
  const Library lib = DetectLibrary();
  const std::string best = BestKernel(DetectCpu(), lib.dynamic_arch ? lib.kernels
                                                                     : std::vector<std::string>{});
  *kernel = best.empty() ? lib.corename : best;
  if (best.empty() || absl::EqualsIgnoreCase(best, lib.corename)) return MeasureSgemm(threads, n);
  // A child of this program on that kernel: OpenBLAS's kernel is fixed once it has loaded.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv(*e);
    if (absl::StartsWith(kv, absl::StrCat(kCoretypeVar, "=")) ||
        absl::StartsWith(kv, absl::StrCat(kMarkerVar, "=")) ||
        absl::StartsWith(kv, absl::StrCat(kProbeVar, "="))) {
      continue;
    }
    env_strings.emplace_back(kv);
  }
  env_strings.push_back(absl::StrCat(kCoretypeVar, "=", best));
  env_strings.push_back(absl::StrCat(kMarkerVar, "=", best, ",", lib.corename));
  env_strings.push_back(absl::StrCat(kProbeVar, "=", threads, ",", n));
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  char arg0[] = "strata-sgemm-probe";
  char* argv[] = {arg0, nullptr};

  int fds[2];
  if (pipe(fds) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  std::string out;
  if (rc == 0) {
    char buf[256];
    ssize_t got;
    while ((got = read(fds[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(got));
  }
  close(fds[0]);
  if (rc != 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  double gflops = -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
      !absl::SimpleAtod(absl::StripAsciiWhitespace(out), &gflops)) {
    return -1;
  }
  return gflops;
}

}  // namespace strata::blas
