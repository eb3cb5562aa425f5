// Mixed precision (ModelOptions::bf16, train.precision BF16) on the CPU, whose bf16 GEMMs emulate
// the GPU's rounding: the compute copies give the bits of rounding every weight as it is used,
// they are made again after every update (a model built from the updated weights agrees bit for
// bit), Decode makes and uses them too, the router ignores the precision, and bf16 moves the loss
// by rounding only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "runtime/model/adamw.h"
#include "runtime/model/gate.h"
#include "runtime/model/transformer.h"
#include "tests/runtime/moe_test_util.h"

namespace strata::model {
namespace {

config::ModelConfig SmallModel(bool swiglu_untied_shared) {
  config::ModelConfig m;
  m.set_vocab_size(29);
  m.set_seq_len(8);
  m.set_d_model(16);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_d_ff(24);
  m.set_moe_every(1);
  m.mutable_moe()->set_num_experts(4);
  m.mutable_moe()->set_top_k(2);
  m.mutable_moe()->set_d_expert(12);
  m.set_init_std(0.2f);
  if (swiglu_untied_shared) {
    m.set_norm(config::ModelConfig::RMS_NORM);
    m.set_activation(config::ModelConfig::SWIGLU);
    m.set_tie_embeddings(false);
    m.mutable_moe()->set_num_shared_experts(1);
    m.set_moe_every(2);  // block 0 dense, block 1 MoE
  }
  return m;
}

class MixedPrecisionTest : public ::testing::TestWithParam<bool> {
 protected:
  std::unique_ptr<MoeTransformer> Build(bool bf16) {
    ModelOptions o;
    o.config = SmallModel(GetParam());
    o.seed = 7;
    o.max_batch = kB;
    o.bf16 = bf16;
    auto m = MoeTransformer::Create(ctx_, o);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *std::move(m) : nullptr;
  }
  double Loss(MoeTransformer& m, const Batch& b, bool training) {
    return m.Forward(ctx_, b.tokens.data(), b.targets.data(), kB, GateCall{training, 1});
  }
  Batch MakeBatch(unsigned seed) const {
    const config::ModelConfig c = SmallModel(GetParam());
    return RandomBatch(kB, c.seq_len(), c.vocab_size(), seed);
  }

  static constexpr int kB = 3;
  ThreadPool pool_{2};
  ops::Context ctx_{&pool_};
};

// Every GEMM weight of a BF16 model has a bf16 copy on the model's device; the router has none
// (its GEMM stays fp32), nor does anything that is not a GEMM weight; an fp32 model has none.
TEST_P(MixedPrecisionTest, GemmWeightsHaveBf16CopiesAndNothingElse) {
  auto bf16 = Build(true);
  auto fp32 = Build(false);
  ASSERT_TRUE(bf16 && fp32);
  int copies = 0;
  for (Parameter* p : bf16->Parameters()) {
    const bool router = p->name.find(".gate.") != std::string::npos;
    const bool matrix = p->shape.rank() == 2 && p->name != "wpe" &&
                        (p->name != "wte" || !bf16->FindParameter("lm_head"));
    EXPECT_EQ(p->compute.defined(), matrix && !router) << p->name;
    if (p->compute.defined()) {
      ++copies;
      EXPECT_EQ(p->compute.dtype(), DType::kBF16) << p->name;
      EXPECT_TRUE(p->compute.shape() == p->shape) << p->name;
    }
  }
  EXPECT_GT(copies, 6);
  for (Parameter* p : fp32->Parameters()) EXPECT_FALSE(p->compute.defined()) << p->name;
}

// The copies are the operands rounding at use would give: a model whose copies are dropped (every
// GEMM then rounds its fp32 weight itself, as a tiered expert's does) computes the same loss and
// the same gradients, bit for bit.
TEST_P(MixedPrecisionTest, CopiesGiveTheBitsOfRoundingEveryWeightAtUse) {
  auto with = Build(true);
  auto without = Build(true);
  ASSERT_TRUE(with && without);
  for (Parameter* p : without->Parameters()) p->compute = Tensor();
  const Batch b = MakeBatch(11);
  const double a = Loss(*with, b, true), c = Loss(*without, b, true);
  EXPECT_EQ(0, std::memcmp(&a, &c, sizeof a)) << a << " vs " << c;
  with->Backward(ctx_);
  without->Backward(ctx_);
  const auto pa = with->Parameters(), pc = without->Parameters();
  ASSERT_EQ(pa.size(), pc.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(pa[i]->grad.f32(), pc[i]->grad.f32(), pa[i]->grad.bytes()))
        << pa[i]->name;
  }
}

// After an update the next Forward multiplies copies of the new weights: a model built afresh
// with the updated values (its copies made from them) gives the same loss bit for bit, and a
// model still at the old weights does not.
TEST_P(MixedPrecisionTest, CopiesAreMadeAgainAfterEveryUpdate) {
  auto trained = Build(true);
  ASSERT_TRUE(trained);
  AdamWOptions ao;
  AdamW opt(trained->Parameters(), ao);
  const Batch b1 = MakeBatch(21), b2 = MakeBatch(22);
  for (int step = 0; step < 2; ++step) {
    trained->ZeroGrad();
    Loss(*trained, b1, true);
    trained->Backward(ctx_);
    opt.Step(ctx_, 1e-2, 1.0);
  }
  const double after = Loss(*trained, b2, false);

  auto fresh = Build(true);
  auto old = Build(true);
  ASSERT_TRUE(fresh && old);
  const auto from = trained->Parameters(), to = fresh->Parameters();
  for (size_t i = 0; i < from.size(); ++i) to[i]->value.CopyFrom(from[i]->value);
  const double rebuilt = Loss(*fresh, b2, false);
  EXPECT_EQ(0, std::memcmp(&after, &rebuilt, sizeof after)) << after << " vs " << rebuilt;
  EXPECT_NE(Loss(*old, b2, false), after) << "the update changed nothing";

  // Decode, after the training Forward, multiplies the same copies: its logits of a prompt's last
  // position equal the (evaluation) Forward's at that position.
  const int64_t T = SmallModel(GetParam()).seq_len(), V = SmallModel(GetParam()).vocab_size();
  trained->ZeroGrad();
  Loss(*trained, b1, true);
  trained->Backward(ctx_);
  opt.Step(ctx_, 1e-2, 1.0);
  Loss(*trained, b2, false);
  std::vector<float> full(static_cast<size_t>(kB * T * V));
  trained->logits().CopyToHost(full.data());
  std::vector<int32_t> slots(T, 0), positions(T);
  for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(t);
  Tensor logits = trained->Decode(ctx_, b2.tokens.data(), slots.data(), positions.data(), T);
  std::vector<float> dec(static_cast<size_t>(T * V));
  logits.CopyToHost(dec.data());
  for (int64_t v = 0; v < V; ++v) {
    EXPECT_NEAR(dec[(T - 1) * V + v], full[(T - 1) * V + v], 1e-4) << v;
  }
}

// Decode makes the copies when nothing has since the last Forward, and then multiplies them: a
// model's first Decode (no Forward before it) gives the logits a Forward gives; copies spoiled
// after it change the next Decode (they are what its GEMMs read, and are not made again), and
// RefreshComputeCopies, or a Forward, makes them anew.
TEST_P(MixedPrecisionTest, DecodeMakesAndUsesTheCopies) {
  const config::ModelConfig c = SmallModel(GetParam());
  const int64_t T = c.seq_len(), V = c.vocab_size();
  const Batch b = MakeBatch(41);
  auto decoded = Build(true);
  auto forward = Build(true);
  ASSERT_TRUE(decoded && forward);
  std::vector<int32_t> positions(T);
  for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(t);
  auto decode = [&](int slot) {
    const std::vector<int32_t> slots(T, slot);
    Tensor logits = decoded->Decode(ctx_, b.tokens.data(), slots.data(), positions.data(), T);
    std::vector<float> out(static_cast<size_t>(T * V));
    logits.CopyToHost(out.data());
    return out;
  };
  const std::vector<float> first = decode(0);
  Loss(*forward, b, false);
  std::vector<float> full(static_cast<size_t>(kB * T * V));
  forward->logits().CopyToHost(full.data());
  for (int64_t i = 0; i < T * V; ++i) ASSERT_NEAR(first[i], full[i], 1e-4) << i;

  for (Parameter* p : decoded->Parameters()) {
    if (p->compute.defined()) p->compute.SetZero();
  }
  EXPECT_NE(decode(1), first) << "Decode did not multiply the compute copies";
  decoded->RefreshComputeCopies(ctx_);
  EXPECT_EQ(decode(2), first);
  for (Parameter* p : decoded->Parameters()) {
    if (p->compute.defined()) p->compute.SetZero();
  }
  Loss(*decoded, b, false);  // a Forward makes them again, and the next Decode too
  EXPECT_EQ(decode(0), first);
}

// The router's GEMMs ignore Context::bf16: the same weights route the same tokens with the same
// combine weights, and give the same router gradients (the noise router's too), bit for bit, for
// the softmax gates and expert choice.
TEST(MixedPrecisionRouterTest, TheRouterStaysFp32) {
  ThreadPool pool(2);
  for (auto type : {config::GateConfig::TOP_K, config::GateConfig::NOISY_TOP_K,
                    config::GateConfig::EXPERT_CHOICE}) {
    SCOPED_TRACE(config::GateConfig::Type_Name(type));
    SoftmaxGateOptions g;
    g.d_model = 16;
    g.num_experts = 8;
    g.k = 2;
    g.max_tokens = 24;
    g.seed = 3;
    g.init_std = 0.5f;
    g.config.set_type(type);
    if (type == config::GateConfig::EXPERT_CHOICE) g.config.set_capacity_factor_train(1.0f);
    std::unique_ptr<Gate> gate32 = MakeGate("g", g), gate16 = MakeGate("g", g);
    std::mt19937 rng(5);
    std::normal_distribution<float> d;
    Tensor x = Tensor::Empty({24, 16});
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = d(rng);
    ops::Context fp32{&pool}, bf16{&pool};
    bf16.bf16 = true;
    Routing r32, r16;
    std::vector<Tensor> dx(2);
    int side = 0;
    for (auto [gate, ctx, r] :
         {std::tuple{gate32.get(), &fp32, &r32}, std::tuple{gate16.get(), &bf16, &r16}}) {
      for (Parameter* p : gate->Parameters()) Initialize(*ctx, *p, 9);
      gate->Forward(*ctx, x, GateCall{true, 1}, r);
      Tensor dw = Tensor::Empty({r->tokens, r->k});
      std::mt19937 drng(6);
      for (int64_t i = 0; i < dw.numel(); ++i) dw.f32()[i] = d(drng);
      dx[side] = Tensor::Zeros({24, 16});
      gate->Backward(*ctx, x, dw, dx[side++]);
    }
    ASSERT_EQ(r32.expert.numel(), r16.expert.numel());
    EXPECT_EQ(0, std::memcmp(r32.expert.i32(), r16.expert.i32(), r32.expert.bytes()));
    EXPECT_EQ(0, std::memcmp(r32.weight.f32(), r16.weight.f32(), r32.weight.bytes()));
    EXPECT_EQ(0, std::memcmp(dx[0].f32(), dx[1].f32(), dx[0].bytes()));
    const auto p32 = gate32->Parameters(), p16 = gate16->Parameters();
    for (size_t i = 0; i < p32.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(p32[i]->grad.f32(), p16[i]->grad.f32(), p32[i]->grad.bytes()))
          << p32[i]->name;
    }
    // A bf16 GEMM of the same operands would round: the router inputs are not bf16 values.
    int rounded_away = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      rounded_away += ops::RoundBf16(x.f32()[i]) != x.f32()[i];
    }
    EXPECT_GT(rounded_away, x.numel() / 2);
  }
}

// bf16 moves the loss and the gradients by rounding, not by more. Each bf16 operand is within
// 2^-9 (2e-3, relative) of its fp32 value; a GEMM's output errors are sums of such errors that
// partly cancel, and the loss is a mean over 24 tokens: it moves by less than one operand's
// rounding, 3e-3 relative (measured: 3e-4 to 4e-4). A gradient goes through every GEMM of the
// backward pass and through a difference of nearly equal terms in the norms' backward: each
// tensor's worst element within 5% of its largest (measured: at most 2%). Both must move.
TEST_P(MixedPrecisionTest, Bf16DiffersFromFp32ByRoundingOnly) {
  auto bf16 = Build(true);
  auto fp32 = Build(false);
  ASSERT_TRUE(bf16 && fp32);
  const Batch b = MakeBatch(31);
  const double l16 = Loss(*bf16, b, true), l32 = Loss(*fp32, b, true);
  EXPECT_LT(std::abs(l16 - l32), 3e-3 * l32) << l16 << " vs " << l32;
  EXPECT_GT(std::abs(l16 - l32), 0.0);
  bf16->Backward(ctx_);
  fp32->Backward(ctx_);
  const auto p16 = bf16->Parameters(), p32 = fp32->Parameters();
  for (size_t i = 0; i < p16.size(); ++i) {
    double most = 0, diff = 0;
    for (int64_t j = 0; j < p32[i]->grad.numel(); ++j) {
      most = std::max(most, double(std::abs(p32[i]->grad.f32()[j])));
      diff = std::max(diff, double(std::abs(p32[i]->grad.f32()[j] - p16[i]->grad.f32()[j])));
    }
    EXPECT_LE(diff, 5e-2 * most + 1e-7) << p16[i]->name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, MixedPrecisionTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "RmsNormSwigluUntiedSharedExperts" : "Default";
                         });

}  // namespace
}  // namespace strata::model
