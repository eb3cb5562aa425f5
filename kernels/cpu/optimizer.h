// AdamW (decoupled weight decay, PyTorch's update order) and the pieces of global-norm clipping.
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"
#include "kernels/vocabulary.h"

namespace strata::cpu {

// The hyperparameters and the clipping multiplier (kernels/vocabulary.h).
using ops::AdamWHyper;
using ops::ClipScale;

// p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), with g = grad * grad_scale.
template <typename T>
void adamw_update(ThreadPool& pool, T* param, const T* grad, T* m, T* v, int64_t n,
                  const AdamWHyper& h);

// Sum of squares, accumulated in double slice by slice in a fixed order.
template <typename T>
double sum_squares(ThreadPool& pool, const T* x, int64_t n);

}  // namespace strata::cpu
