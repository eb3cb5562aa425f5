// Vectorisable exp, tanh and sigmoid for the float kernels.
//
// glibc's expf/tanhf are scalar calls the compiler cannot vectorise, and they dominated the
// pointwise kernels (GELU's tanh was over a quarter of a training step). The float versions here
// are branch-free (Cody-Waite range reduction and a degree-6 polynomial, as in Cephes), so loops
// over them compile to AVX2/AVX-512; their error is a few ulp. The double versions call libm:
// tests compute gradients in double and compare the float kernels against them.
//
// Pure inline functions: any thread.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace strata::cpu {

inline float FastExp(float x) {
  // Clamp with plain comparisons: std::fmin/fmax are library calls without -ffast-math.
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.37626f ? 88.37626f : x;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: adding it leaves the integer in the low mantissa
  // bits. (A float-to-int conversion would keep GCC from vectorising the loop under the default
  // -ftrapping-math.)
  constexpr float kMagic = 12582912.0f;
  const float t = x * 1.44269504088896341f + kMagic;
  const int32_t n = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kMagic);
  const float fx = t - kMagic;
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * std::bit_cast<float>((n + 127) << 23);
}

template <typename T>
inline T Exp(T x) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return FastExp(x);
  } else {
    return std::exp(x);
  }
}

template <typename T>
inline T Tanh(T x) {
  if constexpr (sizeof(T) == sizeof(float)) {
    // 1 - 2 / (e^{2x} + 1): exact limits at both ends; absolute error ~1e-7 near 0.
    return 1.0f - 2.0f / (FastExp(2.0f * x) + 1.0f);
  } else {
    return std::tanh(x);
  }
}

template <typename T>
inline T Sigmoid(T x) {
  return T(1) / (T(1) + Exp(-x));
}

}  // namespace strata::cpu
