#include "runtime/model/adamw.h"

#include <cmath>

namespace strata::model {

AdamW::AdamW(std::vector<Parameter*> params, const AdamWOptions& options)
    : slices_(std::move(params)), options_(options) {
  for (Parameter* p : slices_.params()) {
    // The moments live with the parameter (on its GPU when the model is on one).
    m_.push_back(Tensor::Zeros(p->value.shape(), DType::kF32, p->value.device()));
    v_.push_back(Tensor::Zeros(p->value.shape(), DType::kF32, p->value.device()));
  }
}

void AdamW::Step(ops::Context& ctx, double lr, double grad_scale) {
  ++step_;
  slices_.Run(ctx, [&](int, size_t i, int64_t begin, int64_t n) {
    Parameter* p = slices_.params()[i];
    ops::AdamWHyper h;
    h.lr = lr;
    h.beta1 = options_.beta1;
    h.beta2 = options_.beta2;
    h.eps = options_.eps;
    h.weight_decay = p->decay ? options_.weight_decay : 0.0;
    h.step = step_;
    h.grad_scale = grad_scale;
    ops::AdamW(ctx, p->value.View(begin, {n}), p->grad.View(begin, {n}), m_[i].View(begin, {n}),
               v_[i].View(begin, {n}), h);
  });
}

double AdamW::GradNorm(ops::Context& ctx) const { return std::sqrt(GradSumSquares(ctx)); }

double AdamW::GradSumSquares(ops::Context& ctx) const {
  return model::GradSumSquares(ctx, slices_, &norm_partials_);
}

void AdamW::ZeroGrad(ops::Context& ctx) const {
  slices_.Run(ctx, [&](int, size_t i, int64_t begin, int64_t n) {
    slices_.params()[i]->grad.View(begin, {n}).SetZero();
  });
}

}  // namespace strata::model
