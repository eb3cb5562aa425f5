#include "kernels/cpu/activation.h"

#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/fast_math.h"

namespace strata::cpu {
namespace {

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;

}  // namespace

template <typename T>
void activation_forward(ThreadPool& pool, Activation act, T* out, const T* inp, int64_t N,
                        int64_t H) {
  const int64_t grain = std::max<int64_t>(1, internal::kElementGrain / std::max<int64_t>(H, 1));
  pool.ParallelFor(N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* o = out + r * H;
      switch (act) {
        case Activation::kGelu: {
          const T* x = inp + r * H;
          for (int64_t c = 0; c < H; ++c) {
            T v = x[c];
            T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
            o[c] = T(0.5) * v * (T(1) + Tanh(u));
          }
          break;
        }
        case Activation::kRelu: {
          const T* x = inp + r * H;
          for (int64_t c = 0; c < H; ++c) o[c] = x[c] > T(0) ? x[c] : T(0);
          break;
        }
        case Activation::kSwiglu: {
          const T* g = inp + r * 2 * H;
          const T* u = g + H;
          for (int64_t c = 0; c < H; ++c) o[c] = g[c] * Sigmoid(g[c]) * u[c];
          break;
        }
      }
    }
  });
}

template <typename T>
void activation_backward(ThreadPool& pool, Activation act, T* dinp, const T* dout, const T* inp,
                         int64_t N, int64_t H) {
  const int64_t grain = std::max<int64_t>(1, internal::kElementGrain / std::max<int64_t>(H, 1));
  pool.ParallelFor(N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* dy = dout + r * H;
      switch (act) {
        case Activation::kGelu: {
          const T* x = inp + r * H;
          T* dx = dinp + r * H;
          for (int64_t c = 0; c < H; ++c) {
            T v = x[c];
            T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
            T th = Tanh(u);
            T du = T(kGeluScale) * (T(1) + T(3 * kGeluCubic) * v * v);
            dx[c] = dy[c] * (T(0.5) * (T(1) + th) + T(0.5) * v * (T(1) - th * th) * du);
          }
          break;
        }
        case Activation::kRelu: {
          const T* x = inp + r * H;
          T* dx = dinp + r * H;
          for (int64_t c = 0; c < H; ++c) dx[c] = x[c] > T(0) ? dy[c] : T(0);
          break;
        }
        case Activation::kSwiglu: {
          const T* g = inp + r * 2 * H;
          const T* u = g + H;
          T* dg = dinp + r * 2 * H;
          T* du = dg + H;
          for (int64_t c = 0; c < H; ++c) {
            T gv = g[c], uv = u[c];
            T s = Sigmoid(gv);
            T silu = gv * s;
            dg[c] = dy[c] * uv * s * (T(1) + gv * (T(1) - s));
            du[c] = dy[c] * silu;
          }
          break;
        }
      }
    }
  });
}

#define STRATA_INSTANTIATE(T)                                                                    \
  template void activation_forward<T>(ThreadPool&, Activation, T*, const T*, int64_t, int64_t);  \
  template void activation_backward<T>(ThreadPool&, Activation, T*, const T*, const T*, int64_t, \
                                       int64_t);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
