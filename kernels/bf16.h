// bfloat16 on the host: rounding fp32 to bfloat16 and back, exactly as the GPU's
// __float2bfloat16_rn and __bfloat162float do, so the CPU computes what a BF16 GPU step computes.
//
// A bfloat16 is the top 16 bits of an fp32 (sign, 8 exponent bits, 7 mantissa bits). Rounding is
// to nearest, ties to even; values beyond the largest bfloat16 round to infinity; every NaN
// becomes the canonical NaN 0x7fff, as on the GPU. Converting back is exact. Pure functions: any
// thread.
#pragma once

#include <cstdint>
#include <cstring>

namespace strata::ops {

inline uint16_t Bf16Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16Value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// x rounded to the nearest bfloat16, as an fp32.
inline float RoundBf16(float x) { return Bf16Value(Bf16Bits(x)); }

}  // namespace strata::ops
