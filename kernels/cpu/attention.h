// Causal multi-head self-attention on a fused QKV tensor.
//
// qkv is [B, T, 3C]: for every token the C query, then C key, then C value channels; head h uses
// channels [h*hs, (h+1)*hs) of each, hs = C / NH. Each (batch, head) pair is one task on the pool;
// inside it, QK^T, PV and their backward are single-threaded BLAS calls on strided views, and the
// causal softmax runs over j <= i only. The softmax probabilities are saved for backward
// (B*NH*T*T values); backward needs only per-thread T*T scratch.
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// out [B, T, C]; att [B, NH, T, T] (saved probabilities, zero above the diagonal).
template <typename T>
void attention_forward(ThreadPool& pool, T* out, T* att, const T* qkv, int64_t B, int64_t Tn,
                       int64_t C, int64_t NH);

// dqkv [B, T, 3C] is overwritten.
template <typename T>
void attention_backward(ThreadPool& pool, T* dqkv, const T* dout, const T* qkv, const T* att,
                        int64_t B, int64_t Tn, int64_t C, int64_t NH);

}  // namespace strata::cpu
