// Helpers shared by the MoE layer and model tests (CPU and GPU).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "core/common/rng.h"
#include "runtime/model/parameter.h"

namespace strata::model {

// Initialises `p` from `seed` as the model does; a parameter the model starts at zero (a bias)
// gets small normal values instead, so a wrong bias gradient shows in the checks. Its gradient is
// left alone.
inline void InitializeWithBiases(ops::Context& ctx, Parameter& p, uint64_t seed) {
  Initialize(ctx, p, seed);
  if (p.init != Init::kZeros) return;
  for (int64_t i = 0; i < p.value.numel(); ++i) {
    p.value.f32()[i] = static_cast<float>(0.1 * rng::Normal(rng::Key(5, NameHash(p.name)), i));
  }
}

// B sequences of T tokens and their targets, uniform over a vocabulary of V, from `seed`.
struct Batch {
  std::vector<int32_t> tokens, targets;
};

inline Batch RandomBatch(int B, int T, int V, unsigned seed) {
  std::mt19937 g(seed);
  Batch b;
  for (int i = 0; i < B * T; ++i) {
    b.tokens.push_back(static_cast<int32_t>(g() % V));
    b.targets.push_back(static_cast<int32_t>(g() % V));
  }
  return b;
}

}  // namespace strata::model
