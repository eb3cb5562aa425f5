#include "runtime/model/adamw.h"

#include <cmath>

namespace strata::model {

AdamW::AdamW(std::vector<Parameter*> params, const AdamWOptions& options)
    : params_(std::move(params)), options_(options) {
  for (Parameter* p : params_) {
    m_.push_back(Tensor::Zeros(p->value.shape()));
    v_.push_back(Tensor::Zeros(p->value.shape()));
  }
}

void AdamW::Step(ops::Context& ctx, double lr, double grad_scale) {
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* p = params_[i];
    ops::AdamWHyper h;
    h.lr = lr;
    h.beta1 = options_.beta1;
    h.beta2 = options_.beta2;
    h.eps = options_.eps;
    h.weight_decay = p->decay ? options_.weight_decay : 0.0;
    h.step = step_;
    h.grad_scale = grad_scale;
    ops::AdamW(ctx, p->value, p->grad, m_[i], v_[i], h);
  }
}

double AdamW::GradNorm(ops::Context& ctx, const std::vector<Parameter*>& params) {
  double s = 0;
  for (Parameter* p : params) s += ops::SumSquares(ctx, p->grad);
  return std::sqrt(s);
}

}  // namespace strata::model
