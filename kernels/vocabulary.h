// The op vocabulary: the small types and formulas that callers of kernels/ops.h pass to ops or
// compute beside them, shared by both backends (kernels/cpu and kernels/cuda include this header
// and name these in their own namespaces). Nothing outside kernels/ includes a backend's header;
// what a caller needs from kernels is here or in kernels/ops.h.
//
// Plain values and pure functions: any thread may use them. The header includes no CUDA or
// library header, so .cu files (compiled as C++17) include it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace strata::ops {

// Pointwise activations: GELU (tanh approximation), ReLU, SwiGLU. SwiGLU takes a row of 2H
// pre-activations — H gate values then H up values — and produces H outputs silu(gate) * up. The
// others map H to H.
enum class Activation { kGelu = 0, kRelu = 1, kSwiglu = 2 };

// Width of the pre-activation row for H outputs: 2H for SwiGLU, H otherwise.
inline int64_t ActivationInputWidth(Activation act, int64_t H) {
  return act == Activation::kSwiglu ? 2 * H : H;
}

// AdamW's hyperparameters for one update (decoupled weight decay, PyTorch's update order).
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // 0 for parameters that are not decayed
  int64_t step = 1;           // 1-based step count, for bias correction
  double grad_scale = 1.0;    // gradient multiplier (global-norm clipping)
};

// The multiplier that brings a gradient of global L2 norm `norm` down to `max_norm` (1 when it is
// already within, or when max_norm is 0).
inline double ClipScale(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

// Capacity per expert: ceil(capacity_factor * T * k / E), at least 1; 0 when capacity_factor is 0
// (dropless).
inline int64_t MoeCapacity(double capacity_factor, int64_t Tn, int k, int64_t E) {
  if (capacity_factor <= 0) return 0;
  double c = std::ceil(capacity_factor * static_cast<double>(Tn) * k / static_cast<double>(E));
  return std::max<int64_t>(1, static_cast<int64_t>(c));
}

}  // namespace strata::ops
