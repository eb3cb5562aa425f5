// The choice of OpenBLAS kernel (kernels/blas_kernel.h) against made-up CPUs and libraries, each
// expected result written by hand from OpenBLAS's kernel list; and the cpuid reading against the
// flags the Linux kernel lists in /proc/cpuinfo.
#include "kernels/blas_kernel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/gemm.h"

namespace strata::blas {
namespace {

const std::vector<std::string> kDebian12 = {"Cooperlake", "SkylakeX", "Haswell", "Sandybridge",
                                            "Prescott"};

Library OpenBlas(std::string corename, bool dynamic = true) {
  Library lib;
  lib.config = absl::StrCat("OpenBLAS 0.3.21 NO_LAPACKE", dynamic ? " DYNAMIC_ARCH" : "",
                            " NO_AFFINITY ", corename, " MAX_THREADS=64");
  lib.corename = std::move(corename);
  lib.dynamic_arch = dynamic;
  if (dynamic) lib.kernels = kDebian12;
  return lib;
}

// An Intel Xeon with AVX-512 and AVX512_BF16 (and AMX), or an AMD Zen 4/5.
CpuFeatures Avx512Bf16() {
  return {.sse3 = true,
          .ssse3 = true,
          .sse4_1 = true,
          .sse4_2 = true,
          .avx = true,
          .avx2 = true,
          .fma = true,
          .avx512 = true,
          .avx512_bf16 = true,
          .amx = true};
}
CpuFeatures Avx512() {
  CpuFeatures f = Avx512Bf16();
  f.avx512_bf16 = false;
  f.amx = false;
  return f;
}
CpuFeatures Avx2() {
  CpuFeatures f = Avx512();
  f.avx512 = false;
  return f;
}

Environment Env(std::string coretype, std::string marker = "", Policy policy = Policy::kAuto) {
  Environment env;
  env.coretype = std::move(coretype);
  env.set_by_strata = std::move(marker);
  env.policy = policy;
  return env;
}

// The choice keeps the kernel and warns with `text` in its message.
void ExpectKeptWithWarning(const Choice& c, const std::string& text) {
  EXPECT_EQ(c.reexec_with, "");
  EXPECT_NE(c.warning.find(text), std::string::npos) << c.warning;
}

TEST(BlasKernelTest, TiersFollowTheWidestVectors) {
  EXPECT_EQ(KernelTier("Prescott"), 1);
  EXPECT_EQ(KernelTier("Sandybridge"), 2);
  EXPECT_EQ(KernelTier("Haswell"), 3);
  EXPECT_EQ(KernelTier("ZEN"), 3);
  EXPECT_EQ(KernelTier("SkylakeX"), 4);
  // Cooperlake's sgemm is SkylakeX's: one tier.
  EXPECT_EQ(KernelTier("Cooperlake"), 4);
  EXPECT_EQ(KernelTier("SapphireRapids"), 4);
  EXPECT_EQ(KernelTier("NEOVERSEN1"), 0);
  EXPECT_EQ(KernelIsa("Cooperlake"), "AVX-512 BF16");
  EXPECT_EQ(KernelIsa("SkylakeX"), "AVX-512");
  EXPECT_EQ(KernelIsa("Zen"), "AVX2");
  EXPECT_EQ(KernelIsa("NEOVERSEN1"), "");
  EXPECT_EQ(LibraryVersion("OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH"), "OpenBLAS 0.3.21");
}

TEST(BlasKernelTest, BestKernelIsTheWidestTheCpuAndTheLibraryBothHave) {
  EXPECT_EQ(BestKernel(Avx512Bf16(), kDebian12), "Cooperlake");
  EXPECT_EQ(BestKernel(Avx512(), kDebian12), "SkylakeX");
  EXPECT_EQ(BestKernel(Avx2(), kDebian12), "Haswell");
  // An OpenBLAS older than Cooperlake's kernel.
  EXPECT_EQ(BestKernel(Avx512Bf16(), {"SkylakeX", "Haswell", "Prescott"}), "SkylakeX");
  // AVX without FMA (Sandy Bridge), SSE3 only, nothing at all.
  CpuFeatures avx = Avx2();
  avx.avx2 = false;
  avx.fma = false;
  EXPECT_EQ(BestKernel(avx, kDebian12), "Sandybridge");
  EXPECT_EQ(BestKernel(CpuFeatures{.sse3 = true}, kDebian12), "Prescott");
  EXPECT_EQ(BestKernel(CpuFeatures{}, kDebian12), "");
  EXPECT_EQ(BestKernel(Avx512Bf16(), {}), "");
}

// cpuid and xgetbv words written by hand from the Intel SDM's bit positions.
TEST(BlasKernelTest, FeaturesFromRegistersNeedTheOsToSaveTheRegisters) {
  CpuRegisters r;
  r.leaf1_ecx = (1u << 0) | (1u << 12) | (1u << 27) | (1u << 28);  // SSE3 FMA OSXSAVE AVX
  r.leaf7_ebx = (1u << 5) | (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);
  r.leaf7_edx = (1u << 22) | (1u << 24);  // AMX-BF16, AMX-TILE
  r.leaf7_1_eax = 1u << 5;                // AVX512_BF16
  r.xcr0 = 0x600e7;                       // x87 SSE AVX opmask ZMM_Hi256 Hi16_ZMM TILECFG TILEDATA
  CpuFeatures f = CpuFeaturesFromRegisters(r);
  EXPECT_TRUE(f.sse3 && f.avx && f.avx2 && f.fma && f.avx512 && f.avx512_bf16 && f.amx);

  // An OS that saves AVX but not the AVX-512 state: AVX2, no AVX-512, no BF16.
  r.xcr0 = 0x7;
  f = CpuFeaturesFromRegisters(r);
  EXPECT_TRUE(f.avx2 && f.fma);
  EXPECT_FALSE(f.avx512 || f.avx512_bf16 || f.amx);
  // No OSXSAVE: xgetbv's word is not to be trusted, nothing past SSE3.
  r.xcr0 = 0x600e7;
  r.leaf1_ecx &= ~(1u << 27);
  f = CpuFeaturesFromRegisters(r);
  EXPECT_TRUE(f.sse3);
  EXPECT_FALSE(f.avx || f.avx2 || f.fma || f.avx512);
  // AMD's own extensions (leaf 0x80000001); FMA4 and XOP work on YMM registers, so the OS must
  // save them too.
  r.ext1_ecx = (1u << 6) | (1u << 11) | (1u << 16);  // SSE4a, XOP, FMA4
  r.ext1_edx = 1u << 31;                             // 3DNow!
  f = CpuFeaturesFromRegisters(r);
  EXPECT_TRUE(f.sse4a && f.three_dnow && !f.xop && !f.fma4);
  r.leaf1_ecx |= 1u << 27;
  f = CpuFeaturesFromRegisters(r);
  EXPECT_TRUE(f.sse4a && f.three_dnow && f.xop && f.fma4);
  // AVX-512 without VL (bit 31) is not what the SkylakeX kernel needs.
  r.leaf7_ebx &= ~(1u << 31);
  f = CpuFeaturesFromRegisters(r);
  EXPECT_TRUE(f.avx2);
  EXPECT_FALSE(f.avx512 || f.avx512_bf16);
}

// The machine of the report: a Xeon (family 6, model 207) with AVX-512 BF16, on which Debian 12's
// OpenBLAS 0.3.21 picks Prescott. strata re-executes on Cooperlake.
TEST(BlasKernelTest, APrescottChoiceOnAnAvx512Bf16XeonIsFixed) {
  const Choice c = Choose(Avx512Bf16(), OpenBlas("Prescott"), Environment{});
  EXPECT_EQ(c.reexec_with, "Cooperlake");
  EXPECT_EQ(c.warning, "");
  // The same with an OpenBLAS that lacks Cooperlake, and on a CPU with AVX-512 but no BF16.
  Library old = OpenBlas("Prescott");
  old.kernels = {"SkylakeX", "Haswell", "Sandybridge", "Prescott"};
  EXPECT_EQ(Choose(Avx512Bf16(), old, Environment{}).reexec_with, "SkylakeX");
  EXPECT_EQ(Choose(Avx512(), OpenBlas("Haswell"), Environment{}).reexec_with, "SkylakeX");
}

// After the re-execution: the marker names what strata set and what it replaced.
TEST(BlasKernelTest, AfterTheFixTheKernelIsReportedAsStratasChoice) {
  Environment env = Env("Cooperlake", "Cooperlake,Prescott");
  const Choice c = Choose(Avx512Bf16(), OpenBlas("Cooperlake"), env);
  EXPECT_EQ(c.reexec_with, "");
  EXPECT_EQ(c.warning, "");
  EXPECT_EQ(c.describe,
            "OpenBLAS 0.3.21, kernel Cooperlake (AVX-512 BF16), chosen by strata in place of "
            "Prescott (OPENBLAS_CORETYPE=Cooperlake)");
  // OpenBLAS ignored the setting: never a second re-execution, a warning instead.
  ExpectKeptWithWarning(Choose(Avx512Bf16(), OpenBlas("Prescott"), env),
                        "strata set OPENBLAS_CORETYPE=Cooperlake, but OpenBLAS runs its Prescott "
                        "kernel");
}

// This project's development machine: an AMD EPYC (Zen 5, AVX-512 BF16) whose environment sets
// OPENBLAS_CORETYPE=Haswell. The user's setting is kept, with a warning that says how to lift it.
TEST(BlasKernelTest, AUsersOpenblasCoretypeIsKeptWithAWarningUnlessThePolicyIsBest) {
  Environment env = Env("Haswell");
  const Choice c = Choose(Avx512Bf16(), OpenBlas("Haswell"), env);
  EXPECT_EQ(c.reexec_with, "");
  EXPECT_EQ(c.describe, "OpenBLAS 0.3.21, kernel Haswell (AVX2), set by OPENBLAS_CORETYPE=Haswell");
  EXPECT_EQ(c.warning,
            "OpenBLAS runs its Haswell kernel (AVX2), below the best this CPU runs, Cooperlake "
            "(AVX-512 BF16): GEMMs run slower than this CPU can; OPENBLAS_CORETYPE=Haswell is "
            "kept: unset it, or set STRATA_BLAS_KERNEL=best to let strata choose Cooperlake");
  env.policy = Policy::kBest;
  EXPECT_EQ(Choose(Avx512Bf16(), OpenBlas("Haswell"), env).reexec_with, "Cooperlake");
  // A user's setting that is already the best stays, without a warning.
  env.coretype = "SkylakeX";
  const Choice fine = Choose(Avx512(), OpenBlas("SkylakeX"), env);
  EXPECT_EQ(fine.reexec_with, "");
  EXPECT_EQ(fine.warning, "");
  // A marker for another kernel than OPENBLAS_CORETYPE's is stale: the setting is the user's.
  env = Env("Haswell", "Cooperlake,Prescott");
  ExpectKeptWithWarning(Choose(Avx512Bf16(), OpenBlas("Haswell"), env), "is kept");
}

// Cooperlake's sgemm is SkylakeX's: neither choice is "below" on a CPU with BF16.
TEST(BlasKernelTest, SkylakeXOnABf16CpuIsNotBelowTheBest) {
  const Choice own = Choose(Avx512Bf16(), OpenBlas("SkylakeX"), Environment{});
  EXPECT_EQ(own.reexec_with, "");
  EXPECT_EQ(own.warning, "");
  EXPECT_EQ(own.describe, "OpenBLAS 0.3.21, kernel SkylakeX (AVX-512): the best for this CPU");
  const Choice user = Choose(Avx512Bf16(), OpenBlas("SkylakeX"), Env("SkylakeX"));
  EXPECT_EQ(user.reexec_with, "");
  EXPECT_EQ(user.warning, "");
}

// A forced kernel that needs instructions the CPU lacks would stop the first GEMM with SIGILL:
// strata switches to the best kernel the CPU runs, or (keep) says so loudly. A marker for such a
// kernel (an environment carried to another machine) is not trusted.
TEST(BlasKernelTest, AKernelTheCpuCannotRunIsReplacedOrWarnedAbout) {
  EXPECT_EQ(Choose(Avx2(), OpenBlas("Cooperlake"), Env("Cooperlake")).reexec_with, "Haswell");
  EXPECT_EQ(Choose(Avx512(), OpenBlas("Cooperlake"), Env("Cooperlake")).reexec_with, "SkylakeX");
  ExpectKeptWithWarning(Choose(Avx2(), OpenBlas("SkylakeX"), Env("SkylakeX", "", Policy::kKeep)),
                        "which needs instructions this CPU or its OS does not provide: GEMMs will "
                        "stop the process with SIGILL; unset OPENBLAS_CORETYPE or set it to "
                        "Haswell");
  EXPECT_EQ(
      Choose(Avx2(), OpenBlas("Cooperlake"), Env("Cooperlake", "Cooperlake,Haswell")).reexec_with,
      "Haswell");
}

// OpenBLAS's kernels for older AMD CPUs use AMD's own instructions (FMA4 and XOP from Bulldozer to
// Excavator, 3DNow! on Opteron and Athlon, SSE4a on Barcelona and Bobcat), which Intel CPUs and
// Zen lack: forced on such a CPU, each is replaced like any kernel the CPU cannot run.
TEST(BlasKernelTest, OldAmdKernelsNeedAmdsOwnInstructions) {
  for (const char* k : {"Bulldozer", "Piledriver", "Steamroller", "Excavator", "Opteron",
                        "Opteron_SSE3", "Athlon", "Barcelona", "Bobcat"}) {
    EXPECT_EQ(Choose(Avx512Bf16(), OpenBlas(k), Env(k)).reexec_with, "Cooperlake") << k;
  }
  CpuFeatures piledriver = Avx2();  // AVX, FMA3, FMA4 and XOP, no AVX2
  piledriver.avx2 = false;
  piledriver.fma4 = piledriver.xop = piledriver.sse4a = true;
  const Choice own = Choose(piledriver, OpenBlas("Piledriver"), Environment{});
  EXPECT_EQ(own.reexec_with, "");
  EXPECT_EQ(own.warning, "");
  // A forced Intel kernel on a CPU without its SSE level (SSSE3 for Core2, SSE4.2 for Nehalem).
  CpuFeatures sse3_only{};
  sse3_only.sse3 = true;
  ExpectKeptWithWarning(Choose(sse3_only, OpenBlas("Nehalem"), Env("Nehalem", "", Policy::kKeep)),
                        "needs instructions this CPU or its OS does not provide");
  EXPECT_EQ(Choose(sse3_only, OpenBlas("Core2"), Env("Core2")).reexec_with, "Prescott");
  // SapphireRapids (a newer OpenBLAS) needs AMX as well as BF16: Zen 4 and 5 have no AMX.
  CpuFeatures zen5 = Avx512Bf16();
  zen5.amx = false;
  EXPECT_EQ(Choose(zen5, OpenBlas("SapphireRapids"), Env("SapphireRapids")).reexec_with,
            "Cooperlake");
}

// An OPENBLAS_CORETYPE that OpenBLAS did not take (not a kernel it holds) is not reported as the
// kernel's reason.
TEST(BlasKernelTest, AnOpenblasCoretypeThatDidNotTakeIsNamedAsSuch) {
  const Choice c = Choose(Avx512Bf16(), OpenBlas("Cooperlake"), Env("Bogus"));
  EXPECT_EQ(c.describe,
            "OpenBLAS 0.3.21, kernel Cooperlake (AVX-512 BF16), chosen by OpenBLAS although "
            "OPENBLAS_CORETYPE=Bogus (not a kernel this OpenBLAS can switch to): the best for this "
            "CPU");
  EXPECT_EQ(c.warning, "");
}

TEST(BlasKernelTest, KeepOnlyWarnsAndTheBestChoiceNeedsNothing) {
  ExpectKeptWithWarning(Choose(Avx512Bf16(), OpenBlas("Prescott"), Env("", "", Policy::kKeep)),
                        "STRATA_BLAS_KERNEL=keep keeps it: set STRATA_BLAS_KERNEL=auto (or unset "
                        "it) to let strata choose Cooperlake");
  // OpenBLAS's own choice is the best (or as good: Zen is the AVX2 tier).
  const Choice good = Choose(Avx2(), OpenBlas("Zen"), Environment{});
  EXPECT_EQ(good.reexec_with, "");
  EXPECT_EQ(good.warning, "");
  EXPECT_EQ(good.describe, "OpenBLAS 0.3.21, kernel Zen (AVX2): the best for this CPU");
  // A kernel strata does not know (another architecture) is reported, not judged.
  const Choice arm = Choose(CpuFeatures{}, OpenBlas("NEOVERSEN1"), Environment{});
  EXPECT_EQ(arm.reexec_with, "");
  EXPECT_EQ(arm.warning, "");
}

TEST(BlasKernelTest, AnOpenblasBuiltForOneCpuCannotBeFixedAndSaysSo) {
  ExpectKeptWithWarning(Choose(Avx512Bf16(), OpenBlas("Haswell", /*dynamic=*/false), Environment{}),
                        "this OpenBLAS cannot switch to it (it is built for one CPU)");
  // A DYNAMIC_ARCH build without the better kernel.
  Library old = OpenBlas("Haswell");
  old.kernels = {"Haswell", "Prescott"};
  ExpectKeptWithWarning(Choose(Avx512Bf16(), old, Environment{}), "it does not hold that kernel");
}

TEST(BlasKernelTest, AnUnknownPolicyNamesTheVariableAndTheChoices) {
  EXPECT_EQ(*ParsePolicy(""), Policy::kAuto);
  EXPECT_EQ(*ParsePolicy("BEST"), Policy::kBest);
  EXPECT_EQ(*ParsePolicy("keep"), Policy::kKeep);
  const auto bad = ParsePolicy("fastest");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("STRATA_BLAS_KERNEL='fastest' is not a policy: use auto"),
            std::string::npos)
      << bad.status();
}

// cpuid and xgetbv against the flags Linux lists for this CPU (it lists AVX and AVX-512 only when
// it saves their registers, which is what DetectCpu checks with xgetbv).
TEST(BlasKernelTest, DetectCpuAgreesWithProcCpuinfo) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "cpuid is x86-64 only";
#endif
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) == 0) {
      for (auto w : absl::StrSplit(line.substr(line.find(':') + 1), ' ', absl::SkipEmpty())) {
        flags.insert(std::string(w));
      }
      break;
    }
  }
  if (flags.empty()) GTEST_SKIP() << "no flags line in /proc/cpuinfo";
  const CpuFeatures cpu = DetectCpu();
  EXPECT_EQ(cpu.sse3, flags.count("pni") == 1);
  EXPECT_EQ(cpu.avx, flags.count("avx") == 1);
  EXPECT_EQ(cpu.avx2, flags.count("avx2") == 1);
  EXPECT_EQ(cpu.fma, flags.count("fma") == 1);
  const bool avx512 = flags.count("avx512f") && flags.count("avx512cd") &&
                      flags.count("avx512bw") && flags.count("avx512dq") && flags.count("avx512vl");
  EXPECT_EQ(cpu.avx512, avx512);
  EXPECT_EQ(cpu.avx512_bf16, avx512 && flags.count("avx512_bf16") == 1);
}

// The row-count probe against another matrix, row counts and offsets than its own: rows [first,
// first + m) of a 40-row call computed again in an m-row call. Where any differ, the probe must
// report that rows depend on the row count (where all agree, either answer can be right).
TEST(BlasKernelTest, TheRowCountProbeAgreesWithOtherRowCounts) {
  constexpr int kK = 32, kN = 8;
  std::vector<float> a(40 * kK), b(kN * kK), full(40 * kN), part(40 * kN);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::cos(0.11f * static_cast<float>(i));
  cpu::GemmSerial<float>(false, true, 40, kN, kK, 1.f, a.data(), kK, b.data(), kK, 0.f, full.data(),
                         kN);
  int differ = 0;
  for (int m : {2, 7, 9, 13, 22, 31}) {
    for (int first : {0, 5, 40 - m}) {
      cpu::GemmSerial<float>(false, true, m, kN, kK, 1.f, a.data() + first * kK, kK, b.data(), kK,
                             0.f, part.data(), kN);
      differ += std::memcmp(part.data(), full.data() + first * kN, sizeof(float) * m * kN) != 0;
    }
  }
  const bool independent = SgemmRowsIndependentOfRowCount();
  std::printf("kernel %s: %d of 18 calls differ; the probe says %s\n",
              DetectLibrary().corename.c_str(), differ, independent ? "independent" : "dependent");
  if (differ > 0) {
    EXPECT_FALSE(independent);
  }
}

// The probe the benchmarks print checks its own result (-1 when wrong), so a positive rate is a
// correct GEMM. In a program whose main() does not call ChooseKernelAtStart (this test), the child
// probe refuses: the child would run the whole test program again.
TEST(BlasKernelTest, MeasureSgemmRunsARealGemmAndTheChildProbeNeedsTheStartHook) {
  const double g = MeasureSgemm(2, 128);
  EXPECT_GT(g, 0.0);
  EXPECT_LT(g, 1e6);
  std::string ran = "unset";
  EXPECT_EQ(MeasureSgemmInChild("", 1, 64, &ran), -1);
  EXPECT_EQ(ran, "");
}

}  // namespace
}  // namespace strata::blas
