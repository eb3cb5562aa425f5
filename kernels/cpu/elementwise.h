// Element-wise helpers used on the residual stream.
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
