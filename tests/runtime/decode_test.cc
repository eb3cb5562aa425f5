// Incremental decoding (MoeTransformer::Decode) against the full forward pass it replaces: for
// every token-choice gate type, sigmoid scores with a loss-free bias and expert groups, shared
// experts, RMSNorm + SwiGLU with untied embeddings and dense blocks between MoE blocks, the logits
// of every row Decode runs are those of a Forward over the row's sequence up to it, at its
// position.
//
// Three sequences of different prompt lengths are decoded as a generator does: one Decode holding
// all three prompts, then one token per sequence per Decode until each fills seq_len; then one
// slot starts a new sequence from position 0 (nothing past a row's position may be read). The
// reference is a Forward over the three sequences padded to seq_len (causal attention keeps the
// padding out of the positions before it; a dropless gate routes each token on its own).
//
// Tolerance 1e-5 relative to max(1, |logit|): both paths compute the same float arithmetic up to
// the order of the sums in the attention products and the GEMMs' blocking for another row count:
// a few ulp (6e-8 each) per op, through three blocks, leaves the logits within about 1e-6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "proto/config_io.h"
#include "runtime/model/transformer.h"

namespace strata::model {
namespace {

config::ModelConfig SmallModel() {
  config::ModelConfig m;
  m.set_vocab_size(37);
  m.set_seq_len(12);
  m.set_d_model(16);
  m.set_n_layers(3);
  m.set_n_heads(4);
  m.set_d_ff(24);
  m.set_moe_every(1);
  m.mutable_moe()->set_num_experts(6);
  m.mutable_moe()->set_d_expert(10);
  m.set_init_std(0.3f);
  return m;
}

struct Variant {
  std::string name;
  config::ModelConfig config;
};

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  for (auto type : {config::GateConfig::TOP_K, config::GateConfig::SWITCH,
                    config::GateConfig::GSHARD, config::GateConfig::NOISY_TOP_K}) {
    config::ModelConfig m = SmallModel();
    m.mutable_moe()->mutable_gate()->set_type(type);
    v.push_back({config::GateConfig::Type_Name(type), m});
  }
  {
    config::ModelConfig m = SmallModel();
    m.mutable_moe()->set_top_k(3);
    config::GateConfig* g = m.mutable_moe()->mutable_gate();
    g->set_score_function(config::GateConfig::SIGMOID);
    g->set_bias_update_rate(0.01f);
    g->set_num_groups(3);
    g->set_topk_groups(2);
    v.push_back({"sigmoid, loss-free bias, groups", m});
  }
  {
    config::ModelConfig m = SmallModel();
    m.mutable_moe()->set_num_shared_experts(2);
    m.mutable_moe()->set_shared_d_expert(8);
    m.mutable_moe()->set_expert_bias(true);
    v.push_back({"shared experts, expert bias", m});
  }
  {
    config::ModelConfig m = SmallModel();
    m.set_norm(config::ModelConfig::RMS_NORM);
    m.set_activation(config::ModelConfig::SWIGLU);
    m.set_tie_embeddings(false);
    m.set_moe_every(2);
    v.push_back({"rmsnorm, swiglu, untied, dense blocks", m});
  }
  return v;
}

class DecodeTest : public ::testing::TestWithParam<int> {};

TEST_P(DecodeTest, EveryRowsLogitsAreThoseOfAFullForwardAtItsPosition) {
  const Variant variant = Variants()[GetParam()];
  SCOPED_TRACE(variant.name);
  config::JobConfig job;
  *job.mutable_model() = variant.config;
  config::Normalize(&job);
  const config::ModelConfig& cfg = job.model();
  const int64_t T = cfg.seq_len(), V = cfg.vocab_size(), S = 3;
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  ModelOptions o;
  o.config = cfg;
  o.seed = 11;
  o.max_batch = S;
  auto made = MoeTransformer::Create(ctx, o);
  ASSERT_TRUE(made.ok()) << made.status();
  MoeTransformer& m = **made;
  // A loss-free bias is zero at initialisation; give it values that change the choice.
  std::mt19937 g(3);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (Parameter* p : m.Parameters()) {
    if (p->name.find("router_bias") == std::string::npos) continue;
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] = normal(g);
  }

  std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(S));
  for (auto& s : seqs) {
    for (int64_t t = 0; t < T; ++t) s.push_back(static_cast<int32_t>(g() % V));
  }
  std::vector<float> full(static_cast<size_t>(S * T * V)), got;
  auto forward = [&] {
    std::vector<int32_t> tokens, targets(static_cast<size_t>(S * T), 0);
    for (const auto& s : seqs) tokens.insert(tokens.end(), s.begin(), s.end());
    m.Forward(ctx, tokens.data(), targets.data(), S, GateCall{false, 0});
    m.logits().CopyToHost(full.data());
  };
  forward();

  double worst = 0;
  int64_t rows_checked = 0;
  // Decodes rows (slot, position) and compares each row's logits with the full Forward's.
  auto decode = [&](const std::vector<std::pair<int, int>>& rows) {
    std::vector<int32_t> tokens, slots, positions;
    for (const auto& [s, t] : rows) {
      tokens.push_back(seqs[s][t]);
      slots.push_back(s);
      positions.push_back(t);
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    Tensor logits = m.Decode(ctx, tokens.data(), slots.data(), positions.data(), n);
    ASSERT_EQ(logits.numel(), n * V);
    got.resize(static_cast<size_t>(n * V));
    logits.CopyToHost(got.data());
    for (int64_t r = 0; r < n; ++r) {
      const auto [s, t] = rows[r];
      for (int64_t v = 0; v < V; ++v) {
        const float want = full[(s * T + t) * V + v], have = got[r * V + v];
        const double err = std::abs(have - want) / std::max(1.0, std::abs(double{want}));
        worst = std::max(worst, err);
        ASSERT_LE(err, 1e-5) << "slot " << s << " position " << t << " token " << v << ": decode "
                             << have << ", full forward " << want;
      }
      ++rows_checked;
    }
  };
  // The prompts (5, 1 and 8 tokens) in one call, then a token per sequence per call.
  const int64_t prompt[3] = {5, 1, 8};
  std::vector<std::pair<int, int>> rows;
  for (int s = 0; s < S; ++s) {
    for (int t = 0; t < prompt[s]; ++t) rows.push_back({s, t});
  }
  decode(rows);
  std::vector<int64_t> next(prompt, prompt + S);
  while (*std::min_element(next.begin(), next.end()) < T) {
    rows.clear();
    for (int s = 0; s < S; ++s) {
      if (next[s] < T) rows.push_back({s, static_cast<int>(next[s]++)});
    }
    decode(rows);
  }
  EXPECT_EQ(rows_checked, S * T);

  // Slot 1 starts a new sequence of 4 tokens from position 0; the others are left as they are.
  for (int64_t t = 0; t < T; ++t) seqs[1][t] = static_cast<int32_t>(g() % V);
  forward();
  decode({{1, 0}, {1, 1}, {1, 2}});
  decode({{1, 3}});
  if (::testing::Test::HasFailure()) return;
  std::printf("  %-40s %lld rows, worst relative error %.2g\n", variant.name.c_str(),
              static_cast<long long>(rows_checked), worst);
}

INSTANTIATE_TEST_SUITE_P(GatesAndLayouts, DecodeTest, ::testing::Range(0, 7));

TEST(DecodeCacheTest, ReleasingTheCacheAndDecodingAgainGivesTheSameLogits) {
  config::JobConfig job;
  *job.mutable_model() = SmallModel();
  config::Normalize(&job);
  ThreadPool pool(2);
  ops::Context ctx{&pool};
  ModelOptions o;
  o.config = job.model();
  o.max_batch = 2;
  auto m = MoeTransformer::Create(ctx, o);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5}, slots = {0, 0, 0, 0, 0};
  const std::vector<int32_t> positions = {0, 1, 2, 3, 4};
  auto run = [&] {
    std::vector<float> out(5 * 37);
    (*m)->Decode(ctx, tokens.data(), slots.data(), positions.data(), 5).CopyToHost(out.data());
    return out;
  };
  const std::vector<float> first = run();
  (*m)->ReleaseKvCache();
  EXPECT_EQ(run(), first) << "bit for bit: the same rows, the same arithmetic";
}

}  // namespace
}  // namespace strata::model
