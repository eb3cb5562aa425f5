// AdamW over a list of parameters, with global-norm gradient clipping.
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

  // L2 norm of all gradients together, summed parameter by parameter in a fixed order.
  static double GradNorm(ops::Context& ctx, const std::vector<Parameter*>& params);

  int64_t steps() const { return step_; }
  const std::vector<Tensor>& first_moments() const { return m_; }
  const std::vector<Tensor>& second_moments() const { return v_; }

 private:
  std::vector<Parameter*> params_;
  AdamWOptions options_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

}  // namespace strata::model
