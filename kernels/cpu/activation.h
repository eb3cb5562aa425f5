// Pointwise activations: GELU (tanh approximation), ReLU, SwiGLU.
//
// SwiGLU takes a row of 2H pre-activations — H gate values then H up values — and produces H
// outputs silu(gate) * up. The others map H to H. Backward may run in place (dinp == inp), which
// lets a layer reuse the pre-activation buffer for its gradient.
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"
#include "kernels/vocabulary.h"

namespace strata::cpu {

// The activations and their input widths (kernels/vocabulary.h).
using ops::Activation;
using ops::ActivationInputWidth;

// out [N, H] from inp [N, ActivationInputWidth(act, H)].
template <typename T>
void activation_forward(ThreadPool& pool, Activation act, T* out, const T* inp, int64_t N,
                        int64_t H);

// Fused bias and activation: pre [N, in_width] += bias [in_width], then out [N, H] = act(pre).
// One pass over the pre-activation instead of two; pre keeps the biased values for backward.
template <typename T>
void bias_activation_forward(ThreadPool& pool, Activation act, T* out, T* pre, const T* bias,
                             int64_t N, int64_t H);

// dinp [N, in_width] (=) from dout [N, H] and the saved pre-activation inp. dinp may alias inp.
// When dbias is non-null it also accumulates the column sums of dinp into it (the gradient of a
// bias added before the activation), in the same pass.
template <typename T>
void activation_backward(ThreadPool& pool, Activation act, T* dinp, const T* dout, const T* inp,
                         int64_t N, int64_t H, T* dbias = nullptr);

}  // namespace strata::cpu
