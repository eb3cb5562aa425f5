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

// Incremental decoding against a KV cache. k_cache and v_cache are [S, T_max, C]: slot s holds
// the keys (values) of one sequence's positions 0, 1, ... Row i of qkv [N, 3C] is the token of
// slot slots[i] at position positions[i] (< T_max). First every row's key and value enter the
// cache at (slot, position); then row i attends to positions [0, positions[i]] of its slot, so a
// row may see the rows of the same call at earlier positions (a prompt decoded in one call).
// out [N, C]. Scores are scale * q.k, softmax over the positions, then the weighted values: the
// arithmetic of attention_forward for the same positions, up to the order of the sums. Rows of one
// call must not write the same (slot, position) twice.
template <typename T>
void attention_decode(ThreadPool& pool, T* out, const T* qkv, T* k_cache, T* v_cache,
                      const int32_t* slots, const int32_t* positions, int64_t N, int64_t Tmax,
                      int64_t C, int64_t NH);

}  // namespace strata::cpu
