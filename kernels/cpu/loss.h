// Softmax cross-entropy over a vocabulary, forward and backward fused.
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// For each of N rows of logits [N, V] and its target in [0, V): loss = logsumexp(row) - row[t].
// Writes per-row losses when `losses` is non-null and returns their sum (accumulated in double,
// slice by slice in a fixed order). When dlogits is non-null it gets
// (softmax(row) - onehot(target)) * grad_scale; dlogits may alias logits.
template <typename T>
double softmax_cross_entropy(ThreadPool& pool, T* dlogits, T* losses, const T* logits,
                             const int32_t* targets, int64_t N, int64_t V, T grad_scale);

}  // namespace strata::cpu
