#include "kernels/cpu/elementwise.h"

#include "kernels/cpu/common.h"

namespace strata::cpu {

template <typename T>
void add(ThreadPool& pool, T* out, const T* a, const T* b, int64_t n) {
  pool.ParallelFor(n, internal::kElementGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

template <typename T>
void accumulate(ThreadPool& pool, T* out, const T* a, int64_t n) {
  pool.ParallelFor(n, internal::kElementGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] += a[i];
  });
}

template void add<float>(ThreadPool&, float*, const float*, const float*, int64_t);
template void add<double>(ThreadPool&, double*, const double*, const double*, int64_t);
template void accumulate<float>(ThreadPool&, float*, const float*, int64_t);
template void accumulate<double>(ThreadPool&, double*, const double*, int64_t);

}  // namespace strata::cpu
