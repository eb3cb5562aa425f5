// The hand-offs between an MoE layer and what serves its experts: the blob layout both sides of
// an ExpertResidency share (against offsets computed by hand); a layer whose experts are unbound
// running on the blobs a residency hands it — bitwise the same outputs and gradients as the same
// layer owning its parameters, with the residency never touching a parameter and the layer
// binding each expert only for its call; and an ExpertExchange that sees only the layer's
// LocalExperts, bitwise the same as the layer alone.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/common/rng.h"
#include "runtime/model/expert_residency.h"
#include "runtime/model/moe_layer.h"

namespace strata::model {
namespace {

constexpr int64_t kT = 48, kC = 6, kH = 5, kE = 6;
constexpr uint64_t kSeed = 21;

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.f32(), b.f32(), a.bytes()) == 0;
}

TEST(ExpertLayoutTest, PacksParametersInOrderWithoutPadding) {
  FfnExpert e("e", FfnOptions{kC, kH, ops::Activation::kGelu, true, 0.5f, 0.5f});
  const ExpertLayout l = ExpertLayout::Of(e.Parameters());
  ASSERT_EQ(l.segments.size(), 4u);  // w1 [H, C], b1 [H], w2 [C, H], b2 [C]
  const int64_t want_offset[] = {0, kH * kC, kH * kC + kH, 2 * kH * kC + kH};
  const bool want_decay[] = {true, false, true, false};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(l.segments[i].offset, want_offset[i]) << i;
    EXPECT_EQ(l.segments[i].decay, want_decay[i]) << i;
  }
  EXPECT_EQ(l.segments[0].shape, (Shape{kH, kC}));
  EXPECT_EQ(l.segments[2].shape, (Shape{kC, kH}));
  EXPECT_EQ(l.floats, 2 * kH * kC + kH + kC);

  FfnExpert swiglu("s", FfnOptions{kC, kH, ops::Activation::kSwiglu, false, 0.5f, 0.5f});
  const ExpertLayout s = ExpertLayout::Of(swiglu.Parameters());
  ASSERT_EQ(s.segments.size(), 2u);  // w1 [2H, C], w2 [C, H]
  EXPECT_EQ(s.segments[1].offset, 2 * kH * kC);
  EXPECT_EQ(s.floats, 3 * kH * kC);
  EXPECT_TRUE(l.Fits(e.Parameters()));
  EXPECT_FALSE(l.Fits(swiglu.Parameters()));
  EXPECT_FALSE(s.Fits(e.Parameters()));
}

// Hands out per-expert blobs it owns, the way the tiered store hands out its device slots, and
// checks that nobody but the layer binds the experts' parameters, and only between NextReady and
// Done, and that the layer hands back the blobs it got, their weights unchanged.
class BlobResidency : public ExpertResidency {
 public:
  BlobResidency(MoeLayer* layer, const ExpertLayout& layout) : layer_(layer) {
    for (int64_t e = 0; e < kE; ++e) {
      weights[e] = Tensor::Zeros({layout.floats});
      grads[e] = Tensor::Zeros({layout.floats});
    }
  }

  void BeginPass(int, Pass pass, std::span<const int> experts) override {
    std::lock_guard<std::mutex> lock(mu_);
    pass_ = pass;
    pending_.assign(experts.begin(), experts.end());
    for (int e : experts) {
      before_[e] = Tensor::Empty(weights[e].shape());
      before_[e].CopyFrom(weights[e]);
    }
  }

  ResidentExpert NextReady(int, Pass pass) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(pass, pass_);
    if (pending_.empty()) return {};
    const int e = pending_.back();  // out of order on purpose
    pending_.pop_back();
    bound_outside_ += BoundParameters(e);
    ++handed[e];
    return ResidentExpert{e, weights[e], pass == Pass::kBackward ? grads[e] : Tensor()};
  }

  void Done(int, Pass pass, const ResidentExpert& r) override {
    std::lock_guard<std::mutex> lock(mu_);
    // The handles handed out, not others; the weights as they were before the pass, bitwise.
    ASSERT_TRUE(r.weights.defined()) << "expert " << r.expert;
    EXPECT_EQ(r.weights.f32(), weights[r.expert].f32()) << "expert " << r.expert;
    EXPECT_EQ(r.weights.numel(), weights[r.expert].numel()) << "expert " << r.expert;
    EXPECT_TRUE(SameBits(r.weights, before_[r.expert])) << "expert " << r.expert;
    EXPECT_EQ(r.grad.defined(), pass == Pass::kBackward);
    if (r.grad.defined()) {
      EXPECT_EQ(r.grad.f32(), grads[r.expert].f32()) << "expert " << r.expert;
    }
    bound_at_done_ += BoundParameters(r.expert);
  }

  int BoundParameters(int e) {
    int n = 0;
    for (Parameter* p : layer_->expert(e).Parameters()) n += p->value.defined() + p->grad.defined();
    return n;
  }

  std::map<int, Tensor> weights, grads;
  std::map<int, int> handed;
  int bound_outside_ = 0, bound_at_done_ = 0;

 private:
  MoeLayer* layer_;
  std::mutex mu_;
  Pass pass_ = Pass::kForward;
  std::vector<int> pending_;
  std::map<int, Tensor> before_;  // each expert's weights as BeginPass found them
};

std::unique_ptr<MoeLayer> MakeLayer(bool unbound) {
  SoftmaxGateOptions g;
  g.d_model = kC;
  g.num_experts = kE;
  g.k = 2;
  g.max_tokens = kT;
  g.seed = kSeed;
  g.init_std = 0.8f;
  g.config.set_capacity_factor_train(0.9f);  // some drops, maybe an empty expert
  std::vector<std::unique_ptr<Expert>> experts;
  for (int64_t e = 0; e < kE; ++e) {
    experts.push_back(std::make_unique<FfnExpert>(
        absl::StrCat("experts.", e), FfnOptions{kC, kH, ops::Activation::kGelu, true, 0.5f, 0.5f}));
    if (unbound) {
      for (Parameter* p : experts.back()->Parameters()) Unbind(*p);
    }
  }
  return std::make_unique<MoeLayer>(kC, kT, MakeGate("gate", g), std::move(experts));
}

// Values for every bound parameter (biases too, so they matter).
void Fill(ops::Context& ctx, MoeLayer& layer) {
  for (Parameter* p : layer.Parameters()) {
    if (!p->value.defined()) continue;  // an unbound expert's: its residency holds the values
    Initialize(ctx, *p, kSeed);
    for (int64_t i = 0; i < p->value.numel(); ++i) {
      p->value.f32()[i] += static_cast<float>(0.1 * rng::Normal(rng::Key(4, NameHash(p->name)), i));
    }
    if (p->grad.defined()) p->grad.SetZero();
  }
}

// Forward then backward of layers a and b on the same random x and dy (drawn from `seed`): both
// outputs and both input gradients must be bitwise equal.
void ExpectSamePasses(ops::Context& ctx, MoeLayer& a, MoeLayer& b, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0, 1);
  Tensor x = Tensor::Empty({kT, kC}), dy = Tensor::Empty({kT, kC});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = nd(gen);
  for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = nd(gen);
  Tensor ya = Tensor::Empty({kT, kC}), yb = Tensor::Empty({kT, kC});
  Tensor dxa = Tensor::Empty({kT, kC}), dxb = Tensor::Empty({kT, kC});
  a.Forward(ctx, x, ya, GateCall{true, seed});
  b.Forward(ctx, x, yb, GateCall{true, seed});
  a.Backward(ctx, x, dy, dxa);
  b.Backward(ctx, x, dy, dxb);
  EXPECT_TRUE(SameBits(ya, yb));
  EXPECT_TRUE(SameBits(dxa, dxb));
}

TEST(ResidencyHandOffTest, LayerRunsOnHandedBlobsBitwiseAsInMemory) {
  ThreadPool one(1);
  ops::Context ctx{&one};  // one thread: both paths run every expert single-threaded
  auto owned = MakeLayer(false), unbound = MakeLayer(true);
  Fill(ctx, *owned);
  Fill(ctx, *unbound);  // the gate; the experts are unbound and skipped
  const ExpertLayout layout = ExpertLayout::Of(owned->expert(0).Parameters());
  BlobResidency residency(unbound.get(), layout);
  for (int64_t e = 0; e < kE; ++e) {
    std::vector<Parameter*> ps = owned->expert(e).Parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      const ExpertLayout::Segment& s = layout.segments[i];
      residency.weights[e].View(s.offset, s.shape).CopyFrom(ps[i]->value);
    }
  }
  unbound->AttachResidency(&residency, 0);
  ExpectSamePasses(ctx, *owned, *unbound, 3);
  EXPECT_EQ(residency.bound_outside_, 0) << "an expert was bound before the layer got its blobs";
  EXPECT_EQ(residency.bound_at_done_, 0) << "the layer kept an expert bound past Done";
  int routed = 0;
  for (int64_t e = 0; e < kE; ++e) {
    SCOPED_TRACE(absl::StrCat("expert ", e));
    EXPECT_EQ(residency.BoundParameters(static_cast<int>(e)), 0);
    const bool has_rows = owned->stats().load[e] > 0;
    routed += has_rows;
    EXPECT_EQ(residency.handed[static_cast<int>(e)], has_rows ? 2 : 0);  // forward, backward
    // The gradient landed in the handed blob, parameter by parameter at the layout's offsets.
    std::vector<Parameter*> ps = owned->expert(e).Parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      const ExpertLayout::Segment& s = layout.segments[i];
      EXPECT_TRUE(SameBits(ps[i]->grad, residency.grads[e].View(s.offset, s.shape))) << ps[i]->name;
    }
  }
  EXPECT_GE(routed, 3);
  std::vector<Parameter*> ga = owned->DenseParameters(), gb = unbound->DenseParameters();
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(SameBits(ga[i]->grad, gb[i]->grad));
}

// An exchange that keeps every row on this worker (a one-worker expert-parallel group), seeing
// only the layer's LocalExperts: the layer through it must give bitwise what it gives alone.
class LoopbackExchange : public ExpertExchange {
 public:
  void Forward(ops::Context& ctx, int, LocalExperts& experts, const Tensor& xp,
               const std::vector<int64_t>& counts, const Tensor& yp) override {
    EXPECT_EQ(experts.first(), 0);
    EXPECT_EQ(experts.count(), kE);
    EXPECT_EQ(experts.d_model(), kC);
    EXPECT_EQ(experts.saved_stride(), 2 * kH);  // GELU FFN: pre-activation and activation
    offsets_.assign(1, 0);
    for (int64_t n : counts) offsets_.push_back(offsets_.back() + n);
    x_ = Tensor::Empty(xp.shape());  // kept for backward, as the exchange keeps received rows
    x_.CopyFrom(xp);
    saved_ = Tensor::Empty({std::max<int64_t>(1, offsets_.back() * experts.saved_stride())});
    experts.Forward(ctx, offsets_, x_, yp, saved_);
    ++passes;
  }
  void Backward(ops::Context& ctx, int, LocalExperts& experts, const Tensor& dyp,
                const Tensor& dxp) override {
    experts.Backward(ctx, offsets_, x_, dyp, dxp, saved_);
    ++passes;
  }
  int passes = 0;

 private:
  std::vector<int64_t> offsets_;
  Tensor x_, saved_;
};

TEST(LocalExpertsTest, ExchangeRunsTheLayersExpertsBitwiseAsTheLayerAlone) {
  ThreadPool two(2);
  ops::Context ctx{&two};
  auto alone = MakeLayer(false), exchanged = MakeLayer(false);
  Fill(ctx, *alone);
  Fill(ctx, *exchanged);
  LoopbackExchange exchange;
  exchanged->AttachExchange(&exchange, 0);
  ExpectSamePasses(ctx, *alone, *exchanged, 5);
  EXPECT_EQ(exchange.passes, 2);
  std::vector<Parameter*> pa = alone->Parameters(), pb = exchanged->Parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(SameBits(pa[i]->grad, pb[i]->grad)) << pa[i]->name;
}

}  // namespace
}  // namespace strata::model
