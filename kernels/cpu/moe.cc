#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/common/logging.h"
#include "core/common/rng.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/fast_math.h"

namespace strata::cpu {

namespace {

// Keeps the n <= cap largest values seen, in descending order (ties: the earlier first), by
// insertion with strict '>'. Until it is full every value enters (at its place, or last when it
// is NaN), so a row of NaN scores still yields valid, distinct ids: the first ones offered.
template <typename T>
struct TopList {
  int32_t idx[kMaxTopK] = {};
  T val[kMaxTopK] = {};
  int n = 0;
  void Offer(T v, int32_t id, int cap) {
    if (n == cap && !(v > val[cap - 1])) return;
    int pos = n < cap ? n++ : cap - 1;
    while (pos > 0 && v > val[pos - 1]) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    val[pos] = v;
    idx[pos] = id;
  }
};

// The groups a token may choose from (MoeRouterSpec), as a bit mask; all ones without groups.
template <typename T>
uint64_t AllowedGroups(const T* p, const T* bias, int64_t E, const MoeRouterSpec& spec) {
  if (spec.num_groups <= 1) return ~uint64_t{0};
  const int G = spec.num_groups;
  const int64_t per = E / G;
  const int m = std::max(1, spec.k / spec.topk_groups);
  TopList<T> best;
  for (int g = 0; g < G; ++g) {
    TopList<T> top;
    for (int64_t e = g * per; e < (g + 1) * per; ++e) {
      top.Offer(bias != nullptr ? p[e] + bias[e] : p[e], static_cast<int32_t>(e),
                std::min<int>(m, static_cast<int>(per)));
    }
    T score = 0;
    for (int j = 0; j < top.n; ++j) score += top.val[j];
    best.Offer(score, g, spec.topk_groups);
  }
  uint64_t mask = 0;
  for (int j = 0; j < best.n; ++j) mask |= uint64_t{1} << best.idx[j];
  return mask;
}

}  // namespace

template <typename T>
void moe_router_forward(ThreadPool& pool, T* scores, T* lse, int32_t* topk_expert, T* topk_weight,
                        const T* logits, const T* bias, int64_t Tn, int64_t E,
                        const MoeRouterSpec& spec) {
  const int k = spec.k;
  CHECK(k >= 1 && k <= kMaxTopK && k <= E) << "k=" << k << " E=" << E;
  CHECK(spec.num_groups <= 1 ||
        (spec.num_groups <= ops::kMaxRouterGroups && E % spec.num_groups == 0 &&
         spec.topk_groups >= 1 && spec.topk_groups <= spec.num_groups &&
         k <= spec.topk_groups * (E / spec.num_groups)))
      << "groups " << spec.num_groups << " top " << spec.topk_groups << " k=" << k << " E=" << E;
  const int64_t per_group = spec.num_groups > 1 ? E / spec.num_groups : E;
  pool.ParallelFor(Tn, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* x = logits + t * E;
      T* p = scores + t * E;
      // One exp per score, in loops that vectorise (Exp: fast_math.h).
      const T mx = internal::Max(x, E);
      for (int64_t e = 0; e < E; ++e) p[e] = Exp(x[e] - mx);
      const T s = internal::Sum(p, E);
      lse[t] = mx + std::log(s);
      if (spec.sigmoid) {
        for (int64_t e = 0; e < E; ++e) p[e] = Sigmoid(x[e]);
      } else {
        const T inv = T(1) / s;
        for (int64_t e = 0; e < E; ++e) p[e] *= inv;
      }
      const uint64_t allowed = AllowedGroups(p, bias, E, spec);
      TopList<T> top;
      for (int64_t e = 0; e < E; ++e) {
        if (!((allowed >> (e / per_group)) & 1)) continue;
        top.Offer(bias != nullptr ? p[e] + bias[e] : p[e], static_cast<int32_t>(e), k);
      }
      T norm = static_cast<T>(spec.scaling);
      if (spec.renormalize && k > 1) {
        T sum = 0;
        for (int j = 0; j < k; ++j) sum += p[top.idx[j]];
        norm = static_cast<T>(spec.scaling) / sum;
      }
      for (int j = 0; j < k; ++j) {
        topk_expert[t * k + j] = top.idx[j];
        topk_weight[t * k + j] = p[top.idx[j]] * norm;
      }
    }
  });
}

template <typename T>
void moe_router_forward(ThreadPool& pool, T* probs, T* lse, int32_t* topk_expert, T* topk_weight,
                        const T* logits, int64_t Tn, int64_t E, int k, bool renormalize) {
  MoeRouterSpec spec;
  spec.k = k;
  spec.renormalize = renormalize;
  moe_router_forward<T>(pool, probs, lse, topk_expert, topk_weight, logits, nullptr, Tn, E, spec);
}

namespace {
// Row t's normaliser of q = scores / sum (1 when not normalising).
template <typename T>
double RowSum(const T* p, int64_t E, bool normalize) {
  if (!normalize) return 1.0;
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += static_cast<double>(p[e]);
  return s;
}
}  // namespace

template <typename T>
double moe_aux_loss(const T* scores, const int32_t* topk_expert, int64_t* top1_counts, int64_t Tn,
                    int64_t E, int k, bool normalize) {
  std::fill(top1_counts, top1_counts + E, 0);
  for (int64_t t = 0; t < Tn; ++t) ++top1_counts[topk_expert[t * k]];
  double* mean_q = internal::Scratch<double>(static_cast<size_t>(E), 0);
  std::fill(mean_q, mean_q + E, 0.0);
  for (int64_t t = 0; t < Tn; ++t) {
    const T* p = scores + t * E;
    const double inv = 1.0 / RowSum(p, E, normalize);
    for (int64_t e = 0; e < E; ++e) mean_q[e] += static_cast<double>(p[e]) * inv;
  }
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    loss += static_cast<double>(top1_counts[e]) / static_cast<double>(Tn) *
            (mean_q[e] / static_cast<double>(Tn));
  }
  return static_cast<double>(E) * loss;
}

template <typename T>
double moe_sequence_aux_loss(const T* scores, const int32_t* topk_expert, int64_t Tn, int64_t E,
                             int k, int64_t seq_len, bool normalize, double* dq) {
  CHECK_GT(seq_len, 0);
  const int64_t nseq = (Tn + seq_len - 1) / seq_len;
  if (nseq == 0) return 0.0;  // no tokens: no sequence to balance
  double* f = internal::Scratch<double>(static_cast<size_t>(E), 0);
  double* P = internal::Scratch<double>(static_cast<size_t>(E), 1);
  double loss = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t t0 = s * seq_len, t1 = std::min(Tn, t0 + seq_len);
    const double S = static_cast<double>(t1 - t0);
    std::fill(f, f + E, 0.0);
    std::fill(P, P + E, 0.0);
    for (int64_t t = t0; t < t1; ++t) {
      for (int j = 0; j < k; ++j) f[topk_expert[t * k + j]] += 1.0;
      const T* p = scores + t * E;
      const double inv = 1.0 / RowSum(p, E, normalize);
      for (int64_t e = 0; e < E; ++e) P[e] += static_cast<double>(p[e]) * inv;
    }
    double term = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double fe = static_cast<double>(E) / (static_cast<double>(k) * S) * f[e];
      term += fe * (P[e] / S);
      dq[s * E + e] = fe / (S * static_cast<double>(nseq));
    }
    loss += term;
  }
  return loss / static_cast<double>(nseq);
}

template <typename T>
double moe_z_loss(const T* lse, int64_t Tn) {
  double s = 0;
  for (int64_t t = 0; t < Tn; ++t) s += static_cast<double>(lse[t]) * static_cast<double>(lse[t]);
  return s / static_cast<double>(Tn);
}

template <typename T>
void moe_router_backward(ThreadPool& pool, T* dlogits, const T* dweight, const T* scores,
                         const T* logits, const T* lse, const int32_t* topk_expert,
                         const T* score_grad, int64_t grad_rows, int64_t Tn, int64_t E,
                         const MoeRouterSpec& spec, T z_coef) {
  const int k = spec.k;
  const T z_scale = z_coef * T(2) / static_cast<T>(Tn);
  const T scaling = static_cast<T>(spec.scaling);
  pool.ParallelFor(Tn, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* p = scores + t * E;
      const int32_t* idx = topk_expert + t * k;
      const T* dw = dweight + t * k;
      T* dl = dlogits + t * E;
      // dscores: first the balancing losses' (through q = p / sum p when sigmoid), ...
      if (score_grad == nullptr) {
        std::fill(dl, dl + E, T(0));
      } else {
        const T* g = score_grad + (t / grad_rows) * E;
        if (spec.sigmoid) {
          // q_e = p_e / S  =>  dp_e = (dq_e - sum_i dq_i q_i) / S
          T S = 0;
          for (int64_t e = 0; e < E; ++e) S += p[e];
          T dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += g[e] * (p[e] / S);
          for (int64_t e = 0; e < E; ++e) dl[e] = (g[e] - dot) / S;
        } else {
          std::copy_n(g, E, dl);
        }
      }
      // ... then the scatter of d(combine weights), w_j = scaling * p_j (/ sum of the k).
      if (spec.renormalize && k > 1) {
        // w_j = c p_j / S, S = sum_i p_i  =>  dp_i = c (dw_i - sum_j dw_j p_j / S) / S
        T sum = 0;
        for (int j = 0; j < k; ++j) sum += p[idx[j]];
        T dot = 0;
        for (int j = 0; j < k; ++j) dot += dw[j] * (p[idx[j]] / sum);
        for (int j = 0; j < k; ++j) dl[idx[j]] += scaling * (dw[j] - dot) / sum;
      } else {
        for (int j = 0; j < k; ++j) dl[idx[j]] += scaling * dw[j];
      }
      // Through the score function, then the z-loss term (softmax of the logits either way).
      const T zt = z_scale * lse[t];
      if (spec.sigmoid) {
        const T* x = logits + t * E;
        for (int64_t e = 0; e < E; ++e) {
          dl[e] = dl[e] * p[e] * (T(1) - p[e]) + zt * std::exp(x[e] - lse[t]);
        }
      } else {
        T dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += dl[e] * p[e];
        for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dl[e] - dot) + zt * p[e];
      }
    }
  });
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
  MoeRouterSpec spec;
  spec.k = k;
  spec.renormalize = renormalize;
  moe_router_backward<T>(pool, dlogits, dweight, probs, nullptr, lse, topk_expert, aux_grad,
                         std::max<int64_t>(Tn, 1), Tn, E, spec, z_coef);
}

int64_t moe_plan_dispatch(const int32_t* topk_expert, const uint8_t* eligible, int64_t Tn, int k,
                          int64_t E, int64_t capacity, int32_t* slot, int64_t* counts,
                          int64_t* offsets, int32_t* row_token, int64_t* dropped,
                          int64_t row_capacity) {
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
  CHECK_LE(offsets[E], row_capacity < 0 ? Tn * k : row_capacity)
      << "more dispatched rows than the layer's buffers hold";
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
        // dyp may be yp itself (in place): read the row before writing it.
        dweight[t * k + j] = internal::Dot(g, src, C);
        for (int64_t c = 0; c < C; ++c) d[c] = w * g[c];
      }
    }
  });
}

template <typename T>
void moe_combine_backward_rows(ThreadPool& pool, T* dyp, T* dweight, const T* dy, const T* yp,
                               const T* weight, const int32_t* row_slot, int64_t R, int k,
                               int64_t C) {
  pool.ParallelFor(R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t s = row_slot[r];
      const T* g = dy + static_cast<int64_t>(s / k) * C;
      // dyp may be yp itself (in place): read the row before writing it.
      dweight[s] = internal::Dot(g, yp + r * C, C);
      const T w = weight[s];
      T* d = dyp + r * C;
      for (int64_t c = 0; c < C; ++c) d[c] = w * g[c];
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
  template void moe_router_forward<T>(ThreadPool&, T*, T*, int32_t*, T*, const T*, const T*,     \
                                      int64_t, int64_t, const MoeRouterSpec&);                   \
  template void moe_router_forward<T>(ThreadPool&, T*, T*, int32_t*, T*, const T*, int64_t,      \
                                      int64_t, int, bool);                                       \
  template double moe_aux_loss<T>(const T*, const int32_t*, int64_t*, int64_t, int64_t, int,     \
                                  bool);                                                         \
  template double moe_sequence_aux_loss<T>(const T*, const int32_t*, int64_t, int64_t, int,      \
                                           int64_t, bool, double*);                              \
  template double moe_z_loss<T>(const T*, int64_t);                                              \
  template void moe_router_backward<T>(ThreadPool&, T*, const T*, const T*, const T*, const T*,  \
                                       const int32_t*, const T*, int64_t, int64_t, int64_t,      \
                                       const MoeRouterSpec&, T);                                 \
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
  template void moe_combine_backward_rows<T>(ThreadPool&, T*, T*, const T*, const T*, const T*,  \
                                             const int32_t*, int64_t, int, int64_t);             \
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
