// AdamW (decoupled weight decay, PyTorch's update order) and the pieces of global-norm clipping.
#pragma once

#include <cstdint>

#include "runtime/common/thread_pool.h"

namespace strata::cpu {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // 0 for parameters that are not decayed
  int64_t step = 1;           // 1-based step count, for bias correction
  double grad_scale = 1.0;    // gradient multiplier (global-norm clipping)
};

// p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), with g = grad * grad_scale.
template <typename T>
void adamw_update(ThreadPool& pool, T* param, const T* grad, T* m, T* v, int64_t n,
                  const AdamWHyper& h);

// Sum of squares, accumulated in double slice by slice in a fixed order.
template <typename T>
double sum_squares(ThreadPool& pool, const T* x, int64_t n);

// The multiplier that brings a gradient of global L2 norm `norm` down to `max_norm` (1 when it is
// already within, or when max_norm is 0).
inline double ClipScale(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

}  // namespace strata::cpu
