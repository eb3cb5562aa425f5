#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <mutex>

namespace strata::cpu {
namespace {

void EnsureSingleThreadedBlas() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

inline void Blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}
inline void Blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                 int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

// Below this many multiply-adds a GEMM is not worth splitting.
constexpr int64_t kMinSplitWork = 1 << 18;
// Split points are multiples of this, so every block keeps full-width micro-kernel tiles.
constexpr int64_t kSplitAlign = 32;

}  // namespace

void SetBlasThreads(int threads) {
  EnsureSingleThreadedBlas();
  openblas_set_num_threads(std::max(1, threads));
}
int BlasThreads() { return openblas_get_num_threads(); }

template <typename T>
void GemmSerial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  EnsureSingleThreadedBlas();
  Blas(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <typename T>
void Gemm(ThreadPool& pool, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  int threads = pool.num_threads();
  if (threads == 1 || K <= 0 || M * N * K < kMinSplitWork || ThreadPool::InTask()) {
    GemmSerial(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  EnsureSingleThreadedBlas();
  // Split the larger output dimension into aligned blocks.
  const bool split_m = M >= N;
  const int64_t dim = split_m ? M : N;
  const int64_t blocks = (dim + kSplitAlign - 1) / kSplitAlign;
  const int parts = static_cast<int>(std::min<int64_t>(threads, blocks));
  pool.Run([&](int tid, int) {
    if (tid >= parts) return;
    int64_t b0 = ThreadPool::SliceBegin(blocks, parts, tid) * kSplitAlign;
    int64_t b1 = std::min(dim, ThreadPool::SliceBegin(blocks, parts, tid + 1) * kSplitAlign);
    if (b0 >= b1) return;
    if (split_m) {
      const T* a = trans_a ? A + b0 : A + b0 * lda;
      Blas(trans_a, trans_b, b1 - b0, N, K, alpha, a, lda, B, ldb, beta, C + b0 * ldc, ldc);
    } else {
      const T* b = trans_b ? B + b0 * ldb : B + b0;
      Blas(trans_a, trans_b, M, b1 - b0, K, alpha, A, lda, b, ldb, beta, C + b0, ldc);
    }
  });
}

template void Gemm<float>(ThreadPool&, bool, bool, int64_t, int64_t, int64_t, float, const float*,
                          int64_t, const float*, int64_t, float, float*, int64_t);
template void Gemm<double>(ThreadPool&, bool, bool, int64_t, int64_t, int64_t, double,
                           const double*, int64_t, const double*, int64_t, double, double*,
                           int64_t);
template void GemmSerial<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                                const float*, int64_t, float, float*, int64_t);
template void GemmSerial<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                 int64_t, const double*, int64_t, double, double*, int64_t);

}  // namespace strata::cpu
