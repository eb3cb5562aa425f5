// The whole MoE Transformer: its gradient against finite differences of its loss along random
// directions, initialisation as a pure function of (seed, name), and every norm/activation/gate
// combination building and running.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "proto/config_io.h"
#include "runtime/model/transformer.h"
#include "tests/runtime/moe_test_util.h"

namespace strata::model {
namespace {

config::ModelConfig TinyModel() {
  config::ModelConfig m;
  m.set_vocab_size(17);
  m.set_seq_len(6);
  m.set_d_model(8);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_d_ff(12);
  m.set_moe_every(1);
  m.mutable_moe()->set_num_experts(4);
  m.mutable_moe()->set_top_k(2);
  m.mutable_moe()->set_d_expert(6);
  m.set_init_std(0.3f);
  return m;
}

// Directional derivative check: (L(p + h d) - L(p - h d)) / 2h against <grad, d>, in float, for
// random directions d over all parameters at once. This exercises the wiring of every block —
// residuals, norms, attention, MoE — together.
void ExpectDirectionalDerivatives(const config::ModelConfig& cfg, int B) {
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  ModelOptions o;
  o.config = cfg;
  o.seed = 5;
  o.max_batch = B;
  auto model = MoeTransformer::Create(ctx, o);
  ASSERT_TRUE(model.ok()) << model.status();
  MoeTransformer& m = **model;
  Batch b = RandomBatch(B, cfg.seq_len(), cfg.vocab_size(), 9);
  const GateCall call{true, 3};
  // The experts every token was routed to, in every MoE layer.
  auto routing = [&] {
    std::vector<int32_t> r;
    for (const auto& ref : m.moe_layers()) {
      const Tensor& e = ref.layer->routing().expert;
      r.insert(r.end(), e.i32(), e.i32() + e.numel());
    }
    return r;
  };
  auto loss = [&] {
    double l = m.Forward(ctx, b.tokens.data(), b.targets.data(), B, call);
    for (const auto& ref : m.moe_layers()) {
      l += cfg.moe().gate().aux_loss_coef() * ref.layer->stats().aux_loss +
           cfg.moe().gate().z_loss_coef() * ref.layer->stats().z_loss;
    }
    return l;
  };
  m.ZeroGrad();
  loss();
  const std::vector<int32_t> base_routing = routing();
  m.Backward(ctx);
  std::mt19937 g(1);
  std::normal_distribution<float> nd(0, 1);
  int valid = 0;
  for (int trial = 0; trial < 12 && valid < 3; ++trial) {
    std::vector<std::vector<float>> dir;
    double analytic = 0;
    for (Parameter* p : m.Parameters()) {
      dir.emplace_back(p->value.numel());
      for (int64_t i = 0; i < p->value.numel(); ++i) {
        dir.back()[i] = nd(g);
        analytic += static_cast<double>(dir.back()[i]) * p->grad.f32()[i];
      }
    }
    auto shift = [&](float h) {
      size_t k = 0;
      for (Parameter* p : m.Parameters()) {
        for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] += h * dir[k][i];
        ++k;
      }
    };
    const float h = 5e-4f;
    shift(h);
    const double lp = loss();
    const bool same_plus = routing() == base_routing;
    shift(-2 * h);
    const double lm = loss();
    const bool same_minus = routing() == base_routing;
    shift(h);
    if (!same_plus || !same_minus) continue;  // a token switched experts: not differentiable here
    ++valid;
    const double numeric = (lp - lm) / (2 * h);
    EXPECT_NEAR(analytic, numeric, 0.02 * std::abs(numeric) + 5e-3)
        << "direction " << trial << " analytic " << analytic << " numeric " << numeric;
  }
  EXPECT_EQ(valid, 3) << "too many random directions changed the routing";
}

TEST(ModelTest, GradientMatchesFiniteDifferencesLayerNormGelu) {
  ExpectDirectionalDerivatives(TinyModel(), 2);
}

TEST(ModelTest, GradientMatchesFiniteDifferencesRmsNormSwigluUntiedMixedLayers) {
  config::ModelConfig cfg = TinyModel();
  cfg.set_norm(config::ModelConfig::RMS_NORM);
  cfg.set_activation(config::ModelConfig::SWIGLU);
  cfg.set_tie_embeddings(false);
  cfg.set_n_layers(3);
  cfg.set_moe_every(2);  // block 1 is MoE, blocks 0 and 2 dense
  ExpectDirectionalDerivatives(cfg, 2);
}

TEST(ModelTest, InitialisationIsAPureFunctionOfSeedAndName) {
  ThreadPool one(1), three(3);
  ops::Context c1{&one}, c3{&three};
  ModelOptions o;
  o.config = TinyModel();
  o.seed = 11;
  auto a = MoeTransformer::Create(c1, o);
  auto b = MoeTransformer::Create(c3, o);
  o.seed = 12;
  auto c = MoeTransformer::Create(c1, o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_EQ((*a)->Parameters().size(), (*b)->Parameters().size());
  bool any_differs = false;
  for (size_t i = 0; i < (*a)->Parameters().size(); ++i) {
    const Tensor& va = (*a)->Parameters()[i]->value;
    const Tensor& vb = (*b)->Parameters()[i]->value;
    const Tensor& vc = (*c)->Parameters()[i]->value;
    EXPECT_EQ(0, std::memcmp(va.f32(), vb.f32(), va.bytes())) << (*a)->Parameters()[i]->name;
    any_differs |= std::memcmp(va.f32(), vc.f32(), va.bytes()) != 0;
  }
  EXPECT_TRUE(any_differs);
  // Normal initialisation has the configured spread.
  Parameter* w = (*a)->FindParameter("blocks.0.attn.qkv.weight");
  ASSERT_NE(w, nullptr);
  double s2 = 0;
  for (int64_t i = 0; i < w->value.numel(); ++i) s2 += w->value.f32()[i] * w->value.f32()[i];
  EXPECT_NEAR(std::sqrt(s2 / w->value.numel()), 0.3, 0.06);
}

TEST(ModelTest, EveryGateTypeTrainsAStep) {
  for (auto type : {config::GateConfig::TOP_K, config::GateConfig::SWITCH,
                    config::GateConfig::GSHARD, config::GateConfig::NOISY_TOP_K}) {
    config::JobConfig job;
    *job.mutable_model() = TinyModel();
    auto* moe = job.mutable_model()->mutable_moe();
    moe->clear_top_k();
    moe->mutable_gate()->set_type(type);
    moe->mutable_gate()->set_capacity_factor_train(1.0f);
    config::Normalize(&job);
    ThreadPool pool(2);
    ops::Context ctx{&pool};
    ModelOptions o;
    o.config = job.model();
    o.max_batch = 3;
    auto m = MoeTransformer::Create(ctx, o);
    ASSERT_TRUE(m.ok()) << m.status();
    Batch b = RandomBatch(3, 6, 17, 2);
    double loss = (*m)->Forward(ctx, b.tokens.data(), b.targets.data(), 3, GateCall{true, 0});
    EXPECT_NEAR(loss, std::log(17.0), 1.5);  // near-uniform predictions at initialisation
    (*m)->Backward(ctx);
    const int k = type == config::GateConfig::SWITCH ? 1 : 2;
    EXPECT_EQ((*m)->moe_layers()[0].layer->gate().k(), k);
    int64_t routed = 0;
    for (int64_t l : (*m)->moe_layers()[0].layer->stats().load) routed += l;
    EXPECT_LE(routed, 18 * k);
  }
}

}  // namespace
}  // namespace strata::model
