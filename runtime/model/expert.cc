#include "runtime/model/expert.h"

namespace strata::model {

FfnExpert::FfnExpert(const std::string& prefix, const FfnOptions& o)
    : options_(o), in_width_(cpu::ActivationInputWidth(o.activation, o.d_hidden)) {
  w1_ = MakeParameter(prefix + ".w1", {in_width_, o.d_model}, Init::kNormal, o.init_std, true,
                      o.device);
  w2_ = MakeParameter(prefix + ".w2", {o.d_model, o.d_hidden}, Init::kNormal, o.out_std, true,
                      o.device);
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
  ops::LinearForward(ctx, pre, x, w1_->value, none);
  if (b1_) {
    ops::BiasActivationForward(ctx, options_.activation, act, pre, b1_->value);
  } else {
    ops::ActivationForward(ctx, options_.activation, act, pre);
  }
  ops::LinearForward(ctx, y, act, w2_->value, b2_ ? b2_->value : none);
}

void FfnExpert::Backward(ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx,
                         const Tensor& saved) {
  const int64_t n = x.dim(0);
  if (n == 0) return;
  Tensor pre = saved.View(0, {n, in_width_});
  Tensor act = saved.View(n * in_width_, {n, options_.d_hidden});
  Tensor none;
  // dW2 += dy^T act, then d(act) overwrites act.
  ops::LinearBackward(ctx, act, w2_->grad, b2_ ? b2_->grad : none, dy, act, w2_->value, false);
  // d(pre) overwrites pre; b1's gradient is summed in the same pass.
  ops::ActivationBackward(ctx, options_.activation, pre, act, pre, b1_ ? b1_->grad : none);
  ops::LinearBackward(ctx, dx, w1_->grad, none, pre, x, w1_->value, false);
}

}  // namespace strata::model
