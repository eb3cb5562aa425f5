// Element-wise helpers used on the residual stream.
//
// Threads: like every kernel in kernels/cpu, these run on `pool` (one calling thread at a time;
// inline on the calling thread inside a pool task, see core/common/thread_pool.h) and borrow their
// arrays for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// out[i] = a[i] + b[i]; out may alias a or b.
template <typename T>
void add(ThreadPool& pool, T* out, const T* a, const T* b, int64_t n);

// out[i] += a[i].
template <typename T>
void accumulate(ThreadPool& pool, T* out, const T* a, int64_t n);

}  // namespace strata::cpu
