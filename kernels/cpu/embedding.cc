#include "kernels/cpu/embedding.h"

namespace strata::cpu {

template <typename T>
void embedding_forward(ThreadPool& pool, T* out, const int32_t* tokens, const T* wte, const T* wpe,
                       int64_t B, int64_t Tn, int64_t C, const int32_t* positions) {
  pool.ParallelFor(B * Tn, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* e = wte + static_cast<int64_t>(tokens[r]) * C;
      const T* p = wpe + (positions != nullptr ? static_cast<int64_t>(positions[r]) : r % Tn) * C;
      T* o = out + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
    }
  });
}

template <typename T>
void embedding_backward(ThreadPool& pool, T* dwte, T* dwpe, const T* dout, const int32_t* tokens,
                        int64_t B, int64_t Tn, int64_t C) {
  pool.ParallelFor(C, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < B * Tn; ++r) {
      const T* d = dout + r * C;
      T* e = dwte + static_cast<int64_t>(tokens[r]) * C;
      T* p = dwpe + (r % Tn) * C;
      for (int64_t c = c0; c < c1; ++c) {
        e[c] += d[c];
        p[c] += d[c];
      }
    }
  });
}

#define STRATA_INSTANTIATE(T)                                                                      \
  template void embedding_forward<T>(ThreadPool&, T*, const int32_t*, const T*, const T*, int64_t, \
                                     int64_t, int64_t, const int32_t*);                            \
  template void embedding_backward<T>(ThreadPool&, T*, T*, const T*, const int32_t*, int64_t,      \
                                      int64_t, int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
