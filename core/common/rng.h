// Counter-based random numbers: every draw is a pure function of (key, counter).
//
// Why: strata's randomness (parameter init, gate noise and jitter, GShard's random routing, data
// order) must not depend on thread count, scheduling or how work is split over workers, and a
// reference implementation in a test must be able to reproduce any single draw. A stateful
// generator cannot give that; a hash of (key, counter) can. The mixer is SplitMix64's finalizer,
// applied to a key built from up to four 64-bit words.
//
// Pure inline functions with no state: any thread may call them at any time.
#pragma once

#include <cmath>
#include <cstdint>

namespace strata::rng {

inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A key for a stream of draws, e.g. Key(seed, step, layer, purpose).
inline uint64_t Key(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t h = Mix64(a);
  h = Mix64(h ^ b);
  h = Mix64(h ^ c);
  return Mix64(h ^ d);
}

inline uint64_t Bits(uint64_t key, uint64_t counter) { return Mix64(key ^ Mix64(counter)); }

// Uniform in [0, 1) with 53 random bits.
inline double Uniform(uint64_t key, uint64_t counter) {
  return static_cast<double>(Bits(key, counter) >> 11) * 0x1.0p-53;
}

// Uniform in (0, 1]: safe to take the log of.
inline double UniformOpenZero(uint64_t key, uint64_t counter) {
  return (static_cast<double>(Bits(key, counter) >> 11) + 1.0) * 0x1.0p-53;
}

// Standard normal by Box-Muller on two independent uniforms of this counter.
inline double Normal(uint64_t key, uint64_t counter) {
  double u1 = UniformOpenZero(key, 2 * counter);
  double u2 = Uniform(key, 2 * counter + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Uniform integer in [0, n), n > 0 (multiply-shift; bias below 2^-32 for n < 2^32).
inline uint64_t Below(uint64_t key, uint64_t counter, uint64_t n) {
  return static_cast<uint64_t>((static_cast<__uint128_t>(Bits(key, counter)) * n) >> 64);
}

}  // namespace strata::rng
