// Parameters: a named tensor with its gradient, and how it is initialised and decayed.
//
// Initialisation is a pure function of (seed, parameter name, element index): value[i] =
// std * Normal(Key(seed, hash(name)), i). So a parameter's initial value does not depend on the
// order in which parameters are created, on the thread count, or on which worker holds it — an
// expert placed on another worker starts from the same numbers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "runtime/device/device.h"

namespace strata::model {

enum class Init { kNormal, kZeros, kOnes };

struct Parameter {
  std::string name;
  Tensor value;
  Tensor grad;
  bool decay = false;  // AdamW weight decay applies (weight matrices)
  Init init = Init::kZeros;
  float init_std = 0.0f;
};

// Allocates value and grad (grad zeroed). The caller fills value with Initialize.
std::unique_ptr<Parameter> MakeParameter(std::string name, Shape shape, Init init, float init_std,
                                         bool decay);

// Writes the parameter's initial value for `seed`.
void Initialize(ops::Context& ctx, Parameter& p, uint64_t seed);

// 64-bit FNV-1a of a name, the per-parameter stream of the initialiser.
uint64_t NameHash(const std::string& name);

// Total number of scalars.
int64_t CountScalars(const std::vector<Parameter*>& params);

}  // namespace strata::model
