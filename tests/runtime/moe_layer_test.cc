// The MoE layer against a direct per-token reference loop, for every gate, with and without
// capacity drops, k = 1, 2, 4, 8; and the router options of today's MoE models: sigmoid scores,
// a selection bias (loss-free balancing), routed scaling, group-limited choice and the
// sequence-wise balancing loss.
//
// The reference (double precision) routes, drops and combines one token at a time, straight from
// the definitions in proto/config.proto, reproducing the gate's random draws from their keys. The
// layer's output, routing, drops and auxiliary losses must match it, and the layer's analytic
// gradients (input, router, noise router, every expert parameter) must match central finite
// differences of the reference loss  L = <R, y> + aux_coef * aux + z_coef * z + seq_coef * seq.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/common/rng.h"
#include "runtime/model/adamw.h"
#include "runtime/model/moe_layer.h"
#include "runtime/model/transformer.h"
#include "tests/runtime/moe_test_util.h"

// Counts heap allocations, to show the layer's steady state allocates nothing. (GCC cannot see
// that new and delete below are a matched pair.)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
static std::atomic<int64_t> g_allocations{0};
void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace strata::model {
namespace {

using config::GateConfig;

struct Case {
  std::string name;
  GateConfig::Type type;
  int k;
  double capacity_factor;  // training
  bool training = true;
  bool renormalize = true;
  int experts = 5;  // per layer (top_k up to 8 needs more)
  bool sigmoid = false;
  double scaling = 1.0;
  bool bias = false;  // loss-free balancing's selection bias (given random values)
  int groups = 0, topk_groups = 1;
  double seq_coef = 0;  // sequence-wise balancing loss, over sequences of kSeqLen tokens
};

// A case with today's router options on top of TOP_K with k of `experts`.
Case Modern(std::string name, int k, int experts, double capacity_factor) {
  Case c{std::move(name), GateConfig::TOP_K, k, capacity_factor};
  c.experts = experts;
  return c;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int kTokens = 16, kC = 6, kH = 4, kLayer = 3, kSeqLen = 5;
constexpr uint64_t kSeed = 77, kStep = 12;
constexpr double kAuxCoef = 0.05, kZCoef = 0.02;

// All of the layer's parameters as doubles, in a fixed order, so finite differences can walk them.
struct Params {
  std::vector<double> router, noise;                // [E, C]
  std::vector<double> bias;                         // [E] selection bias (a constant)
  std::vector<std::vector<double>> w1, b1, w2, b2;  // per expert
};

struct RefResult {
  std::vector<double> y;
  std::vector<int64_t> load;
  int64_t dropped = 0, dropped_tokens = 0;
  int64_t capacity = 0;  // per expert (expert choice: the tokens each took); 0 = dropless
  double aux = 0, z = 0, seq = 0;
  std::vector<int64_t> routed;  // all k choices, before capacity
};

double Gelu(double v) {
  return 0.5 * v * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
}

RefResult Reference(const Case& c, const std::vector<double>& x, const Params& p) {
  const bool expert_choice = c.type == GateConfig::EXPERT_CHOICE;
  // Expert choice: slot j of every token is expert j (dispatched where expert j took it).
  const int T = kTokens, C = kC, E = c.experts, k = expert_choice ? c.experts : c.k;
  const bool jitter = c.training && c.type == GateConfig::SWITCH;
  const bool noise = c.training && c.type == GateConfig::NOISY_TOP_K;
  const bool random_routing = c.training && c.type == GateConfig::GSHARD;
  const bool renorm = c.type == GateConfig::GSHARD || (c.renormalize && k > 1);
  const double eps = 0.1;
  std::vector<std::vector<int>> choice(T);
  std::vector<std::vector<double>> weight(T);
  std::vector<std::vector<bool>> eligible(T);
  std::vector<double> probs(T * E), lse(T);
  for (int t = 0; t < T; ++t) {
    std::vector<double> xr(C);
    for (int i = 0; i < C; ++i) {
      const double mult =
          jitter
              ? 1 - eps +
                    2 * eps * rng::Uniform(SoftmaxGate::JitterKey(kSeed, kStep, kLayer), t * C + i)
              : 1.0;
      xr[i] = x[t * C + i] * mult;
    }
    std::vector<double> logit(E);
    for (int e = 0; e < E; ++e) {
      double s = 0;
      for (int i = 0; i < C; ++i) s += xr[i] * p.router[e * C + i];
      if (noise) {
        double raw = 0;
        for (int i = 0; i < C; ++i) raw += xr[i] * p.noise[e * C + i];
        s += rng::Normal(SoftmaxGate::NoiseKey(kSeed, kStep, kLayer), t * E + e) *
             std::log1p(std::exp(raw));
      }
      logit[e] = s;
    }
    double z = 0;
    for (double l : logit) z += std::exp(l);
    lse[t] = std::log(z);
    for (int e = 0; e < E; ++e) {
      probs[t * E + e] = c.sigmoid ? 1 / (1 + std::exp(-logit[e])) : std::exp(logit[e]) / z;
    }
    // Selection values: the scores plus the bias; with groups, only the best groups' experts.
    std::vector<double> sel(E);
    for (int e = 0; e < E; ++e) sel[e] = probs[t * E + e] + (c.bias ? p.bias[e] : 0.0);
    std::vector<bool> allowed(E, true);
    if (c.groups > 1) {
      const int per = E / c.groups, m = std::max(1, k / c.topk_groups);
      std::vector<double> gscore(c.groups, 0.0);
      for (int g = 0; g < c.groups; ++g) {
        std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<double>());
        for (int j = 0; j < std::min(m, per); ++j) gscore[g] += v[j];
      }
      std::vector<int> gorder(c.groups);
      std::iota(gorder.begin(), gorder.end(), 0);
      std::stable_sort(gorder.begin(), gorder.end(),
                       [&](int a, int b) { return gscore[a] > gscore[b]; });
      for (int e = 0; e < E; ++e) {
        allowed[e] = std::find(gorder.begin(), gorder.begin() + c.topk_groups, e / per) !=
                     gorder.begin() + c.topk_groups;
      }
    }
    std::vector<int> order;
    for (int e = 0; e < E; ++e) {
      if (allowed[e]) order.push_back(e);
    }
    if (expert_choice) {  // every expert in id order; weights and choices come below
      for (int e = 0; e < E; ++e) {
        choice[t].push_back(e);
        weight[t].push_back(probs[t * E + e]);
      }
      continue;
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return sel[a] > sel[b]; });
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += probs[t * E + order[j]];
    for (int j = 0; j < k; ++j) {
      choice[t].push_back(order[j]);
      weight[t].push_back(c.scaling * probs[t * E + order[j]] / (renorm ? sum : 1.0));
      bool keep = true;
      if (random_routing && j == 1) {
        keep = 2 * weight[t][1] > rng::Uniform(SoftmaxGate::RoutingKey(kSeed, kStep, kLayer), t);
      }
      eligible[t].push_back(keep);
    }
  }
  RefResult r;
  if (expert_choice) {
    // Each expert takes its C best tokens (ties: the earlier token); capacity factor 0 reads 1.
    const double f = c.training && c.capacity_factor > 0 ? c.capacity_factor : 1.0;
    const int cap = std::min<int>(
        T, std::max(1, static_cast<int>(std::ceil(f * T * c.k / static_cast<double>(E)))));
    for (int t = 0; t < T; ++t) eligible[t].assign(E, false);
    for (int e = 0; e < E; ++e) {
      std::vector<int> tokens(T);
      std::iota(tokens.begin(), tokens.end(), 0);
      std::stable_sort(tokens.begin(), tokens.end(),
                       [&](int a, int b) { return probs[a * E + e] > probs[b * E + e]; });
      for (int i = 0; i < cap; ++i) eligible[tokens[i]][e] = true;
    }
    r.capacity = cap;
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e) {
        if (!eligible[t][e]) weight[t][e] = 0;
      }
    }
  }
  // Capacity: first choices of all tokens, then second choices, ...
  const double cf = c.training && !expert_choice ? c.capacity_factor : 0.0;
  const int64_t cap =
      cf > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(cf * T * k / E))) : 1 << 30;
  if (cf > 0) r.capacity = cap;
  r.load.assign(E, 0);
  std::vector<std::vector<bool>> kept(T, std::vector<bool>(k, false));
  for (int j = 0; j < k; ++j)
    for (int t = 0; t < T; ++t) {
      if (!eligible[t][j]) continue;
      int e = choice[t][j];
      if (r.load[e] < cap) {
        ++r.load[e];
        kept[t][j] = true;
      } else {
        ++r.dropped;
      }
    }
  r.y.assign(T * C, 0.0);
  for (int t = 0; t < T; ++t) {
    bool any = false;
    for (int j = 0; j < k; ++j) {
      if (!kept[t][j]) continue;
      any = true;
      const int e = choice[t][j];
      std::vector<double> act(kH);
      for (int h = 0; h < kH; ++h) {
        double s = p.b1[e][h];
        for (int i = 0; i < C; ++i) s += p.w1[e][h * C + i] * x[t * C + i];
        act[h] = Gelu(s);
      }
      for (int i = 0; i < C; ++i) {
        double s = p.b2[e][i];
        for (int h = 0; h < kH; ++h) s += p.w2[e][i * kH + h] * act[h];
        r.y[t * C + i] += weight[t][j] * s;
      }
    }
    r.dropped_tokens += !any;
  }
  // The balancing losses see q: the scores, or for sigmoid scores each token's divided by their
  // sum.
  std::vector<double> q(probs);
  if (c.sigmoid) {
    for (int t = 0; t < T; ++t) {
      double s = 0;
      for (int e = 0; e < E; ++e) s += probs[t * E + e];
      for (int e = 0; e < E; ++e) q[t * E + e] = probs[t * E + e] / s;
    }
  }
  std::vector<double> f(E, 0.0), P(E, 0.0);
  r.routed.assign(E, 0);
  for (int t = 0; t < T; ++t) {
    f[choice[t][0]] += 1.0 / T;
    for (int j = 0; j < k; ++j) ++r.routed[choice[t][j]];
    for (int e = 0; e < E; ++e) P[e] += q[t * E + e] / T;
    r.z += lse[t] * lse[t] / T;
  }
  for (int e = 0; e < E; ++e) r.aux += E * f[e] * P[e];
  if (expert_choice) {  // no aux loss; every expert took its capacity
    r.aux = 0;
    r.routed = r.load;
  }
  // Sequence-wise: mean over sequences of sum_e (E / (k S) * choices to e) * mean q_e.
  const int nseq = (T + kSeqLen - 1) / kSeqLen;
  for (int sq = 0; sq < nseq; ++sq) {
    const int t0 = sq * kSeqLen, t1 = std::min(T, t0 + kSeqLen), S = t1 - t0;
    for (int e = 0; e < E; ++e) {
      double n = 0, qe = 0;
      for (int t = t0; t < t1; ++t) {
        for (int j = 0; j < k; ++j) n += choice[t][j] == e;
        qe += q[t * E + e];
      }
      r.seq += (static_cast<double>(E) / (k * S) * n) * (qe / S) / nseq;
    }
  }
  return r;
}

class MoeLayerTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    SoftmaxGateOptions g;
    g.d_model = kC;
    g.num_experts = c.experts;
    g.k = c.k;
    g.max_tokens = kTokens;
    g.config.set_type(c.type);
    g.config.set_capacity_factor_train(c.capacity_factor);
    g.config.set_capacity_factor_eval(0);
    g.config.set_aux_loss_coef(kAuxCoef);
    g.config.set_z_loss_coef(kZCoef);
    g.config.set_jitter_eps(0.1);
    g.config.set_renormalize(c.renormalize);
    if (c.sigmoid) g.config.set_score_function(GateConfig::SIGMOID);
    g.config.set_routed_scaling(static_cast<float>(c.scaling));
    if (c.bias) g.config.set_bias_update_rate(0.001f);
    g.config.set_num_groups(c.groups);
    g.config.set_topk_groups(c.topk_groups);
    g.config.set_sequence_aux_loss_coef(static_cast<float>(c.seq_coef));
    g.seed = kSeed;
    g.layer = kLayer;
    g.init_std = 0.8f;  // a peaked router, so routing is far from ties
    std::vector<std::unique_ptr<Expert>> experts;
    for (int e = 0; e < c.experts; ++e) {
      FfnOptions f{kC, kH, ops::Activation::kGelu, true, 0.5f, 0.5f};
      experts.push_back(std::make_unique<FfnExpert>(absl::StrCat("experts.", e), f));
    }
    layer_ = std::make_unique<MoeLayer>(kC, kTokens, MakeGate("gate", g), std::move(experts));
    for (Parameter* p : layer_->Parameters()) InitializeWithBiases(ctx_, *p, kSeed);
    std::mt19937 gen(3);
    std::normal_distribution<float> nd(0, 1);
    x_ = Tensor::Empty({kTokens, kC});
    for (int64_t i = 0; i < x_.numel(); ++i) x_.f32()[i] = nd(gen);
    r_ = Tensor::Empty({kTokens, kC});
    for (int64_t i = 0; i < r_.numel(); ++i) r_.f32()[i] = nd(gen);
  }

  // The router of either gate class; the softmax gate, or null for expert choice.
  Parameter& Router() {
    if (SoftmaxGate* g = Softmax()) return g->router();
    return dynamic_cast<ExpertChoiceGate&>(layer_->gate()).router();
  }
  SoftmaxGate* Softmax() { return dynamic_cast<SoftmaxGate*>(&layer_->gate()); }

  Params Snapshot() {
    Params p;
    auto vec = [](const Tensor& t) { return std::vector<double>(t.f32(), t.f32() + t.numel()); };
    p.router = vec(Router().value);
    if (SoftmaxGate* g = Softmax()) {
      if (g->noise_router()) p.noise = vec(g->noise_router()->value);
      if (g->selection_bias()) p.bias = vec(g->selection_bias()->value);
    }
    for (int e = 0; e < GetParam().experts; ++e) {
      auto& f = static_cast<FfnExpert&>(layer_->expert(e));
      p.w1.push_back(vec(f.w1().value));
      p.b1.push_back(vec(f.b1()->value));
      p.w2.push_back(vec(f.w2().value));
      p.b2.push_back(vec(f.b2()->value));
    }
    return p;
  }

  double RefLoss(const std::vector<double>& x, const Params& p) {
    RefResult r = Reference(GetParam(), x, p);
    double l = 0;
    for (int i = 0; i < kTokens * kC; ++i) l += r.y[i] * r_.f32()[i];
    return l + kAuxCoef * r.aux + kZCoef * r.z + GetParam().seq_coef * r.seq;
  }

  static GateCall Call(bool training, uint64_t step) {
    GateCall call{training, step};
    call.sequence_length = kSeqLen;
    return call;
  }

  ThreadPool pool_{2};
  ops::Context ctx_{&pool_};
  std::unique_ptr<MoeLayer> layer_;
  Tensor x_, r_;
};

TEST_P(MoeLayerTest, ForwardMatchesPerTokenReference) {
  const Case& c = GetParam();
  Tensor y = Tensor::Empty({kTokens, kC});
  layer_->Forward(ctx_, x_, y, Call(c.training, kStep));
  std::vector<double> x(x_.f32(), x_.f32() + x_.numel());
  RefResult ref = Reference(c, x, Snapshot());
  for (int i = 0; i < kTokens * kC; ++i) EXPECT_NEAR(y.f32()[i], ref.y[i], 2e-5) << i;
  const MoeStats& s = layer_->stats();
  EXPECT_EQ(s.load, ref.load);
  EXPECT_EQ(s.routed, ref.routed);
  if (c.seq_coef > 0) {
    EXPECT_NEAR(Softmax()->last_sequence_aux_loss(), ref.seq, 1e-5);
  }
  if (c.groups > 1) {  // every token's experts lie in at most topk_groups groups
    const Tensor& ids = Softmax()->last_experts();
    const int per = c.experts / c.groups;
    for (int t = 0; t < kTokens; ++t) {
      std::set<int> groups;
      for (int j = 0; j < c.k; ++j) groups.insert(ids.i32()[t * c.k + j] / per);
      EXPECT_LE(static_cast<int>(groups.size()), c.topk_groups) << "token " << t;
    }
  }
  EXPECT_EQ(s.dropped, ref.dropped);
  EXPECT_EQ(s.dropped_tokens, ref.dropped_tokens);
  EXPECT_EQ(s.capacity, ref.capacity);
  EXPECT_NEAR(s.aux_loss, ref.aux, 1e-5);
  EXPECT_NEAR(s.z_loss, ref.z, 1e-5);
  if (c.capacity_factor > 0 && c.capacity_factor < 1 && c.training &&
      c.type != GateConfig::EXPERT_CHOICE) {
    EXPECT_GT(ref.dropped, 0) << "this case is meant to drop tokens";
  }
}

TEST_P(MoeLayerTest, GradientsMatchFiniteDifferencesOfReference) {
  const Case& c = GetParam();
  Tensor y = Tensor::Empty({kTokens, kC}), dx = Tensor::Empty({kTokens, kC});
  for (Parameter* p : layer_->Parameters()) p->grad.SetZero();
  layer_->Forward(ctx_, x_, y, Call(c.training, kStep));
  layer_->Backward(ctx_, x_, r_, dx);

  std::vector<double> x(x_.f32(), x_.f32() + x_.numel());
  Params p = Snapshot();
  const RefResult base = Reference(c, x, p);
  const double h = 1e-6;
  int checked = 0;
  auto check = [&](const char* what, std::vector<double>& v, const float* analytic) {
    for (size_t i = 0; i < v.size(); ++i) {
      const double saved = v[i];
      v[i] = saved + h;
      const double lp = RefLoss(x, p);
      v[i] = saved - h;
      const double lm = RefLoss(x, p);
      v[i] = saved;
      const double numeric = (lp - lm) / (2 * h);
      EXPECT_NEAR(analytic[i], numeric, 2e-4 + 2e-3 * std::abs(numeric)) << what << "[" << i << "]";
      ++checked;
    }
  };
  // A perturbation must not change the routing, or finite differences are meaningless.
  ASSERT_EQ(Reference(c, x, p).load, base.load);
  check("x", x, dx.f32());
  check("router", p.router, Router().grad.f32());
  if (SoftmaxGate* gate = Softmax()) {
    if (gate->noise_router()) check("noise_router", p.noise, gate->noise_router()->grad.f32());
    if (gate->selection_bias()) {  // not trained: its gradient stays zero
      for (int64_t e = 0; e < c.experts; ++e) {
        EXPECT_EQ(gate->selection_bias()->grad.f32()[e], 0.0f);
      }
    }
  }
  for (int e = 0; e < c.experts; ++e) {
    auto& f = static_cast<FfnExpert&>(layer_->expert(e));
    check("w1", p.w1[e], f.w1().grad.f32());
    check("b1", p.b1[e], f.b1()->grad.f32());
    check("w2", p.w2[e], f.w2().grad.f32());
    check("b2", p.b2[e], f.b2()->grad.f32());
  }
  EXPECT_GT(checked, 300);
}

TEST_P(MoeLayerTest, SteadyStateAllocatesNothing) {
  const Case& c = GetParam();
  Tensor y = Tensor::Empty({kTokens, kC}), dx = Tensor::Empty({kTokens, kC});
  auto steps = [&] {
    for (uint64_t step = 0; step < 3; ++step) {
      layer_->Forward(ctx_, x_, y, Call(c.training, kStep + step));
      layer_->Backward(ctx_, x_, r_, dx);
    }
  };
  // The first pass over these steps may size grow-only scratch (per thread, on first use); the
  // same steps again route identically and must allocate nothing.
  steps();
  const int64_t before = g_allocations.load();
  steps();
  EXPECT_EQ(g_allocations.load() - before, 0);
}

// A whole training step of the model — forward with loss, backward, gradient norm, AdamW, zeroing
// — allocates nothing once warmed up on the same steps.
TEST(ModelAllocationTest, TrainingStepAllocatesNothing) {
  config::ModelConfig m;
  m.set_vocab_size(40);
  m.set_seq_len(8);
  m.set_d_model(16);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_d_ff(32);
  m.mutable_moe()->set_num_experts(4);
  m.mutable_moe()->set_top_k(2);
  m.mutable_moe()->set_d_expert(16);
  m.mutable_moe()->mutable_gate()->set_type(GateConfig::NOISY_TOP_K);
  m.mutable_moe()->mutable_gate()->set_capacity_factor_train(1.0f);
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  ModelOptions o;
  o.config = m;
  o.max_batch = 4;
  auto model = MoeTransformer::Create(ctx, o);
  ASSERT_TRUE(model.ok()) << model.status();
  AdamW opt((*model)->Parameters(), AdamWOptions{});
  std::vector<int32_t> tokens(32), targets(32);
  for (int i = 0; i < 32; ++i) tokens[i] = (i * 7) % 40, targets[i] = (i * 11) % 40;
  auto steps = [&] {
    for (uint64_t s = 0; s < 3; ++s) {
      opt.ZeroGrad(ctx);
      (*model)->Forward(ctx, tokens.data(), targets.data(), 4, GateCall{true, s});
      (*model)->Backward(ctx);
      opt.Step(ctx, 1e-3, ops::ClipScale(opt.GradNorm(ctx), 1.0));
      (*model)->Forward(ctx, tokens.data(), targets.data(), 4, GateCall{false, s});  // eval
    }
  };
  steps();
  const int64_t before = g_allocations.load();
  steps();
  EXPECT_EQ(g_allocations.load() - before, 0);
}

// Loss-free balancing against a hand-computed example: 4 experts, top-1, a router that sends a
// one-hot token e to expert e. Step 0 routes 5, 1, 2 and 0 tokens (mean 2), so the update moves
// the biases by rate * sign(2 - load) = [-r, +r, 0, +r]; a second Forward of the same step and an
// evaluation Forward change nothing. The bias then decides a tie (the unbiased score still
// weighs the output), and step 1 (every token to expert 0) adds [-r, +r, +r, +r].
TEST(LossFreeBalancingTest, BiasMovesByRateTimesTheSignOfMeanMinusLoad) {
  constexpr int64_t E = 4, C = 4;
  constexpr float kRate = 0.25f;
  SoftmaxGateOptions o;
  o.d_model = C;
  o.num_experts = E;
  o.k = 1;
  o.max_tokens = 8;
  o.config.set_bias_update_rate(kRate);
  SoftmaxGate gate("gate", o);
  ASSERT_NE(gate.selection_bias(), nullptr);
  gate.selection_bias()->value.SetZero();
  Tensor& w = gate.router().value;
  w.SetZero();
  for (int64_t e = 0; e < E; ++e) w.f32()[e * C + e] = 10.0f;
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  auto tokens = [&](const std::vector<std::vector<float>>& rows) {
    Tensor x = Tensor::Empty({static_cast<int64_t>(rows.size()), C});
    for (size_t t = 0; t < rows.size(); ++t) {
      for (int64_t c = 0; c < C; ++c) x.f32()[t * C + c] = rows[t][c];
    }
    return x;
  };
  const std::vector<float> to0 = {1, 0, 0, 0}, to1 = {0, 1, 0, 0}, to2 = {0, 0, 1, 0};
  Tensor step0 = tokens({to0, to0, to1, to0, to2, to0, to2, to0});
  Routing r;
  gate.Forward(ctx, step0, GateCall{true, 0}, &r);
  EXPECT_EQ(gate.BatchLoad(), (std::vector<int64_t>{5, 1, 2, 0}));
  gate.Forward(ctx, step0, GateCall{true, 0}, &r);   // the same step again (recomputation)
  gate.Forward(ctx, step0, GateCall{false, 0}, &r);  // evaluation: not counted
  gate.UpdateBias(ctx);
  const float* b = gate.selection_bias()->value.f32();
  EXPECT_EQ(std::vector<float>(b, b + E), (std::vector<float>{-kRate, kRate, 0.0f, kRate}));
  double lo = 0, hi = 0;
  ASSERT_TRUE(gate.BiasRange(&lo, &hi));
  EXPECT_EQ(lo, -kRate);
  EXPECT_EQ(hi, kRate);

  // A token tied between experts 0 and 1 goes to 1 now (bias +r against -r), weighted by its
  // unbiased probability e^10 / (2 e^10 + 2).
  Tensor tie = tokens({{1, 1, 0, 0}});
  gate.Forward(ctx, tie, GateCall{false, 1}, &r);
  EXPECT_EQ(r.expert.i32()[0], 1);
  EXPECT_NEAR(r.weight.f32()[0], std::exp(10.0) / (2 * std::exp(10.0) + 2), 1e-6);

  gate.Forward(ctx, tokens({to0, to0, to0, to0}), GateCall{true, 1}, &r);
  gate.UpdateBias(ctx);
  EXPECT_EQ(std::vector<float>(b, b + E),
            (std::vector<float>{-2 * kRate, 2 * kRate, kRate, 2 * kRate}));
  // The bias is not trained: Backward leaves its gradient at zero.
  Tensor dweight = Tensor::Empty({4, 1}), dx = Tensor::Empty({4, C});
  for (int i = 0; i < 4; ++i) dweight.f32()[i] = 1.0f;
  gate.selection_bias()->grad.SetZero();
  gate.Backward(ctx, tokens({to0, to0, to0, to0}), dweight, dx);
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(gate.selection_bias()->grad.f32()[e], 0.0f);
}

// Expert choice's own choice, checked against a stable sort of each expert's column (ties: the
// earlier token), on duplicated tokens so that ties do occur at the capacity boundary; and its
// behaviour when the batch-wide sum cannot be trusted: a reducer whose Sum did nothing (a failed
// collective leaves the buffer as it was) and calls that do not fit the batch they name choose
// without a crash.
class NoSumReducer : public BatchReducer {
 public:
  int parts() const override { return 2; }
  void Sum(double*, size_t) override {}
};

TEST(ExpertChoiceGateTest, TiesGoToTheEarlierTokenAndABrokenSumIsNoCrash) {
  constexpr int64_t E = 4, C = 6, T = 8;
  SoftmaxGateOptions o;
  o.d_model = C;
  o.num_experts = E;
  o.k = 2;
  o.max_tokens = T;
  o.batch_tokens = 2 * T;
  o.init_std = 0.8f;
  o.config.set_type(GateConfig::EXPERT_CHOICE);
  o.config.set_capacity_factor_train(0.75f);  // C = ceil(0.75 * 8 * 2 / 4) = 3 of 8 tokens
  ExpertChoiceGate gate("gate", o);
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  Initialize(ctx, gate.router(), 3);
  Tensor x = Tensor::Empty({T, C});
  std::mt19937 gen(11);
  std::normal_distribution<float> nd(0, 1);
  for (int64_t t = 0; t < T / 2; ++t) {
    for (int64_t c = 0; c < C; ++c) x.f32()[t * C + c] = x.f32()[(t + T / 2) * C + c] = nd(gen);
  }
  // The reference: softmax scores in double, a stable sort of each column.
  std::vector<double> p(T * E);
  for (int64_t t = 0; t < T; ++t) {
    double z = 0;
    for (int64_t e = 0; e < E; ++e) {
      double l = 0;
      for (int64_t c = 0; c < C; ++c)
        l += double(gate.router().value.f32()[e * C + c]) * x.f32()[t * C + c];
      p[t * E + e] = std::exp(l);
      z += p[t * E + e];
    }
    for (int64_t e = 0; e < E; ++e) p[t * E + e] /= z;
  }
  auto expect_choice = [&](const Routing& r, int64_t cap, const char* what) {
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int> order(T);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return p[a * E + e] > p[b * E + e]; });
      std::set<int> want(order.begin(), order.begin() + cap), got;
      for (int64_t t = 0; t < T; ++t) {
        if (r.eligible[t * E + e]) got.insert(static_cast<int>(t));
      }
      EXPECT_EQ(got, want) << what << ", expert " << e;
    }
  };
  Routing r;
  GateCall call{true, 0};
  gate.Forward(ctx, x, call, &r);  // one process, the call is the batch
  expect_choice(r, 3, "alone");
  EXPECT_EQ(gate.ChosenCapacity(), 3);
  // Rows 0-3 and 4-7 are equal, so every expert's third place was a tie, won by the earlier token.
  NoSumReducer reducer;
  gate.AttachReducer(&reducer);
  call.batch_tokens = 2 * T;
  call.first_token = T;  // the second half of a batch of 16 whose other rows never arrive
  gate.Forward(ctx, x, call, &r);
  // C = ceil(0.75 * 16 * 2 / 4) = 6, all from this call's rows (the others stayed 0).
  expect_choice(r, 6, "the sum did nothing");
  EXPECT_EQ(gate.ChosenCapacity(), 6);
  call.first_token = T + 4;  // does not fit the batch it names: chosen alone
  gate.Forward(ctx, x, call, &r);
  expect_choice(r, 3, "outside its batch");
}

// Experts run either in per-thread groups or one after another with split GEMMs (MoeLayer picks by
// balance). Both must give the single-threaded result up to rounding.
TEST_P(MoeLayerTest, GroupedAndSequentialExpertsAgreeWithOneThread) {
  const Case& c = GetParam();
  ThreadPool one(1), three(3);
  ops::Context c1{&one}, c3{&three};
  Tensor y1 = Tensor::Empty({kTokens, kC}), y2 = Tensor::Empty({kTokens, kC}),
         y3 = Tensor::Empty({kTokens, kC});
  layer_->Forward(c1, x_, y1, GateCall{c.training, kStep});
  EXPECT_FALSE(layer_->last_run_grouped());
  layer_->Forward(ctx_, x_, y2, GateCall{c.training, kStep});
  const bool grouped2 = layer_->last_run_grouped();
  layer_->Forward(c3, x_, y3, GateCall{c.training, kStep});
  for (int i = 0; i < kTokens * kC; ++i) {
    EXPECT_NEAR(y2.f32()[i], y1.f32()[i], 1e-5);
    EXPECT_NEAR(y3.f32()[i], y1.f32()[i], 1e-5);
  }
  ::testing::Test::RecordProperty("grouped_with_2_threads", grouped2 ? "yes" : "no");
}

// Both execution paths, forced by the routing: balanced loads run grouped, one hot expert does not.
TEST(MoeLayerPathsTest, BalancedRoutingRunsGroupedAndSkewedDoesNot) {
  for (bool skewed : {false, true}) {
    const int64_t T = 256, C = 8, E = 8;
    SoftmaxGateOptions g;
    g.d_model = C;
    g.num_experts = E;
    g.k = skewed ? 1 : 2;
    g.max_tokens = T;
    g.seed = 1;
    std::vector<std::unique_ptr<Expert>> experts;
    for (int e = 0; e < E; ++e) {
      experts.push_back(std::make_unique<FfnExpert>(
          absl::StrCat("e", e), FfnOptions{C, 4, ops::Activation::kGelu, true, 0.5f, 0.5f}));
    }
    MoeLayer layer(C, T, MakeGate("gate", g), std::move(experts));
    ThreadPool one(1), two(2);
    ops::Context c1{&one}, c2{&two};
    for (Parameter* p : layer.Parameters()) Initialize(c1, *p, 3);
    Tensor x = Tensor::Empty({T, C});
    std::mt19937 gen(5);
    std::normal_distribution<float> nd(0, 1);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = skewed ? std::abs(nd(gen)) : nd(gen);
    if (skewed) {  // every token's first choice is expert 0
      auto& router = static_cast<SoftmaxGate&>(layer.gate()).router().value;
      router.SetZero();
      for (int64_t c = 0; c < C; ++c) router.f32()[c] = 1.0f;
    }
    Tensor y1 = Tensor::Empty({T, C}), y2 = Tensor::Empty({T, C});
    Tensor dy = Tensor::Empty({T, C}), dx1 = Tensor::Empty({T, C}), dx2 = Tensor::Empty({T, C});
    for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(gen);
    layer.Forward(c1, x, y1, GateCall{true, 0});
    layer.Backward(c1, x, dy, dx1);
    layer.Forward(c2, x, y2, GateCall{true, 0});
    EXPECT_EQ(layer.last_run_grouped(), !skewed);
    layer.Backward(c2, x, dy, dx2);
    for (int64_t i = 0; i < T * C; ++i) {
      ASSERT_NEAR(y2.f32()[i], y1.f32()[i], 1e-5) << i;
      ASSERT_NEAR(dx2.f32()[i], dx1.f32()[i], 1e-5) << i;
    }
  }
}

// The experts as grouped GEMMs (the GPU's default path) against one GEMM per expert, on the CPU:
// the same rows, expert by expert, and the same gradients up to the order of float additions
// (bias gradients are summed in another order).
TEST(MoeLayerPathsTest, GroupedGemmExpertsMatchOneGemmPerExpert) {
  for (ops::Activation act : {ops::Activation::kGelu, ops::Activation::kSwiglu}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(absl::StrCat("activation ", static_cast<int>(act), " bias ", bias));
      const int64_t T = 64, C = 8, E = 6;
      auto make = [&] {
        SoftmaxGateOptions g;
        g.d_model = C;
        g.num_experts = E;
        g.k = 2;
        g.max_tokens = T;
        g.seed = 1;
        g.config.set_capacity_factor_train(0.8f);  // some drops, some empty experts
        std::vector<std::unique_ptr<Expert>> experts;
        for (int e = 0; e < E; ++e) {
          experts.push_back(std::make_unique<FfnExpert>(absl::StrCat("e", e),
                                                        FfnOptions{C, 5, act, bias, 0.5f, 0.5f}));
        }
        return std::make_unique<MoeLayer>(C, T, MakeGate("gate", g), std::move(experts));
      };
      auto per_expert = make(), grouped = make();
      EXPECT_FALSE(grouped->grouped_gemm());  // off by default on the CPU
      grouped->set_grouped_gemm(true);
      ThreadPool pool(2);
      ops::Context ctx{&pool};
      auto pa = per_expert->Parameters(), pb = grouped->Parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        Initialize(ctx, *pa[i], 3);
        for (int64_t j = 0; j < pa[i]->value.numel(); ++j) {  // biases get values too
          pa[i]->value.f32()[j] += static_cast<float>(0.1 * rng::Normal(rng::Key(9, i), j));
        }
        pb[i]->value.CopyFrom(pa[i]->value);
      }
      std::mt19937 gen(5);
      std::normal_distribution<float> nd(0, 1);
      Tensor x = Tensor::Empty({T, C}), dy = Tensor::Empty({T, C});
      for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(gen);
      for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(gen);
      Tensor ya = Tensor::Empty({T, C}), yb = Tensor::Empty({T, C});
      Tensor dxa = Tensor::Empty({T, C}), dxb = Tensor::Empty({T, C});
      per_expert->Forward(ctx, x, ya, GateCall{true, 0});
      grouped->Forward(ctx, x, yb, GateCall{true, 0});
      EXPECT_EQ(grouped->stats().load, per_expert->stats().load);
      per_expert->Backward(ctx, x, dy, dxa);
      grouped->Backward(ctx, x, dy, dxb);
      for (int64_t i = 0; i < T * C; ++i) {
        ASSERT_NEAR(yb.f32()[i], ya.f32()[i], 1e-5) << "y " << i;
        ASSERT_NEAR(dxb.f32()[i], dxa.f32()[i], 1e-5) << "dx " << i;
      }
      for (size_t i = 0; i < pa.size(); ++i) {
        for (int64_t j = 0; j < pa[i]->grad.numel(); ++j) {
          ASSERT_NEAR(pb[i]->grad.f32()[j], pa[i]->grad.f32()[j], 1e-5) << pa[i]->name << " " << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gates, MoeLayerTest,
                         ::testing::Values(
                             Case{"TopK1_Dropless", GateConfig::TOP_K, 1, 0.0},
                             Case{"TopK1_Capacity", GateConfig::TOP_K, 1, 0.5},
                             Case{"TopK2_Dropless", GateConfig::TOP_K, 2, 0.0},
                             Case{"TopK2_Capacity", GateConfig::TOP_K, 2, 0.5},
                             Case{"TopK2_NoRenormalize", GateConfig::TOP_K, 2, 0.0, true, false},
                             Case{"TopK4_Dropless", GateConfig::TOP_K, 4, 0.0},
                             Case{"TopK4_Capacity", GateConfig::TOP_K, 4, 0.6},
                             Case{"TopK8_Dropless", GateConfig::TOP_K, 8, 0.0, true, true, 12},
                             Case{"TopK8_Capacity", GateConfig::TOP_K, 8, 0.6, true, true, 12},
                             [] {
                               Case c = Modern("Sigmoid2_Dropless", 2, 6, 0.0);
                               c.sigmoid = true;
                               return c;
                             }(),
                             [] {
                               Case c = Modern("Sigmoid1_Scaled", 1, 6, 0.0);
                               c.sigmoid = true;
                               c.scaling = 2.5;
                               return c;
                             }(),
                             [] {
                               Case c = Modern("Sigmoid8_NoRenormalize_Scaled", 8, 12, 0.0);
                               c.sigmoid = true;
                               c.renormalize = false;
                               c.scaling = 1.7;
                               return c;
                             }(),
                             [] {
                               Case c = Modern("Softmax2_Bias_Capacity", 2, 6, 0.6);
                               c.bias = true;
                               return c;
                             }(),
                             [] {  // DeepSeek-V3's router: sigmoid, bias, groups, scaling, seq loss
                               Case c = Modern("Sigmoid8_Bias_Groups_SeqAux", 8, 16, 0.0);
                               c.sigmoid = true;
                               c.bias = true;
                               c.groups = 4;
                               c.topk_groups = 2;
                               c.scaling = 2.5;
                               c.seq_coef = 0.3;
                               return c;
                             }(),
                             [] {
                               Case c = Modern("Softmax4_Groups_Capacity", 4, 12, 0.7);
                               c.groups = 6;
                               c.topk_groups = 3;
                               return c;
                             }(),
                             [] {
                               Case c = Modern("Softmax2_SeqAux", 2, 6, 0.0);
                               c.seq_coef = 0.5;
                               return c;
                             }(),
                             Case{"ExpertChoice2", GateConfig::EXPERT_CHOICE, 2, 0.0},
                             Case{"ExpertChoice2_Capacity1_5", GateConfig::EXPERT_CHOICE, 2, 1.5},
                             Case{"ExpertChoice1_Eval", GateConfig::EXPERT_CHOICE, 1, 0.0, false},
                             Case{"Switch_Dropless", GateConfig::SWITCH, 1, 0.0},
                             Case{"Switch_Capacity", GateConfig::SWITCH, 1, 0.5},
                             Case{"GShard_Dropless", GateConfig::GSHARD, 2, 0.0},
                             Case{"GShard_Capacity", GateConfig::GSHARD, 2, 0.5},
                             Case{"Noisy2_Dropless", GateConfig::NOISY_TOP_K, 2, 0.0},
                             Case{"Noisy2_Capacity", GateConfig::NOISY_TOP_K, 2, 0.5},
                             Case{"Noisy2_Eval", GateConfig::NOISY_TOP_K, 2, 0.5, false},
                             Case{"GShard_Eval", GateConfig::GSHARD, 2, 0.5, false}),
                         CaseName);

}  // namespace
}  // namespace strata::model
