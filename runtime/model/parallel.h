// The model's view of other workers: how an MoE layer reaches experts placed elsewhere, how gate
// statistics are summed over the workers that share a step's batch, and where backward reports
// gradients that are ready to be reduced.
//
// The model itself knows no communicator: the scheduler implements these interfaces over
// comm::Communicator (scheduler/expert_parallel.h, scheduler/data_parallel.h) and the trainer
// attaches them. Model code has no Status return path in its passes, so implementations keep the
// first communication error and the trainer checks it after each pass (as with ExpertResidency);
// after an error the values they hand back are unspecified and the step is abandoned.
//
// Ownership and threads: the model does not own the implementations attached to it, and calls
// them only from the thread running its Forward/Backward (never from its pool's workers), so an
// implementation needs no locking against the model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace strata::model {

// Sums small vectors over the workers a step's batch is split across (the data-parallel ranks).
class BatchReducer {
 public:
  virtual ~BatchReducer() = default;
  // How many workers share the batch (1: no reduction needed).
  virtual int parts() const = 0;
  // In place, identical on every worker afterwards.
  virtual void Sum(double* data, size_t n) = 0;
};

// This worker's experts of one MoE layer, as an ExpertExchange sees them: all it may do is run
// them on rows it received. The MoE layer implements it and lends it to the exchange for one
// Forward/Backward call; the exchange keeps no reference past the call and calls it only from the
// thread that called the exchange.
class LocalExperts {
 public:
  // Global id of local expert 0; local expert i is global expert first() + i.
  virtual int64_t first() const = 0;
  virtual int64_t count() const = 0;
  virtual int64_t d_model() const = 0;
  // Floats of saved storage per row (the most any local expert keeps).
  virtual int64_t saved_stride() const = 0;
  // Runs local expert i on rows [offsets[i], offsets[i + 1]) of x [rows, C], writing those rows of
  // y and keeping saved[row * saved_stride()..] for Backward. offsets has count() + 1 entries;
  // saved holds at least offsets.back() * saved_stride() floats (and at least one).
  virtual void Forward(ops::Context& ctx, const std::vector<int64_t>& offsets, const Tensor& x,
                       const Tensor& y, const Tensor& saved) = 0;
  // The backward of Forward on the same rows and saved storage: dx from dy; accumulates the
  // experts' parameter gradients.
  virtual void Backward(ops::Context& ctx, const std::vector<int64_t>& offsets, const Tensor& x,
                        const Tensor& dy, const Tensor& dx, const Tensor& saved) = 0;

 protected:
  ~LocalExperts() = default;  // not owned through this interface
};

// Moves an MoE layer's dispatched rows to the workers that hold their experts and back.
//
// Forward: xp [R, C] holds counts[e] rows for each of the layer's E experts, in expert order (the
// local dispatch plan). The exchange sends every worker the rows of its experts, has this worker's
// experts run on the rows it received (experts.Forward), and returns the outputs into yp [R, C]
// in xp's order. Backward does the same with dyp -> dxp (experts.Backward), reusing the rows and
// saved activations the exchange kept from the forward of the same layer. The tensors are the
// layer's, borrowed for the call. The layer's pass calls these on the thread running it, one layer
// at a time.
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual void Forward(ops::Context& ctx, int layer, LocalExperts& experts, const Tensor& xp,
                       const std::vector<int64_t>& counts, const Tensor& yp) = 0;
  virtual void Backward(ops::Context& ctx, int layer, LocalExperts& experts, const Tensor& dyp,
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
