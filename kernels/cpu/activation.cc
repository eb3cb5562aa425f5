#include "kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/fast_math.h"

namespace strata::cpu {
namespace {

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;

// One row of the forward: o[0, H) = act(x), x of width ActivationInputWidth(act, H).
template <typename T>
inline void ForwardRow(Activation act, T* __restrict o, const T* __restrict x, int64_t H) {
  switch (act) {
    case Activation::kGelu:
      for (int64_t c = 0; c < H; ++c) {
        const T v = x[c];
        const T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
        o[c] = T(0.5) * v * (T(1) + Tanh(u));
      }
      break;
    case Activation::kRelu:
      for (int64_t c = 0; c < H; ++c) o[c] = x[c] > T(0) ? x[c] : T(0);
      break;
    case Activation::kSwiglu: {
      const T* u = x + H;
      for (int64_t c = 0; c < H; ++c) o[c] = x[c] * Sigmoid(x[c]) * u[c];
      break;
    }
  }
}

// One row of the backward: dx (width ActivationInputWidth) from dy [H] and x; dx may alias x.
template <typename T>
inline void BackwardRow(Activation act, T* dx, const T* __restrict dy, const T* x, int64_t H) {
  switch (act) {
    case Activation::kGelu:
      for (int64_t c = 0; c < H; ++c) {
        const T v = x[c];
        const T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
        const T th = Tanh(u);
        const T du = T(kGeluScale) * (T(1) + T(3 * kGeluCubic) * v * v);
        dx[c] = dy[c] * (T(0.5) * (T(1) + th) + T(0.5) * v * (T(1) - th * th) * du);
      }
      break;
    case Activation::kRelu:
      for (int64_t c = 0; c < H; ++c) dx[c] = x[c] > T(0) ? dy[c] : T(0);
      break;
    case Activation::kSwiglu:
      for (int64_t c = 0; c < H; ++c) {
        const T gv = x[c], uv = x[H + c];
        const T s = Sigmoid(gv);
        dx[c] = dy[c] * uv * s * (T(1) + gv * (T(1) - s));
        dx[H + c] = dy[c] * gv * s;
      }
      break;
  }
}

template <typename T>
int64_t RowGrain(int64_t width) {
  return std::max<int64_t>(1, internal::kElementGrain / std::max<int64_t>(width, 1));
}

}  // namespace

template <typename T>
void activation_forward(ThreadPool& pool, Activation act, T* out, const T* inp, int64_t N,
                        int64_t H) {
  const int64_t W = ActivationInputWidth(act, H);
  pool.ParallelFor(N, RowGrain<T>(W), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ForwardRow(act, out + r * H, inp + r * W, H);
  });
}

template <typename T>
void bias_activation_forward(ThreadPool& pool, Activation act, T* out, T* pre, const T* bias,
                             int64_t N, int64_t H) {
  const int64_t W = ActivationInputWidth(act, H);
  pool.ParallelFor(N, RowGrain<T>(W), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* x = pre + r * W;
      for (int64_t c = 0; c < W; ++c) x[c] += bias[c];
      ForwardRow(act, out + r * H, x, H);
    }
  });
}

template <typename T>
void activation_backward(ThreadPool& pool, Activation act, T* dinp, const T* dout, const T* inp,
                         int64_t N, int64_t H, T* dbias) {
  const int64_t W = ActivationInputWidth(act, H);
  if (dbias == nullptr) {
    pool.ParallelFor(N, RowGrain<T>(W), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        BackwardRow(act, dinp + r * W, dout + r * H, inp + r * W, H);
    });
    return;
  }
  T* outs[1] = {dbias};
  internal::RowPartialSums<T>(
      pool, N, W, 1, outs,
      [&](int64_t r0, int64_t r1, T* partial) {
        for (int64_t r = r0; r < r1; ++r) {
          T* dx = dinp + r * W;
          BackwardRow(act, dx, dout + r * H, inp + r * W, H);
          for (int64_t c = 0; c < W; ++c) partial[c] += dx[c];
        }
      },
      RowGrain<T>(W));
}

#define STRATA_INSTANTIATE(T)                                                                    \
  template void activation_forward<T>(ThreadPool&, Activation, T*, const T*, int64_t, int64_t);  \
  template void bias_activation_forward<T>(ThreadPool&, Activation, T*, T*, const T*, int64_t,   \
                                           int64_t);                                             \
  template void activation_backward<T>(ThreadPool&, Activation, T*, const T*, const T*, int64_t, \
                                       int64_t, T*);
STRATA_INSTANTIATE(float)
STRATA_INSTANTIATE(double)

}  // namespace strata::cpu
