#include "kernels/cpu/loss.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/fast_math.h"

namespace strata::cpu {

template <typename T>
double softmax_cross_entropy(ThreadPool& pool, T* dlogits, T* losses, const T* logits,
                             const int32_t* targets, int64_t N, int64_t V, T grad_scale) {
  int parts = pool.PartsFor(N, 8);
  double* partial = internal::Scratch<double>(parts, 2);
  pool.ParallelForSlices(N, 8, [&](int part, int64_t r0, int64_t r1) {
    double sum = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = logits + r * V;
      T mx = x[0];
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, x[v]);
      T s = 0;
      for (int64_t v = 0; v < V; ++v) s += Exp(x[v] - mx);
      T lse = mx + std::log(s);
      const int32_t tgt = targets[r];
      T loss = lse - x[tgt];
      if (losses != nullptr) losses[r] = loss;
      sum += static_cast<double>(loss);
      if (dlogits != nullptr) {
        T* d = dlogits + r * V;
        for (int64_t v = 0; v < V; ++v) d[v] = Exp(x[v] - lse) * grad_scale;
        d[tgt] -= grad_scale;
      }
    }
    partial[part] = sum;
  });
  double total = 0;
  for (int p = 0; p < parts; ++p) total += partial[p];
  return total;
}

template double softmax_cross_entropy<float>(ThreadPool&, float*, float*, const float*,
                                             const int32_t*, int64_t, int64_t, float);
template double softmax_cross_entropy<double>(ThreadPool&, double*, double*, const double*,
                                              const int32_t*, int64_t, int64_t, double);

}  // namespace strata::cpu
