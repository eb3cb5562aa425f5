// Helpers shared by the MoE layer tests (CPU and GPU).
#pragma once

#include <cstdint>

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

}  // namespace strata::model
