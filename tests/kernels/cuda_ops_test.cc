// The CUDA backend against the CPU reference: every op of kernels/ops.h run on CUDA tensors and on
// CPU tensors from the same inputs (random, fixed seeds, built on the CPU and copied up), with the
// GPU results copied back and compared. Plus the device basics the backend stands on: budgeted
// device buffers and copies between host and GPU.
//
// Every test skips (GTEST_SKIP) where CudaDeviceCount() == 0: on machines without a GPU and in
// builds without CUDA, where this file still compiles.
//
// How results are compared. For a float tensor the error is normalized by the reference's scale:
//
//     err = max_i |gpu_i - cpu_i| / max(1e-30, max_i |cpu_i|)   and the test wants err <= bound.
//
// A NaN on the GPU side counts as an infinite error. Outputs the op overwrites start as NaN on the
// GPU (so an element the kernel fails to write fails the test); gradients the op accumulates into
// start from the same nonzero values on both sides (so overwrite-instead-of-accumulate fails).
// Integer outputs (top-k experts, dispatch plans, random routing) must be exactly equal. Scalars
// returned on the host (losses, sums) use the relative error |gpu - cpu| / max(1e-30, |cpu|).
//
//   op                                        bound   why
//   ----------------------------------------  ------  ------------------------------------------
//   MoePermuteForward                         0       a gather: a copy of the same floats
//   plan / top-k / counts / eligible / slot   exact   integer results of the same float inputs
//   EmbeddingForward, Add, Accumulate,        1e-5    pointwise; identical up to FMA contraction
//     Activation*, MoeJitter*, MoeNoisy*,             and the libm/CUDA exp, tanh, log1p (a few
//     MoeCombine*, MoePermuteBackward, AdamW          ulp); jitter and noise use the same
//                                                     counter-based draws in double
//   EmbeddingBackward, Norm*, CrossEntropy    1e-5    fp32 sums over at most a few thousand terms
//     dlogits, MoeRouterForward/Backward              in a different order
//   Linear*, Attention*,                      2e-5    fp32 GEMMs (cuBLAS without TF32: TF32 would
//     GroupedLinear* (fp32)                           be ~1e-3 and fail) over K <= 768, sums
//                                                     reordered
//   Linear*, GroupedLinear* with              1e-4    both sides round the same fp32 inputs to bf16
//     Context::bf16 (fp32 weights or bf16
//     compute copies)                                 and accumulate the exact bf16 products in
//                                                     fp32, so they differ by summation order only
//                                                     (~1e-6); a side that rounds a different
//                                                     operand (or not at all) is off by ~1e-3
//                                                     (bf16's 2^-9) and fails
//   RoundToBf16                               exact   the same rounding of the same floats
//   CrossEntropy, SumSquares, MoeAuxLoss,     1e-6    relative; both accumulate in double
//     MoeZLoss (returned scalars)
//
// Set STRATA_CUDA_OPS_VERBOSE=1 to print every comparison's error (to see the margins).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "core/common/rng.h"
#include "core/common/thread_pool.h"
#include "core/device/device.h"
#include "kernels/cpu/moe.h"
#include "kernels/ops.h"

// Skips the calling test where there is no GPU (and always in a build without CUDA).
#define REQUIRE_GPU()                   \
  if (::strata::CudaDeviceCount() == 0) \
  GTEST_SKIP() << "no CUDA device: this test runs on a machine with an NVIDIA GPU"

namespace strata {
namespace {

using ops::Activation;
using ops::NormKind;

constexpr double kExact = 0.0;
constexpr double kPointwise = 1e-5;
constexpr double kReduction = 1e-5;
constexpr double kGemm = 2e-5;
constexpr double kBf16 = 1e-4;
constexpr double kScalar = 1e-6;

Device Gpu() { return Device::Cuda(0); }

// ---- Tensors ---------------------------------------------------------------------------------

// A CPU tensor of normal(offset, scale) values.
Tensor RandomF32(Shape shape, uint64_t seed, double scale = 1.0, double offset = 0.0) {
  Tensor t = Tensor::Empty(shape, DType::kF32);
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(offset + scale * d(gen));
  return t;
}

// A CPU tensor of uniform values in [lo, hi).
Tensor UniformF32(Shape shape, uint64_t seed, double lo, double hi) {
  Tensor t = Tensor::Empty(shape, DType::kF32);
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(d(gen));
  return t;
}

// A CPU i32 tensor of uniform integers in [lo, hi).
Tensor RandomI32(Shape shape, int32_t lo, int32_t hi, uint64_t seed) {
  Tensor t = Tensor::Empty(shape, DType::kI32);
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi - 1);
  int32_t* p = t.i32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = d(gen);
  return t;
}

// A new CPU tensor with t's values (t on any device).
Tensor Clone(const Tensor& t) {
  Tensor c = Tensor::Empty(t.shape(), t.dtype());
  c.CopyFrom(t);
  return c;
}

// A copy of a CPU tensor on the GPU.
Tensor Up(const Tensor& cpu) {
  Tensor g = Tensor::Empty(cpu.shape(), cpu.dtype(), Gpu());
  g.CopyFrom(cpu);
  return g;
}

std::vector<Tensor> Up(const std::vector<Tensor>& cpu) {
  std::vector<Tensor> g;
  for (const Tensor& t : cpu) g.push_back(t.defined() ? Up(t) : Tensor());
  return g;
}

std::vector<Tensor> Clone(const std::vector<Tensor>& cpu) {
  std::vector<Tensor> c;
  for (const Tensor& t : cpu) c.push_back(t.defined() ? Clone(t) : Tensor());
  return c;
}

// A GPU tensor for an output the op must overwrite entirely: NaN (floats) or 0x5a5a5a5a (ints),
// so any element left unwritten shows up.
Tensor GpuGarbage(Shape shape, DType dtype = DType::kF32) {
  Tensor c = Tensor::Empty(shape, dtype);
  if (dtype == DType::kF32) {
    std::fill(c.f32(), c.f32() + c.numel(), std::numeric_limits<float>::quiet_NaN());
  } else {
    std::memset(c.raw_data(), 0x5a, c.bytes());
  }
  return Up(c);
}

// ---- Comparisons -----------------------------------------------------------------------------

bool Verbose() {
  const char* v = std::getenv("STRATA_CUDA_OPS_VERBOSE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

struct Error {
  double err = 0;   // max |got - want| / max(1e-30, max |want|)
  int64_t at = -1;  // where the largest difference is
  double got = 0, want = 0;
  double scale = 0;  // max |want|
};

// got on any device, want on the CPU; both f32 with the same number of elements.
Error NormalizedError(const Tensor& got, const Tensor& want) {
  const Tensor g = got.device().is_cpu() ? got : got.To(Device::Cpu());
  const float* a = g.f32();
  const float* b = want.f32();
  Error e;
  double worst = -1;
  for (int64_t i = 0; i < want.numel(); ++i) {
    e.scale = std::max(e.scale, std::abs(static_cast<double>(b[i])));
    double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > worst) {
      worst = d;
      e.at = i;
      e.got = a[i];
      e.want = b[i];
    }
  }
  e.err = std::max(worst, 0.0) / std::max(1e-30, e.scale);
  return e;
}

// Fails the test (and says where and by how much) unless got (GPU or CPU) is within `bound` of the
// CPU reference `want` in the normalized error above.
void ExpectClose(const Tensor& got, const Tensor& want, double bound, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_TRUE(want.device().is_cpu()) << what << ": the reference must be a CPU tensor";
  ASSERT_EQ(got.dtype(), DType::kF32) << what;
  ASSERT_EQ(want.dtype(), DType::kF32) << what;
  ASSERT_EQ(got.numel(), want.numel())
      << what << ": " << got.ShapeString() << " vs " << want.ShapeString();
  const Error e = NormalizedError(got, want);
  if (Verbose()) {
    std::printf("  %-50s err %.3g (bound %.3g) over %lld values\n", what.c_str(), e.err, bound,
                static_cast<long long>(want.numel()));
  }
  EXPECT_LE(e.err, bound) << what << ": worst at element " << e.at << " of " << want.ShapeString()
                          << ": gpu " << e.got << " cpu " << e.want << " (max |cpu| " << e.scale
                          << ")";
}

void ExpectClose(const std::vector<Tensor>& got, const std::vector<Tensor>& want, double bound,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].defined(), want[i].defined()) << what << "[" << i << "]";
    if (got[i].defined()) ExpectClose(got[i], want[i], bound, what + "[" + std::to_string(i) + "]");
  }
}

// Integer tensors, exactly: the first `count` elements (all when count < 0).
void ExpectEqualInts(const Tensor& got, const Tensor& want, const std::string& what,
                     int64_t count = -1) {
  ASSERT_EQ(got.dtype(), DType::kI32) << what;
  ASSERT_EQ(want.dtype(), DType::kI32) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (count < 0) count = want.numel();
  ASSERT_LE(count, want.numel()) << what;
  const Tensor g = got.device().is_cpu() ? got : got.To(Device::Cpu());
  const int32_t* a = g.i32();
  const int32_t* b = want.i32();
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < count; ++i) {
    if (a[i] != b[i]) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " of " << count << " differ; first at "
                           << first << ": gpu " << (first >= 0 ? a[first] : 0) << " cpu "
                           << (first >= 0 ? b[first] : 0);
}

void ExpectScalarClose(double got, double want, double bound, const std::string& what) {
  const double err = std::abs(got - want) / std::max(1e-30, std::abs(want));
  if (Verbose()) std::printf("  %-50s rel err %.3g (bound %.3g)\n", what.c_str(), err, bound);
  EXPECT_LE(err, bound) << what << ": gpu " << got << " cpu " << want;
  EXPECT_FALSE(std::isnan(got)) << what;
}

// Two results of the same GPU computation must be bit for bit the same (cuda_ops.h: no float
// atomics on any output).
void ExpectBitwiseEqual(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.bytes(), b.bytes()) << what;
  const Tensor x = a.To(Device::Cpu()), y = b.To(Device::Cpu());
  const auto* p = static_cast<const unsigned char*>(x.raw_data());
  const auto* q = static_cast<const unsigned char*>(y.raw_data());
  const size_t n = x.bytes();
  size_t first = n;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != q[i]) {
      first = i;
      break;
    }
  }
  EXPECT_EQ(first, n) << what << ": runs differ first at byte " << first << " (element "
                      << first / DTypeSize(a.dtype()) << ")";
}

// ---- The fixture -----------------------------------------------------------------------------

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    ctx.pool = &pool;
  }

  ThreadPool pool{4};
  ops::Context ctx;  // for both sides: CPU ops use the pool, GPU ops the thread's stream
};

// ---- Dense layers ----------------------------------------------------------------------------

TEST_F(CudaOpsTest, EmbeddingForwardAndBackward) {
  // EmbeddingForward: pointwise (1e-5). EmbeddingBackward: sums over repeated tokens (1e-5).
  for (int64_t C : {130, 768}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t B = 3, T = 17, V = 50, Tmax = 24;  // wpe longer than T
    Tensor tokens = RandomI32({B * T}, 0, V, 1);
    for (int i = 0; i < 12; ++i) tokens.i32()[3 * i] = 7;  // a heavily repeated token
    Tensor wte = RandomF32({V, C}, 2), wpe = RandomF32({Tmax, C}, 3);

    Tensor out_c = Tensor::Empty({B * T, C});
    ops::EmbeddingForward(ctx, out_c, tokens, wte, wpe, B, T);
    Tensor out_g = GpuGarbage({B * T, C});
    ops::EmbeddingForward(ctx, out_g, Up(tokens), Up(wte), Up(wpe), B, T);
    ExpectClose(out_g, out_c, kPointwise, "embedding out");

    Tensor dout = RandomF32({B * T, C}, 4);
    Tensor dwte0 = RandomF32({V, C}, 5, 0.1), dwpe0 = RandomF32({Tmax, C}, 6, 0.1);
    Tensor dwte_c = Clone(dwte0), dwpe_c = Clone(dwpe0);
    Tensor dwte_g = Up(dwte0), dwpe_g = Up(dwpe0);
    ops::EmbeddingBackward(ctx, dwte_c, dwpe_c, dout, tokens, B, T);
    ops::EmbeddingBackward(ctx, dwte_g, dwpe_g, Up(dout), Up(tokens), B, T);
    ExpectClose(dwte_g, dwte_c, kReduction, "dwte (accumulated)");
    ExpectClose(dwpe_g, dwpe_c, kReduction, "dwpe (accumulated; rows >= T untouched)");
  }
}

TEST_F(CudaOpsTest, NormForwardAndBackward) {
  // Row reductions over C: 1e-5 for out, mean, rstd and every gradient.
  struct Case {
    NormKind kind;
    bool bias;
    const char* name;
  };
  for (Case cs : {Case{NormKind::kLayerNorm, true, "layernorm"},
                  Case{NormKind::kLayerNorm, false, "layernorm without bias"},
                  Case{NormKind::kRmsNorm, false, "rmsnorm"}}) {
    for (int64_t C : {130, 768}) {
      SCOPED_TRACE(std::string(cs.name) + " C=" + std::to_string(C));
      const int64_t N = 64;
      const bool ln = cs.kind == NormKind::kLayerNorm;
      Tensor inp = RandomF32({N, C}, 10, 2.0, 0.5), w = RandomF32({C}, 11, 0.5, 1.0);
      Tensor b = cs.bias ? RandomF32({C}, 12) : Tensor();

      Tensor out_c = Tensor::Empty({N, C}), rstd_c = Tensor::Empty({N});
      Tensor mean_c = ln ? Tensor::Empty({N}) : Tensor();
      ops::NormForward(ctx, cs.kind, out_c, mean_c, rstd_c, inp, w, b, 1e-5f);
      Tensor out_g = GpuGarbage({N, C}), rstd_g = GpuGarbage({N});
      Tensor mean_g = ln ? GpuGarbage({N}) : Tensor();
      Tensor inp_g = Up(inp), w_g = Up(w), b_g = cs.bias ? Up(b) : Tensor();
      ops::NormForward(ctx, cs.kind, out_g, mean_g, rstd_g, inp_g, w_g, b_g, 1e-5f);
      ExpectClose(out_g, out_c, kReduction, "out");
      ExpectClose(rstd_g, rstd_c, kReduction, "rstd");
      if (ln) ExpectClose(mean_g, mean_c, kReduction, "mean");

      // Backward accumulates into dinp, dweight and dbias: start from nonzero values. Each side
      // uses its own saved statistics, as a model does.
      Tensor dout = RandomF32({N, C}, 13);
      Tensor dinp0 = RandomF32({N, C}, 14, 0.1), dw0 = RandomF32({C}, 15, 0.1);
      Tensor db0 = cs.bias ? RandomF32({C}, 16, 0.1) : Tensor();
      Tensor dinp_c = Clone(dinp0), dw_c = Clone(dw0), db_c = cs.bias ? Clone(db0) : Tensor();
      Tensor dinp_g = Up(dinp0), dw_g = Up(dw0), db_g = cs.bias ? Up(db0) : Tensor();
      ops::NormBackward(ctx, cs.kind, dinp_c, dw_c, db_c, dout, inp, w, mean_c, rstd_c);
      ops::NormBackward(ctx, cs.kind, dinp_g, dw_g, db_g, Up(dout), inp_g, w_g, mean_g, rstd_g);
      ExpectClose(dinp_g, dinp_c, kReduction, "dinp (accumulated)");
      ExpectClose(dw_g, dw_c, kReduction, "dweight (accumulated)");
      if (cs.bias) ExpectClose(db_g, db_c, kReduction, "dbias (accumulated)");
    }
  }
}

TEST_F(CudaOpsTest, LinearForwardAndBackward) {
  // cuBLAS fp32 GEMMs: 2e-5.
  for (auto [N, IC, OC] : {std::tuple<int64_t, int64_t, int64_t>{67, 100, 72},
                           std::tuple<int64_t, int64_t, int64_t>{512, 768, 2304}}) {
    for (bool has_bias : {true, false}) {
      SCOPED_TRACE("N=" + std::to_string(N) + " IC=" + std::to_string(IC) +
                   " OC=" + std::to_string(OC) + (has_bias ? " with bias" : " without bias"));
      Tensor inp = RandomF32({N, IC}, 20), w = RandomF32({OC, IC}, 21, 0.2);
      Tensor b = has_bias ? RandomF32({OC}, 22) : Tensor();
      Tensor inp_g = Up(inp), w_g = Up(w), b_g = has_bias ? Up(b) : Tensor();

      Tensor out_c = Tensor::Empty({N, OC});
      ops::LinearForward(ctx, out_c, inp, w, b);
      Tensor out_g = GpuGarbage({N, OC});
      ops::LinearForward(ctx, out_g, inp_g, w_g, b_g);
      ExpectClose(out_g, out_c, kGemm, "out");

      Tensor dout = RandomF32({N, OC}, 23);
      Tensor dout_g = Up(dout);
      Tensor dw0 = RandomF32({OC, IC}, 24, 0.1);
      Tensor db0 = has_bias ? RandomF32({OC}, 25, 0.1) : Tensor();
      Tensor dinp0 = RandomF32({N, IC}, 26, 0.1);
      enum Mode { kOverwrite, kAccumulate, kNoDinp };
      for (Mode mode : {kOverwrite, kAccumulate, kNoDinp}) {
        const char* mname = mode == kOverwrite    ? "dinp overwritten"
                            : mode == kAccumulate ? "dinp accumulated"
                                                  : "dinp undefined";
        SCOPED_TRACE(mname);
        const bool acc = mode == kAccumulate;
        Tensor dinp_c = mode == kNoDinp ? Tensor() : Clone(dinp0);
        Tensor dinp_g = mode == kNoDinp      ? Tensor()
                        : mode == kOverwrite ? GpuGarbage({N, IC})
                                             : Up(dinp0);
        Tensor dw_c = Clone(dw0), db_c = has_bias ? Clone(db0) : Tensor();
        Tensor dw_g = Up(dw0), db_g = has_bias ? Up(db0) : Tensor();
        ops::LinearBackward(ctx, dinp_c, dw_c, db_c, dout, inp, w, acc);
        ops::LinearBackward(ctx, dinp_g, dw_g, db_g, dout_g, inp_g, w_g, acc);
        if (mode != kNoDinp) ExpectClose(dinp_g, dinp_c, kGemm, "dinp");
        ExpectClose(dw_g, dw_c, kGemm, "dweight (accumulated)");
        if (has_bias) ExpectClose(db_g, db_c, kReduction, "dbias (accumulated)");
      }
    }
  }
}

// Mixed precision: a weight's compute copy is made on the GPU with the CPU's bits, and bf16 GEMMs
// on either kind of weight (fp32 rounded at use, or the copy) match the CPU's emulation at 1e-4.
TEST_F(CudaOpsTest, Bf16ComputeCopiesAndGemms) {
  {
    Tensor src = RandomF32({1000, 77}, 90, 3.0);
    Tensor c = Tensor::Empty({1000, 77}, DType::kBF16);
    ops::RoundToBf16(ctx, c, src);
    Tensor g = Tensor::Empty({1000, 77}, DType::kBF16, Device::Cuda(0));
    ops::RoundToBf16(ctx, g, Up(src));
    std::vector<uint16_t> back(static_cast<size_t>(g.numel()));
    g.CopyToHost(back.data());
    EXPECT_EQ(0, std::memcmp(back.data(), c.bf16(), c.bytes())) << "RoundToBf16";
    // Many arrays in one kernel (a model's copies), of sizes around the kernel's block and grid.
    std::vector<Tensor> srcs, dsts_c, srcs_g, dsts_g;
    for (int64_t n : {1, 255, 256, 257, 300000, 3}) {
      srcs.push_back(RandomF32({n}, 100 + n, 2.0));
      dsts_c.push_back(Tensor::Empty({n}, DType::kBF16));
      srcs_g.push_back(Up(srcs.back()));
      dsts_g.push_back(Tensor::Empty({n}, DType::kBF16, Device::Cuda(0)));
    }
    ops::RoundToBf16(ctx, dsts_c, srcs);
    ops::RoundToBf16(ctx, dsts_g, srcs_g);
    for (size_t t = 0; t < srcs.size(); ++t) {
      std::vector<uint16_t> got(static_cast<size_t>(dsts_g[t].numel()));
      dsts_g[t].CopyToHost(got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), dsts_c[t].bf16(), dsts_c[t].bytes())) << "array " << t;
    }
  }
  ops::Context c = ctx;
  c.bf16 = true;
  const int64_t N = 300, IC = 256, OC = 96;
  Tensor inp = RandomF32({N, IC}, 91), w = RandomF32({OC, IC}, 92, 0.2), b = RandomF32({OC}, 93);
  Tensor dout = RandomF32({N, OC}, 94);
  Tensor out_c = Tensor::Empty({N, OC}), dinp_c = Tensor::Empty({N, IC});
  Tensor dw_c = Tensor::Zeros({OC, IC}), db_c = Tensor::Zeros({OC});
  ops::LinearForward(c, out_c, inp, w, b);
  ops::LinearBackward(c, dinp_c, dw_c, db_c, dout, inp, w, false);
  Tensor w_g = Up(w);
  Tensor w16_g = Tensor::Empty({OC, IC}, DType::kBF16, Device::Cuda(0));
  ops::RoundToBf16(c, w16_g, w_g);
  for (const Tensor& weight : {w_g, w16_g}) {
    SCOPED_TRACE(weight.dtype() == DType::kBF16 ? "bf16 compute copy" : "fp32 rounded at use");
    Tensor out_g = GpuGarbage({N, OC}), dinp_g = GpuGarbage({N, IC});
    Tensor dw_g = Up(Tensor::Zeros({OC, IC})), db_g = Up(Tensor::Zeros({OC}));
    ops::LinearForward(c, out_g, Up(inp), weight, Up(b));
    ops::LinearBackward(c, dinp_g, dw_g, db_g, Up(dout), Up(inp), weight, false);
    ExpectClose(out_g, out_c, kBf16, "out");
    ExpectClose(dinp_g, dinp_c, kBf16, "dinp");
    ExpectClose(dw_g, dw_c, kBf16, "dweight");
    ExpectClose(db_g, db_c, kReduction, "dbias (fp32 sums of the fp32 dout)");
    // dinp accumulated, without a weight gradient (the other size of the operand scratch).
    Tensor acc_c = Clone(dinp_c), acc_g = Up(dinp_c);
    ops::LinearBackward(c, acc_c, Tensor(), Tensor(), dout, inp, w, /*accumulate_dinp=*/true);
    ops::LinearBackward(c, acc_g, Tensor(), Tensor(), Up(dout), Up(inp), weight, true);
    ExpectClose(acc_g, acc_c, kBf16, "dinp accumulated, no dweight");
  }
  {
    // In place (dinp is inp), as an FFN's backward writes d(act) over act: the input is rounded
    // for dW before dinp overwrites it.
    const int64_t n = 200, ic = 160;
    Tensor x = RandomF32({n, ic}, 120), sq = RandomF32({ic, ic}, 121, 0.2);
    Tensor dy = RandomF32({n, ic}, 122);
    Tensor io_c = Clone(x), dw_sq_c = Tensor::Zeros({ic, ic});
    ops::LinearBackward(c, io_c, dw_sq_c, Tensor(), dy, io_c, sq, false);
    Tensor sq16 = Tensor::Empty({ic, ic}, DType::kBF16, Device::Cuda(0));
    ops::RoundToBf16(c, sq16, Up(sq));
    Tensor io_g = Up(x), dw_sq_g = Up(Tensor::Zeros({ic, ic}));
    ops::LinearBackward(c, io_g, dw_sq_g, Tensor(), Up(dy), io_g, sq16, false);
    ExpectClose(io_g, io_c, kBf16, "dinp (in place)");
    ExpectClose(dw_sq_g, dw_sq_c, kBf16, "dweight (in place)");
  }
  // The experts' grouped GEMMs on compute copies.
  const std::vector<int64_t> offsets = {0, 100, 100, 300};
  std::vector<Tensor> ws, ws16_g, dws_c, dws_g;
  for (int g = 0; g < 3; ++g) {
    ws.push_back(RandomF32({OC, IC}, 95 + g, 0.2));
    ws16_g.push_back(Tensor::Empty({OC, IC}, DType::kBF16, Device::Cuda(0)));
    ops::RoundToBf16(c, ws16_g.back(), Up(ws.back()));
    dws_c.push_back(Tensor::Zeros({OC, IC}));
    dws_g.push_back(Up(Tensor::Zeros({OC, IC})));
  }
  Tensor gout_c = Tensor::Empty({N, OC}), gout_g = GpuGarbage({N, OC});
  ops::GroupedLinearForward(c, gout_c, inp, ws, offsets);
  ops::GroupedLinearForward(c, gout_g, Up(inp), ws16_g, offsets);
  ExpectClose(gout_g, gout_c, kBf16, "grouped out");
  Tensor gdinp_c = Tensor::Empty({N, IC}), gdinp_g = GpuGarbage({N, IC});
  ops::GroupedLinearBackward(c, gdinp_c, dws_c, dout, inp, ws, offsets, false);
  ops::GroupedLinearBackward(c, gdinp_g, dws_g, Up(dout), Up(inp), ws16_g, offsets, false);
  ExpectClose(gdinp_g, gdinp_c, kBf16, "grouped dinp");
  ExpectClose(dws_g, dws_c, kBf16, "grouped dweights");
}

TEST_F(CudaOpsTest, GroupedLinearForwardAndBackward) {
  // fp32: 2e-5 (cuBLAS GEMMs). Context::bf16 on both sides: 1e-4 (same bf16 operands, fp32
  // accumulation, only the summation order differs; see the table at the top).
  struct Case {
    std::vector<int64_t> rows;  // per group; zeros are empty groups
    int64_t IC, OC;
    int undefined_dweight;  // this group's dweight is left undefined
  };
  const std::vector<Case> cases = {
      {{13, 0, 40, 1, 27}, 100, 72, 3},
      {{0, 17, 33, 0}, 64, 130, 2},
      {{128, 0, 300, 77}, 768, 256, 0},
      {{50, 90, 0, 31}, 96, 96, -1},  // IC == OC: also in place
  };
  for (const Case& cs : cases) {
    const int64_t G = static_cast<int64_t>(cs.rows.size());
    std::vector<int64_t> offsets = {0};
    for (int64_t r : cs.rows) offsets.push_back(offsets.back() + r);
    const int64_t R = offsets.back(), IC = cs.IC, OC = cs.OC;
    Tensor inp = RandomF32({R, IC}, 30);
    std::vector<Tensor> w;
    for (int64_t g = 0; g < G; ++g) w.push_back(RandomF32({OC, IC}, 31 + g, 0.2));
    Tensor dout = RandomF32({R, OC}, 40), dinp0 = RandomF32({R, IC}, 41, 0.1);
    std::vector<Tensor> dw0;
    for (int64_t g = 0; g < G; ++g) {
      dw0.push_back(g == cs.undefined_dweight ? Tensor() : RandomF32({OC, IC}, 50 + g, 0.1));
    }
    Tensor inp_g = Up(inp), dout_g = Up(dout);
    std::vector<Tensor> w_g = Up(w);

    Tensor fp32_out;  // the CPU's fp32 result, to see that bf16 changes something
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE("R=" + std::to_string(R) + " G=" + std::to_string(G) + " IC=" +
                   std::to_string(IC) + " OC=" + std::to_string(OC) + (bf16 ? " bf16" : " fp32"));
      ops::Context c = ctx;
      c.bf16 = bf16;
      const double bound = bf16 ? kBf16 : kGemm;

      Tensor out_c = Tensor::Empty({R, OC});
      ops::GroupedLinearForward(c, out_c, inp, w, offsets);
      Tensor out_g = GpuGarbage({R, OC});
      ops::GroupedLinearForward(c, out_g, inp_g, w_g, offsets);
      ExpectClose(out_g, out_c, bound, "out");
      if (!bf16) {
        fp32_out = out_c;
      } else {
        // The CPU's bf16 emulation is visible but small: bf16 has 8 significant bits.
        const double d = NormalizedError(out_c, fp32_out).err;
        EXPECT_GT(d, 1e-5) << "Context::bf16 changed nothing on the CPU";
        EXPECT_LT(d, 2e-2) << "Context::bf16 changed the CPU result by more than bf16 rounding";
      }

      enum Mode { kOverwrite, kAccumulate, kNoDinp };
      for (Mode mode : {kOverwrite, kAccumulate, kNoDinp}) {
        const char* mname = mode == kOverwrite    ? "dinp overwritten"
                            : mode == kAccumulate ? "dinp accumulated"
                                                  : "dinp undefined";
        SCOPED_TRACE(mname);
        const bool acc = mode == kAccumulate;
        Tensor dinp_c = mode == kNoDinp ? Tensor() : Clone(dinp0);
        Tensor dinp_g = mode == kNoDinp      ? Tensor()
                        : mode == kOverwrite ? GpuGarbage({R, IC})
                                             : Up(dinp0);
        std::vector<Tensor> dw_c = Clone(dw0), dw_g = Up(dw0);
        ops::GroupedLinearBackward(c, dinp_c, dw_c, dout, inp, w, offsets, acc);
        ops::GroupedLinearBackward(c, dinp_g, dw_g, dout_g, inp_g, w_g, offsets, acc);
        if (mode != kNoDinp) ExpectClose(dinp_g, dinp_c, bound, "dinp");
        // Empty groups' dweights must come back unchanged (+= nothing).
        ExpectClose(dw_g, dw_c, bound, "dweights (accumulated)");
      }
      if (IC == OC) {
        // In place, as a layer reusing its input buffer for the input gradient: every dW must
        // read inp before any dinp overwrites it.
        SCOPED_TRACE("dinp aliasing inp");
        Tensor io_c = Clone(inp), io_g = Up(inp);
        std::vector<Tensor> dw_c = Clone(dw0), dw_g = Up(dw0);
        ops::GroupedLinearBackward(c, io_c, dw_c, dout, io_c, w, offsets, false);
        ops::GroupedLinearBackward(c, io_g, dw_g, dout_g, io_g, w_g, offsets, false);
        ExpectClose(io_g, io_c, bound, "dinp (in place)");
        ExpectClose(dw_g, dw_c, bound, "dweights (in place)");
      }
    }
  }
}

TEST_F(CudaOpsTest, AttentionForwardAndBackward) {
  // Softmax + two GEMMs per head: 2e-5 for out, att and dqkv.
  struct Case {
    int64_t B, T, C, NH;
  };
  for (Case cs : {Case{2, 33, 64, 4}, Case{1, 128, 384, 6}, Case{2, 65, 96, 3}}) {
    const int64_t B = cs.B, T = cs.T, C = cs.C, NH = cs.NH;
    SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
                 " NH=" + std::to_string(NH));
    Tensor qkv = RandomF32({B * T, 3 * C}, 60);
    Tensor qkv_g = Up(qkv);
    Tensor out_c = Tensor::Empty({B * T, C}), att_c = Tensor::Empty({B, NH, T, T});
    ops::AttentionForward(ctx, out_c, att_c, qkv, B, T, NH);
    // att starts as NaN on the GPU: backward must not read what forward did not write.
    Tensor out_g = GpuGarbage({B * T, C}), att_g = GpuGarbage({B, NH, T, T});
    ops::AttentionForward(ctx, out_g, att_g, qkv_g, B, T, NH);
    ExpectClose(out_g, out_c, kGemm, "out");
    // The saved probabilities, zero above the diagonal on both backends (kernels/cpu/attention.h;
    // the GPU writes the zeros too, so nothing of att is left as NaN).
    ExpectClose(att_g, att_c, kGemm, "att");

    Tensor dout = RandomF32({B * T, C}, 61);
    Tensor dqkv_c = Tensor::Empty({B * T, 3 * C});
    ops::AttentionBackward(ctx, dqkv_c, dout, qkv, att_c, B, T, NH);
    Tensor dqkv_g = GpuGarbage({B * T, 3 * C});
    ops::AttentionBackward(ctx, dqkv_g, Up(dout), qkv_g, att_g, B, T, NH);
    ExpectClose(dqkv_g, dqkv_c, kGemm, "dqkv (overwritten)");
  }
}

TEST_F(CudaOpsTest, AttentionDecodeAndEmbeddingAtPositions) {
  // A dot product per key, a softmax and a weighted sum per channel, like AttentionForward: 2e-5
  // for out, and the cache rows are copies (bitwise). EmbeddingForwardAt is pointwise (1e-5).
  struct Case {
    int64_t S, Tmax, C, NH, N;
  };
  // Positions up to Tmax - 1 (299: the softmax loops wrap a 128-thread block) and a head of 192
  // channels (the value loop wraps too); scores in the backend's scratch or in a given buffer.
  for (Case cs : {Case{3, 40, 64, 4, 50}, Case{2, 300, 384, 2, 7}, Case{4, 17, 96, 3, 4}}) {
    const int64_t S = cs.S, Tmax = cs.Tmax, C = cs.C, NH = cs.NH, N = cs.N;
    SCOPED_TRACE("S=" + std::to_string(S) + " Tmax=" + std::to_string(Tmax) +
                 " C=" + std::to_string(C) + " N=" + std::to_string(N));
    // A cache already holding positions [0, held) of every slot, then N rows: each slot's next
    // positions, up to the cache's end, the slots' rows interleaved.
    const int64_t held = Tmax - (N + S - 1) / S;
    Tensor k_c = RandomF32({S, Tmax, C}, 70), v_c = RandomF32({S, Tmax, C}, 71);
    Tensor k_g = Up(k_c), v_g = Up(v_c);
    Tensor slots = Tensor::Empty({N}, DType::kI32), positions = Tensor::Empty({N}, DType::kI32);
    std::vector<int64_t> next(static_cast<size_t>(S), held);
    for (int64_t i = 0; i < N; ++i) {
      slots.i32()[i] = static_cast<int32_t>(i % S);
      positions.i32()[i] = static_cast<int32_t>(next[i % S]++);
    }
    Tensor qkv = RandomF32({N, 3 * C}, 72);
    Tensor out_c = Tensor::Empty({N, C});
    ops::AttentionDecode(ctx, out_c, qkv, k_c, v_c, slots, positions, NH);
    Tensor out_g = GpuGarbage({N, C});
    const Tensor scores = S == 2 ? GpuGarbage({N * NH * Tmax}) : Tensor();
    ops::AttentionDecode(ctx, out_g, Up(qkv), k_g, v_g, Up(slots), Up(positions), NH, scores);
    ExpectClose(out_g, out_c, kGemm, "decode out");
    ExpectBitwiseEqual(k_g, Up(k_c), "k cache");
    ExpectBitwiseEqual(v_g, Up(v_c), "v cache");

    const int64_t V = 50;
    Tensor tokens = RandomI32({N}, 0, V, 73);
    Tensor wte = RandomF32({V, C}, 74), wpe = RandomF32({Tmax, C}, 75);
    Tensor emb_c = Tensor::Empty({N, C});
    ops::EmbeddingForwardAt(ctx, emb_c, tokens, positions, wte, wpe);
    Tensor emb_g = GpuGarbage({N, C});
    ops::EmbeddingForwardAt(ctx, emb_g, Up(tokens), Up(positions), Up(wte), Up(wpe));
    ExpectClose(emb_g, emb_c, kPointwise, "embedding at positions");
  }
}

const char* ActName(Activation act) {
  return act == Activation::kGelu ? "gelu" : act == Activation::kRelu ? "relu" : "swiglu";
}

TEST_F(CudaOpsTest, Activations) {
  // Pointwise (1e-5); dbias sums over N rows (1e-5).
  for (Activation act : {Activation::kGelu, Activation::kRelu, Activation::kSwiglu}) {
    for (int64_t H : {130, 1024}) {
      SCOPED_TRACE(std::string(ActName(act)) + " H=" + std::to_string(H));
      const int64_t N = 67, W = ops::ActivationInputWidth(act, H);
      Tensor inp = RandomF32({N, W}, 70, 1.5);
      Tensor inp_g = Up(inp);

      Tensor out_c = Tensor::Empty({N, H});
      ops::ActivationForward(ctx, act, out_c, inp);
      Tensor out_g = GpuGarbage({N, H});
      ops::ActivationForward(ctx, act, out_g, inp_g);
      ExpectClose(out_g, out_c, kPointwise, "forward out");

      // Fused bias: pre += bias in place, out = act(pre).
      Tensor bias = RandomF32({W}, 71);
      Tensor pre_c = Clone(inp), pre_g = Up(inp);
      Tensor bout_c = Tensor::Empty({N, H});
      ops::BiasActivationForward(ctx, act, bout_c, pre_c, bias);
      Tensor bout_g = GpuGarbage({N, H});
      ops::BiasActivationForward(ctx, act, bout_g, pre_g, Up(bias));
      ExpectClose(bout_g, bout_c, kPointwise, "bias forward out");
      ExpectClose(pre_g, pre_c, kPointwise, "bias forward pre (+= bias)");

      Tensor dout = RandomF32({N, H}, 72);
      Tensor dout_g = Up(dout);
      // Without dbias, dinp separate and overwritten.
      Tensor dinp_c = Tensor::Empty({N, W});
      ops::ActivationBackward(ctx, act, dinp_c, dout, inp);
      Tensor dinp_g = GpuGarbage({N, W});
      ops::ActivationBackward(ctx, act, dinp_g, dout_g, inp_g);
      ExpectClose(dinp_g, dinp_c, kPointwise, "dinp");

      // With dbias (accumulated from nonzero), on the biased pre-activation.
      Tensor dbias0 = RandomF32({W}, 73, 0.1);
      Tensor dbias_c = Clone(dbias0), dbias_g = Up(dbias0);
      Tensor dpre_c = Tensor::Empty({N, W});
      ops::ActivationBackward(ctx, act, dpre_c, dout, pre_c, dbias_c);
      Tensor dpre_g = GpuGarbage({N, W});
      ops::ActivationBackward(ctx, act, dpre_g, dout_g, pre_g, dbias_g);
      ExpectClose(dpre_g, dpre_c, kPointwise, "dinp with dbias");
      ExpectClose(dbias_g, dbias_c, kReduction, "dbias (accumulated)");

      // In place (dinp == inp), with and without dbias.
      for (bool with_dbias : {false, true}) {
        SCOPED_TRACE(with_dbias ? "in place with dbias" : "in place");
        Tensor ip_c = Clone(pre_c), ip_g = Up(pre_c);
        Tensor db_c = with_dbias ? Clone(dbias0) : Tensor();
        Tensor db_g = with_dbias ? Up(dbias0) : Tensor();
        ops::ActivationBackward(ctx, act, ip_c, dout, ip_c, db_c);
        ops::ActivationBackward(ctx, act, ip_g, dout_g, ip_g, db_g);
        ExpectClose(ip_g, ip_c, kPointwise, "in-place dinp");
        ExpectClose(ip_g, dpre_c, kPointwise, "in-place dinp vs separate (cpu)");
        if (with_dbias) ExpectClose(db_g, db_c, kReduction, "in-place dbias (accumulated)");
      }
    }
  }
}

TEST_F(CudaOpsTest, AddAndAccumulate) {
  // Pointwise: 1e-5 (the sums are the same float additions; expected exact).
  const int64_t n = (1 << 20) + 3;  // a tail after any vector width
  Tensor a = RandomF32({n}, 80), b = RandomF32({n}, 81);
  Tensor out_c = Tensor::Empty({n});
  ops::Add(ctx, out_c, a, b);
  Tensor a_g = Up(a), b_g = Up(b);
  Tensor out_g = GpuGarbage({n});
  ops::Add(ctx, out_g, a_g, b_g);
  ExpectClose(out_g, out_c, kPointwise, "add");
  {
    Tensor x = Up(a);
    ops::Add(ctx, x, x, b_g);  // out aliases a
    ExpectClose(x, out_c, kPointwise, "add, out aliasing a");
    Tensor y = Up(b);
    ops::Add(ctx, y, a_g, y);  // out aliases b
    ExpectClose(y, out_c, kPointwise, "add, out aliasing b");
  }
  Tensor acc0 = RandomF32({n}, 82);
  Tensor acc_c = Clone(acc0), acc_g = Up(acc0);
  ops::Accumulate(ctx, acc_c, a);
  ops::Accumulate(ctx, acc_g, a_g);
  ExpectClose(acc_g, acc_c, kPointwise, "accumulate");
}

TEST_F(CudaOpsTest, AddBiasAndBiasGrad) {
  // AddBias pointwise: 1e-5. BiasGrad a column reduction: 1e-5, onto nonzero initial values.
  const int64_t N = 1037, C = 261;
  Tensor out0 = RandomF32({N, C}, 83), bias = RandomF32({C}, 84);
  Tensor out_c = Clone(out0), out_g = Up(out0);
  ops::AddBias(ctx, out_c, bias);
  ops::AddBias(ctx, out_g, Up(bias));
  ExpectClose(out_g, out_c, kPointwise, "add bias");
  Tensor db0 = RandomF32({C}, 85);
  Tensor db_c = Clone(db0), db_g = Up(db0);
  ops::BiasGrad(ctx, db_c, out0);
  ops::BiasGrad(ctx, db_g, Up(out0));
  ExpectClose(db_g, db_c, kReduction, "bias grad (accumulated)");
}

TEST_F(CudaOpsTest, PointwiseOpsOnUnalignedViews) {
  // Layers pass views (Rows of odd-width tensors) whose data do not start on a 16-byte boundary;
  // vectorised kernels must handle them and must not write outside the view. 1e-5.
  const int64_t n = 100003;
  Tensor a = RandomF32({n + 3}, 83), b = RandomF32({n + 3}, 84), out0 = RandomF32({n + 3}, 85);
  Tensor out_c = Clone(out0), out_g = Up(out0), a_g = Up(a), b_g = Up(b);
  ops::Add(ctx, out_c.View(2, {n}), a.View(1, {n}), b.View(3, {n}));
  ops::Add(ctx, out_g.View(2, {n}), a_g.View(1, {n}), b_g.View(3, {n}));
  ExpectClose(out_g, out_c, kPointwise, "add on views (whole buffer)");
  ops::Accumulate(ctx, out_c.View(1, {n}), a.View(3, {n}));
  ops::Accumulate(ctx, out_g.View(1, {n}), a_g.View(3, {n}));
  ExpectClose(out_g, out_c, kPointwise, "accumulate on views (whole buffer)");

  // An activation over rows 1.. of an odd-width tensor, written into rows 1.. of another.
  const int64_t N = 33, H = 129;
  Tensor x = RandomF32({N, H}, 86), y0 = RandomF32({N, H}, 87);
  Tensor y_c = Clone(y0), y_g = Up(y0), x_g = Up(x);
  ops::ActivationForward(ctx, Activation::kGelu, y_c.Rows(1, N), x.Rows(1, N));
  ops::ActivationForward(ctx, Activation::kGelu, y_g.Rows(1, N), x_g.Rows(1, N));
  ExpectClose(y_g, y_c, kPointwise, "gelu on row views (whole buffer)");
}

TEST_F(CudaOpsTest, CrossEntropy) {
  // Loss: relative 1e-6 (per-row float losses summed in double). dlogits: pointwise on softmax
  // (1e-5).
  for (int64_t V : {1000, 5003}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    const int64_t N = 37;
    const float scale = 1.0f / N;
    Tensor logits = RandomF32({N, V}, 90, 2.0), targets = RandomI32({N}, 0, V, 91);
    Tensor dl_c = Tensor::Empty({N, V});
    const double loss_c = ops::CrossEntropy(ctx, dl_c, logits, targets, scale);
    Tensor logits_g = Up(logits), targets_g = Up(targets);

    const double loss_nodl = ops::CrossEntropy(ctx, Tensor(), logits_g, targets_g, scale);
    ExpectScalarClose(loss_nodl, loss_c, kScalar, "loss without dlogits");
    ExpectClose(logits_g, logits, kExact, "logits untouched without dlogits");

    Tensor dl_g = GpuGarbage({N, V});
    const double loss_g = ops::CrossEntropy(ctx, dl_g, logits_g, targets_g, scale);
    ExpectScalarClose(loss_g, loss_c, kScalar, "loss with dlogits");
    ExpectClose(dl_g, dl_c, kPointwise, "dlogits");

    Tensor alias_g = Up(logits);
    const double loss_alias = ops::CrossEntropy(ctx, alias_g, alias_g, targets_g, scale);
    ExpectScalarClose(loss_alias, loss_c, kScalar, "loss with dlogits aliasing logits");
    ExpectClose(alias_g, dl_c, kPointwise, "dlogits aliasing logits");
  }
}

// ---- Optimizer -------------------------------------------------------------------------------

TEST_F(CudaOpsTest, AdamW) {
  // Pointwise: 1e-5 on param, m and v after three steps. A wrong weight decay or bias correction
  // moves param by ~lr * 0.1 = 1e-3 of its scale and fails.
  const int64_t n = 100003;
  Tensor p0 = RandomF32({n}, 100), m0 = RandomF32({n}, 101, 1e-3);
  Tensor v0 = UniformF32({n}, 102, 0.0, 1e-5);
  Tensor p_c = Clone(p0), m_c = Clone(m0), v_c = Clone(v0);
  Tensor p_g = Up(p0), m_g = Up(m0), v_g = Up(v0);
  ops::AdamWHyper h;
  h.lr = 1e-2;
  h.beta1 = 0.9;
  h.beta2 = 0.95;
  h.eps = 1e-8;
  h.weight_decay = 0.1;
  h.grad_scale = 0.7;
  for (int step = 1; step <= 3; ++step) {
    Tensor g = RandomF32({n}, 110 + step, 0.01);
    h.step = step;
    ops::AdamW(ctx, p_c, g, m_c, v_c, h);
    ops::AdamW(ctx, p_g, Up(g), m_g, v_g, h);
  }
  ExpectClose(p_g, p_c, kPointwise, "param");
  ExpectClose(m_g, m_c, kPointwise, "m");
  ExpectClose(v_g, v_c, kPointwise, "v");
}

TEST_F(CudaOpsTest, SumSquares) {
  // Relative 1e-6 (both accumulate in double).
  for (int64_t n : {1, 33, 4097, 3000017}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    Tensor x = RandomF32({n}, 120);
    ExpectScalarClose(ops::SumSquares(ctx, Up(x)), ops::SumSquares(ctx, x), kScalar,
                      "sum of squares");
  }
}

// ---- Mixture of Experts ----------------------------------------------------------------------

// Router logits [T, E] with ties: row 0 all equal (top-k is experts 0..k-1), row 1 with experts 3
// and 5 tied for first (top-2 is 3, 5).
Tensor RouterLogits(int64_t T, int64_t E, uint64_t seed) {
  Tensor l = RandomF32({T, E}, seed, 2.0);
  for (int64_t e = 0; e < E; ++e) {
    l.f32()[e] = 0.0f;
    l.f32()[E + e] = -1.0f;
  }
  l.f32()[E + 3] = 4.0f;
  l.f32()[E + 5] = 4.0f;
  return l;
}

struct Router {
  Tensor probs, lse, idx, w;
};

Router CpuRouter(ops::Context& ctx, const Tensor& logits, int k, bool renorm) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  Router r{Tensor::Empty({T, E}), Tensor::Empty({T}), Tensor::Empty({T, k}, DType::kI32),
           Tensor::Empty({T, k})};
  ops::MoeRouterForward(ctx, r.probs, r.lse, r.idx, r.w, logits, renorm);
  return r;
}

TEST_F(CudaOpsTest, MoeRouterForward) {
  // probs, lse, topk_weight: 1e-5 (softmax over E). topk_expert: exact (ties: lower id first).
  const int64_t T = 300;
  for (int64_t E : {8, 64}) {
    for (int k : {1, 2}) {
      for (bool renorm : {false, true}) {
        SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) +
                     (renorm ? " renormalized" : ""));
        Tensor logits = RouterLogits(T, E, 130 + E + k);
        Router c = CpuRouter(ctx, logits, k, renorm);
        Router g{GpuGarbage({T, E}), GpuGarbage({T}), GpuGarbage({T, k}, DType::kI32),
                 GpuGarbage({T, k})};
        ops::MoeRouterForward(ctx, g.probs, g.lse, g.idx, g.w, Up(logits), renorm);
        ExpectClose(g.probs, c.probs, kReduction, "probs");
        ExpectClose(g.lse, c.lse, kReduction, "lse");
        ExpectEqualInts(g.idx, c.idx, "topk_expert");
        ExpectClose(g.w, c.w, kReduction, "topk_weight");
        // The ties resolve by expert id on the CPU (the reference the GPU matched above).
        EXPECT_EQ(c.idx.i32()[0], 0);
        EXPECT_EQ(c.idx.i32()[k], 3);
        if (k == 2) {
          EXPECT_EQ(c.idx.i32()[k + 1], 5);
        }
      }
    }
  }
}

TEST_F(CudaOpsTest, MoeAuxLossAndZLoss) {
  // Counts exact; the losses relative 1e-6 (double accumulation of the same float inputs).
  const int64_t T = 300;
  for (int64_t E : {8, 64}) {
    for (int k : {1, 2}) {
      SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k));
      Router c = CpuRouter(ctx, RouterLogits(T, E, 140 + E + k), k, true);
      std::vector<int64_t> counts_c, counts_g = {-1, -1, -1};
      const double aux_c = ops::MoeAuxLoss(ctx, c.probs, c.idx, &counts_c);
      const double aux_g = ops::MoeAuxLoss(ctx, Up(c.probs), Up(c.idx), &counts_g);
      EXPECT_EQ(counts_g, counts_c) << "top-1 counts";
      ExpectScalarClose(aux_g, aux_c, kScalar, "aux loss");
      ExpectScalarClose(ops::MoeZLoss(ctx, Up(c.lse)), ops::MoeZLoss(ctx, c.lse), kScalar,
                        "z loss");
    }
  }
}

TEST_F(CudaOpsTest, MoeRouterBackward) {
  // dlogits (overwritten): softmax backward over E, 1e-5. Both sides get the same saved
  // probabilities, experts and counts (the CPU router's).
  const int64_t T = 300;
  for (int64_t E : {8, 64}) {
    for (int k : {1, 2}) {
      for (bool renorm : {false, true}) {
        SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) +
                     (renorm ? " renormalized" : ""));
        Router c = CpuRouter(ctx, RouterLogits(T, E, 150 + E + k), k, renorm);
        std::vector<int64_t> counts;
        ops::MoeAuxLoss(ctx, c.probs, c.idx, &counts);
        Tensor dweight = RandomF32({T, k}, 151);
        const float aux_coef = 0.3f, z_coef = 0.07f;
        Tensor dl_c = Tensor::Empty({T, E});
        ops::MoeRouterBackward(ctx, dl_c, dweight, c.probs, c.lse, c.idx, counts, renorm, aux_coef,
                               z_coef);
        Tensor dl_g = GpuGarbage({T, E});
        ops::MoeRouterBackward(ctx, dl_g, Up(dweight), Up(c.probs), Up(c.lse), Up(c.idx), counts,
                               renorm, aux_coef, z_coef);
        ExpectClose(dl_g, dl_c, kReduction, "dlogits");
      }
    }
  }
}

// Today's router options (MoeRouterSpec) against the CPU: sigmoid or softmax scores, a selection
// bias, groups, k up to 8, normalised and scaled weights; then the backward with a balancing
// gradient per sequence of 7 tokens (score_grad rows) and the z-loss. Tolerances as above;
// experts exact (random logits: no ties).
TEST_F(CudaOpsTest, MoeRouterSpecForwardAndBackward) {
  const int64_t T = 300;
  struct SpecCase {
    int64_t E;
    ops::MoeRouterSpec spec;
    bool bias;
  };
  std::vector<SpecCase> cases;
  for (bool sigmoid : {false, true}) {
    ops::MoeRouterSpec s;
    s.sigmoid = sigmoid;
    s.k = 8;
    s.renormalize = true;
    s.scaling = 2.5f;
    cases.push_back({64, s, true});  // no groups
    s.num_groups = 8;
    s.topk_groups = 4;
    cases.push_back({64, s, true});  // DeepSeek-V3's shape of router
    s.k = 2;
    s.renormalize = false;
    s.scaling = 1.0f;
    s.num_groups = 4;
    s.topk_groups = 1;
    cases.push_back({8, s, false});
  }
  for (const SpecCase& sc : cases) {
    const ops::MoeRouterSpec& spec = sc.spec;
    SCOPED_TRACE("E=" + std::to_string(sc.E) + " k=" + std::to_string(spec.k) +
                 (spec.sigmoid ? " sigmoid" : " softmax") +
                 " groups=" + std::to_string(spec.num_groups));
    const int64_t E = sc.E;
    const int k = spec.k;
    Tensor logits = RandomF32({T, E}, 160 + E + k, 2.0);
    Tensor bias = sc.bias ? RandomF32({E}, 161, 0.1) : Tensor();
    Router c{Tensor::Empty({T, E}), Tensor::Empty({T}), Tensor::Empty({T, k}, DType::kI32),
             Tensor::Empty({T, k})};
    ops::MoeRouterForward(ctx, c.probs, c.lse, c.idx, c.w, logits, bias, spec);
    Router g{GpuGarbage({T, E}), GpuGarbage({T}), GpuGarbage({T, k}, DType::kI32),
             GpuGarbage({T, k})};
    ops::MoeRouterForward(ctx, g.probs, g.lse, g.idx, g.w, Up(logits),
                          sc.bias ? Up(bias) : Tensor(), spec);
    ExpectClose(g.probs, c.probs, kReduction, "scores");
    ExpectClose(g.lse, c.lse, kReduction, "lse");
    ExpectEqualInts(g.idx, c.idx, "topk_expert");
    ExpectClose(g.w, c.w, kReduction, "topk_weight");

    const int64_t rows_per = 7, rows = (T + rows_per - 1) / rows_per;
    Tensor score_grad = RandomF32({rows, E}, 162, 0.05);
    Tensor dweight = RandomF32({T, k}, 163);
    Tensor dl_c = Tensor::Empty({T, E});
    ops::MoeRouterBackward(ctx, dl_c, dweight, c.probs, logits, c.lse, c.idx, score_grad, rows_per,
                           spec, 0.07f);
    Tensor dl_g = GpuGarbage({T, E});
    ops::MoeRouterBackward(ctx, dl_g, Up(dweight), Up(c.probs), Up(logits), Up(c.lse), Up(c.idx),
                           Up(score_grad), rows_per, spec, 0.07f);
    ExpectClose(dl_g, dl_c, kReduction, "dlogits");
  }
}

TEST_F(CudaOpsTest, MoeRouterBackwardWithASlotPerExpert) {
  // Expert choice's backward: k = E slots, slot j = expert j, softmax, not renormalised; E = 40
  // is more than a top-k list holds and not a multiple of the warp. With and without the
  // balancing term; dweight is zero where an expert did not take the token.
  const int64_t T = 200, E = 40;
  ops::MoeRouterSpec spec;
  spec.k = static_cast<int>(E);
  Tensor logits = RandomF32({T, E}, 190, 2.0);
  Tensor probs = Tensor::Empty({T, E}), lse = Tensor::Empty({T});
  Tensor top1 = Tensor::Empty({T, 1}, DType::kI32), w1 = Tensor::Empty({T, 1});
  ops::MoeRouterSpec softmax;
  softmax.k = 1;
  ops::MoeRouterForward(ctx, probs, lse, top1, w1, logits, Tensor(), softmax);
  Tensor ids = Tensor::Empty({T, E}, DType::kI32), dweight = RandomF32({T, E}, 191);
  for (int64_t i = 0; i < T * E; ++i) {
    ids.i32()[i] = static_cast<int32_t>(i % E);
    if (i % 3 == 0) dweight.f32()[i] = 0.f;  // not taken
  }
  Tensor score_grad = RandomF32({1, E}, 192, 0.05);
  for (bool balancing : {false, true}) {
    SCOPED_TRACE(balancing ? "with a balancing term" : "without");
    const Tensor g = balancing ? score_grad : Tensor();
    Tensor dl_c = Tensor::Empty({T, E});
    ops::MoeRouterBackward(ctx, dl_c, dweight, probs, logits, lse, ids, g, T, spec, 0.07f);
    Tensor dl_g = GpuGarbage({T, E});
    ops::MoeRouterBackward(ctx, dl_g, Up(dweight), Up(probs), Up(logits), Up(lse), Up(ids),
                           balancing ? Up(score_grad) : Tensor(), T, spec, 0.07f);
    ExpectClose(dl_g, dl_c, kReduction, "dlogits");
  }
}

// topk_expert [T, k]: distinct experts per token, first choices skewed to expert 0 (60%) so a
// tight capacity drops many of them and some tokens lose every choice.
Tensor SkewedExperts(int64_t T, int k, int64_t E, uint64_t seed) {
  std::mt19937_64 gen(seed);
  Tensor t = Tensor::Empty({T, k}, DType::kI32);
  int32_t* p = t.i32();
  for (int64_t i = 0; i < T; ++i) {
    for (int j = 0; j < k; ++j) {
      int32_t e;
      do {
        e = (j == 0 && gen() % 10 < 6) ? 0 : static_cast<int32_t>(gen() % E);
      } while (std::find(p + i * k, p + i * k + j, e) != p + i * k + j);
      p[i * k + j] = e;
    }
  }
  return t;
}

// A gate's eligibility mask [T, k]: first choices always eligible when k > 1 (as GShard's random
// routing), the others with probability 1/2; with k == 1, 80%.
std::vector<uint8_t> RandomEligible(int64_t T, int k, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<uint8_t> e(T * k);
  for (int64_t i = 0; i < T; ++i) {
    for (int j = 0; j < k; ++j) {
      e[i * k + j] = (k > 1 && j == 0) ? 1 : (k > 1 ? gen() % 2 : gen() % 5 != 0);
    }
  }
  return e;
}

TEST_F(CudaOpsTest, MoePlanDispatch) {
  // Everything exact: rows, dropped, capacity, counts, offsets, slot, row_token[0, R).
  struct Case {
    int64_t T;
    int k;
    int64_t E;
  };
  for (Case cs : {Case{200, 2, 8}, Case{1000, 2, 64}, Case{150, 1, 8}}) {
    const int64_t T = cs.T, E = cs.E;
    const int k = cs.k;
    Tensor topk = SkewedExperts(T, k, E, 160 + E);
    Tensor topk_g = Up(topk);
    const std::vector<uint8_t> eligible = RandomEligible(T, k, 161);
    for (int64_t capacity : {int64_t{0}, cpu::MoeCapacity(0.5, T, k, E), int64_t{1}}) {
      for (bool with_mask : {false, true}) {
        SCOPED_TRACE("T=" + std::to_string(T) + " k=" + std::to_string(k) +
                     " E=" + std::to_string(E) + " capacity=" + std::to_string(capacity) +
                     (with_mask ? " with eligible mask" : ""));
        const uint8_t* mask = with_mask ? eligible.data() : nullptr;
        Tensor slot_c = Tensor::Empty({T, k}, DType::kI32);
        Tensor row_c = Tensor::Empty({T * k}, DType::kI32);
        ops::DispatchPlan pc;
        ops::MoePlanDispatch(ctx, topk, mask, E, capacity, slot_c, row_c, &pc);
        Tensor slot_g = GpuGarbage({T, k}, DType::kI32);
        Tensor row_g = GpuGarbage({T * k}, DType::kI32);
        ops::DispatchPlan pg;
        pg.rows = pg.dropped = pg.capacity = -7;
        pg.counts.assign(3, -7);
        ops::MoePlanDispatch(ctx, topk_g, mask, E, capacity, slot_g, row_g, &pg);
        if (capacity > 0) {
          EXPECT_GT(pc.dropped, 0) << "the case should exercise drops";
        }
        EXPECT_EQ(pg.rows, pc.rows);
        EXPECT_EQ(pg.dropped, pc.dropped);
        EXPECT_EQ(pg.capacity, pc.capacity);
        EXPECT_EQ(pg.counts, pc.counts);
        EXPECT_EQ(pg.offsets, pc.offsets);
        ExpectEqualInts(slot_g, slot_c, "slot");
        ExpectEqualInts(row_g, row_c, "row_token[0, R)", pc.rows);
      }
    }
  }
}

TEST_F(CudaOpsTest, MoePermuteAndCombine) {
  // Permute forward: a gather, exact. Permute backward (sums of <= k rows), combine forward and
  // backward (weighted sums, dots over C): 1e-5. Both sides use the CPU's dispatch plan.
  struct Case {
    int64_t T;
    int k;
    int64_t E;
    double capacity_factor;  // 0: dropless
  };
  const int64_t C = 130;
  for (Case cs : {Case{200, 2, 8, 0.5}, Case{200, 2, 8, 0.0}, Case{300, 1, 64, 1.0}}) {
    const int64_t T = cs.T, E = cs.E;
    const int k = cs.k;
    const int64_t capacity =
        cs.capacity_factor > 0 ? cpu::MoeCapacity(cs.capacity_factor, T, k, E) : 0;
    SCOPED_TRACE("T=" + std::to_string(T) + " k=" + std::to_string(k) + " E=" + std::to_string(E) +
                 " capacity=" + std::to_string(capacity));
    Tensor topk = SkewedExperts(T, k, E, 170 + E);
    Tensor slot = Tensor::Empty({T, k}, DType::kI32),
           row_token = Tensor::Empty({T * k}, DType::kI32);
    ops::DispatchPlan plan;
    ops::MoePlanDispatch(ctx, topk, nullptr, E, capacity, slot, row_token, &plan);
    const int64_t R = plan.rows;
    ASSERT_GT(R, 0);
    int64_t lost = 0;  // tokens with no dispatched choice: their dx / y rows are zero
    for (int64_t t = 0; t < T; ++t) {
      bool any = false;
      for (int j = 0; j < k; ++j) any = any || slot.i32()[t * k + j] >= 0;
      lost += !any;
    }
    if (capacity > 0) {
      EXPECT_GT(lost, 0) << "the case should have tokens that lost every choice";
    }
    Tensor slot_g = Up(slot), row_g = Up(row_token);

    Tensor x = RandomF32({T, C}, 171);
    Tensor xp_c = Tensor::Empty({R, C});
    ops::MoePermuteForward(ctx, xp_c, x, row_token);
    Tensor xp_g = GpuGarbage({R, C});
    ops::MoePermuteForward(ctx, xp_g, Up(x), row_g);
    ExpectClose(xp_g, xp_c, kExact, "permute xp");

    Tensor dxp = RandomF32({R, C}, 172), dx0 = RandomF32({T, C}, 173, 0.1);
    Tensor dxp_g = Up(dxp);
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "permute backward accumulating" : "permute backward");
      Tensor dx_c = Clone(dx0);
      Tensor dx_g = accumulate ? Up(dx0) : GpuGarbage({T, C});
      ops::MoePermuteBackward(ctx, dx_c, dxp, slot, accumulate);
      ops::MoePermuteBackward(ctx, dx_g, dxp_g, slot_g, accumulate);
      ExpectClose(dx_g, dx_c, kPointwise, "dx");
    }

    Tensor yp = RandomF32({R, C}, 174), weight = UniformF32({T, k}, 175, 0.0, 1.0);
    Tensor yp_g = Up(yp), weight_g = Up(weight);
    Tensor y_c = Tensor::Empty({T, C});
    ops::MoeCombineForward(ctx, y_c, yp, weight, slot);
    Tensor y_g = GpuGarbage({T, C});
    ops::MoeCombineForward(ctx, y_g, yp_g, weight_g, slot_g);
    ExpectClose(y_g, y_c, kPointwise, "combine y");

    Tensor dy = RandomF32({T, C}, 176);
    Tensor dy_g = Up(dy);
    Tensor dyp_c = Tensor::Empty({R, C}), dw_c = Tensor::Empty({T, k});
    ops::MoeCombineBackward(ctx, dyp_c, dw_c, dy, yp, weight, slot);
    Tensor dyp_g = GpuGarbage({R, C}), dw_g = GpuGarbage({T, k});
    ops::MoeCombineBackward(ctx, dyp_g, dw_g, dy_g, yp_g, weight_g, slot_g);
    ExpectClose(dyp_g, dyp_c, kPointwise, "combine dyp");
    ExpectClose(dw_g, dw_c, kReduction, "combine dweight (0 where not dispatched)");
    // dyp aliasing yp: dweight must still see yp's values.
    Tensor alias_g = Up(yp), dw2_g = GpuGarbage({T, k});
    ops::MoeCombineBackward(ctx, alias_g, dw2_g, dy_g, alias_g, weight_g, slot_g);
    ExpectClose(alias_g, dyp_c, kPointwise, "combine dyp aliasing yp");
    ExpectClose(dw2_g, dw_c, kReduction, "combine dweight with dyp aliasing yp");
    // The per-expert rows kernel, each expert's block in place over yp; dweight starts as NaN
    // where a row will write it and as the reference (0) where the choice was dropped.
    Tensor row_slot = Tensor::Empty({R}, DType::kI32), dw_init = Clone(dw_c);
    for (int64_t i = 0; i < T * k; ++i) {
      const int32_t s = slot.i32()[i];
      if (s >= 0) {
        row_slot.i32()[s] = static_cast<int32_t>(i);
        dw_init.f32()[i] = std::numeric_limits<float>::quiet_NaN();
      }
    }
    Tensor rows_g = Up(yp), dw3_g = Up(dw_init), row_slot_g = Up(row_slot);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = plan.offsets[e], r1 = plan.offsets[e + 1];
      ops::MoeCombineBackwardRows(ctx, rows_g.Rows(r0, r1), dw3_g, dy_g, rows_g.Rows(r0, r1),
                                  weight_g, row_slot_g.Rows(r0, r1));
    }
    ExpectClose(rows_g, dyp_c, kPointwise, "combine dyp by expert rows");
    ExpectClose(dw3_g, dw_c, kReduction, "combine dweight by expert rows");
  }
}

TEST_F(CudaOpsTest, MoeRandomRouting) {
  // eligible exactly equal: the same counter-based uniforms compared with the same 2 * w.
  const int64_t T = 333;
  Tensor w(Tensor::Empty({T, 2}));
  Tensor second = UniformF32({T}, 180, 0.0, 0.5);
  for (int64_t t = 0; t < T; ++t) {
    w.f32()[2 * t] = 1.0f - second.f32()[t];
    w.f32()[2 * t + 1] = second.f32()[t];
  }
  Tensor w_g = Up(w);
  for (uint64_t key : {rng::Key(1, 2, 3), rng::Key(4)}) {
    for (int64_t first_token : {int64_t{0}, int64_t{4103}}) {
      SCOPED_TRACE("first_token=" + std::to_string(first_token));
      std::vector<uint8_t> ec, eg = {9, 9, 9};
      ops::MoeRandomRouting(ctx, &ec, w, key, first_token);
      ops::MoeRandomRouting(ctx, &eg, w_g, key, first_token);
      EXPECT_EQ(eg, ec);
      int64_t kept = 0;
      for (int64_t t = 0; t < T; ++t) kept += ec[2 * t + 1];
      EXPECT_GT(kept, 0);
      EXPECT_LT(kept, T);
    }
  }
}

TEST_F(CudaOpsTest, MoeJitter) {
  // Pointwise with the same draws: 1e-5. Backward accumulates into dx (as the CPU kernel does).
  const int64_t T = 100, C = 130;
  const uint64_t key = rng::Key(9, 8, 7);
  const double eps = 0.01;
  Tensor x = RandomF32({T, C}, 190), dxj = RandomF32({T, C}, 191), dx0 = RandomF32({T, C}, 192);
  Tensor x_g = Up(x), dxj_g = Up(dxj);
  for (int64_t first_token : {int64_t{0}, int64_t{517}}) {
    SCOPED_TRACE("first_token=" + std::to_string(first_token));
    Tensor xj_c = Tensor::Empty({T, C});
    ops::MoeJitterForward(ctx, xj_c, x, key, eps, first_token);
    Tensor xj_g = GpuGarbage({T, C});
    ops::MoeJitterForward(ctx, xj_g, x_g, key, eps, first_token);
    ExpectClose(xj_g, xj_c, kPointwise, "xj");
    Tensor dx_c = Clone(dx0), dx_g = Up(dx0);
    ops::MoeJitterBackward(ctx, dx_c, dxj, key, eps, first_token);
    ops::MoeJitterBackward(ctx, dx_g, dxj_g, key, eps, first_token);
    ExpectClose(dx_g, dx_c, kPointwise, "jitter dx (accumulated)");
  }
}

TEST_F(CudaOpsTest, MoeNoisyLogits) {
  // Pointwise with the same normal draws: 1e-5.
  const int64_t T = 100, E = 64;
  const uint64_t key = rng::Key(5, 6);
  Tensor clean = RandomF32({T, E}, 200), raw = RandomF32({T, E}, 201), dh = RandomF32({T, E}, 202);
  Tensor clean_g = Up(clean), raw_g = Up(raw), dh_g = Up(dh);
  for (int64_t first_token : {int64_t{0}, int64_t{517}}) {
    SCOPED_TRACE("first_token=" + std::to_string(first_token));
    Tensor h_c = Tensor::Empty({T, E});
    ops::MoeNoisyLogitsForward(ctx, h_c, clean, raw, key, first_token);
    Tensor h_g = GpuGarbage({T, E});
    ops::MoeNoisyLogitsForward(ctx, h_g, clean_g, raw_g, key, first_token);
    ExpectClose(h_g, h_c, kPointwise, "h");
    Tensor alias_g = Up(clean);  // h may alias clean (kernels/cpu/moe.h)
    ops::MoeNoisyLogitsForward(ctx, alias_g, alias_g, raw_g, key, first_token);
    ExpectClose(alias_g, h_c, kPointwise, "h aliasing clean");

    Tensor draw_c = Tensor::Empty({T, E});
    ops::MoeNoisyLogitsBackward(ctx, draw_c, dh, raw, key, first_token);
    Tensor draw_g = GpuGarbage({T, E});
    ops::MoeNoisyLogitsBackward(ctx, draw_g, dh_g, raw_g, key, first_token);
    ExpectClose(draw_g, draw_c, kPointwise, "draw_noise");
  }
}

// ---- Ordering and determinism ----------------------------------------------------------------

TEST_F(CudaOpsTest, ResultsAreReadyForTheNextCopy) {
  // GPU ops return without waiting; a copy back to the host right after must still see their
  // results (ops.h: copies are synchronous; they must be ordered after the op's stream). 100
  // back-to-back Accumulates over 64 MB take milliseconds, so an unordered copy sees a partial sum.
  const int64_t n = int64_t{1} << 24;
  Tensor a = Tensor::Empty({n});
  for (int64_t i = 0; i < n; ++i) a.f32()[i] = static_cast<float>(i % 7);
  Tensor a_g = Up(a), out_g = Tensor::Zeros({n}, DType::kF32, Gpu());
  for (int i = 0; i < 100; ++i) ops::Accumulate(ctx, out_g, a_g);
  Tensor out = out_g.To(Device::Cpu());
  int64_t wrong = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (out.f32()[i] != 100.0f * a.f32()[i]) {
      if (first < 0) first = i;
      ++wrong;
    }
  }
  EXPECT_EQ(wrong, 0) << "first wrong element " << first << ": " << out.f32()[first]
                      << " instead of " << 100.0f * a.f32()[first];
}

TEST_F(CudaOpsTest, ReductionsAreDeterministicRunToRun) {
  // cuda_ops.h: no float atomics on any output, so the same call gives the same bits.
  {
    const int64_t B = 8, T = 512, C = 256, V = 10;  // every token repeated hundreds of times
    Tensor tokens = Up(RandomI32({B * T}, 0, V, 210)), dout = Up(RandomF32({B * T, C}, 211));
    Tensor dwte[2], dwpe[2];
    for (int r = 0; r < 2; ++r) {
      dwte[r] = Tensor::Zeros({V, C}, DType::kF32, Gpu());
      dwpe[r] = Tensor::Zeros({T, C}, DType::kF32, Gpu());
      ops::EmbeddingBackward(ctx, dwte[r], dwpe[r], dout, tokens, B, T);
    }
    ExpectBitwiseEqual(dwte[0], dwte[1], "embedding dwte");
    ExpectBitwiseEqual(dwpe[0], dwpe[1], "embedding dwpe");
  }
  {
    const int64_t N = 4096, C = 256;
    Tensor inp = Up(RandomF32({N, C}, 212)), w = Up(RandomF32({C}, 213, 0.5, 1.0));
    Tensor b = Up(RandomF32({C}, 214)), dout = Up(RandomF32({N, C}, 215));
    Tensor out = Tensor::Empty({N, C}, DType::kF32, Gpu());
    Tensor mean = Tensor::Empty({N}, DType::kF32, Gpu()),
           rstd = Tensor::Empty({N}, DType::kF32, Gpu());
    ops::NormForward(ctx, NormKind::kLayerNorm, out, mean, rstd, inp, w, b, 1e-5f);
    Tensor dinp[2], dw[2], db[2];
    for (int r = 0; r < 2; ++r) {
      dinp[r] = Tensor::Zeros({N, C}, DType::kF32, Gpu());
      dw[r] = Tensor::Zeros({C}, DType::kF32, Gpu());
      db[r] = Tensor::Zeros({C}, DType::kF32, Gpu());
      ops::NormBackward(ctx, NormKind::kLayerNorm, dinp[r], dw[r], db[r], dout, inp, w, mean, rstd);
    }
    ExpectBitwiseEqual(dw[0], dw[1], "layernorm dweight");
    ExpectBitwiseEqual(db[0], db[1], "layernorm dbias");

    Tensor lw = Up(RandomF32({C, C}, 216, 0.1));
    Tensor ldw[2], ldb[2];
    for (int r = 0; r < 2; ++r) {
      ldw[r] = Tensor::Zeros({C, C}, DType::kF32, Gpu());
      ldb[r] = Tensor::Zeros({C}, DType::kF32, Gpu());
      ops::LinearBackward(ctx, Tensor(), ldw[r], ldb[r], dout, inp, lw, false);
    }
    ExpectBitwiseEqual(ldw[0], ldw[1], "linear dweight");
    ExpectBitwiseEqual(ldb[0], ldb[1], "linear dbias");

    Tensor adb[2];
    for (int r = 0; r < 2; ++r) {
      adb[r] = Tensor::Zeros({C}, DType::kF32, Gpu());
      Tensor dpre = Tensor::Empty({N, C}, DType::kF32, Gpu());
      ops::ActivationBackward(ctx, Activation::kGelu, dpre, dout, inp, adb[r]);
    }
    ExpectBitwiseEqual(adb[0], adb[1], "activation dbias");

    const std::vector<int64_t> offsets = {0, 1000, 1000, 4096};
    std::vector<Tensor> gw, gdw[2];
    for (int g = 0; g < 3; ++g) gw.push_back(Up(RandomF32({C, C}, 217 + g, 0.1)));
    for (int r = 0; r < 2; ++r) {
      for (int g = 0; g < 3; ++g) gdw[r].push_back(Tensor::Zeros({C, C}, DType::kF32, Gpu()));
      ops::GroupedLinearBackward(ctx, Tensor(), gdw[r], dout, inp, gw, offsets, false);
    }
    for (int g = 0; g < 3; ++g) {
      ExpectBitwiseEqual(gdw[0][g], gdw[1][g], "grouped dweight " + std::to_string(g));
    }

    EXPECT_EQ(ops::SumSquares(ctx, inp), ops::SumSquares(ctx, inp)) << "sum of squares";
    Tensor targets = Up(RandomI32({N}, 0, C, 218));
    EXPECT_EQ(ops::CrossEntropy(ctx, Tensor(), inp, targets, 1.0f),
              ops::CrossEntropy(ctx, Tensor(), inp, targets, 1.0f))
        << "cross-entropy";
  }
  {
    const int64_t B = 2, T = 128, C = 256, NH = 4;
    Tensor qkv = Up(RandomF32({B * T, 3 * C}, 219)), dout = Up(RandomF32({B * T, C}, 220));
    Tensor out = Tensor::Empty({B * T, C}, DType::kF32, Gpu());
    Tensor att = Tensor::Empty({B, NH, T, T}, DType::kF32, Gpu());
    ops::AttentionForward(ctx, out, att, qkv, B, T, NH);
    Tensor dqkv[2];
    for (int r = 0; r < 2; ++r) {
      dqkv[r] = Tensor::Empty({B * T, 3 * C}, DType::kF32, Gpu());
      ops::AttentionBackward(ctx, dqkv[r], dout, qkv, att, B, T, NH);
    }
    ExpectBitwiseEqual(dqkv[0], dqkv[1], "attention dqkv");
  }
}

// ---- Device memory and copies ----------------------------------------------------------------

TEST(GpuTest, DeviceBuffersHonourTheirBudget) {
  REQUIRE_GPU();
  constexpr size_t kKiB = 1024;
  MemoryBudget budget("gpu test", 1024 * kKiB);
  {
    auto a = Tensor::TryEmpty({128 * 1024}, DType::kF32, Gpu(), &budget);  // 512 KiB
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->device() == Gpu()) << a->device().ToString();
    EXPECT_EQ(budget.used(), 512 * kKiB);
    auto b = Tensor::TryEmpty({192 * 1024}, DType::kF32, Gpu(), &budget);  // 768 KiB: over
    EXPECT_TRUE(absl::IsResourceExhausted(b.status())) << b.status();
    EXPECT_EQ(budget.used(), 512 * kKiB) << "a failed allocation must not keep its charge";
    a->SetZero();  // the memory is real device memory
  }
  EXPECT_EQ(budget.used(), 0u) << "freeing the tensor returns its bytes";
  EXPECT_EQ(budget.peak(), 512 * kKiB);
  auto c = Tensor::TryEmpty({192 * 1024}, DType::kF32, Gpu(), &budget);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(budget.used(), 768 * kKiB);
}

TEST(GpuTest, CopiesRoundTripBitwise) {
  REQUIRE_GPU();
  const int64_t n = (1 << 20) + 13;
  // Arbitrary bits, including float NaN payloads and denormals when read as f32.
  Tensor host = Tensor::Empty({n}, DType::kI32);
  std::mt19937 gen(230);
  for (int64_t i = 0; i < n; ++i) host.i32()[i] = static_cast<int32_t>(gen());
  const size_t bytes = host.bytes();
  auto same = [&](const void* p) { return std::memcmp(p, host.raw_data(), bytes) == 0; };

  // Tensor::To both ways.
  Tensor g = host.To(Gpu());
  EXPECT_FALSE(g.device().is_cpu());
  Tensor back = g.To(Device::Cpu());
  EXPECT_TRUE(back.device().is_cpu());
  EXPECT_TRUE(same(back.raw_data())) << "CPU -> GPU -> CPU with To";

  // CopyFrom host -> device, device -> device, device -> host; the same bits as f32.
  Tensor hf = Tensor::Empty({n}, DType::kF32);
  std::memcpy(hf.raw_data(), host.raw_data(), bytes);
  Tensor g1 = Tensor::Empty({n}, DType::kF32, Gpu()), g2 = Tensor::Empty({n}, DType::kF32, Gpu());
  g1.CopyFrom(hf);
  g2.CopyFrom(g1);
  Tensor back2 = Tensor::Empty({n}, DType::kF32);
  back2.CopyFrom(g2);
  EXPECT_TRUE(same(back2.raw_data())) << "CPU -> GPU -> GPU -> CPU with CopyFrom";

  // SetZero on the device.
  g2.SetZero();
  Tensor zeros = g2.To(Device::Cpu());
  EXPECT_EQ(std::count(zeros.f32(), zeros.f32() + n, 0.0f), n);

  // Pinned host buffers through two copy streams ordered by an event.
  auto in = Buffer::AllocatePinned(bytes);
  auto out = Buffer::AllocatePinned(bytes);
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE((*in)->pinned());
  EXPECT_TRUE((*in)->device().is_cpu());
  auto dev = Buffer::Allocate(Gpu(), bytes);
  ASSERT_TRUE(dev.ok()) << dev.status();
  std::memcpy((*in)->data(), host.raw_data(), bytes);
  std::memset((*out)->data(), 0, bytes);

  auto up = CopyStream::Create(Gpu());
  auto down = CopyStream::Create(Gpu());
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_NE((*up)->native(), nullptr);
  CopyEvent never_recorded;
  EXPECT_TRUE(never_recorded.Done());

  ASSERT_TRUE((*up)->CopyAsync((*dev)->data(), (*in)->data(), bytes).ok());
  CopyEvent uploaded;
  ASSERT_TRUE((*up)->Record(&uploaded).ok());
  ASSERT_TRUE((*down)->Wait(uploaded).ok());
  ASSERT_TRUE((*down)->CopyAsync((*out)->data(), (*dev)->data(), bytes).ok());
  CopyEvent downloaded;
  ASSERT_TRUE((*down)->Record(&downloaded).ok());
  const Status s = downloaded.Synchronize();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(downloaded.Done());
  EXPECT_TRUE(uploaded.Done());
  EXPECT_TRUE(same((*out)->data())) << "pinned -> GPU -> pinned with CopyStream";
  EXPECT_TRUE((*up)->Synchronize().ok());
  EXPECT_TRUE((*down)->Synchronize().ok());
}

}  // namespace
}  // namespace strata
