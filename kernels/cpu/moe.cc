#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/common/logging.h"
#include "core/common/rng.h"
#include "kernels/cpu/common.h"

namespace strata::cpu {

template <typename T>
void moe_router_forward(ThreadPool& pool, T* probs, T* lse, int32_t* topk_expert, T* topk_weight,
                        const T* logits, int64_t Tn, int64_t E, int k, bool renormalize) {
  CHECK(k >= 1 && k <= 4 && k <= E) << "k=" << k << " E=" << E;
  pool.ParallelFor(Tn, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* x = logits + t * E;
      T* p = probs + t * E;
      T mx = x[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, x[e]);
      T s = 0;
      for (int64_t e = 0; e < E; ++e) s += std::exp(x[e] - mx);
      T l = mx + std::log(s);
      lse[t] = l;
      for (int64_t e = 0; e < E; ++e) p[e] = std::exp(x[e] - l);
      // Top-k by insertion into a small sorted list (k <= 4); strict '>' keeps lower ids first.
      int32_t idx[4];
      T val[4];
      int n = 0;
      for (int64_t e = 0; e < E; ++e) {
        T v = p[e];
        if (n == k && !(v > val[k - 1])) continue;
        int pos = n < k ? n++ : k - 1;
        while (pos > 0 && v > val[pos - 1]) {
          val[pos] = val[pos - 1];
          idx[pos] = idx[pos - 1];
          --pos;
        }
        val[pos] = v;
        idx[pos] = static_cast<int32_t>(e);
      }
      T norm = T(1);
      if (renormalize && k > 1) {
        T sum = 0;
        for (int j = 0; j < k; ++j) sum += val[j];
        norm = T(1) / sum;
      }
      for (int j = 0; j < k; ++j) {
        topk_expert[t * k + j] = idx[j];
        topk_weight[t * k + j] = val[j] * norm;
      }
    }
  });
}

template <typename T>
double moe_aux_loss(const T* probs, const int32_t* topk_expert, int64_t* top1_counts, int64_t Tn,
                    int64_t E, int k) {
  std::fill(top1_counts, top1_counts + E, 0);
  for (int64_t t = 0; t < Tn; ++t) ++top1_counts[topk_expert[t * k]];
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    double mean_p = 0;
    for (int64_t t = 0; t < Tn; ++t) mean_p += static_cast<double>(probs[t * E + e]);
    mean_p /= static_cast<double>(Tn);
    loss += static_cast<double>(top1_counts[e]) / static_cast<double>(Tn) * mean_p;
  }
  return static_cast<double>(E) * loss;
}

template <typename T>
double moe_z_loss(const T* lse, int64_t Tn) {
  double s = 0;
  for (int64_t t = 0; t < Tn; ++t) s += static_cast<double>(lse[t]) * static_cast<double>(lse[t]);
  return s / static_cast<double>(Tn);
}

template <typename T>
void moe_router_backward(ThreadPool& pool, T* dlogits, const T* dweight, const T* probs,
                         const T* lse, const int32_t* topk_expert, const int64_t* top1_counts,
                         int64_t Tn, int64_t E, int k, bool renormalize, T aux_coef, T z_coef) {
  // d(aux)/d(probs[t, e]) = E * f_e / T, the same for every token.
  T* aux_grad = internal::Scratch<T>(static_cast<size_t>(E), 3);
  for (int64_t e = 0; e < E; ++e) {
    aux_grad[e] = aux_coef * static_cast<T>(E) * static_cast<T>(top1_counts[e]) /
                  (static_cast<T>(Tn) * static_cast<T>(Tn));
  }
  const T z_scale = z_coef * T(2) / static_cast<T>(Tn);
  pool.ParallelFor(Tn, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* p = probs + t * E;
      const int32_t* idx = topk_expert + t * k;
      const T* dw = dweight + t * k;
      T* dl = dlogits + t * E;
      // dprobs = aux term + scatter of d(selected probabilities).
      for (int64_t e = 0; e < E; ++e) dl[e] = aux_grad[e];
      if (renormalize && k > 1) {
        // w_j = p_j / S, S = sum_i p_i  =>  dp_i = (dw_i - sum_j dw_j w_j) / S
        T sum = 0;
        for (int j = 0; j < k; ++j) sum += p[idx[j]];
        T dot = 0;
        for (int j = 0; j < k; ++j) dot += dw[j] * (p[idx[j]] / sum);
        for (int j = 0; j < k; ++j) dl[idx[j]] += (dw[j] - dot) / sum;
      } else {
        for (int j = 0; j < k; ++j) dl[idx[j]] += dw[j];
      }
      // Softmax backward, then the z-loss term.
      T dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += dl[e] * p[e];
      const T zt = z_scale * lse[t];
      for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dl[e] - dot) + zt * p[e];
    }
  });
}

int64_t moe_plan_dispatch(const int32_t* topk_expert, const uint8_t* eligible, int64_t Tn, int k,
                          int64_t E, int64_t capacity, int32_t* slot, int64_t* counts,
                          int64_t* offsets, int32_t* row_token, int64_t* dropped) {
  std::fill(counts, counts + E, 0);
  int64_t drops = 0;
  // Pass 1, in priority order: position of each choice within its expert, or -1.
  for (int j = 0; j < k; ++j) {
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t i = t * k + j;
      if (eligible != nullptr && !eligible[i]) {
        slot[i] = -1;
        continue;
      }
      const int32_t e = topk_expert[i];
      if (capacity > 0 && counts[e] >= capacity) {
        slot[i] = -1;
        ++drops;
        continue;
      }
      slot[i] = static_cast<int32_t>(counts[e]++);
    }
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  // Pass 2: positions become rows of the permuted buffer.
  for (int64_t i = 0; i < Tn * k; ++i) {
    if (slot[i] < 0) continue;
    const int64_t row = offsets[topk_expert[i]] + slot[i];
    slot[i] = static_cast<int32_t>(row);
    row_token[row] = static_cast<int32_t>(i / k);
  }
  if (dropped != nullptr) *dropped = drops;
  return offsets[E];
}

template <typename T>
void moe_permute_forward(ThreadPool& pool, T* xp, const T* x, const int32_t* row_token, int64_t R,
                         int64_t C) {
  pool.ParallelFor(R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::copy_n(x + static_cast<int64_t>(row_token[r]) * C, C, xp + r * C);
    }
  });
}

template <typename T>
void moe_permute_backward(ThreadPool& pool, T* dx, const T* dxp, const int32_t* slot, int64_t Tn,
                          int k, int64_t C, bool accumulate) {
  pool.ParallelFor(Tn, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* d = dx + t * C;
      if (!accumulate) std::fill(d, d + C, T(0));
      for (int j = 0; j < k; ++j) {
        const int32_t s = slot[t * k + j];
        if (s < 0) continue;
        const T* src = dxp + static_cast<int64_t>(s) * C;
        for (int64_t c = 0; c < C; ++c) d[c] += src[c];
      }
    }
  });
}

template <typename T>
void moe_combine_forward(ThreadPool& pool, T* y, const T* yp, const T* weight, const int32_t* slot,
                         int64_t Tn, int k, int64_t C) {
  pool.ParallelFor(Tn, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* o = y + t * C;
      std::fill(o, o + C, T(0));
      for (int j = 0; j < k; ++j) {
        const int32_t s = slot[t * k + j];
        if (s < 0) continue;
        const T w = weight[t * k + j];
        const T* src = yp + static_cast<int64_t>(s) * C;
        for (int64_t c = 0; c < C; ++c) o[c] += w * src[c];
      }
    }
  });
}

template <typename T>
void moe_combine_backward(ThreadPool& pool, T* dyp, T* dweight, const T* dy, const T* yp,
                          const T* weight, const int32_t* slot, int64_t Tn, int k, int64_t C) {
  pool.ParallelFor(Tn, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* g = dy + t * C;
      for (int j = 0; j < k; ++j) {
        const int32_t s = slot[t * k + j];
        if (s < 0) {
          dweight[t * k + j] = 0;
          continue;
        }
        const T w = weight[t * k + j];
        const T* src = yp + static_cast<int64_t>(s) * C;
        T* d = dyp + static_cast<int64_t>(s) * C;
        T dot = 0;
        for (int64_t c = 0; c < C; ++c) {
          dot += g[c] * src[c];
          d[c] = w * g[c];
        }
        dweight[t * k + j] = dot;
      }
    }
  });
}

template <typename T>
void moe_jitter_forward(ThreadPool& pool, T* xj, const T* x, uint64_t key, int64_t Tn, int64_t C,
                        double eps, int64_t first_token) {
  const int64_t base = first_token * C;
  pool.ParallelFor(Tn * C, internal::kElementGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      xj[i] = x[i] * static_cast<T>(1.0 - eps + 2.0 * eps * rng::Uniform(key, base + i));
    }
  });
}

template <typename T>
void moe_jitter_backward(ThreadPool& pool, T* dx, const T* dxj, uint64_t key, int64_t Tn, int64_t C,
                         double eps, int64_t first_token) {
  const int64_t base = first_token * C;
  pool.ParallelFor(Tn * C, internal::kElementGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      dx[i] += dxj[i] * static_cast<T>(1.0 - eps + 2.0 * eps * rng::Uniform(key, base + i));
    }
  });
}

namespace {
template <typename T>
inline T Softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
}  // namespace

template <typename T>
void moe_noisy_logits_forward(ThreadPool& pool, T* h, const T* clean, const T* raw_noise,
                              uint64_t key, int64_t Tn, int64_t E, int64_t first_token) {
  const int64_t base = first_token * E;
  pool.ParallelFor(Tn * E, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      h[i] = clean[i] + static_cast<T>(rng::Normal(key, base + i)) * Softplus(raw_noise[i]);
    }
  });
}

template <typename T>
void moe_noisy_logits_backward(ThreadPool& pool, T* draw_noise, const T* dh, const T* raw_noise,
                               uint64_t key, int64_t Tn, int64_t E, int64_t first_token) {
  const int64_t base = first_token * E;
  pool.ParallelFor(Tn * E, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T sig = T(1) / (T(1) + std::exp(-raw_noise[i]));
      draw_noise[i] = dh[i] * static_cast<T>(rng::Normal(key, base + i)) * sig;
    }
  });
}

template <typename T>
void moe_random_routing(uint8_t* eligible, const T* topk_weight, uint64_t key, int64_t Tn,
                        int64_t first_token) {
  for (int64_t t = 0; t < Tn; ++t) {
    eligible[2 * t] = 1;
    eligible[2 * t + 1] =
        2.0 * static_cast<double>(topk_weight[2 * t + 1]) > rng::Uniform(key, first_token + t);
  }
}

#define STRATA_INSTANTIATE(T)                                                                    \
  template void moe_router_forward<T>(ThreadPool&, T*, T*, int32_t*, T*, const T*, int64_t,      \
                                      int64_t, int, bool);                                       \
  template double moe_aux_loss<T>(const T*, const int32_t*, int64_t*, int64_t, int64_t, int);    \
  template double moe_z_loss<T>(const T*, int64_t);                                              \
  template void moe_router_backward<T>(ThreadPool&, T*, const T*, const T*, const T*,            \
                                       const int32_t*, const int64_t*, int64_t, int64_t, int,    \
                                       bool, T, T);                                              \
  template void moe_permute_forward<T>(ThreadPool&, T*, const T*, const int32_t*, int64_t,       \
                                       int64_t);                                                 \
  template void moe_permute_backward<T>(ThreadPool&, T*, const T*, const int32_t*, int64_t, int, \
                                        int64_t, bool);                                          \
  template void moe_combine_forward<T>(ThreadPool&, T*, const T*, const T*, const int32_t*,      \
                                       int64_t, int, int64_t);                                   \
  template void moe_combine_backward<T>(ThreadPool&, T*, T*, const T*, const T*, const T*,       \
                                        const int32_t*, int64_t, int, int64_t);                  \
  template void moe_jitter_forward<T>(ThreadPool&, T*, const T*, uint64_t, int64_t, int64_t,     \
                                      double, int64_t);                                          \
  template void moe_jitter_backward<T>(ThreadPool&, T*, const T*, uint64_t, int64_t, int64_t,    \
                                       double, int64_t);                                         \
  template void moe_noisy_logits_forward<T>(ThreadPool&, T*, const T*, const T*, uint64_t,       \
                                            int64_t, int64_t, int64_t);                          \
  template void moe_noisy_logits_backward<T>(ThreadPool&, T*, const T*, const T*, uint64_t,      \
                                             int64_t, int64_t, int64_t);                         \
  template void moe_random_routing<T>(uint8_t*, const T*, uint64_t, int64_t, int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
