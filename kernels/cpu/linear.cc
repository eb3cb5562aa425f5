#include "kernels/cpu/linear.h"

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"

namespace strata::cpu {

template <typename T>
void add_bias(ThreadPool& pool, T* out, const T* bias, int64_t N, int64_t C) {
  pool.ParallelFor(N, std::max<int64_t>(1, internal::kElementGrain / std::max<int64_t>(C, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) {
                       T* o = out + r * C;
                       for (int64_t c = 0; c < C; ++c) o[c] += bias[c];
                     }
                   });
}

template <typename T>
void linear_forward(ThreadPool& pool, T* out, const T* inp, const T* weight, const T* bias,
                    int64_t N, int64_t IC, int64_t OC) {
  Gemm<T>(pool, false, true, N, OC, IC, T(1), inp, IC, weight, IC, T(0), out, OC);
  if (bias != nullptr) add_bias(pool, out, bias, N, OC);
}

template <typename T>
void linear_backward(ThreadPool& pool, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int64_t N, int64_t IC, int64_t OC, bool accumulate_dinp) {
  // Parameter gradients first: they read inp, which dinp may alias.
  if (dweight != nullptr) {
    Gemm<T>(pool, true, false, OC, IC, N, T(1), dout, OC, inp, IC, T(1), dweight, IC);
  }
  if (dbias != nullptr) internal::ColumnSums(pool, dbias, dout, N, OC, OC, /*accumulate=*/true);
  if (dinp != nullptr) {
    Gemm<T>(pool, false, false, N, IC, OC, T(1), dout, OC, weight, IC,
            accumulate_dinp ? T(1) : T(0), dinp, IC);
  }
}

#define STRATA_INSTANTIATE(T)                                                                      \
  template void linear_forward<T>(ThreadPool&, T*, const T*, const T*, const T*, int64_t, int64_t, \
                                  int64_t);                                                        \
  template void linear_backward<T>(ThreadPool&, T*, T*, T*, const T*, const T*, const T*, int64_t, \
                                   int64_t, int64_t, bool);                                        \
  template void add_bias<T>(ThreadPool&, T*, const T*, int64_t, int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
