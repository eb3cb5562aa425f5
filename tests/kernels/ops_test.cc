// Ops of kernels/ops.h that have no single CPU kernel behind them: the grouped GEMM of the experts
// (one GEMM per group on the CPU, one cuBLAS grouped call on a GPU) and the bf16 GEMMs of mixed
// precision (Context::bf16, compute copies), checked against double-precision loops over
// hand-rounded operands, bit patterns worked out by hand, and each other bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/ops.h"

namespace strata::ops {
namespace {

Tensor RandomTensor(Shape shape, uint64_t seed, float offset = 0.f) {
  Tensor t = Tensor::Empty(shape);
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = offset + d(gen);
  return t;
}

class OpsTest : public ::testing::Test {
 protected:
  ThreadPool pool{2};
  Context ctx{&pool, nullptr};
};

TEST_F(OpsTest, GroupedLinearMatchesAReferenceLoopPerGroup) {
  const int64_t IC = 7, OC = 5;
  const std::vector<int64_t> offsets = {0, 3, 3, 9, 10};  // group 1 is empty
  const int64_t G = 4, R = offsets.back();
  Tensor x = RandomTensor({R, IC}, 1), dy = RandomTensor({R, OC}, 2);
  std::vector<Tensor> w, dw;
  for (int64_t g = 0; g < G; ++g) {
    w.push_back(RandomTensor({OC, IC}, 10 + g));
    dw.push_back(RandomTensor({OC, IC}, 20 + g));  // gradients accumulate onto these
  }
  std::vector<std::vector<float>> dw0;
  for (auto& t : dw) dw0.emplace_back(t.f32(), t.f32() + t.numel());

  Tensor y = Tensor::Empty({R, OC});
  GroupedLinearForward(ctx, y, x, w, offsets);
  Tensor dx = RandomTensor({R, IC}, 3);
  Tensor dx_acc = Tensor::Empty({R, IC});
  dx_acc.CopyFrom(dx);
  GroupedLinearBackward(ctx, dx, dw, dy, x, w, offsets, /*accumulate_dinp=*/false);
  std::vector<Tensor> none(G);
  GroupedLinearBackward(ctx, dx_acc, none, dy, x, w, offsets, /*accumulate_dinp=*/true);

  Tensor dx_before = RandomTensor({R, IC}, 3);  // dx_acc's initial value
  for (int64_t g = 0; g < G; ++g) {
    const float* W = w[g].f32();
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      for (int64_t o = 0; o < OC; ++o) {
        double s = 0;
        for (int64_t i = 0; i < IC; ++i) s += double(x.f32()[r * IC + i]) * W[o * IC + i];
        EXPECT_NEAR(y.f32()[r * OC + o], s, 1e-5 * (1 + std::abs(s))) << "y " << r << "," << o;
      }
      for (int64_t i = 0; i < IC; ++i) {
        double s = 0;
        for (int64_t o = 0; o < OC; ++o) s += double(dy.f32()[r * OC + o]) * W[o * IC + i];
        EXPECT_NEAR(dx.f32()[r * IC + i], s, 1e-5 * (1 + std::abs(s))) << "dx " << r << "," << i;
        const double acc = s + dx_before.f32()[r * IC + i];
        EXPECT_NEAR(dx_acc.f32()[r * IC + i], acc, 1e-5 * (1 + std::abs(acc)));
      }
    }
    for (int64_t o = 0; o < OC; ++o) {
      for (int64_t i = 0; i < IC; ++i) {
        double s = dw0[g][o * IC + i];
        for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
          s += double(dy.f32()[r * OC + o]) * x.f32()[r * IC + i];
        }
        EXPECT_NEAR(dw[g].f32()[o * IC + i], s, 1e-5 * (1 + std::abs(s)))
            << "dw" << g << " " << o << "," << i;
      }
    }
  }
}

TEST_F(OpsTest, GroupedLinearBackwardInPlaceEqualsOutOfPlace) {
  const int64_t C = 6;
  const std::vector<int64_t> offsets = {0, 4, 4, 11};
  const int64_t R = offsets.back();
  std::vector<Tensor> w, dw_a, dw_b;
  for (int g = 0; g < 3; ++g) {
    w.push_back(RandomTensor({C, C}, 60 + g));
    dw_a.push_back(Tensor::Zeros({C, C}));
    dw_b.push_back(Tensor::Zeros({C, C}));
  }
  Tensor x = RandomTensor({R, C}, 70), dy = RandomTensor({R, C}, 71);
  Tensor dx = Tensor::Empty({R, C}), io = Tensor::Empty({R, C});
  io.CopyFrom(x);
  GroupedLinearBackward(ctx, dx, dw_a, dy, x, w, offsets, false);
  GroupedLinearBackward(ctx, io, dw_b, dy, io, w, offsets, false);  // dinp is inp
  for (int64_t i = 0; i < R * C; ++i) EXPECT_EQ(io.f32()[i], dx.f32()[i]) << i;
  for (int g = 0; g < 3; ++g) {
    for (int64_t i = 0; i < C * C; ++i) EXPECT_EQ(dw_b[g].f32()[i], dw_a[g].f32()[i]) << g;
  }
}

TEST_F(OpsTest, AddBiasAndBiasGradByHand) {
  Tensor out = Tensor::Empty({3, 2}), bias = Tensor::Empty({2}), db = Tensor::Empty({2});
  const float v[6] = {1, 2, 3, 4, 5, 6};
  for (int i = 0; i < 6; ++i) out.f32()[i] = v[i];
  bias.f32()[0] = 0.5f;
  bias.f32()[1] = -1.0f;
  db.f32()[0] = 10.0f;  // gradients accumulate
  db.f32()[1] = 0.0f;
  BiasGrad(ctx, db, out);
  EXPECT_EQ(db.f32()[0], 10.0f + 1 + 3 + 5);
  EXPECT_EQ(db.f32()[1], 2.0f + 4 + 6);
  AddBias(ctx, out, bias);
  const float want[6] = {1.5f, 1, 3.5f, 3, 5.5f, 5};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.f32()[i], want[i]) << i;
}

// bfloat16 keeps 7 mantissa bits: between 1 and 2 its step is 2^-7. Values halfway between two
// steps round to the even one.
TEST_F(OpsTest, Bf16ExpertsRoundInputsAndWeightsToNearestEven) {
  const float cases[][2] = {
      {1.0f + 0x1p-8f, 1.0f},                            // halfway, 1.0 is even: down
      {1.0f + 0x1p-7f + 0x1p-8f, 1.0f + 0x1p-6f},        // halfway, 1 + 2^-7 is odd: up
      {1.0f + 0x1p-8f + 0x1p-20f, 1.0f + 0x1p-7f},       // past halfway: up
      {-(1.0f + 0x1p-7f + 0x1p-9f), -(1.0f + 0x1p-7f)},  // below halfway: down (in magnitude)
  };
  ctx.bf16 = true;
  for (const auto& c : cases) {
    Tensor x = Tensor::Empty({1, 1}), w = Tensor::Empty({1, 1}), y = Tensor::Empty({1, 1});
    x.f32()[0] = c[0];
    w.f32()[0] = 1.0f;
    GroupedLinearForward(ctx, y, x, {w}, {0, 1});
    EXPECT_EQ(y.f32()[0], c[1]) << "input " << c[0];
    // The weight is rounded the same way, and the fp32 master weight is left alone.
    x.f32()[0] = 1.0f;
    w.f32()[0] = c[0];
    GroupedLinearForward(ctx, y, x, {w}, {0, 1});
    EXPECT_EQ(y.f32()[0], c[1]) << "weight " << c[0];
    EXPECT_EQ(w.f32()[0], c[0]);
  }
  // Off (the default) nothing is rounded.
  ctx.bf16 = false;
  Tensor x = Tensor::Empty({1, 1}), w = Tensor::Empty({1, 1}), y = Tensor::Empty({1, 1});
  x.f32()[0] = 1.0f + 0x1p-8f;
  w.f32()[0] = 1.0f;
  GroupedLinearForward(ctx, y, x, {w}, {0, 1});
  EXPECT_EQ(y.f32()[0], 1.0f + 0x1p-8f);
}

// Bit patterns by hand: bfloat16 is fp32's top 16 bits, rounded to nearest even.
TEST(Bf16Test, BitsRoundToNearestEvenLikeTheGpu) {
  struct Case {
    float x;
    uint16_t bits;
  };
  const Case cases[] = {
      {1.0f, 0x3f80},
      {1.0f + 0x1p-8f, 0x3f80},             // halfway, 0x3f80 is even: down
      {1.0f + 0x1p-7f + 0x1p-8f, 0x3f82},   // halfway, 0x3f81 is odd: up
      {1.0f + 0x1p-8f + 0x1p-20f, 0x3f81},  // past halfway: up
      {-2.0f, 0xc000},
      {-0.0f, 0x8000},
      {3.3895314e38f, 0x7f7f},  // the largest bfloat16
      {3.4028235e38f, 0x7f80},  // fp32's largest rounds to infinity
      {-std::numeric_limits<float>::infinity(), 0xff80},
      {1e-40f, 0x0001},  // a subnormal: 0x000116c2 rounds to 0x0001
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Bf16Bits(c.x), c.bits) << c.x;
    EXPECT_EQ(Bf16Value(c.bits), RoundBf16(c.x)) << c.x;
  }
  // Every NaN becomes the canonical NaN, as __float2bfloat16_rn makes it, whatever its sign and
  // payload (this one's payload is only in bits a truncation would drop).
  EXPECT_EQ(Bf16Bits(std::numeric_limits<float>::quiet_NaN()), 0x7fff);
  for (uint32_t bits : {0x7f800001u, 0xffc00000u}) {
    float s;
    std::memcpy(&s, &bits, 4);
    EXPECT_EQ(Bf16Bits(s), 0x7fff) << std::hex << bits;
    EXPECT_TRUE(std::isnan(RoundBf16(s)));
  }
  // Widening is exact and rounding a bfloat16 again changes nothing.
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    const float v = Bf16Value(static_cast<uint16_t>(b));
    if (!std::isnan(v)) {
      EXPECT_EQ(Bf16Bits(v), b) << b;
    }
  }
}

TEST_F(OpsTest, RoundToBf16OpIsBf16BitsOfEveryElement) {
  const Tensor src = RandomTensor({1000, 3}, 5);
  Tensor dst = Tensor::Empty({1000, 3}, DType::kBF16);
  RoundToBf16(ctx, dst, src);
  for (int64_t i = 0; i < src.numel(); ++i) ASSERT_EQ(dst.bf16()[i], Bf16Bits(src.f32()[i])) << i;
  // Several at once (a model's copies): each pair as on its own.
  std::vector<Tensor> srcs = {RandomTensor({5}, 6), RandomTensor({300, 7}, 7),
                              RandomTensor({1}, 8)};
  std::vector<Tensor> dsts;
  for (const Tensor& s : srcs) dsts.push_back(Tensor::Empty(s.shape(), DType::kBF16));
  RoundToBf16(ctx, dsts, srcs);
  for (size_t t = 0; t < srcs.size(); ++t) {
    for (int64_t i = 0; i < srcs[t].numel(); ++i) {
      ASSERT_EQ(dsts[t].bf16()[i], Bf16Bits(srcs[t].f32()[i])) << t << " " << i;
    }
  }
}

// Context::bf16: the GEMM multiplies bf16 operands with fp32 accumulation; the bias and its
// gradient stay fp32. Reference: double loops over operands rounded here. A product of two
// bfloat16 values is exact in fp32, so only the fp32 sums round: IC (or N) terms, each within
// 2^-24 of the running sum, stay well inside 1e-5 (1 + |s|) at these sizes.
TEST_F(OpsTest, LinearInBf16MultipliesRoundedOperandsWithFp32Sums) {
  const int64_t N = 9, IC = 37, OC = 11;
  const Tensor x = RandomTensor({N, IC}, 30), w = RandomTensor({OC, IC}, 31);
  const Tensor b = RandomTensor({OC}, 32), dy = RandomTensor({N, OC}, 33);
  Tensor dw = RandomTensor({OC, IC}, 34), db = RandomTensor({OC}, 35);
  const Tensor dw0 = RandomTensor({OC, IC}, 34), db0 = RandomTensor({OC}, 35);
  Tensor y = Tensor::Empty({N, OC}), dx = Tensor::Empty({N, IC});
  ctx.bf16 = true;
  LinearForward(ctx, y, x, w, b);
  LinearBackward(ctx, dx, dw, db, dy, x, w, /*accumulate_dinp=*/false);
  auto R = [](const Tensor& t, int64_t i) { return double(RoundBf16(t.f32()[i])); };
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < OC; ++o) {
      double s = b.f32()[o];
      for (int64_t i = 0; i < IC; ++i) s += R(x, n * IC + i) * R(w, o * IC + i);
      EXPECT_NEAR(y.f32()[n * OC + o], s, 1e-5 * (1 + std::abs(s))) << n << "," << o;
    }
    for (int64_t i = 0; i < IC; ++i) {
      double s = 0;
      for (int64_t o = 0; o < OC; ++o) s += R(dy, n * OC + o) * R(w, o * IC + i);
      EXPECT_NEAR(dx.f32()[n * IC + i], s, 1e-5 * (1 + std::abs(s))) << n << "," << i;
    }
  }
  for (int64_t o = 0; o < OC; ++o) {
    double sb = db0.f32()[o];
    for (int64_t n = 0; n < N; ++n) sb += dy.f32()[n * OC + o];  // fp32 dout, not rounded
    EXPECT_NEAR(db.f32()[o], sb, 1e-5 * (1 + std::abs(sb))) << o;
    for (int64_t i = 0; i < IC; ++i) {
      double s = dw0.f32()[o * IC + i];
      for (int64_t n = 0; n < N; ++n) s += R(dy, n * OC + o) * R(x, n * IC + i);
      EXPECT_NEAR(dw.f32()[o * IC + i], s, 1e-5 * (1 + std::abs(s))) << o << "," << i;
    }
  }
  // Rounding is visible: the fp32 product differs.
  Tensor y32 = Tensor::Empty({N, OC});
  ctx.bf16 = false;
  LinearForward(ctx, y32, x, w, b);
  double most = 0;
  for (int64_t i = 0; i < N * OC; ++i)
    most = std::max(most, double(std::abs(y32.f32()[i] - y.f32()[i])));
  EXPECT_GT(most, 1e-3);
}

// A weight's bf16 compute copy and the fp32 weight rounded as it is used are the same operand:
// every output and gradient is the same bits, for Linear* and GroupedLinear*.
TEST_F(OpsTest, ComputeCopiesGiveTheBitsOfRoundingAtUse) {
  ctx.bf16 = true;
  const int64_t N = 10, IC = 13, OC = 6;
  const Tensor x = RandomTensor({N, IC}, 40), dy = RandomTensor({N, OC}, 41);
  const Tensor b = RandomTensor({OC}, 42);
  const Tensor w = RandomTensor({OC, IC}, 43);
  Tensor w16 = Tensor::Empty({OC, IC}, DType::kBF16);
  RoundToBf16(ctx, w16, w);
  auto same = [](const Tensor& a, const Tensor& c, const char* what) {
    ASSERT_EQ(a.numel(), c.numel());
    EXPECT_EQ(0, std::memcmp(a.f32(), c.f32(), a.bytes())) << what;
  };
  {
    Tensor y1 = Tensor::Empty({N, OC}), y2 = Tensor::Empty({N, OC});
    LinearForward(ctx, y1, x, w, b);
    LinearForward(ctx, y2, x, w16, b);
    same(y1, y2, "linear out");
    Tensor dx1 = Tensor::Empty({N, IC}), dx2 = Tensor::Empty({N, IC});
    Tensor dw1 = Tensor::Zeros({OC, IC}), dw2 = Tensor::Zeros({OC, IC});
    Tensor db1 = Tensor::Zeros({OC}), db2 = Tensor::Zeros({OC});
    LinearBackward(ctx, dx1, dw1, db1, dy, x, w, false);
    LinearBackward(ctx, dx2, dw2, db2, dy, x, w16, false);
    same(dx1, dx2, "linear dinp");
    same(dw1, dw2, "linear dweight");
    same(db1, db2, "linear dbias");
  }
  const std::vector<int64_t> offsets = {0, 4, 4, 10};
  std::vector<Tensor> ws, ws16, dws1, dws2;
  for (int g = 0; g < 3; ++g) {
    ws.push_back(RandomTensor({OC, IC}, 50 + g));
    ws16.push_back(Tensor::Empty({OC, IC}, DType::kBF16));
    RoundToBf16(ctx, ws16.back(), ws.back());
    dws1.push_back(Tensor::Zeros({OC, IC}));
    dws2.push_back(Tensor::Zeros({OC, IC}));
  }
  Tensor y1 = Tensor::Empty({N, OC}), y2 = Tensor::Empty({N, OC});
  GroupedLinearForward(ctx, y1, x, ws, offsets);
  GroupedLinearForward(ctx, y2, x, ws16, offsets);
  same(y1, y2, "grouped out");
  Tensor dx1 = Tensor::Empty({N, IC}), dx2 = Tensor::Empty({N, IC});
  GroupedLinearBackward(ctx, dx1, dws1, dy, x, ws, offsets, false);
  GroupedLinearBackward(ctx, dx2, dws2, dy, x, ws16, offsets, false);
  same(dx1, dx2, "grouped dinp");
  for (int g = 0; g < 3; ++g) same(dws1[g], dws2[g], "grouped dweight");
}

TEST_F(OpsTest, ABf16WeightNeedsABf16Context) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the pool's threads are running
  Tensor w16 = Tensor::Empty({2, 3}, DType::kBF16);
  RoundToBf16(ctx, w16, RandomTensor({2, 3}, 60));
  Tensor x = RandomTensor({4, 3}, 61), y = Tensor::Empty({4, 2});
  ctx.bf16 = false;
  EXPECT_DEATH(LinearForward(ctx, y, x, w16, Tensor()), "bf16 weight without Context::bf16");
}

}  // namespace
}  // namespace strata::ops
