#include "runtime/model/expert.h"

namespace strata::model {

FfnExpert::FfnExpert(const std::string& prefix, const FfnOptions& o)
    : options_(o), in_width_(ops::ActivationInputWidth(o.activation, o.d_hidden)) {
  w1_ = MakeParameter(prefix + ".w1", {in_width_, o.d_model}, Init::kNormal, o.init_std, true,
                      o.device);
  w2_ = MakeParameter(prefix + ".w2", {o.d_model, o.d_hidden}, Init::kNormal, o.out_std, true,
                      o.device);
  w1_->gemm = w2_->gemm = true;
  if (o.bias) {
    b1_ = MakeParameter(prefix + ".b1", {in_width_}, Init::kZeros, 0, false, o.device);
    b2_ = MakeParameter(prefix + ".b2", {o.d_model}, Init::kZeros, 0, false, o.device);
  }
}

std::vector<Parameter*> FfnExpert::Parameters() {
  std::vector<Parameter*> ps = {w1_.get()};
  if (b1_) ps.push_back(b1_.get());
  ps.push_back(w2_.get());
  if (b2_) ps.push_back(b2_.get());
  return ps;
}

void FfnExpert::Forward(ops::Context& ctx, const Tensor& x, const Tensor& y, const Tensor& saved) {
  const int64_t n = x.dim(0);
  if (n == 0) return;
  Tensor pre = saved.View(0, {n, in_width_});
  Tensor act = saved.View(n * in_width_, {n, options_.d_hidden});
  Tensor none;
  ops::LinearForward(ctx, pre, x, GemmWeight(*w1_), none);
  if (b1_) {
    ops::BiasActivationForward(ctx, options_.activation, act, pre, b1_->value);
  } else {
    ops::ActivationForward(ctx, options_.activation, act, pre);
  }
  ops::LinearForward(ctx, y, act, GemmWeight(*w2_), b2_ ? b2_->value : none);
}

void FfnExpert::Backward(ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx,
                         const Tensor& saved) {
  const int64_t n = x.dim(0);
  if (n == 0) return;
  Tensor pre = saved.View(0, {n, in_width_});
  Tensor act = saved.View(n * in_width_, {n, options_.d_hidden});
  Tensor none;
  // dW2 += dy^T act, then d(act) overwrites act.
  ops::LinearBackward(ctx, act, w2_->grad, b2_ ? b2_->grad : none, dy, act, GemmWeight(*w2_),
                      false);
  // d(pre) overwrites pre; b1's gradient is summed in the same pass.
  ops::ActivationBackward(ctx, options_.activation, pre, act, pre, b1_ ? b1_->grad : none);
  ops::LinearBackward(ctx, dx, w1_->grad, none, pre, x, GemmWeight(*w1_), false);
}

ExpertLayout ExpertLayout::Of(const std::vector<Parameter*>& params) {
  ExpertLayout layout;
  for (const Parameter* p : params) {
    layout.segments.push_back(Segment{layout.floats, p->shape, p->decay});
    layout.floats += p->shape.numel();
  }
  return layout;
}

bool ExpertLayout::Fits(const std::vector<Parameter*>& params) const {
  if (params.size() != segments.size()) return false;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!(params[i]->shape == segments[i].shape)) return false;
  }
  return true;
}

void ExpertLayout::Bind(const std::vector<Parameter*>& params, const Tensor& weights,
                        const Tensor& grad) const {
  CHECK_EQ(params.size(), segments.size());
  CHECK_GE(weights.numel(), floats);
  CHECK(!grad.defined() || grad.numel() >= floats);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i]->value = weights.View(segments[i].offset, segments[i].shape);
    params[i]->grad = grad.defined() ? grad.View(segments[i].offset, segments[i].shape) : Tensor();
  }
}

bool FfnExpert::SameShape(const std::vector<FfnExpert*>& experts) {
  if (experts.empty()) return false;
  const FfnOptions& a = experts[0]->options_;
  for (const FfnExpert* e : experts) {
    const FfnOptions& b = e->options_;
    if (b.d_model != a.d_model || b.d_hidden != a.d_hidden || b.activation != a.activation ||
        b.bias != a.bias) {
      return false;
    }
  }
  return true;
}

void FfnExpert::GroupForward(ops::Context& ctx, const std::vector<FfnExpert*>& experts,
                             const std::vector<int64_t>& offsets, const Tensor& x, const Tensor& y,
                             const Tensor& saved) {
  const int64_t R = offsets.back(), G = static_cast<int64_t>(experts.size());
  if (R == 0) return;
  const FfnOptions& o = experts[0]->options_;
  const int64_t W = experts[0]->in_width_;
  Tensor pre = saved.View(0, {R, W}), act = saved.View(R * W, {R, o.d_hidden});
  std::vector<Tensor> w1(G), w2(G);
  for (int64_t e = 0; e < G; ++e) {
    w1[e] = GemmWeight(*experts[e]->w1_);
    w2[e] = GemmWeight(*experts[e]->w2_);
  }
  ops::GroupedLinearForward(ctx, pre, x, w1, offsets);
  if (o.bias) {  // each expert its own bias: one fused bias + activation per expert
    for (int64_t e = 0; e < G; ++e) {
      const int64_t r0 = offsets[e], r1 = offsets[e + 1];
      if (r1 > r0) {
        ops::BiasActivationForward(ctx, o.activation, act.Rows(r0, r1), pre.Rows(r0, r1),
                                   experts[e]->b1_->value);
      }
    }
  } else {
    ops::ActivationForward(ctx, o.activation, act, pre);
  }
  ops::GroupedLinearForward(ctx, y, act, w2, offsets);
  if (o.bias) {
    for (int64_t e = 0; e < G; ++e) {
      const int64_t r0 = offsets[e], r1 = offsets[e + 1];
      if (r1 > r0) ops::AddBias(ctx, y.Rows(r0, r1), experts[e]->b2_->value);
    }
  }
}

void FfnExpert::GroupBackward(ops::Context& ctx, const std::vector<FfnExpert*>& experts,
                              const std::vector<int64_t>& offsets, const Tensor& x,
                              const Tensor& dy, const Tensor& dx, const Tensor& saved) {
  const int64_t R = offsets.back(), G = static_cast<int64_t>(experts.size());
  if (R == 0) return;
  const FfnOptions& o = experts[0]->options_;
  const int64_t W = experts[0]->in_width_;
  Tensor pre = saved.View(0, {R, W}), act = saved.View(R * W, {R, o.d_hidden});
  std::vector<Tensor> w1(G), w2(G), dw1(G), dw2(G);
  for (int64_t e = 0; e < G; ++e) {
    w1[e] = GemmWeight(*experts[e]->w1_);
    w2[e] = GemmWeight(*experts[e]->w2_);
    dw1[e] = experts[e]->w1_->grad;
    dw2[e] = experts[e]->w2_->grad;
    if (o.bias && offsets[e + 1] > offsets[e]) {
      ops::BiasGrad(ctx, experts[e]->b2_->grad, dy.Rows(offsets[e], offsets[e + 1]));
    }
  }
  // dW2 += dy^T act, then d(act) overwrites act (in place, as the per-expert path does).
  ops::GroupedLinearBackward(ctx, act, dw2, dy, act, w2, offsets, false);
  // d(pre) overwrites pre; each expert's b1 gradient is summed in the same pass.
  if (o.bias) {
    for (int64_t e = 0; e < G; ++e) {
      const int64_t r0 = offsets[e], r1 = offsets[e + 1];
      if (r1 > r0) {
        ops::ActivationBackward(ctx, o.activation, pre.Rows(r0, r1), act.Rows(r0, r1),
                                pre.Rows(r0, r1), experts[e]->b1_->grad);
      }
    }
  } else {
    ops::ActivationBackward(ctx, o.activation, pre, act, pre);
  }
  ops::GroupedLinearBackward(ctx, dx, dw1, pre, x, w1, offsets, false);
}

}  // namespace strata::model
