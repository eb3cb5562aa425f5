// How the elastic unit's files cut an expert's blob into tensors (internal to train/elastic/).
#pragma once

#include <algorithm>
#include <cstdint>

#include "storage/tiered_store.h"

namespace strata::train::elastic_internal {

// The tensors of an expert's blob, per MoE layer: the weights and both Adam moments.
inline constexpr storage::TensorKind kBlobKinds[] = {
    storage::TensorKind::kWeights, storage::TensorKind::kAdamM, storage::TensorKind::kAdamV};

// Rounds of whole tensors of `tensor_floats`, one or as many as fit in 4 MiB, out of and into each
// worker (a piece of a tensor costs a whole one's trip through a host slot).
inline int64_t ChunkOfTensors(int64_t tensor_floats) {
  return tensor_floats * std::max<int64_t>(1, (int64_t{1} << 20) / tensor_floats);
}

}  // namespace strata::train::elastic_internal
