#include "kernels/cpu/optimizer.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace strata::cpu {

template <typename T>
void adamw_update(ThreadPool& pool, T* param, const T* grad, T* m, T* v, int64_t n,
                  const AdamWHyper& h) {
  const T lr = static_cast<T>(h.lr);
  const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
  const T eps = static_cast<T>(h.eps);
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  const T bc1 = static_cast<T>(1.0 - std::pow(h.beta1, static_cast<double>(h.step)));
  const T bc2 = static_cast<T>(1.0 - std::pow(h.beta2, static_cast<double>(h.step)));
  const T gs = static_cast<T>(h.grad_scale);
  // The constants are copied into the slice and the arrays marked __restrict, so the compiler
  // keeps them in registers and vectorizes the loop (sqrt and division are exact IEEE operations:
  // the vector loop gives the same bits as a scalar one).
  pool.ParallelFor(n, internal::kElementGrain, [=](int64_t i0, int64_t i1) {
    T* __restrict pp = param;
    const T* __restrict gp = grad;
    T* __restrict mp = m;
    T* __restrict vp = v;
    for (int64_t i = i0; i < i1; ++i) {
      const T g = gp[i] * gs;
      const T mi = b1 * mp[i] + (T(1) - b1) * g;
      const T vi = b2 * vp[i] + (T(1) - b2) * g * g;
      mp[i] = mi;
      vp[i] = vi;
      const T p = pp[i] * decay;
      pp[i] = p - lr * (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    }
  });
}

template <typename T>
double sum_squares(ThreadPool& pool, const T* x, int64_t n) {
  int parts = pool.PartsFor(n, internal::kElementGrain);
  double* partial = internal::Scratch<double>(parts, 2);
  pool.ParallelForSlices(n, internal::kElementGrain, [&](int part, int64_t i0, int64_t i1) {
    double s = 0;
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    partial[part] = s;
  });
  double total = 0;
  for (int p = 0; p < parts; ++p) total += partial[p];
  return total;
}

#define STRATA_INSTANTIATE(T)                                                                   \
  template void adamw_update<T>(ThreadPool&, T*, const T*, T*, T*, int64_t, const AdamWHyper&); \
  template double sum_squares<T>(ThreadPool&, const T*, int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
