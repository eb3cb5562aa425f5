// Token + position embedding (GPT-2 style): out[b, t] = wte[tokens[b, t]] + wpe[t].
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// out [B, T, C]; tokens [B, T] in [0, V); wte [V, C]; wpe [T_max >= T, C]. Row r's position is
// positions[r] when positions is given (incremental decoding: rows of many sequences at any
// positions, each < T_max), else r % Tn.
template <typename T>
void embedding_forward(ThreadPool& pool, T* out, const int32_t* tokens, const T* wte, const T* wpe,
                       int64_t B, int64_t Tn, int64_t C, const int32_t* positions = nullptr);

// dwte[tokens[b, t]] += dout[b, t]; dwpe[t] += sum_b dout[b, t]. Deterministic: each thread owns a
// block of channels and walks tokens in order, so repeated tokens never race.
template <typename T>
void embedding_backward(ThreadPool& pool, T* dwte, T* dwpe, const T* dout, const int32_t* tokens,
                        int64_t B, int64_t Tn, int64_t C);

}  // namespace strata::cpu
