#include "kernels/blas_kernel.h"

#include <cblas.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
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
constexpr char kProbeArgv0[] = "strata-sgemm-probe";

// The kernels strata chooses between, best first: the ones every x86-64 DYNAMIC_ARCH build of
// OpenBLAS since 0.3.10 holds. Cooperlake's sgemm is SkylakeX's (they differ in sbgemm only):
// Cooperlake comes first where the CPU has BF16, but neither is "below" the other.
constexpr const char* kCandidates[] = {"Cooperlake", "SkylakeX", "Haswell", "Sandybridge",
                                       "Prescott"};

// Set by ChooseKernelAtStart: the program's main() handles the sgemm probe's child.
bool g_chose_at_start = false;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// Whether the CPU has what OpenBLAS's kernel of that name executes (a forced kernel the CPU lacks
// an instruction of stops the first GEMM with SIGILL); a name strata does not know passes.
bool CpuCanRun(const CpuFeatures& cpu, std::string_view corename) {
  const std::string n = absl::AsciiStrToLower(std::string(corename));
  if (n == "sapphirerapids") return cpu.avx512 && cpu.avx512_bf16 && cpu.amx;
  if (n == "cooperlake") return cpu.avx512 && cpu.avx512_bf16;
  if (n == "skylakex") return cpu.avx512;
  if (n == "haswell" || n == "zen") return cpu.avx2 && cpu.fma;
  if (n == "sandybridge") return cpu.avx;
  if (n == "bulldozer" || n == "piledriver" || n == "steamroller" || n == "excavator") {
    return cpu.avx && cpu.fma4 && cpu.xop;
  }
  if (n == "barcelona" || n == "bobcat") return cpu.sse3 && cpu.sse4a;
  if (n == "opteron" || n == "athlon") return cpu.three_dnow;
  if (n == "opteron_sse3") return cpu.three_dnow && cpu.sse3;
  if (n == "nehalem") return cpu.sse4_2;
  if (n == "penryn" || n == "dunnington") return cpu.sse4_1;
  if (n == "core2" || n == "atom" || n == "nano") return cpu.ssse3;
  if (n == "prescott") return cpu.sse3;
  return true;  // SSE2 and older (Katmai, Coppermine, Northwood, Banias), and unknown names
}

// Retries a system call that a signal interrupted.
template <typename F>
auto RetryOnEintr(F f) {
  decltype(f()) r;
  do {
    r = f();
  } while (r < 0 && errno == EINTR);
  return r;
}

}  // namespace

CpuFeatures CpuFeaturesFromRegisters(const CpuRegisters& r) {
  CpuFeatures f;
  f.sse3 = r.leaf1_ecx & (1u << 0);
  f.ssse3 = r.leaf1_ecx & (1u << 9);
  f.sse4_1 = r.leaf1_ecx & (1u << 19);
  f.sse4_2 = r.leaf1_ecx & (1u << 20);
  f.sse4a = r.ext1_ecx & (1u << 6);
  f.three_dnow = r.ext1_edx & (1u << 31);
  const bool fma = r.leaf1_ecx & (1u << 12);
  const bool osxsave = r.leaf1_ecx & (1u << 27);
  const bool avx = r.leaf1_ecx & (1u << 28);
  const uint64_t xcr0 = osxsave ? r.xcr0 : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;    // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;  // plus opmask and the upper ZMM registers
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  f.avx = avx && os_ymm;
  f.fma = fma && os_ymm;
  f.xop = os_ymm && (r.ext1_ecx & (1u << 11));
  f.fma4 = os_ymm && (r.ext1_ecx & (1u << 16));
  f.avx2 = f.avx && (r.leaf7_ebx & (1u << 5));
  constexpr uint32_t kAvx512 = (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);
  f.avx512 = os_zmm && (r.leaf7_ebx & kAvx512) == kAvx512;
  f.avx512_bf16 = f.avx512 && (r.leaf7_1_eax & (1u << 5));
  f.amx = os_amx && (r.leaf7_edx & (1u << 24)) && (r.leaf7_edx & (1u << 22));
  return f;
}

CpuFeatures DetectCpu() {
  CpuRegisters r;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return CpuFeatures{};
  r.leaf1_ecx = c;
  if (c & (1u << 27)) {  // OSXSAVE: xgetbv is allowed
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    r.xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  if (__get_cpuid(0x80000001u, &a, &b, &c, &d)) {
    r.ext1_ecx = c;
    r.ext1_edx = d;
  }
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    r.leaf7_ebx = b;
    r.leaf7_edx = d;
    if (a >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      r.leaf7_1_eax = a;
    }
  }
#endif
  return CpuFeaturesFromRegisters(r);
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
  for (const char* k : {"cooperlake", "sapphirerapids", "skylakex"}) {
    if (n == k) return 4;
  }
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

std::string KernelIsa(std::string_view corename) {
  const std::string n = absl::AsciiStrToLower(std::string(corename));
  if (n == "cooperlake" || n == "sapphirerapids") return "AVX-512 BF16";
  switch (KernelTier(corename)) {
    case 4:
      return "AVX-512";
    case 3:
      return "AVX2";
    case 2:
      return "AVX";
    case 1:
      return "SSE3";
    default:
      return "";
  }
}

std::string BestKernel(const CpuFeatures& cpu, const std::vector<std::string>& available) {
  for (const char* k : kCandidates) {
    const bool held = std::any_of(available.begin(), available.end(), [&](const std::string& a) {
      return absl::EqualsIgnoreCase(a, k);
    });
    if (held && CpuCanRun(cpu, k)) return k;
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
  if (used > 0) absl::StrAppend(&c.describe, " (", KernelIsa(lib.corename), ")");

  // The best kernel the CPU runs among all strata knows, and among those this library can switch
  // to (none when it is built for one CPU).
  const std::vector<std::string> all(std::begin(kCandidates), std::end(kCandidates));
  const std::string cpu_best = BestKernel(cpu, all);
  const std::string best = lib.dynamic_arch ? BestKernel(cpu, lib.kernels) : std::string();
  const bool runs = CpuCanRun(cpu, lib.corename);

  // Set by strata: the marker names the kernel it set (and the one before), still matches
  // OPENBLAS_CORETYPE, and this CPU runs it (a marker carried to another machine is stale).
  std::vector<std::string> marker = absl::StrSplit(env.set_by_strata, absl::MaxSplits(',', 1));
  const bool strata_set = !env.coretype.empty() && !marker.empty() &&
                          absl::EqualsIgnoreCase(marker[0], env.coretype) &&
                          CpuCanRun(cpu, env.coretype);
  const bool user_set = !env.coretype.empty() && !strata_set;
  const bool took_effect = absl::EqualsIgnoreCase(lib.corename, env.coretype);
  if (strata_set) {
    if (took_effect) {
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
  if (user_set) {
    absl::StrAppend(&c.describe, took_effect ? ", set by " : ", chosen by OpenBLAS although ",
                    "OPENBLAS_CORETYPE=", env.coretype,
                    took_effect ? "" : " (not a kernel this OpenBLAS can switch to)");
  }

  // A kernel that needs instructions this CPU (or its OS) lacks: the first GEMM would stop the
  // process with SIGILL. Only a forced OPENBLAS_CORETYPE gets there.
  if (!runs) {
    const std::string danger = absl::StrFormat(
        "OpenBLAS runs its %s kernel, which needs instructions this CPU or its OS does not "
        "provide: GEMMs will stop the process with SIGILL",
        lib.corename);
    if (env.policy == Policy::kKeep || best.empty()) {
      c.warning = env.coretype.empty()
                      ? absl::StrCat(danger,
                                     "; install an OpenBLAS built for this CPU, or Debian's "
                                     "libopenblas0-pthread (a DYNAMIC_ARCH build)")
                      : absl::StrCat(danger, "; unset OPENBLAS_CORETYPE",
                                     best.empty() ? "" : absl::StrCat(" or set it to ", best));
    } else {
      c.reexec_with = best;
    }
    return c;
  }
  // An unknown kernel name (another architecture, or a newer OpenBLAS) is not judged.
  if (used == 0 || KernelTier(cpu_best) <= used) {
    if (used > 0) absl::StrAppend(&c.describe, ": the best for this CPU");
    return c;
  }
  const std::string below = absl::StrFormat(
      "OpenBLAS runs its %s kernel (%s), below the best this CPU runs, %s (%s): GEMMs run slower "
      "than this CPU can",
      lib.corename, KernelIsa(lib.corename), cpu_best, KernelIsa(cpu_best));
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
    c.warning = absl::StrCat(below,
                             "; STRATA_BLAS_KERNEL=keep keeps it: set STRATA_BLAS_KERNEL=auto (or "
                             "unset it) to let strata choose ",
                             best);
    return c;
  }
  c.reexec_with = best;
  return c;
}

namespace {

// The child of MeasureSgemmInChild: "<corename> <GFLOP/s>" on stdout, then exit.
[[noreturn]] void RunSgemmProbe(const std::string& spec) {
  std::vector<std::string> parts = absl::StrSplit(spec, ',');
  int threads = 1, n = 1024;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &threads) ||
      !absl::SimpleAtoi(parts[1], &n) || threads < 1 || n < 1) {
    std::fprintf(stderr, "%s='%s' must be THREADS,N\n", kProbeVar, spec.c_str());
    _exit(2);
  }
  std::printf("%s %.3f\n", DetectLibrary().corename.c_str(), MeasureSgemm(threads, n));
  std::fflush(stdout);
  _exit(0);
}

// Linux names a process after the file it executes: after an exec of /proc/self/exe that is
// "exe", which `ps`, `top` and `pgrep strata` would show. Name it after argv[0] again.
void NameProcessAfterArgv0(const char* argv0) {
  if (argv0 == nullptr || argv0[0] == '\0') return;
  std::ifstream f("/proc/self/comm");
  std::string comm;
  if (!std::getline(f, comm) || comm != "exe") return;
  const char* base = std::strrchr(argv0, '/');
  prctl(PR_SET_NAME, base ? base + 1 : argv0, 0, 0, 0);
}

}  // namespace

Status ChooseKernelAtStart(char** argv) {
  g_chose_at_start = true;
  NameProcessAfterArgv0(argv[0]);
  if (const std::string probe = Env(kProbeVar);
      !probe.empty() && argv[0] != nullptr && std::strcmp(argv[0], kProbeArgv0) == 0) {
    RunSgemmProbe(probe);
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
        "OpenBLAS runs its %s kernel, not the best this CPU runs, %s, and this process did not "
        "switch kernels when it started (its main() does not call blas::ChooseKernelAtStart, or "
        "the exec failed); set OPENBLAS_CORETYPE=%s",
        DetectLibrary().corename, c.reexec_with, c.reexec_with);
    c.reexec_with.clear();
  }
  return c;
}

bool SgemmRowsIndependentOfRowCount() {
  constexpr int kRows = 64;
  uint32_t x = 12345;
  auto next = [&x] {
    x = x * 1664525u + 1013904223u;
    return static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  };
  // Two shapes of out [rows, n] = a [rows, k] b^T, as a linear layer computes it: a router's
  // narrow output and a wider one with a longer reduction.
  for (const auto& [k, n] : {std::pair<int, int>{32, 8}, std::pair<int, int>{256, 64}}) {
    std::vector<float> a(kRows * k), b(n * k), full(kRows * n), part(kRows * n);
    for (float& v : a) v = next();
    for (float& v : b) v = next();
    cpu::GemmSerial<float>(false, true, kRows, n, k, 1.f, a.data(), k, b.data(), k, 0.f,
                           full.data(), n);
    for (int m : {1, 3, 5, 8, 16, 17, 33, 61, 63}) {
      for (int first : {0, kRows - m}) {
        cpu::GemmSerial<float>(false, true, m, n, k, 1.f, a.data() + first * k, k, b.data(), k, 0.f,
                               part.data(), n);
        if (std::memcmp(part.data(), full.data() + first * n, sizeof(float) * m * n) != 0) {
          return false;
        }
      }
    }
  }
  return true;
}

double MeasureSgemm(int threads, int n) {
  threads = std::max(1, threads);
  std::vector<double> gflops(static_cast<size_t>(threads), 0.0);
  // Every repetition starts on all threads at once, so the rates add up to what they reach
  // together (sharing caches and memory bandwidth), as the pool's GEMMs do.
  std::barrier start(threads);
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
        start.arrive_and_wait();
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

double MeasureSgemmInChild(const std::string& kernel, int threads, int n, std::string* ran) {
  ran->clear();
  if (!g_chose_at_start) return -1;  // the child would run this program's main() in full
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv(*e);
    const bool replaced =
        !kernel.empty() && (absl::StartsWith(kv, absl::StrCat(kCoretypeVar, "=")) ||
                            absl::StartsWith(kv, absl::StrCat(kMarkerVar, "=")));
    if (replaced || absl::StartsWith(kv, absl::StrCat(kProbeVar, "="))) continue;
    env_strings.push_back(kv);
  }
  if (!kernel.empty()) {
    env_strings.push_back(absl::StrCat(kCoretypeVar, "=", kernel));
    env_strings.push_back(absl::StrCat(kMarkerVar, "=", kernel));
  }
  env_strings.push_back(absl::StrCat(kProbeVar, "=", threads, ",", n));
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string arg0 = kProbeArgv0;
  char* argv[] = {arg0.data(), nullptr};

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;  // no other child inherits the write end
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);  // clears FD_CLOEXEC there
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  std::string out;
  if (rc == 0) {
    char buf[256];
    ssize_t got;
    while ((got = RetryOnEintr([&] { return read(fds[0], buf, sizeof(buf)); })) > 0) {
      out.append(buf, static_cast<size_t>(got));
    }
  }
  close(fds[0]);
  if (rc != 0) return -1;
  int status = 0;
  if (RetryOnEintr([&] { return waitpid(pid, &status, 0); }) != pid) return -1;
  std::vector<std::string> words =
      absl::StrSplit(absl::StripAsciiWhitespace(out), ' ', absl::SkipEmpty());
  double gflops = -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || words.size() != 2 ||
      !absl::SimpleAtod(words[1], &gflops)) {
    return -1;
  }
  *ran = words[0];
  // The child must have run the kernel asked for.
  if (!kernel.empty() && !absl::EqualsIgnoreCase(*ran, kernel)) return -1;
  return gflops;
}

}  // namespace strata::blas
