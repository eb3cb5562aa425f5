#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/common.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace strata::cpu {

template <typename T>
void attention_forward(ThreadPool& pool, T* out, T* att, const T* qkv, int64_t B, int64_t Tn,
                       int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  pool.ParallelFor(B * NH, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / NH, h = i % NH;
      const T* q = qkv + b * Tn * C3 + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* p = att + i * Tn * Tn;
      // S = scale * Q K^T (the upper triangle is computed and then overwritten).
      GemmSerial<T>(false, true, Tn, Tn, hs, scale, q, C3, k, C3, T(0), p, Tn);
      for (int64_t r = 0; r < Tn; ++r) {
        T* row = p + r * Tn;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j <= r; ++j) mx = std::max(mx, row[j]);
        T sum = 0;
        for (int64_t j = 0; j <= r; ++j) {
          row[j] = Exp(row[j] - mx);
          sum += row[j];
        }
        T inv = T(1) / sum;
        for (int64_t j = 0; j <= r; ++j) row[j] *= inv;
        for (int64_t j = r + 1; j < Tn; ++j) row[j] = 0;
      }
      // out_bh = P V
      GemmSerial<T>(false, false, Tn, hs, Tn, T(1), p, Tn, v, C3, T(0), out + b * Tn * C + h * hs,
                    C);
    }
  });
}

template <typename T>
void attention_backward(ThreadPool& pool, T* dqkv, const T* dout, const T* qkv, const T* att,
                        int64_t B, int64_t Tn, int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  pool.ParallelFor(B * NH, 1, [&](int64_t i0, int64_t i1) {
    T* dp = internal::Scratch<T>(static_cast<size_t>(Tn * Tn));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / NH, h = i % NH;
      const T* q = qkv + b * Tn * C3 + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + b * Tn * C3 + h * hs;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* p = att + i * Tn * Tn;
      const T* dO = dout + b * Tn * C + h * hs;
      // dP = dO V^T ; dV = P^T dO
      GemmSerial<T>(false, true, Tn, Tn, hs, T(1), dO, C, v, C3, T(0), dp, Tn);
      GemmSerial<T>(true, false, Tn, hs, Tn, T(1), p, Tn, dO, C, T(0), dv, C3);
      // dS = P * (dP - rowsum(P * dP)) * scale, zero above the diagonal since P is.
      for (int64_t r = 0; r < Tn; ++r) {
        const T* prow = p + r * Tn;
        T* drow = dp + r * Tn;
        T dot = 0;
        for (int64_t j = 0; j <= r; ++j) dot += prow[j] * drow[j];
        for (int64_t j = 0; j <= r; ++j) drow[j] = prow[j] * (drow[j] - dot) * scale;
        for (int64_t j = r + 1; j < Tn; ++j) drow[j] = 0;
      }
      // dQ = dS K ; dK = dS^T Q
      GemmSerial<T>(false, false, Tn, hs, Tn, T(1), dp, Tn, k, C3, T(0), dq, C3);
      GemmSerial<T>(true, false, Tn, hs, Tn, T(1), dp, Tn, q, C3, T(0), dk, C3);
    }
  });
}

template <typename T>
void attention_decode(ThreadPool& pool, T* out, const T* qkv, T* k_cache, T* v_cache,
                      const int32_t* slots, const int32_t* positions, int64_t N, int64_t Tmax,
                      int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
  const int64_t C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  auto at = [&](int64_t i) { return (static_cast<int64_t>(slots[i]) * Tmax + positions[i]) * C; };
  pool.ParallelFor(N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* kv = qkv + i * C3 + C;
      std::copy(kv, kv + C, k_cache + at(i));
      std::copy(kv + C, kv + 2 * C, v_cache + at(i));
    }
  });
  pool.ParallelFor(N * NH, 1, [&](int64_t t0, int64_t t1) {
    T* p = internal::Scratch<T>(static_cast<size_t>(Tmax));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / NH, h = t % NH;
      const int64_t n = static_cast<int64_t>(positions[i]) + 1;
      const T* q = qkv + i * C3 + h * hs;
      const T* k = k_cache + static_cast<int64_t>(slots[i]) * Tmax * C + h * hs;
      const T* v = v_cache + static_cast<int64_t>(slots[i]) * Tmax * C + h * hs;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        p[j] = scale * internal::Dot(q, k + j * C, hs);
        mx = std::max(mx, p[j]);
      }
      T sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = Exp(p[j] - mx);
        sum += p[j];
      }
      const T inv = T(1) / sum;
      for (int64_t j = 0; j < n; ++j) p[j] *= inv;
      T* o = out + i * C + h * hs;
      std::fill(o, o + hs, T(0));
      for (int64_t j = 0; j < n; ++j) {
        const T* vj = v + j * C;
        for (int64_t c = 0; c < hs; ++c) o[c] += p[j] * vj[c];
      }
    }
  });
}

#define STRATA_INSTANTIATE(T)                                                                  \
  template void attention_forward<T>(ThreadPool&, T*, T*, const T*, int64_t, int64_t, int64_t, \
                                     int64_t);                                                 \
  template void attention_backward<T>(ThreadPool&, T*, const T*, const T*, const T*, int64_t,  \
                                      int64_t, int64_t, int64_t);                              \
  template void attention_decode<T>(ThreadPool&, T*, const T*, T*, T*, const int32_t*,         \
                                    const int32_t*, int64_t, int64_t, int64_t, int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
