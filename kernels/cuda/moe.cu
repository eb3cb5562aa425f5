// Mixture-of-Experts kernels on the GPU: the fused router (softmax, logsumexp and top-k in one
// pass), its losses and backward, the dispatch plan, permutation and combine, and the gate's
// random pieces. Each mirrors the function of the same name in kernels/cpu/moe.cc, which is the
// reference: same formulas, same tie-breaking, same random counters.
//
// Determinism: every float output element is written by exactly one thread, and every float
// reduction runs in an order fixed by the sizes alone (warp butterflies, fixed block counts,
// partials summed in chunk order), never by scheduling. The only atomics are integer counts.
// The dispatch plan is a stable radix sort, so the order within an expert is the CPU's priority
// order by construction.
#include <cub/cub.cuh>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/common/rng.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/reduce.cuh"

namespace strata::cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kBlock / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;
// Top-k is kept in per-thread arrays of up to 8, as on the CPU (kernels/vocabulary.h).
constexpr int kMaxK = ops::kMaxRouterTopK;
// Grid-stride loops cover any size; this only bounds the grid.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

unsigned Blocks(int64_t threads) {
  return static_cast<unsigned>(std::min<int64_t>((threads + kBlock - 1) / kBlock, kMaxBlocks));
}
// Blocks for one warp per item.
unsigned WarpBlocks(int64_t items) {
  return static_cast<unsigned>(
      std::min<int64_t>((items + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks));
}

__device__ inline int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t GridThreads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
// Warp-uniform: all lanes of a warp get the same index, so loops over it keep whole warps
// together for the shuffles.
__device__ inline int64_t GlobalWarp() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
}
__device__ inline int64_t GridWarps() { return static_cast<int64_t>(gridDim.x) * kWarpsPerBlock; }

// Several arrays in one scratch block, each 256-byte aligned. A function asks for scratch once,
// with the total, because a larger request may move the block.
class ScratchLayout {
 public:
  size_t Add(size_t bytes) {
    const size_t off = total_;
    total_ += (bytes + 255) / 256 * 256;
    return off;
  }
  size_t bytes() const { return total_; }

 private:
  size_t total_ = 0;
};

// ---- Router ------------------------------------------------------------------------------------

// Round j of a warp top-k: the best candidate strictly after (last_v, last_e) in the order
// (value descending, id ascending) among the ids this lane offers, reduced over the warp. Returns
// the id, or -1 when no lane has one (only when every value is NaN).
__device__ inline int32_t WarpNextBest(float v, int32_t id, bool offer, int j, float last_v,
                                       int32_t last_e, int32_t* best_e, float* best_v) {
  const bool after_last = j == 0 || v < last_v || (v == last_v && id > last_e);
  // Ascending ids with strict '>' keep the lowest id among equals within a lane.
  if (offer && after_last && (*best_e < 0 || v > *best_v)) {
    *best_e = id;
    *best_v = v;
  }
  return *best_e;
}

__device__ inline void WarpReduceBest(int32_t* best_e, float* best_v) {
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, *best_v, off);
    const int32_t oe = __shfl_xor_sync(kFullMask, *best_e, off);
    if (oe >= 0 && (*best_e < 0 || ov > *best_v || (ov == *best_v && oe < *best_e))) {
      *best_e = oe;
      *best_v = ov;
    }
  }
}

// One warp per token. Lane l owns experts l, l + 32, ...; it writes their scores, then the warp
// syncs so that lane 0 (the weights) and the group sums may read any of them. A row whose scores
// are all NaN (softmax of a NaN or infinite logit) gets the CPU's ids; a row with only some NaN
// sigmoid scores may choose otherwise than the CPU (NaN is not ordered) — the loss is NaN then
// and the step fails its check anyway.
__global__ void RouterForwardKernel(float* scores, float* lse, int32_t* topk_expert,
                                    float* topk_weight, const float* logits, const float* bias,
                                    int64_t T, int64_t E, ops::MoeRouterSpec spec) {
  const int lane = threadIdx.x % kWarpSize;
  const int k = spec.k;
  const int G = spec.num_groups > 1 ? spec.num_groups : 1;
  const int64_t per = E / G;
  for (int64_t t = GlobalWarp(); t < T; t += GridWarps()) {
    const float* x = logits + t * E;
    float* p = scores + t * E;
    float mx = -INFINITY;
    for (int64_t e = lane; e < E; e += kWarpSize) mx = fmaxf(mx, x[e]);
    mx = WarpMax(mx);
    float s = 0.f;
    for (int64_t e = lane; e < E; e += kWarpSize) s += expf(x[e] - mx);
    s = WarpSum(s);
    const float l = mx + logf(s);
    for (int64_t e = lane; e < E; e += kWarpSize) {
      p[e] = spec.sigmoid ? 1.f / (1.f + expf(-x[e])) : expf(x[e] - l);
    }
    __syncwarp();
    auto sel = [&](int64_t e) { return bias != nullptr ? p[e] + bias[e] : p[e]; };

    // Groups: lane g sums the top m selection values of group g (g = lane, lane + 32), inserted
    // in the CPU's order so the sums match; then topk_groups rounds of a warp argmax.
    uint64_t allowed = ~0ull;
    if (G > 1) {
      const int m = min(max(1, k / spec.topk_groups), static_cast<int>(per));
      float gscore[2] = {0.f, 0.f};
      for (int i = 0; i < 2; ++i) {
        const int g = lane + kWarpSize * i;
        if (g >= G) continue;
        float val[kMaxK];
        int n = 0;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          const float v = sel(e);
          if (n == m && !(v > val[m - 1])) continue;
          int pos = n < m ? n++ : m - 1;
          while (pos > 0 && v > val[pos - 1]) {
            val[pos] = val[pos - 1];
            --pos;
          }
          val[pos] = v;
        }
        for (int j = 0; j < n; ++j) gscore[i] += val[j];
      }
      allowed = 0;
      int32_t last_g = -1;
      float last_v = 0.f;
      for (int j = 0; j < spec.topk_groups; ++j) {
        int32_t best_g = -1;
        float best_v = 0.f;
        for (int i = 0; i < 2; ++i) {
          const int g = lane + kWarpSize * i;
          WarpNextBest(gscore[i], g, g < G, j, last_v, last_g, &best_g, &best_v);
        }
        WarpReduceBest(&best_g, &best_v);
        if (best_g < 0) {  // NaN group scores: the lowest unused group
          for (int32_t c = 0; best_g < 0; ++c) {
            if (!((allowed >> c) & 1)) best_g = c;
          }
          best_v = NAN;
        }
        allowed |= 1ull << best_g;
        last_g = best_g;
        last_v = best_v;
      }
    }

    // Top-k as k rounds of a warp argmax in the order (selection value descending, id
    // ascending) over the allowed experts — the CPU's order, whose insertion with strict '>'
    // keeps lower ids first.
    int32_t idx[kMaxK];
    int32_t last_e = -1;
    float last_v = 0.f;
    for (int j = 0; j < k; ++j) {
      int32_t best_e = -1;
      float best_v = 0.f;
      for (int64_t e = lane; e < E; e += kWarpSize) {
        WarpNextBest(sel(e), static_cast<int32_t>(e), (allowed >> (e / per)) & 1, j, last_v, last_e,
                     &best_e, &best_v);
      }
      WarpReduceBest(&best_e, &best_v);
      if (best_e < 0) {
        // Only when the scores are NaN (a NaN or infinite logit): keep the ids valid and
        // distinct, the lowest unused allowed one, as the CPU's fill does. (Lanes may then
        // disagree; lane 0's picks are the ones written.)
        for (int32_t c = 0; best_e < 0; ++c) {
          bool used = !((allowed >> (c / per)) & 1);
          for (int i = 0; i < j; ++i) used = used || idx[i] == c;
          if (!used) best_e = c;
        }
        best_v = NAN;
      }
      idx[j] = best_e;
      last_e = best_e;
      last_v = best_v;
    }
    if (lane == 0) {
      lse[t] = l;
      float norm = spec.scaling;
      if (spec.renormalize && k > 1) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) sum += p[idx[j]];
        norm = spec.scaling / sum;
      }
      for (int j = 0; j < k; ++j) {
        topk_expert[t * k + j] = idx[j];
        topk_weight[t * k + j] = p[idx[j]] * norm;
      }
    }
    __syncwarp();
  }
}

// Per-expert column sums of probs over a chunk of tokens, in double: thread (x, y) of a 32 x 8
// block sums tokens y, y + 8, ... of its chunk for expert x, then row y == 0 adds the 8 in order.
constexpr int kColTile = 32;
constexpr int kColRows = kBlock / kColTile;

__global__ void ColumnSumsPartialKernel(double* partial, const float* probs, int64_t T, int64_t E,
                                        int64_t rows_per_chunk) {
  __shared__ double sh[kColRows][kColTile];
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t t0 = chunk * rows_per_chunk;
  const int64_t t1 = t0 + rows_per_chunk < T ? t0 + rows_per_chunk : T;
  double s = 0;
  if (e < E) {
    for (int64_t t = t0 + threadIdx.y; t < t1; t += kColRows) {
      s += static_cast<double>(probs[t * E + e]);
    }
  }
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double total = 0;
    for (int y = 0; y < kColRows; ++y) total += sh[y][threadIdx.x];
    partial[chunk * E + e] = total;
  }
}

// colsum[e] = sum over chunks, in chunk order.
__global__ void ColumnSumsFinalKernel(double* colsum, const double* partial, int64_t chunks,
                                      int64_t E) {
  for (int64_t e = GlobalThread(); e < E; e += GridThreads()) {
    double s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partial[c * E + e];
    colsum[e] = s;
  }
}

// Integer counts: atomics give the same result in any order.
__global__ void Top1CountsKernel(unsigned long long* counts, const int32_t* topk_expert, int64_t T,
                                 int64_t E, int k) {
  for (int64_t t = GlobalThread(); t < T; t += GridThreads()) {
    const int32_t e = topk_expert[t * k];
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1ULL);
  }
}

// Block partial sums of lse^2 in double: each thread strides over the array, then a fixed tree.
__global__ void SumSquaresPartialKernel(double* partial, const float* x, int64_t n) {
  __shared__ double sh[kBlock];
  double s = 0;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = kBlock / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// One warp per token; see moe_router_backward in kernels/cpu/moe.cc for the derivation.
__global__ void RouterBackwardKernel(float* dlogits, const float* dweight, const float* scores,
                                     const float* logits, const float* lse,
                                     const int32_t* topk_expert, const float* score_grad,
                                     int64_t grad_rows, int64_t T, int64_t E,
                                     ops::MoeRouterSpec spec, float z_scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int k = spec.k;
  for (int64_t t = GlobalWarp(); t < T; t += GridWarps()) {
    const float* p = scores + t * E;
    const float* dw = dweight + t * k;
    float* dl = dlogits + t * E;
    if (k > kMaxK) {
      // More slots than a top-k list holds (expert choice: k = E, slot j is expert j), never
      // renormalised: each lane writes the balancing term of its experts, then each lane adds
      // the terms of its slots (a token's slots name distinct experts, so no two lanes add to
      // one entry, and each entry gets the CPU's one addition), then the score function below.
      const float* g = score_grad != nullptr ? score_grad + (t / grad_rows) * E : nullptr;
      for (int64_t e = lane; e < E; e += kWarpSize) dl[e] = g != nullptr ? g[e] : 0.f;
      __syncwarp();
      for (int j = lane; j < k; j += kWarpSize) dl[topk_expert[t * k + j]] += spec.scaling * dw[j];
      __syncwarp();
      float dot = 0.f;
      for (int64_t e = lane; e < E; e += kWarpSize) dot += dl[e] * p[e];
      dot = WarpSum(dot);
      const float zt = z_scale * lse[t];
      for (int64_t e = lane; e < E; e += kWarpSize) dl[e] = p[e] * (dl[e] - dot) + zt * p[e];
      __syncwarp();
      continue;
    }
    int32_t idx[kMaxK];
    float term[kMaxK];  // what the CPU adds to dl[idx[j]]
    for (int j = 0; j < k; ++j) idx[j] = topk_expert[t * k + j];
    if (spec.renormalize && k > 1) {
      // w_j = c p_j / S, S = sum_i p_i  =>  dp_i = c (dw_i - sum_j dw_j p_j / S) / S; every
      // lane computes the same k-term sums in the CPU's order.
      float sum = 0.f;
      for (int j = 0; j < k; ++j) sum += p[idx[j]];
      float dot = 0.f;
      for (int j = 0; j < k; ++j) dot += dw[j] * (p[idx[j]] / sum);
      for (int j = 0; j < k; ++j) term[j] = spec.scaling * (dw[j] - dot) / sum;
    } else {
      for (int j = 0; j < k; ++j) term[j] = spec.scaling * dw[j];
    }
    // The balancing losses' gradient w.r.t. q (through q = p / sum p for sigmoid scores).
    const float* g = score_grad != nullptr ? score_grad + (t / grad_rows) * E : nullptr;
    float S = 1.f, qdot = 0.f;
    if (g != nullptr && spec.sigmoid) {
      float s = 0.f;
      for (int64_t e = lane; e < E; e += kWarpSize) s += p[e];
      S = WarpSum(s);
      float d = 0.f;
      for (int64_t e = lane; e < E; e += kWarpSize) d += g[e] * (p[e] / S);
      qdot = WarpSum(d);
    }
    // dscores = balancing term + the scatter, added in j order like the CPU; then through the
    // score function.
    float dot = 0.f;
    for (int64_t e = lane; e < E; e += kWarpSize) {
      float v = 0.f;
      if (g != nullptr) v = spec.sigmoid ? (g[e] - qdot) / S : g[e];
      for (int j = 0; j < k; ++j) {
        if (idx[j] == e) v += term[j];
      }
      dl[e] = v;
      dot += v * p[e];
    }
    const float zt = z_scale * lse[t];
    if (spec.sigmoid) {
      const float* x = logits + t * E;
      for (int64_t e = lane; e < E; e += kWarpSize) {
        dl[e] = dl[e] * p[e] * (1.f - p[e]) + zt * expf(x[e] - lse[t]);
      }
    } else {
      dot = WarpSum(dot);
      // Each lane reads back only the dl entries it wrote.
      for (int64_t e = lane; e < E; e += kWarpSize) dl[e] = p[e] * (dl[e] - dot) + zt * p[e];
    }
  }
}

// ---- Dispatch plan -----------------------------------------------------------------------------

// Sort input in priority order o = j * T + t: key = expert, or E when the choice is not
// dispatched (ineligible, or an id out of range, which the CPU would not survive either).
__global__ void DispatchKeysKernel(uint32_t* keys, int32_t* order, const int32_t* topk_expert,
                                   const uint8_t* eligible, int64_t T, int k, int64_t E) {
  const int64_t N = T * k;
  for (int64_t o = GlobalThread(); o < N; o += GridThreads()) {
    const int64_t j = o / T, t = o - j * T;
    const int64_t i = t * k + j;
    const int32_t e = topk_expert[i];
    const bool dispatch = (eligible == nullptr || eligible[i] != 0) && e >= 0 && e < E;
    keys[o] = static_cast<uint32_t>(dispatch ? e : E);
    order[o] = static_cast<int32_t>(o);
  }
}

// start[e] = first position in the sorted keys with key >= e, for e in [0, E].
__global__ void SegmentStartsKernel(int64_t* start, const uint32_t* sorted_keys, int64_t N,
                                    int64_t E) {
  for (int64_t e = GlobalThread(); e <= E; e += GridThreads()) {
    int64_t lo = 0, hi = N;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<int64_t>(sorted_keys[mid]) < e) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    start[e] = lo;
  }
}

// meta = [counts E][offsets E + 1][dropped]: kept rows per expert (the first `capacity` of its
// choices in priority order), their exclusive prefix sums and the number cut by capacity. E is a
// few hundred at most, so one thread does it serially.
__global__ void PlanCountsKernel(int64_t* meta, const int64_t* start, int64_t E, int64_t capacity) {
  int64_t* counts = meta;
  int64_t* offsets = meta + E;
  int64_t off = 0, drops = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    const int64_t kept = capacity > 0 && n > capacity ? capacity : n;
    counts[e] = kept;
    offsets[e] = off;
    off += kept;
    drops += n - kept;
  }
  offsets[E] = off;
  meta[2 * E + 1] = drops;
}

// One thread per sorted position: every (token, choice) appears exactly once in the sort, so
// every slot entry and every kept row is written exactly once.
__global__ void AssignSlotsKernel(int32_t* slot, int32_t* row_token, const uint32_t* sorted_keys,
                                  const int32_t* sorted_order, const int64_t* start,
                                  const int64_t* offsets, int64_t T, int k, int64_t E,
                                  int64_t capacity) {
  const int64_t N = T * k;
  for (int64_t i = GlobalThread(); i < N; i += GridThreads()) {
    const int64_t e = sorted_keys[i];
    const int64_t o = sorted_order[i];
    const int64_t j = o / T, t = o - j * T;
    const int64_t idx = t * k + j;
    if (e >= E) {
      slot[idx] = -1;
      continue;
    }
    const int64_t pos = i - start[e];  // position within the expert, in priority order
    if (capacity > 0 && pos >= capacity) {
      slot[idx] = -1;
      continue;
    }
    const int64_t row = offsets[e] + pos;
    slot[idx] = static_cast<int32_t>(row);
    row_token[row] = static_cast<int32_t>(t);
  }
}

// ---- Permute and combine -----------------------------------------------------------------------

__global__ void PermuteForwardKernel(float* xp, const float* x, const int32_t* row_token, int64_t R,
                                     int64_t C) {
  const int64_t n = R * C;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / C, c = i - r * C;
    xp[i] = x[static_cast<int64_t>(row_token[r]) * C + c];
  }
}

// Each element of dx sums its token's dispatched choices in j order, as the CPU does.
__global__ void PermuteBackwardKernel(float* dx, const float* dxp, const int32_t* slot, int64_t T,
                                      int k, int64_t C, bool accumulate) {
  const int64_t n = T * C;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t t = i / C, c = i - t * C;
    float acc = accumulate ? dx[i] : 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t s = slot[t * k + j];
      if (s >= 0) acc += dxp[static_cast<int64_t>(s) * C + c];
    }
    dx[i] = acc;
  }
}

__global__ void CombineForwardKernel(float* y, const float* yp, const float* weight,
                                     const int32_t* slot, int64_t T, int k, int64_t C) {
  const int64_t n = T * C;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t t = i / C, c = i - t * C;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t s = slot[t * k + j];
      if (s >= 0) acc += weight[t * k + j] * yp[static_cast<int64_t>(s) * C + c];
    }
    y[i] = acc;
  }
}

// One row by one warp: d = w * g, returning <g, src> (every lane gets the sum). d may be src.
__device__ float CombineBackwardRow(float* d, const float* g, const float* src, float w, int64_t C,
                                    int lane) {
  float dot = 0.f;
  for (int64_t c = lane; c < C; c += kWarpSize) {
    const float gc = g[c];
    dot += gc * src[c];
    d[c] = w * gc;
  }
  return WarpSum(dot);
}

// One warp per (token, choice). dyp may alias yp: each element of the row is read and then
// overwritten by the same lane (no __restrict__ here, so the compiler keeps that order), and rows
// of different choices are distinct.
__global__ void CombineBackwardKernel(float* dyp, float* dweight, const float* dy, const float* yp,
                                      const float* weight, const int32_t* slot, int64_t T, int k,
                                      int64_t C) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t N = T * k;
  for (int64_t tj = GlobalWarp(); tj < N; tj += GridWarps()) {
    const int32_t s = slot[tj];  // warp-uniform
    if (s < 0) {
      if (lane == 0) dweight[tj] = 0.f;
      continue;
    }
    const int64_t t = tj / k;
    const float dot = CombineBackwardRow(dyp + static_cast<int64_t>(s) * C, dy + t * C,
                                         yp + static_cast<int64_t>(s) * C, weight[tj], C, lane);
    if (lane == 0) dweight[tj] = dot;
  }
}

// One warp per row of a block of rows: the same arithmetic, indexed by row.
__global__ void CombineBackwardRowsKernel(float* dyp, float* dweight, const float* dy,
                                          const float* yp, const float* weight,
                                          const int32_t* row_slot, int64_t R, int k, int64_t C) {
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t r = GlobalWarp(); r < R; r += GridWarps()) {
    const int32_t s = row_slot[r];  // warp-uniform
    const float dot = CombineBackwardRow(dyp + r * C, dy + static_cast<int64_t>(s / k) * C,
                                         yp + r * C, weight[s], C, lane);
    if (lane == 0) dweight[s] = dot;
  }
}

// ---- Gate noise --------------------------------------------------------------------------------
// Counters are base + i with base = first_token * width, exactly the CPU's, and the factors are
// computed in double and then rounded, as the CPU does.

// (1 - eps) + (2 eps) u, rounded step by step like the CPU's expression: nvcc would otherwise fuse
// the multiply and the add into one FMA and differ from the CPU in the last bit.
__device__ inline double JitterFactor(double eps, double u) {
  return __dadd_rn(1.0 - eps, __dmul_rn(2.0 * eps, u));
}

__global__ void JitterForwardKernel(float* xj, const float* x, uint64_t key, int64_t n,
                                    int64_t base, double eps) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const double u = RngUniform(key, static_cast<uint64_t>(base + i));
    xj[i] = x[i] * static_cast<float>(JitterFactor(eps, u));
  }
}

__global__ void JitterBackwardKernel(float* dx, const float* dxj, uint64_t key, int64_t n,
                                     int64_t base, double eps) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const double u = RngUniform(key, static_cast<uint64_t>(base + i));
    dx[i] += dxj[i] * static_cast<float>(JitterFactor(eps, u));
  }
}

__device__ inline float Softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// h may alias clean: element-wise.
__global__ void NoisyLogitsForwardKernel(float* h, const float* clean, const float* raw_noise,
                                         uint64_t key, int64_t n, int64_t base) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float z = static_cast<float>(RngNormal(key, static_cast<uint64_t>(base + i)));
    h[i] = clean[i] + z * Softplus(raw_noise[i]);
  }
}

__global__ void NoisyLogitsBackwardKernel(float* draw_noise, const float* dh,
                                          const float* raw_noise, uint64_t key, int64_t n,
                                          int64_t base) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float sig = 1.f / (1.f + expf(-raw_noise[i]));
    const float z = static_cast<float>(RngNormal(key, static_cast<uint64_t>(base + i)));
    draw_noise[i] = dh[i] * z * sig;
  }
}

}  // namespace

// ---- Router ------------------------------------------------------------------------------------

void MoeRouterForward(Backend& b, float* scores, float* lse, int32_t* topk_expert,
                      float* topk_weight, const float* logits, const float* bias, int64_t T,
                      int64_t E, const ops::MoeRouterSpec& spec) {
  CHECK(spec.k >= 1 && spec.k <= kMaxK && spec.k <= E) << "k=" << spec.k << " E=" << E;
  CHECK(spec.num_groups <= 1 ||
        (spec.num_groups <= ops::kMaxRouterGroups && E % spec.num_groups == 0 &&
         spec.topk_groups >= 1 && spec.topk_groups <= spec.num_groups &&
         spec.k <= spec.topk_groups * (E / spec.num_groups)))
      << "groups " << spec.num_groups << " top " << spec.topk_groups << " k=" << spec.k
      << " E=" << E;
  if (T == 0) return;
  RouterForwardKernel<<<WarpBlocks(T), kBlock, 0, b.stream>>>(scores, lse, topk_expert, topk_weight,
                                                              logits, bias, T, E, spec);
  STRATA_CUDA_LAUNCH_CHECK();
}

double MoeAuxLoss(Backend& b, const float* probs, const int32_t* topk_expert, int64_t* top1_counts,
                  int64_t T, int64_t E, int k) {
  CHECK(E >= 1 && k >= 1) << "E=" << E << " k=" << k;
  std::vector<double> colsum(E, 0.0);
  std::fill(top1_counts, top1_counts + E, 0);
  if (T > 0) {
    // The chunking depends on T alone, so the summation order (and the bits) do not depend on
    // the GPU.
    const int64_t chunks = std::min<int64_t>((T + kBlock - 1) / kBlock, 1024);
    const int64_t rows_per_chunk = (T + chunks - 1) / chunks;
    // [colsum E doubles][counts E u64] back to back for one copy home, then the partials.
    ScratchLayout layout;
    const size_t result_off = layout.Add(2 * E * sizeof(double));
    const size_t partial_off = layout.Add(chunks * E * sizeof(double));
    char* scratch = static_cast<char*>(b.DeviceScratch(layout.bytes()));
    double* d_colsum = reinterpret_cast<double*>(scratch + result_off);
    auto* d_counts = reinterpret_cast<unsigned long long*>(d_colsum + E);
    double* d_partial = reinterpret_cast<double*>(scratch + partial_off);

    STRATA_CUDA_CHECK(cudaMemsetAsync(d_counts, 0, E * sizeof(unsigned long long), b.stream));
    const dim3 grid(static_cast<unsigned>((E + kColTile - 1) / kColTile),
                    static_cast<unsigned>(chunks));
    ColumnSumsPartialKernel<<<grid, dim3(kColTile, kColRows), 0, b.stream>>>(d_partial, probs, T, E,
                                                                             rows_per_chunk);
    STRATA_CUDA_LAUNCH_CHECK();
    ColumnSumsFinalKernel<<<Blocks(E), kBlock, 0, b.stream>>>(d_colsum, d_partial, chunks, E);
    STRATA_CUDA_LAUNCH_CHECK();
    Top1CountsKernel<<<Blocks(T), kBlock, 0, b.stream>>>(d_counts, topk_expert, T, E, k);
    STRATA_CUDA_LAUNCH_CHECK();

    auto* host = static_cast<char*>(b.HostScratch(2 * E * sizeof(double)));
    STRATA_CUDA_CHECK(
        cudaMemcpyAsync(host, d_colsum, 2 * E * sizeof(double), cudaMemcpyDeviceToHost, b.stream));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(b.stream));
    std::memcpy(colsum.data(), host, E * sizeof(double));
    const auto* counts = reinterpret_cast<const unsigned long long*>(host + E * sizeof(double));
    for (int64_t e = 0; e < E; ++e) top1_counts[e] = static_cast<int64_t>(counts[e]);
  }
  // The CPU's formula, in its order (T == 0 gives its NaN too).
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double mean_p = colsum[e] / static_cast<double>(T);
    loss += static_cast<double>(top1_counts[e]) / static_cast<double>(T) * mean_p;
  }
  return static_cast<double>(E) * loss;
}

double MoeZLoss(Backend& b, const float* lse, int64_t T) {
  double s = 0;
  if (T > 0) {
    // Fixed by T alone, like the aux loss's chunks.
    const int64_t blocks = std::min<int64_t>((T + kBlock - 1) / kBlock, 1024);
    double* d_partial = static_cast<double*>(b.DeviceScratch(blocks * sizeof(double)));
    SumSquaresPartialKernel<<<static_cast<unsigned>(blocks), kBlock, 0, b.stream>>>(d_partial, lse,
                                                                                    T);
    STRATA_CUDA_LAUNCH_CHECK();
    auto* host = static_cast<double*>(b.HostScratch(blocks * sizeof(double)));
    STRATA_CUDA_CHECK(cudaMemcpyAsync(host, d_partial, blocks * sizeof(double),
                                      cudaMemcpyDeviceToHost, b.stream));
    STRATA_CUDA_CHECK(cudaStreamSynchronize(b.stream));
    for (int64_t i = 0; i < blocks; ++i) s += host[i];
  }
  return s / static_cast<double>(T);
}

void MoeRouterBackward(Backend& b, float* dlogits, const float* dweight, const float* scores,
                       const float* logits, const float* lse, const int32_t* topk_expert,
                       const float* score_grad, int64_t grad_rows, int64_t T, int64_t E,
                       const ops::MoeRouterSpec& spec, float z_coef) {
  // More than kMaxK slots only as expert choice has them: softmax scores, not renormalised.
  CHECK(spec.k >= 1 && spec.k <= E && (spec.k <= kMaxK || (!spec.renormalize && !spec.sigmoid)))
      << "k=" << spec.k << " E=" << E;
  CHECK(score_grad == nullptr || grad_rows > 0) << "grad_rows=" << grad_rows;
  CHECK(!spec.sigmoid || logits != nullptr) << "sigmoid scores need the logits";
  if (T == 0) return;
  const float z_scale = z_coef * 2.f / static_cast<float>(T);
  RouterBackwardKernel<<<WarpBlocks(T), kBlock, 0, b.stream>>>(dlogits, dweight, scores, logits,
                                                               lse, topk_expert, score_grad,
                                                               grad_rows, T, E, spec, z_scale);
  STRATA_CUDA_LAUNCH_CHECK();
}

// ---- Dispatch plan -----------------------------------------------------------------------------

int64_t MoePlanDispatch(Backend& b, const int32_t* topk_expert, const uint8_t* eligible, int64_t T,
                        int k, int64_t E, int64_t capacity, int32_t* slot, int64_t* counts,
                        int64_t* offsets, int32_t* row_token, int64_t* dropped) {
  CHECK(T >= 0 && k >= 1 && E >= 1 && capacity >= 0)
      << "T=" << T << " k=" << k << " E=" << E << " capacity=" << capacity;
  const int64_t N = T * k;
  // Slots, rows and the sort's values are int32 (as on the CPU); keys hold E.
  CHECK(N <= std::numeric_limits<int32_t>::max() && E < std::numeric_limits<int32_t>::max())
      << "T*k=" << N << " E=" << E;
  std::fill(counts, counts + E, 0);
  std::fill(offsets, offsets + E + 1, 0);
  if (dropped != nullptr) *dropped = 0;
  if (N == 0) return 0;

  // Keys take values 0..E; sort only the bits they use.
  int end_bit = 0;
  while ((int64_t{1} << end_bit) <= E) ++end_bit;
  size_t sort_bytes = 0;
  STRATA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(N), 0,
      end_bit, b.stream));

  const size_t meta_bytes = (2 * E + 2) * sizeof(int64_t);
  ScratchLayout layout;
  const size_t keys_in_off = layout.Add(N * sizeof(uint32_t));
  const size_t keys_out_off = layout.Add(N * sizeof(uint32_t));
  const size_t vals_in_off = layout.Add(N * sizeof(int32_t));
  const size_t vals_out_off = layout.Add(N * sizeof(int32_t));
  const size_t start_off = layout.Add((E + 1) * sizeof(int64_t));
  const size_t meta_off = layout.Add(meta_bytes);
  const size_t elig_off = layout.Add(eligible != nullptr ? N : 0);
  const size_t sort_off = layout.Add(sort_bytes);
  char* scratch = static_cast<char*>(b.DeviceScratch(layout.bytes()));
  auto* keys_in = reinterpret_cast<uint32_t*>(scratch + keys_in_off);
  auto* keys_out = reinterpret_cast<uint32_t*>(scratch + keys_out_off);
  auto* vals_in = reinterpret_cast<int32_t*>(scratch + vals_in_off);
  auto* vals_out = reinterpret_cast<int32_t*>(scratch + vals_out_off);
  auto* start = reinterpret_cast<int64_t*>(scratch + start_off);
  auto* meta = reinterpret_cast<int64_t*>(scratch + meta_off);
  uint8_t* d_eligible = nullptr;
  if (eligible != nullptr) {
    d_eligible = reinterpret_cast<uint8_t*>(scratch + elig_off);
    // Straight from the caller's host array: this function waits for the stream before it
    // returns, so the array outlives the copy.
    STRATA_CUDA_CHECK(cudaMemcpyAsync(d_eligible, eligible, N, cudaMemcpyHostToDevice, b.stream));
  }

  DispatchKeysKernel<<<Blocks(N), kBlock, 0, b.stream>>>(keys_in, vals_in, topk_expert, d_eligible,
                                                         T, k, E);
  STRATA_CUDA_LAUNCH_CHECK();
  // Stable: within an expert the choices stay in priority order o = j * T + t.
  STRATA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch + sort_off, sort_bytes, keys_in,
                                                    keys_out, vals_in, vals_out,
                                                    static_cast<int>(N), 0, end_bit, b.stream));
  SegmentStartsKernel<<<Blocks(E + 1), kBlock, 0, b.stream>>>(start, keys_out, N, E);
  STRATA_CUDA_LAUNCH_CHECK();
  PlanCountsKernel<<<1, 1, 0, b.stream>>>(meta, start, E, capacity);
  STRATA_CUDA_LAUNCH_CHECK();
  AssignSlotsKernel<<<Blocks(N), kBlock, 0, b.stream>>>(slot, row_token, keys_out, vals_out, start,
                                                        meta + E, T, k, E, capacity);
  STRATA_CUDA_LAUNCH_CHECK();

  auto* host = static_cast<int64_t*>(b.HostScratch(meta_bytes));
  STRATA_CUDA_CHECK(cudaMemcpyAsync(host, meta, meta_bytes, cudaMemcpyDeviceToHost, b.stream));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(b.stream));
  std::copy(host, host + E, counts);
  std::copy(host + E, host + 2 * E + 1, offsets);
  if (dropped != nullptr) *dropped = host[2 * E + 1];
  return offsets[E];
}

// ---- Permute and combine -----------------------------------------------------------------------

void MoePermuteForward(Backend& b, float* xp, const float* x, const int32_t* row_token, int64_t R,
                       int64_t C) {
  if (R == 0 || C == 0) return;
  PermuteForwardKernel<<<Blocks(R * C), kBlock, 0, b.stream>>>(xp, x, row_token, R, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoePermuteBackward(Backend& b, float* dx, const float* dxp, const int32_t* slot, int64_t T,
                        int k, int64_t C, bool accumulate) {
  if (T == 0 || C == 0) return;
  PermuteBackwardKernel<<<Blocks(T * C), kBlock, 0, b.stream>>>(dx, dxp, slot, T, k, C, accumulate);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoeCombineForward(Backend& b, float* y, const float* yp, const float* weight,
                       const int32_t* slot, int64_t T, int k, int64_t C) {
  if (T == 0 || C == 0) return;
  CombineForwardKernel<<<Blocks(T * C), kBlock, 0, b.stream>>>(y, yp, weight, slot, T, k, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoeCombineBackward(Backend& b, float* dyp, float* dweight, const float* dy, const float* yp,
                        const float* weight, const int32_t* slot, int64_t T, int k, int64_t C) {
  if (T == 0 || k == 0) return;
  CombineBackwardKernel<<<WarpBlocks(T * k), kBlock, 0, b.stream>>>(dyp, dweight, dy, yp, weight,
                                                                    slot, T, k, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoeCombineBackwardRows(Backend& b, float* dyp, float* dweight, const float* dy,
                            const float* yp, const float* weight, const int32_t* row_slot,
                            int64_t R, int k, int64_t C) {
  if (R == 0) return;
  CombineBackwardRowsKernel<<<WarpBlocks(R), kBlock, 0, b.stream>>>(dyp, dweight, dy, yp, weight,
                                                                    row_slot, R, k, C);
  STRATA_CUDA_LAUNCH_CHECK();
}

// ---- Gate-specific pieces ----------------------------------------------------------------------

void MoeRandomRouting(Backend& b, uint8_t* eligible, const float* topk_weight, uint64_t key,
                      int64_t T, int64_t first_token) {
  if (T == 0) return;
  // The weights come home and the draws are the CPU's own code, so the decisions are its.
  auto* w = static_cast<float*>(b.HostScratch(2 * T * sizeof(float)));
  STRATA_CUDA_CHECK(
      cudaMemcpyAsync(w, topk_weight, 2 * T * sizeof(float), cudaMemcpyDeviceToHost, b.stream));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(b.stream));
  for (int64_t t = 0; t < T; ++t) {
    eligible[2 * t] = 1;
    eligible[2 * t + 1] =
        2.0 * static_cast<double>(w[2 * t + 1]) > rng::Uniform(key, first_token + t);
  }
}

void MoeJitterForward(Backend& b, float* xj, const float* x, uint64_t key, int64_t T, int64_t C,
                      double eps, int64_t first_token) {
  const int64_t n = T * C;
  if (n == 0) return;
  JitterForwardKernel<<<Blocks(n), kBlock, 0, b.stream>>>(xj, x, key, n, first_token * C, eps);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoeJitterBackward(Backend& b, float* dx, const float* dxj, uint64_t key, int64_t T, int64_t C,
                       double eps, int64_t first_token) {
  const int64_t n = T * C;
  if (n == 0) return;
  JitterBackwardKernel<<<Blocks(n), kBlock, 0, b.stream>>>(dx, dxj, key, n, first_token * C, eps);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoeNoisyLogitsForward(Backend& b, float* h, const float* clean, const float* raw_noise,
                           uint64_t key, int64_t T, int64_t E, int64_t first_token) {
  const int64_t n = T * E;
  if (n == 0) return;
  NoisyLogitsForwardKernel<<<Blocks(n), kBlock, 0, b.stream>>>(h, clean, raw_noise, key, n,
                                                               first_token * E);
  STRATA_CUDA_LAUNCH_CHECK();
}

void MoeNoisyLogitsBackward(Backend& b, float* draw_noise, const float* dh, const float* raw_noise,
                            uint64_t key, int64_t T, int64_t E, int64_t first_token) {
  const int64_t n = T * E;
  if (n == 0) return;
  NoisyLogitsBackwardKernel<<<Blocks(n), kBlock, 0, b.stream>>>(draw_noise, dh, raw_noise, key, n,
                                                                first_token * E);
  STRATA_CUDA_LAUNCH_CHECK();
}

}  // namespace strata::cuda
