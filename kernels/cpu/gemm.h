// GEMM for the CPU backend: OpenBLAS, single-threaded, called from the thread pool's slices.
//
// Design decision: OpenBLAS's own thread server is turned off (1 thread) and the output matrix is
// split into contiguous blocks of rows or columns, one per pool thread. So the pool is the only
// source of threads (no oversubscription when kernels and GEMMs alternate), GEMMs may be issued
// from any thread, and every output element is computed by one single-threaded BLAS call whose
// reduction order does not depend on the split: results are bitwise reproducible.
//
// Threads: Gemm runs on `pool` (one calling thread at a time; inline on the calling thread inside
// a pool task); GemmSerial may be called from any number of threads at once. Both borrow A, B and
// C for the call only.
#pragma once

#include <cstdint>

#include "core/common/thread_pool.h"

namespace strata::cpu {

// C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C, all row-major with leading dimensions
// lda, ldb, ldc. op(X) is X or X^T. T is float (sgemm) or double (dgemm). Called from inside a
// pool task it runs on the calling thread alone.
template <typename T>
void Gemm(ThreadPool& pool, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// The same on the calling thread only (for callers that already run inside a pool slice).
template <typename T>
void GemmSerial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// OpenBLAS's internal thread count. strata keeps it at 1 (set on first use of Gemm or GemmSerial);
// benchmarks change it to measure plain multi-threaded sgemm as a baseline. Process-wide: call it
// only while no GEMM is running.
void SetBlasThreads(int threads);
int BlasThreads();

}  // namespace strata::cpu
