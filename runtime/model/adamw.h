// AdamW over a list of parameters, with global-norm gradient clipping. Updates, norms and zeroing
// run over all parameters as one flat range split across the pool (ParameterSlices).
//
// Ownership and threads: AdamW owns its moments (first_moment/second_moment references live as
// long as it) and borrows the parameters, which must outlive it. Not synchronised: one thread at
// a time calls it (the one driving the step), and nothing else may write the parameters or their
// gradients during a call; each call fans out over ctx.pool itself.
#pragma once

#include <vector>

#include "kernels/ops.h"
#include "runtime/model/parameter.h"

namespace strata::model {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;  // applied to parameters with decay = true
};

class AdamW {
 public:
  AdamW(std::vector<Parameter*> params, const AdamWOptions& options);

  // One update of every parameter with learning rate lr, gradients multiplied by grad_scale.
  void Step(ops::Context& ctx, double lr, double grad_scale);

  // L2 norm of all gradients together (per-thread partial sums combined in thread order).
  double GradNorm(ops::Context& ctx) const;
  // Its square, for adding other gradients (experts in the tiered store) before the root.
  double GradSumSquares(ops::Context& ctx) const;
  // Sets every gradient to zero.
  void ZeroGrad(ops::Context& ctx) const;

  int64_t steps() const { return step_; }
  void set_steps(int64_t steps) { step_ = steps; }  // resume
  const std::vector<Parameter*>& params() const { return slices_.params(); }
  // Adam's moments of params()[i].
  const Tensor& first_moment(size_t i) const { return m_[i]; }
  const Tensor& second_moment(size_t i) const { return v_[i]; }

 private:
  ParameterSlices slices_;
  AdamWOptions options_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
  mutable std::vector<double> norm_partials_;  // per-thread partial sums of GradNorm
};

}  // namespace strata::model
