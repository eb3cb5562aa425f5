// Parameters: a named tensor with its gradient, and how it is initialised and decayed.
//
// Initialisation is a pure function of (seed, parameter name, element index): value[i] =
// std * Normal(Key(seed, hash(name)), i). So a parameter's initial value does not depend on the
// order in which parameters are created, on the thread count, or on which worker holds it — an
// expert placed on another worker starts from the same numbers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "kernels/ops.h"

namespace strata::model {

enum class Init { kNormal, kZeros, kOnes };

struct Parameter {
  std::string name;
  Shape shape;
  // value and grad own their memory (MakeParameter), or are undefined while the parameter is
  // unbound (an expert in the tiered store between uses); its MoE layer binds them to views of the
  // resident blobs its ExpertResidency hands it, for one call, and drops the views before handing
  // the blobs back (expert_residency.h). Not synchronised: whoever writes a parameter has it to
  // itself meanwhile — the thread running the step (whose ops may split it into disjoint slices
  // over ctx.pool, see ParameterSlices), the thread running its expert, or, for a gradient between
  // BlockReady and FinishGradients, DataParallel's communication thread (data_parallel.h).
  Tensor value;
  Tensor grad;
  // A GEMM weight (Linear*/GroupedLinear*, not the router's): in a BF16 model (ModelOptions::bf16)
  // a bound one has `compute`, its bf16 copy on the same device, which the model's GEMMs multiply
  // instead of value; MoeTransformer refreshes it from value before each Forward (after each
  // update). An unbound (tiered) expert has none: its GEMMs round value as they use it, to the
  // same bits. `compute` is never checkpointed: value is the master weight.
  bool gemm = false;
  Tensor compute;
  bool decay = false;  // AdamW weight decay applies (weight matrices)
  Init init = Init::kZeros;
  float init_std = 0.0f;
};

// Allocates value and grad (grad zeroed) on `device`. The caller fills value with Initialize.
std::unique_ptr<Parameter> MakeParameter(std::string name, Shape shape, Init init, float init_std,
                                         bool decay, Device device = Device::Cpu());

// What a GEMM multiplies: the compute copy when there is one, else the value.
inline const Tensor& GemmWeight(const Parameter& p) {
  return p.compute.defined() ? p.compute : p.value;
}

// Writes the parameter's initial value for `seed`.
void Initialize(ops::Context& ctx, Parameter& p, uint64_t seed);
// The same values into dst[0, shape.numel()), on the calling thread.
void InitialValues(const Parameter& p, uint64_t seed, float* dst);
// Drops value and grad (their memory is freed unless shared), keeping name and shape.
void Unbind(Parameter& p);

// 64-bit FNV-1a of a name, the per-parameter stream of the initialiser.
uint64_t NameHash(const std::string& name);

// Total number of scalars.
int64_t CountScalars(const std::vector<Parameter*>& params);

// All parameters as one flat index space split evenly over the pool's threads: many parameter
// tensors are too small to split on their own, and a loop over them would leave all but one core
// idle. Thread t calls fn(t, i, begin, count) for each part [begin, begin + count) of parameter i
// that falls in its slice, in parameter order. Inside fn, ops run on the calling thread.
class ParameterSlices {
 public:
  explicit ParameterSlices(std::vector<Parameter*> params);
  const std::vector<Parameter*>& params() const { return params_; }
  int64_t total() const { return offsets_.back(); }

  template <typename Fn>
  void Run(ops::Context& ctx, Fn&& fn) const {
    const int64_t total = offsets_.back();
    ctx.pool->Run([&](int tid, int threads) {
      const int64_t lo = total * tid / threads, hi = total * (tid + 1) / threads;
      for (size_t i = 0; i < params_.size(); ++i) {
        const int64_t b = std::max(lo, offsets_[i]), e = std::min(hi, offsets_[i + 1]);
        if (b < e) fn(tid, i, b - offsets_[i], e - b);
      }
    });
  }

 private:
  std::vector<Parameter*> params_;
  std::vector<int64_t> offsets_;  // prefix sums of sizes, [params + 1]
};

// Sum of the squares of every gradient in `slices`, from per-thread partial sums (kept in
// *partials, sized once) combined in thread order: the same bits for the same thread count.
double GradSumSquares(ops::Context& ctx, const ParameterSlices& slices,
                      std::vector<double>* partials);

}  // namespace strata::model
