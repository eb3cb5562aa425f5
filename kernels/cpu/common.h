// Helpers shared by the CPU kernels (not part of the public kernel API).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/common/thread_pool.h"

namespace strata::cpu::internal {

// Grain sizes: a slice of fewer elements than this is not worth a thread.
constexpr int64_t kElementGrain = 1 << 14;

// Per-thread scratch that grows and is reused across calls, so kernels allocate nothing in steady
// state. `slot` separates independent uses within one kernel.
template <typename T>
T* Scratch(size_t n, int slot = 0) {
  thread_local std::vector<T> buffers[4];
  auto& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
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

}  // namespace strata::cpu::internal
