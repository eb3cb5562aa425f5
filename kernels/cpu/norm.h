// LayerNorm and RMSNorm over the last dimension, forward and backward.
//
// Forward saves per-row statistics (mean and reciprocal std; RMSNorm saves only rstd) so backward
// does not recompute them. Backward *accumulates* into dinp: norms always sit at the start of a
// residual branch, so the caller's residual gradient is already there.
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// out, inp [N, C]; weight, bias [C] (bias may be null); mean, rstd [N].
template <typename T>
void layernorm_forward(ThreadPool& pool, T* out, T* mean, T* rstd, const T* inp, const T* weight,
                       const T* bias, int64_t N, int64_t C, T eps);
// dinp += ...; dweight += ...; dbias += ... (dbias may be null).
template <typename T>
void layernorm_backward(ThreadPool& pool, T* dinp, T* dweight, T* dbias, const T* dout,
                        const T* inp, const T* weight, const T* mean, const T* rstd, int64_t N,
                        int64_t C);

// y = x / sqrt(mean(x^2) + eps) * weight.
template <typename T>
void rmsnorm_forward(ThreadPool& pool, T* out, T* rstd, const T* inp, const T* weight, int64_t N,
                     int64_t C, T eps);
template <typename T>
void rmsnorm_backward(ThreadPool& pool, T* dinp, T* dweight, const T* dout, const T* inp,
                      const T* weight, const T* rstd, int64_t N, int64_t C);

}  // namespace strata::cpu
