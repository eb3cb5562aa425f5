// The model's view of other workers: how an MoE layer reaches experts placed elsewhere, how gate
// statistics are summed over the workers that share a step's batch, and where backward reports
// gradients that are ready to be reduced.
//
// The model itself knows no communicator: the scheduler implements these interfaces over
// comm::Communicator (scheduler/expert_parallel.h, scheduler/data_parallel.h) and the trainer
// attaches them. Model code has no Status return path in its passes, so implementations keep the
// first communication error and the trainer checks it after each pass (as with ExpertResidency);
// after an error the values they hand back are unspecified and the step is abandoned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace strata::model {

class MoeLayer;

// Sums small vectors over the workers a step's batch is split across (the data-parallel ranks).
class BatchReducer {
 public:
  virtual ~BatchReducer() = default;
  // How many workers share the batch (1: no reduction needed).
  virtual int parts() const = 0;
  // In place, identical on every worker afterwards.
  virtual void Sum(double* data, size_t n) = 0;
};

// Moves an MoE layer's dispatched rows to the workers that hold their experts and back.
//
// Forward: xp [R, C] holds counts[e] rows for each of the layer's E experts, in expert order (the
// local dispatch plan). The exchange sends every worker the rows of its experts, has this worker's
// experts run on the rows it received (MoeLayer::RunLocalForward), and returns the outputs into yp
// [R, C] in xp's order. Backward does the same with dyp -> dxp (MoeLayer::RunLocalBackward),
// reusing the rows and saved activations the exchange kept from the forward of the same layer.
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual void Forward(ops::Context& ctx, int layer, MoeLayer& moe, const Tensor& xp,
                       const std::vector<int64_t>& counts, const Tensor& yp) = 0;
  virtual void Backward(ops::Context& ctx, int layer, MoeLayer& moe, const Tensor& dyp,
                        const Tensor& dxp) = 0;
};

// Told by MoeTransformer::Backward when a block's parameter gradients are final (blocks finish in
// reverse order; then the embeddings, block -1), so their reduction can start while backward
// goes on.
class GradientReadyListener {
 public:
  virtual ~GradientReadyListener() = default;
  virtual void BlockReady(int block) = 0;
};

}  // namespace strata::model
