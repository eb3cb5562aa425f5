// ExpertResidency: where an MoE layer's expert parameters are while it runs them.
//
// Without one (training in memory) every expert owns its parameter tensors. With one — the tiered
// store's scheduler — expert parameters are unbound views that the residency binds to resident
// memory just before an expert runs and releases right after, so only the experts at work (and
// those being prefetched) occupy device memory.
//
// The contract, per pass (forward or backward) of one layer:
//   BeginPass(layer, pass, experts)  once, from the thread running the layer: the experts with
//                                    rows, so loading can start at once;
//   NextReady(layer, pass)           from every worker thread: binds and returns an expert whose
//                                    parameters are resident (and, in backward, whose gradient is
//                                    bound to a zeroed buffer), blocking while none is; -1 when
//                                    all were handed out or after an error;
//   Done(layer, pass, expert)        when the expert's forward/backward has finished.
// Each expert is then run on one thread with single-threaded kernels, so its results do not
// depend on the order or timing in which experts become resident. Errors (a failed read, a
// corrupt extent) are kept by the residency and reported by its owner after the pass.
#pragma once

#include <span>

namespace strata::model {

class ExpertResidency {
 public:
  enum class Pass { kForward, kBackward };
  virtual ~ExpertResidency() = default;
  virtual void BeginPass(int layer, Pass pass, std::span<const int> experts) = 0;
  virtual int NextReady(int layer, Pass pass) = 0;
  virtual void Done(int layer, Pass pass, int expert) = 0;
};

}  // namespace strata::model
