#include "kernels/cpu/norm.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace strata::cpu {
template <typename T>
void layernorm_forward(ThreadPool& pool, T* out, T* mean, T* rstd, const T* inp, const T* weight,
                       const T* bias, int64_t N, int64_t C, T eps) {
  pool.ParallelFor(N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = inp + r * C;
      T m = 0;
      for (int64_t c = 0; c < C; ++c) m += x[c];
      m /= static_cast<T>(C);
      T var = 0;
      for (int64_t c = 0; c < C; ++c) {
        T d = x[c] - m;
        var += d * d;
      }
      var /= static_cast<T>(C);
      T s = T(1) / std::sqrt(var + eps);
      T* o = out + r * C;
      for (int64_t c = 0; c < C; ++c) {
        o[c] = (x[c] - m) * s * weight[c] + (bias ? bias[c] : T(0));
      }
      mean[r] = m;
      rstd[r] = s;
    }
  });
}

template <typename T>
void layernorm_backward(ThreadPool& pool, T* dinp, T* dweight, T* dbias, const T* dout,
                        const T* inp, const T* weight, const T* mean, const T* rstd, int64_t N,
                        int64_t C) {
  T* outs[2] = {dweight, dbias};
  internal::RowPartialSums<T>(pool, N, C, 2, outs, [&](int64_t r0, int64_t r1, T* partial) {
    T* pw = partial;
    T* pb = partial + C;
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = inp + r * C;
      const T* dy = dout + r * C;
      const T m = mean[r], s = rstd[r];
      T mean_dn = 0, mean_dn_xhat = 0;
      for (int64_t c = 0; c < C; ++c) {
        T xhat = (x[c] - m) * s;
        T dn = dy[c] * weight[c];
        mean_dn += dn;
        mean_dn_xhat += dn * xhat;
        pw[c] += dy[c] * xhat;
        pb[c] += dy[c];
      }
      mean_dn /= static_cast<T>(C);
      mean_dn_xhat /= static_cast<T>(C);
      T* dx = dinp + r * C;
      for (int64_t c = 0; c < C; ++c) {
        T xhat = (x[c] - m) * s;
        T dn = dy[c] * weight[c];
        dx[c] += s * (dn - mean_dn - xhat * mean_dn_xhat);
      }
    }
  });
}

template <typename T>
void rmsnorm_forward(ThreadPool& pool, T* out, T* rstd, const T* inp, const T* weight, int64_t N,
                     int64_t C, T eps) {
  pool.ParallelFor(N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = inp + r * C;
      T ms = 0;
      for (int64_t c = 0; c < C; ++c) ms += x[c] * x[c];
      ms /= static_cast<T>(C);
      T s = T(1) / std::sqrt(ms + eps);
      T* o = out + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = x[c] * s * weight[c];
      rstd[r] = s;
    }
  });
}

template <typename T>
void rmsnorm_backward(ThreadPool& pool, T* dinp, T* dweight, const T* dout, const T* inp,
                      const T* weight, const T* rstd, int64_t N, int64_t C) {
  T* outs[1] = {dweight};
  internal::RowPartialSums<T>(pool, N, C, 1, outs, [&](int64_t r0, int64_t r1, T* pw) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = inp + r * C;
      const T* dy = dout + r * C;
      const T s = rstd[r];
      T mean_dn_xhat = 0;
      for (int64_t c = 0; c < C; ++c) {
        T xhat = x[c] * s;
        mean_dn_xhat += dy[c] * weight[c] * xhat;
        pw[c] += dy[c] * xhat;
      }
      mean_dn_xhat /= static_cast<T>(C);
      T* dx = dinp + r * C;
      for (int64_t c = 0; c < C; ++c) {
        dx[c] += s * (dy[c] * weight[c] - x[c] * s * mean_dn_xhat);
      }
    }
  });
}

#define STRATA_INSTANTIATE(T)                                                                     \
  template void layernorm_forward<T>(ThreadPool&, T*, T*, T*, const T*, const T*, const T*,       \
                                     int64_t, int64_t, T);                                        \
  template void layernorm_backward<T>(ThreadPool&, T*, T*, T*, const T*, const T*, const T*,      \
                                      const T*, const T*, int64_t, int64_t);                      \
  template void rmsnorm_forward<T>(ThreadPool&, T*, T*, const T*, const T*, int64_t, int64_t, T); \
  template void rmsnorm_backward<T>(ThreadPool&, T*, T*, const T*, const T*, const T*, const T*,  \
                                    int64_t, int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
