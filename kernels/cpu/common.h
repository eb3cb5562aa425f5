// Helpers shared by the CPU kernels (not part of the public kernel API).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/common/thread_pool.h"

namespace strata::cpu::internal {

// Grain sizes: a slice of fewer elements than this is not worth a thread.
constexpr int64_t kElementGrain = 1 << 14;

// Per-thread scratch that grows and is reused across calls, so kernels allocate nothing in steady
// state. `slot` separates independent uses within one kernel. The memory is the calling thread's
// (other threads may write into it during a ParallelFor the caller waits for): it stays valid until
// the same thread asks for more of the same type and slot, which may move it, or ends.
template <typename T>
T* Scratch(size_t n, int slot = 0) {
  thread_local std::vector<T> buffers[4];
  auto& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

// The dot product of a[0, n) and b[0, n), in a fixed order that vectorises: kLanes independent
// partial sums (two 64-byte vectors), then the tail, then the partials in order. A plain serial
// float sum cannot vectorise (its order is fixed), and waits on each add's latency.
template <typename T>
T Dot(const T* a, const T* b, int64_t n) {
  constexpr int kLanes = 128 / sizeof(T);
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  T sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

// The sum and the maximum of a[0, n), the same way (a fixed order that vectorises).
template <typename T>
T Sum(const T* a, int64_t n) {
  constexpr int kLanes = 128 / sizeof(T);
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l];
  }
  T sum = 0;
  for (; i < n; ++i) sum += a[i];
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}
template <typename T>
T Max(const T* a, int64_t n) {  // REQUIRES: n >= 1
  constexpr int kLanes = 128 / sizeof(T);
  T mx = a[0];
  int64_t i = 0;
  if (n >= kLanes) {
    T acc[kLanes];
    for (int l = 0; l < kLanes; ++l) acc[l] = a[l];
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] < a[i + l] ? a[i + l] : acc[l];
    }
    for (int l = 0; l < kLanes; ++l) mx = mx < acc[l] ? acc[l] : mx;
  }
  for (; i < n; ++i) mx = mx < a[i] ? a[i] : mx;
  return mx;
}

// Deterministic parallel column sums: out[c] (+)= sum over rows of in[r * ld + c], each thread
// owning a block of columns and walking rows in order.
template <typename T>
void ColumnSums(ThreadPool& pool, T* out, const T* in, int64_t rows, int64_t cols, int64_t ld,
                bool accumulate) {
  pool.ParallelFor(cols, 64, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      if (!accumulate) out[c] = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = in + r * ld;
      for (int64_t c = c0; c < c1; ++c) out[c] += row[c];
    }
  });
}

// Per-column gradient sums over rows (weights and biases of norms and activations), computed
// alongside a row-parallel kernel: fn(r0, r1, partial) handles rows [r0, r1) and adds into
// `partial`, nvec rows of C; the slices' partials are then added into outs[v] (+=) in slice order,
// so the sum is the same for a given thread count. outs[v] may be null (that sum is dropped).
template <typename T, typename RowFn>
void RowPartialSums(ThreadPool& pool, int64_t N, int64_t C, int nvec, T* const* outs, RowFn&& fn,
                    int64_t min_rows = 32) {
  const int parts = pool.PartsFor(N, min_rows);
  T* partial = Scratch<T>(static_cast<size_t>(parts) * nvec * C, 1);
  std::fill(partial, partial + static_cast<int64_t>(parts) * nvec * C, T(0));
  pool.ParallelForSlices(N, min_rows, [&](int part, int64_t r0, int64_t r1) {
    fn(r0, r1, partial + static_cast<int64_t>(part) * nvec * C);
  });
  for (int v = 0; v < nvec; ++v) {
    if (outs[v] == nullptr) continue;
    for (int p = 0; p < parts; ++p) {
      const T* src = partial + (static_cast<int64_t>(p) * nvec + v) * C;
      for (int64_t c = 0; c < C; ++c) outs[v][c] += src[c];
    }
  }
}

}  // namespace strata::cpu::internal
