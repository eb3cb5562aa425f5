// Ops of kernels/ops.h that have no single CPU kernel behind them: the grouped GEMM of the experts
// (one GEMM per group on the CPU, one cuBLAS grouped call on a GPU) and its bf16 option, checked
// against double-precision loops and hand-rounded values.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

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
  ctx.bf16_experts = true;
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
  ctx.bf16_experts = false;
  Tensor x = Tensor::Empty({1, 1}), w = Tensor::Empty({1, 1}), y = Tensor::Empty({1, 1});
  x.f32()[0] = 1.0f + 0x1p-8f;
  w.f32()[0] = 1.0f;
  GroupedLinearForward(ctx, y, x, {w}, {0, 1});
  EXPECT_EQ(y.f32()[0], 1.0f + 0x1p-8f);
}

}  // namespace
}  // namespace strata::ops
