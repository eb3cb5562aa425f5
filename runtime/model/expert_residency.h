// ExpertResidency: where an MoE layer's expert parameters are while it runs them.
//
// Without one (training in memory) every expert owns its parameter tensors. With one — the tiered
// store's scheduler — expert parameters are unbound, and the residency hands the layer, one expert
// at a time, the resident memory it may use: the expert's weights as one flat blob and, in
// backward, a zeroed gradient blob, both laid out by ExpertLayout (expert.h). The layer, which
// owns its experts, binds the blobs to the expert's parameters for the one call and unbinds them
// before giving the handle back, so nothing else writes the layer's parameters and only the
// experts at work (and those being prefetched) occupy device memory.
//
// The contract, per pass (forward or backward) of one layer:
//   BeginPass(layer, pass, experts)  once, from the thread running the layer: the experts (global
//                                    ids) with rows, so loading can start at once;
//   NextReady(layer, pass)           from every thread of the layer's pool, concurrently: an
//                                    expert whose weights are resident, blocking while none is;
//                                    a handle with expert -1 when all were handed out or after an
//                                    error;
//   Done(layer, pass, handle)        from the thread that got the handle, when the expert's
//                                    forward/backward has finished and nothing refers to the
//                                    handle's tensors any more (the layer has unbound them).
// Each expert is then run on one thread with single-threaded kernels, so its results do not
// depend on the order or timing in which experts become resident. Errors (a failed read, a
// corrupt extent) are kept by the residency and reported by its owner after the pass.
#pragma once

#include <span>

#include "runtime/model/expert.h"

namespace strata::model {

// One expert's resident tensors, lent by the residency to the thread that called NextReady until
// it calls Done with the handle. The residency owns the memory; the layer may read `weights` and
// accumulate into `grad`, and must keep no reference past Done.
struct ResidentExpert {
  int expert = -1;  // global id; -1: nothing (more) to run
  Tensor weights;   // [ExpertLayout::floats]: the expert's parameters, resident
  Tensor grad;      // backward: [ExpertLayout::floats], zeroed; forward: undefined
};

class ExpertResidency {
 public:
  enum class Pass { kForward, kBackward };
  virtual ~ExpertResidency() = default;
  virtual void BeginPass(int layer, Pass pass, std::span<const int> experts) = 0;
  virtual ResidentExpert NextReady(int layer, Pass pass) = 0;
  virtual void Done(int layer, Pass pass, const ResidentExpert& expert) = 0;
};

}  // namespace strata::model
