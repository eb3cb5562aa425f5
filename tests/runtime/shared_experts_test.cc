// Shared experts (model.moe.num_shared_experts): an FFN every token goes through beside its routed
// experts, with weight 1, never dropped, whose parameters are dense.
//
// Each check is against something computed without the layer's code: the shared output against
// a double-precision FFN loop written here over the shared weights (on top of the same layer
// without shared experts, whose routed part moe_layer_test checks); the gradients of the shared
// weights and of the input against central finite differences of a double-precision reference of
// the whole layer (softmax top-k routing, routed and shared FFNs); the model's parameter lists and
// counts against a hand count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/common/rng.h"
#include "runtime/model/moe_layer.h"
#include "runtime/model/transformer.h"
#include "tests/runtime/moe_test_util.h"

namespace strata::model {
namespace {

using config::GateConfig;

struct Case {
  std::string name;
  ops::Activation activation;
  bool bias;
  int shared;  // shared experts of width kH, run as one FFN of width shared * kH
  int k;
  bool in_groups =
      false;  // the shared FFN as a task of the expert groups (not split over the pool)
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int kTokens = 16, kC = 6, kH = 4, kE = 4, kLayer = 2;
constexpr uint64_t kSeed = 31, kStep = 7;

// An FFN's weights as doubles (FfnExpert's layout: W1 [in_width, C], gate rows then up rows for
// SwiGLU; W2 [C, hidden]), and the FFN of one row, written out from the definitions.
struct RefFfn {
  ops::Activation act;
  int64_t hidden = 0;
  std::vector<double> w1, b1, w2, b2;  // b1 and b2 empty without biases
};

RefFfn Snapshot(FfnExpert& f) {
  auto vec = [](const Tensor& t) { return std::vector<double>(t.f32(), t.f32() + t.numel()); };
  RefFfn r{
      f.options().activation, f.options().d_hidden, vec(f.w1().value), {}, vec(f.w2().value), {}};
  if (f.b1() != nullptr) r.b1 = vec(f.b1()->value);
  if (f.b2() != nullptr) r.b2 = vec(f.b2()->value);
  return r;
}

// out[C] += scale * ffn(x[C]).
void ApplyFfn(const RefFfn& f, const double* x, double scale, double* out) {
  const int64_t H = f.hidden, in = f.act == ops::Activation::kSwiglu ? 2 * H : H;
  std::vector<double> pre(in), act(H);
  for (int64_t h = 0; h < in; ++h) {
    double s = f.b1.empty() ? 0.0 : f.b1[h];
    for (int i = 0; i < kC; ++i) s += f.w1[h * kC + i] * x[i];
    pre[h] = s;
  }
  for (int64_t h = 0; h < H; ++h) {
    const double v = pre[h];
    switch (f.act) {
      case ops::Activation::kGelu:
        act[h] = 0.5 * v * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
        break;
      case ops::Activation::kRelu:
        act[h] = v > 0 ? v : 0;
        break;
      case ops::Activation::kSwiglu:
        act[h] = v / (1 + std::exp(-v)) * pre[H + h];
        break;
    }
  }
  for (int i = 0; i < kC; ++i) {
    double s = f.b2.empty() ? 0.0 : f.b2[i];
    for (int64_t h = 0; h < H; ++h) s += f.w2[i * H + h] * act[h];
    out[i] += scale * s;
  }
}

// The whole layer in double: softmax over the router logits, the top k (ties to the lower id),
// weights renormalised over the k for k >= 2, dropless; y = sum of weighted routed FFNs + the
// shared FFN. `choices` gets every token's experts, to show a perturbation left routing alone.
struct RefLayer {
  std::vector<double> router;  // [E, C]
  std::vector<RefFfn> experts;
  RefFfn shared;
};

std::vector<double> Reference(const RefLayer& p, int k, const std::vector<double>& x,
                              std::vector<int>* choices = nullptr) {
  std::vector<double> y(kTokens * kC, 0.0);
  if (choices != nullptr) choices->clear();
  for (int t = 0; t < kTokens; ++t) {
    const double* xt = x.data() + t * kC;
    std::vector<double> prob(kE);
    double z = 0;
    for (int e = 0; e < kE; ++e) {
      double s = 0;
      for (int i = 0; i < kC; ++i) s += p.router[e * kC + i] * xt[i];
      prob[e] = std::exp(s);
      z += prob[e];
    }
    for (double& v : prob) v /= z;
    std::vector<int> order(kE);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += prob[order[j]];
    for (int j = 0; j < k; ++j) {
      ApplyFfn(p.experts[order[j]], xt, prob[order[j]] / (k > 1 ? sum : 1.0), &y[t * kC]);
      if (choices != nullptr) choices->push_back(order[j]);
    }
    ApplyFfn(p.shared, xt, 1.0, &y[t * kC]);
  }
  return y;
}

class SharedExpertsTest : public ::testing::TestWithParam<Case> {
 protected:
  // The layer, with or without the shared experts; the same names give the same routed weights.
  std::unique_ptr<MoeLayer> MakeLayer(bool with_shared, double capacity_factor = 0) {
    const Case& c = GetParam();
    SoftmaxGateOptions g;
    g.d_model = kC;
    g.num_experts = kE;
    g.k = c.k;
    g.max_tokens = kTokens;
    g.config.set_type(GateConfig::TOP_K);
    g.config.set_capacity_factor_train(capacity_factor);
    // No auxiliary losses: the loss below is <R, y> alone, so the reference needs no gate losses.
    g.config.set_aux_loss_coef(0);
    g.config.set_z_loss_coef(0);
    g.seed = kSeed;
    g.layer = kLayer;
    g.init_std = 0.8f;  // a peaked router, far from ties
    std::vector<std::unique_ptr<Expert>> experts;
    for (int e = 0; e < kE; ++e) {
      FfnOptions f{kC, kH, c.activation, c.bias, 0.5f, 0.5f};
      experts.push_back(std::make_unique<FfnExpert>(absl::StrCat("experts.", e), f));
    }
    std::unique_ptr<FfnExpert> shared;
    if (with_shared) {
      FfnOptions f{kC, c.shared * kH, c.activation, c.bias, 0.5f, 0.5f};
      shared = std::make_unique<FfnExpert>("shared", f);
    }
    auto layer = std::make_unique<MoeLayer>(kC, kTokens, MakeGate("gate", g), std::move(experts), 0,
                                            Device::Cpu(), std::move(shared));
    layer->set_shared_in_expert_groups(c.in_groups);
    for (Parameter* p : layer->Parameters()) {
      InitializeWithBiases(ctx_, *p, kSeed);
      p->grad.SetZero();
    }
    return layer;
  }

  void SetUp() override {
    std::mt19937 gen(3);
    std::normal_distribution<float> nd(0, 1);
    x_ = Tensor::Empty({kTokens, kC});
    for (int64_t i = 0; i < x_.numel(); ++i) x_.f32()[i] = nd(gen);
    r_ = Tensor::Empty({kTokens, kC});
    for (int64_t i = 0; i < r_.numel(); ++i) r_.f32()[i] = nd(gen);
  }

  std::vector<double> X() const { return std::vector<double>(x_.f32(), x_.f32() + x_.numel()); }

  ThreadPool pool_{2};
  ops::Context ctx_{&pool_};
  Tensor x_, r_;
};

TEST_P(SharedExpertsTest, OutputIsTheRoutedLayerPlusAnFfnOfTheSharedWeights) {
  auto plain = MakeLayer(false), layer = MakeLayer(true);
  ASSERT_NE(layer->shared(), nullptr);
  EXPECT_EQ(layer->shared()->options().d_hidden, GetParam().shared * kH);
  Tensor y0 = Tensor::Empty({kTokens, kC}), y = Tensor::Empty({kTokens, kC});
  plain->Forward(ctx_, x_, y0, GateCall{true, kStep});
  layer->Forward(ctx_, x_, y, GateCall{true, kStep});
  EXPECT_EQ(layer->stats().load, plain->stats().load) << "the shared experts changed the routing";
  const RefFfn shared = Snapshot(*layer->shared());
  const std::vector<double> x = X();
  double largest = 0;
  for (int t = 0; t < kTokens; ++t) {
    std::vector<double> want(kC, 0.0);
    ApplyFfn(shared, x.data() + t * kC, 1.0, want.data());
    for (int i = 0; i < kC; ++i) {
      EXPECT_NEAR(y.f32()[t * kC + i], y0.f32()[t * kC + i] + want[i], 1e-5)
          << "token " << t << " column " << i;
      largest = std::max(largest, std::abs(want[i]));
    }
  }
  EXPECT_GT(largest, 0.1) << "the shared FFN's output is too small to tell";
  // In groups, the shared FFN really ran as a task of the per-thread expert groups.
  if (GetParam().in_groups) {
    EXPECT_TRUE(layer->last_run_grouped());
  }
}

TEST_P(SharedExpertsTest, GradientsMatchFiniteDifferencesOfReference) {
  const Case& c = GetParam();
  auto plain = MakeLayer(false), layer = MakeLayer(true);
  Tensor y = Tensor::Empty({kTokens, kC}), dx = Tensor::Empty({kTokens, kC});
  Tensor dx0 = Tensor::Empty({kTokens, kC});
  layer->Forward(ctx_, x_, y, GateCall{true, kStep});
  layer->Backward(ctx_, x_, r_, dx);
  plain->Forward(ctx_, x_, y, GateCall{true, kStep});
  plain->Backward(ctx_, x_, r_, dx0);

  RefLayer p;
  const Tensor& router = static_cast<SoftmaxGate&>(layer->gate()).router().value;
  p.router = std::vector<double>(router.f32(), router.f32() + router.numel());
  for (int e = 0; e < kE; ++e)
    p.experts.push_back(Snapshot(static_cast<FfnExpert&>(layer->expert(e))));
  p.shared = Snapshot(*layer->shared());
  std::vector<double> x = X();
  auto loss = [&] {
    const std::vector<double> yr = Reference(p, c.k, x);
    double l = 0;
    for (int i = 0; i < kTokens * kC; ++i) l += yr[i] * r_.f32()[i];
    return l;
  };
  std::vector<int> base_choices, choices;
  Reference(p, c.k, x, &base_choices);
  const double h = 1e-6;
  int checked = 0;
  auto check = [&](const char* what, std::vector<double>& v, const float* analytic) {
    for (size_t i = 0; i < v.size(); ++i) {
      const double saved = v[i];
      v[i] = saved + h;
      const double lp = loss();
      Reference(p, c.k, x, &choices);
      ASSERT_EQ(choices, base_choices) << what << "[" << i << "] changed the routing";
      v[i] = saved - h;
      const double lm = loss();
      v[i] = saved;
      const double numeric = (lp - lm) / (2 * h);
      EXPECT_NEAR(analytic[i], numeric, 2e-4 + 2e-3 * std::abs(numeric)) << what << "[" << i << "]";
      ++checked;
    }
  };
  check("x", x, dx.f32());
  FfnExpert& s = *layer->shared();
  check("shared.w1", p.shared.w1, s.w1().grad.f32());
  check("shared.w2", p.shared.w2, s.w2().grad.f32());
  if (c.bias) {
    check("shared.b1", p.shared.b1, s.b1()->grad.f32());
    check("shared.b2", p.shared.b2, s.b2()->grad.f32());
  }
  EXPECT_GT(checked, kTokens * kC + 2 * kC * kH);
  // The routed experts' and the gate's gradients do not see the shared path: bitwise those of
  // the same layer without it.
  std::vector<Parameter*> with = layer->Parameters(), without = plain->Parameters();
  std::set<Parameter*> shared_params;
  for (Parameter* q : s.Parameters()) shared_params.insert(q);
  size_t j = 0;
  for (Parameter* q : with) {
    if (shared_params.count(q) > 0) continue;
    ASSERT_LT(j, without.size());
    ASSERT_EQ(q->name, without[j]->name);
    EXPECT_EQ(0, std::memcmp(q->grad.f32(), without[j]->grad.f32(), 4 * q->grad.numel()))
        << q->name;
    ++j;
  }
  EXPECT_EQ(j, without.size());
}

TEST_P(SharedExpertsTest, TokensDroppedByCapacityStillGetTheSharedExperts) {
  // Capacity 1 per expert (ceil(0.25 * 16 * k / 4) = k): at most 4k of the 16 tokens' choices
  // are kept, so most tokens lose every routed expert.
  const Case& c = GetParam();
  auto plain = MakeLayer(false, 0.25), layer = MakeLayer(true, 0.25);
  Tensor y0 = Tensor::Empty({kTokens, kC}), y = Tensor::Empty({kTokens, kC});
  Tensor dx0 = Tensor::Empty({kTokens, kC}), dx = Tensor::Empty({kTokens, kC});
  plain->Forward(ctx_, x_, y0, GateCall{true, kStep});
  plain->Backward(ctx_, x_, r_, dx0);
  layer->Forward(ctx_, x_, y, GateCall{true, kStep});
  layer->Backward(ctx_, x_, r_, dx);
  const RefFfn shared = Snapshot(*layer->shared());
  const std::vector<double> x = X();
  int dropped = 0;
  for (int t = 0; t < kTokens; ++t) {
    bool routed = false;
    for (int i = 0; i < kC; ++i) routed |= y0.f32()[t * kC + i] != 0.0f;
    if (routed) continue;
    ++dropped;
    // Output: the shared FFN alone.
    std::vector<double> want(kC, 0.0);
    ApplyFfn(shared, x.data() + t * kC, 1.0, want.data());
    for (int i = 0; i < kC; ++i) {
      EXPECT_NEAR(y.f32()[t * kC + i], want[i], 1e-5) << "token " << t << " column " << i;
      EXPECT_EQ(dx0.f32()[t * kC + i], 0.0f) << "a dropped token has no routed gradient";
    }
    // Input gradient: the shared FFN's, by central differences of <R_t, shared(x_t)>.
    std::vector<double> xt(x.begin() + t * kC, x.begin() + (t + 1) * kC);
    for (int i = 0; i < kC; ++i) {
      auto at = [&](double v) {
        std::vector<double> xv = xt, out(kC, 0.0);
        xv[i] = v;
        ApplyFfn(shared, xv.data(), 1.0, out.data());
        double l = 0;
        for (int j = 0; j < kC; ++j) l += out[j] * r_.f32()[t * kC + j];
        return l;
      };
      const double numeric = (at(xt[i] + 1e-6) - at(xt[i] - 1e-6)) / 2e-6;
      EXPECT_NEAR(dx.f32()[t * kC + i], numeric, 2e-4 + 2e-3 * std::abs(numeric))
          << "token " << t << " column " << i;
    }
  }
  EXPECT_EQ(dropped, layer->stats().dropped_tokens);
  EXPECT_GE(dropped, kTokens - 4 * c.k) << "this case is meant to drop whole tokens";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SharedExpertsTest,
    ::testing::Values(Case{"gelu_bias_2_shared_top2", ops::Activation::kGelu, true, 2, 2},
                      Case{"swiglu_no_bias_1_shared_top2", ops::Activation::kSwiglu, false, 1, 2},
                      Case{"relu_bias_3_shared_top1", ops::Activation::kRelu, true, 3, 1},
                      Case{"gelu_bias_2_shared_top2_in_groups", ops::Activation::kGelu, true, 2, 2,
                           true},
                      Case{"swiglu_no_bias_1_shared_top1_in_groups", ops::Activation::kSwiglu,
                           false, 1, 1, true}),
    CaseName);

// V 17, T 6, C 8, 2 MoE blocks of 4 experts of width 6 (top-2) and 1 shared expert of width 6.
config::ModelConfig SharedModel() {
  config::ModelConfig m;
  m.set_vocab_size(17);
  m.set_seq_len(6);
  m.set_d_model(8);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_moe_every(1);
  m.mutable_moe()->set_num_experts(4);
  m.mutable_moe()->set_top_k(2);
  m.mutable_moe()->set_d_expert(6);
  m.mutable_moe()->set_num_shared_experts(1);  // shared_d_expert: d_expert
  return m;
}

class SharedExpertsModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.config = SharedModel();
    options_.max_batch = 2;
    auto made = MoeTransformer::Create(ctx_, options_);
    ASSERT_TRUE(made.ok()) << made.status();
    model_ = std::move(*made);
  }

  ThreadPool pool_{2};
  ops::Context ctx_{&pool_};
  ModelOptions options_;
  std::unique_ptr<MoeTransformer> model_;
};

TEST_F(SharedExpertsModelTest, SharedExpertsAreDenseParametersOfTheirBlock) {
  MoeTransformer& m = *model_;
  // By hand: wte 17*8 + wpe 6*8 + final norm 2*8 = 200; per block qkv 3*8*8 + 24, proj 8*8 + 8,
  // two norms 2*16 = 320 and the router 4*8 = 32; an FFN of width 6 is 6*8 + 6 + 8*6 + 8 = 110,
  // one shared and 4 routed per block.
  const int64_t ffn = 110;
  const int64_t dense = 200 + 2 * (320 + 32 + ffn), experts = 2 * 4 * ffn;
  EXPECT_EQ(CountScalars(m.DenseParameters()), dense);
  EXPECT_EQ(CountScalars(m.Parameters()), dense + experts);
  EXPECT_EQ(m.ActiveParametersPerToken(), dense + 2 * 2 * ffn);  // + top-2 routed per block

  const std::set<Parameter*> is_dense(m.DenseParameters().begin(), m.DenseParameters().end());
  for (int b = 0; b < 2; ++b) {
    const std::vector<Parameter*> own_list = m.BlockParameters(b);
    const std::vector<Parameter*> other_list = m.BlockParameters(1 - b);
    const std::set<Parameter*> own(own_list.begin(), own_list.end());
    const std::set<Parameter*> other(other_list.begin(), other_list.end());
    int found = 0;
    for (const char* name : {"w1", "b1", "w2", "b2"}) {
      Parameter* p = m.FindParameter(absl::StrCat("blocks.", b, ".moe.shared.", name));
      ASSERT_NE(p, nullptr) << "blocks." << b << ".moe.shared." << name;
      EXPECT_EQ(is_dense.count(p), 1u) << p->name << " is not a dense parameter";
      EXPECT_EQ(own.count(p), 1u) << p->name << " is not among its block's parameters";
      EXPECT_EQ(other.count(p), 0u) << p->name;
      found += own.count(p) > 0;
    }
    EXPECT_EQ(found, 4);
    std::vector<Parameter*> dense_of_layer = m.moe_layers()[b].layer->DenseParameters();
    EXPECT_EQ(CountScalars(dense_of_layer), 32 + ffn);
    // A routed expert's parameters are not dense.
    EXPECT_EQ(is_dense.count(m.FindParameter(absl::StrCat("blocks.", b, ".moe.experts.0.w1"))), 0u);
  }

  // Expert parallelism and the tiered store: a worker holding experts [2, 4) and its routed
  // experts unbound still holds, bound, the same shared experts with the same initial values.
  ModelOptions part = options_;
  part.first_local_expert = 2;
  part.num_local_experts = 2;
  part.unbound_experts = true;
  auto worker = MoeTransformer::Create(ctx_, part);
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_EQ((*worker)->DenseParameters().size(), m.DenseParameters().size());
  for (size_t i = 0; i < m.DenseParameters().size(); ++i) {
    const Parameter* a = m.DenseParameters()[i];
    const Parameter* w = (*worker)->DenseParameters()[i];
    ASSERT_EQ(a->name, w->name);
    ASSERT_TRUE(w->value.defined()) << w->name << " is unbound";
    EXPECT_EQ(0, std::memcmp(a->value.f32(), w->value.f32(), 4 * a->value.numel())) << a->name;
  }
  EXPECT_FALSE((*worker)->FindParameter("blocks.0.moe.experts.2.w1")->value.defined());
}

TEST_F(SharedExpertsModelTest, TrainingStepGivesTheSharedExpertsAGradient) {
  MoeTransformer& m = *model_;
  std::vector<int32_t> tokens(12), targets(12);
  for (int i = 0; i < 12; ++i) tokens[i] = (5 * i) % 17, targets[i] = (7 * i + 3) % 17;
  m.ZeroGrad();
  const double loss = m.Forward(ctx_, tokens.data(), targets.data(), 2, GateCall{true, 1});
  EXPECT_TRUE(std::isfinite(loss));
  m.Backward(ctx_);
  for (int b = 0; b < 2; ++b) {
    for (Parameter* p : m.moe_layers()[b].layer->shared()->Parameters()) {
      double sum = 0;
      for (int64_t i = 0; i < p->grad.numel(); ++i) sum += std::abs(p->grad.f32()[i]);
      EXPECT_GT(sum, 0) << p->name << " got no gradient";
    }
  }
}

}  // namespace
}  // namespace strata::model
