// Fully connected layer: out = inp W^T + b, with W stored [out_features, in_features] (PyTorch's
// layout, so weights compare directly with a PyTorch reference).
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// out [N, OC]; inp [N, IC]; weight [OC, IC]; bias [OC] or null.
template <typename T>
void linear_forward(ThreadPool& pool, T* out, const T* inp, const T* weight, const T* bias,
                    int64_t N, int64_t IC, int64_t OC);

// dinp [N, IC] is overwritten, or accumulated into when accumulate_dinp (dinp may be null when
// not needed); dweight += dout^T inp; dbias += column sums of dout (dbias may be null). The
// parameter gradients are computed first, so dinp may alias inp: inp is not read once dinp is
// being written.
template <typename T>
void linear_backward(ThreadPool& pool, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int64_t N, int64_t IC, int64_t OC, bool accumulate_dinp);

// out[r, c] += bias[c] for r < N.
template <typename T>
void add_bias(ThreadPool& pool, T* out, const T* bias, int64_t N, int64_t C);

}  // namespace strata::cpu
