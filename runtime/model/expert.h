// Experts: the pluggable computation of an MoE layer.
//
// An Expert is any function of a block of token rows with its own parameters (as in FastMoE,
// where any module can be an expert). The MoE layer hands each expert the contiguous rows that
// were routed to it, plus storage for whatever the expert wants to keep for backward — so an
// expert allocates nothing per call, and the same expert can be called on several blocks (chunks)
// in one step, each with its own saved storage.
//
// Different experts of a layer may run at the same time on different threads (see MoeLayer); one
// expert is never called concurrently with itself. An expert called on a pool thread gets the
// layer's ctx, and its ops run inline on that thread (the pool does not nest), so an expert needs
// no locking but must not share mutable state with the layer's other experts. The MoE layer owns
// its experts; an expert owns its parameters (Parameters() pointers live as long as the expert) and
// borrows the tensors of a call for that call only.
//
// FfnExpert, the two-layer FFN, is the default; examples/custom_expert shows another.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "runtime/model/parameter.h"

namespace strata::model {

class Expert {
 public:
  virtual ~Expert() = default;

  // Floats per input row that Forward keeps for Backward.
  virtual int64_t SavedPerRow() const = 0;

  // y [n, C] = f(x [n, C]). saved is [n, SavedPerRow()], contiguous. n may be 0.
  virtual void Forward(ops::Context& ctx, const Tensor& x, const Tensor& y,
                       const Tensor& saved) = 0;

  // dx [n, C] (overwritten) from dy [n, C], for the x and saved of the matching Forward call;
  // accumulates the gradients of Parameters(). May overwrite saved.
  virtual void Backward(ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx,
                        const Tensor& saved) = 0;

  // This expert's parameters, in a fixed order.
  virtual std::vector<Parameter*> Parameters() = 0;
};

// Where an expert's parameters lie in one flat float blob: Expert::Parameters() order, packed
// without padding. The tiered store keeps every expert (weights, gradient, moments) as such blobs,
// and the MoE layer binds the blobs its ExpertResidency hands it with the same layout, so the two
// sides compute it here and cannot drift. Plain data: any thread may read it.
struct ExpertLayout {
  struct Segment {
    int64_t offset = 0;  // floats from the start of the blob
    Shape shape;
    bool decay = false;  // AdamW weight decay applies
  };
  std::vector<Segment> segments;  // one per parameter, in Parameters() order
  int64_t floats = 0;             // the blob's size

  // The layout of `params` (an expert's Parameters(); they may be unbound: only the shapes count).
  static ExpertLayout Of(const std::vector<Parameter*>& params);
  // Whether `params` have exactly this layout's shapes, in order.
  bool Fits(const std::vector<Parameter*>& params) const;
  // Binds params[i].value to a view of `weights` [floats] and params[i].grad to a view of `grad`
  // (left unbound when grad is undefined). The views share the blobs' memory; the caller unbinds
  // them (model::Unbind) before that memory goes away. REQUIRES: Fits(params).
  void Bind(const std::vector<Parameter*>& params, const Tensor& weights, const Tensor& grad) const;
};

// Makes expert `expert` of MoE layer `layer`. `name_prefix` ("blocks.3.moe.experts.5") prefixes
// its parameter names, which key their initialisation.
using ExpertFactory =
    std::function<std::unique_ptr<Expert>(int layer, int expert, const std::string& name_prefix)>;

struct FfnOptions {
  int64_t d_model = 0;
  int64_t d_hidden = 0;
  ops::Activation activation = ops::Activation::kGelu;
  bool bias = true;
  float init_std = 0.02f;         // first matrix
  float out_std = 0.02f;          // second matrix (scaled down for deep residual stacks)
  Device device = Device::Cpu();  // where its parameters live
};

// y = act(x W1^T + b1) W2^T + b2. W1 is [in_width, C] with in_width = 2 * d_hidden for SwiGLU
// (gate rows, then up rows), d_hidden otherwise; W2 is [C, d_hidden]. Saved per row: the
// pre-activation (in_width) and the activation (d_hidden); backward reuses both in place.
// Used as the default expert and, on all rows, as the dense FFN.
class FfnExpert : public Expert {
 public:
  FfnExpert(const std::string& name_prefix, const FfnOptions& options);

  int64_t SavedPerRow() const override { return in_width_ + options_.d_hidden; }
  void Forward(ops::Context& ctx, const Tensor& x, const Tensor& y, const Tensor& saved) override;
  void Backward(ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx,
                const Tensor& saved) override;
  std::vector<Parameter*> Parameters() override;

  const FfnOptions& options() const { return options_; }
  Parameter& w1() { return *w1_; }
  Parameter& w2() { return *w2_; }
  Parameter* b1() { return b1_.get(); }
  Parameter* b2() { return b2_.get(); }

  // Whether `experts` can run as one group: every one an FfnExpert with the same shape,
  // activation and biases.
  static bool SameShape(const std::vector<FfnExpert*>& experts);
  // The experts of a layer as grouped GEMMs (one cuBLAS grouped call per matrix on a GPU instead
  // of one GEMM per expert): expert i takes rows [offsets[i], offsets[i + 1]) of x, offsets[0] = 0.
  // saved holds the pre-activations [R, in_width] of all R rows, then their activations
  // [R, d_hidden]. The same results as each expert's Forward/Backward on its rows, up to the order
  // of float additions.
  static void GroupForward(ops::Context& ctx, const std::vector<FfnExpert*>& experts,
                           const std::vector<int64_t>& offsets, const Tensor& x, const Tensor& y,
                           const Tensor& saved);
  static void GroupBackward(ops::Context& ctx, const std::vector<FfnExpert*>& experts,
                            const std::vector<int64_t>& offsets, const Tensor& x, const Tensor& dy,
                            const Tensor& dx, const Tensor& saved);

 private:
  FfnOptions options_;
  int64_t in_width_;
  std::unique_ptr<Parameter> w1_, b1_, w2_, b2_;
};

}  // namespace strata::model
