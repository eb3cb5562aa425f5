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

// How a router turns logits into its choices and combine weights (model.moe.gate):
//   scores     softmax over the experts, or sigmoid of each logit on its own;
//   selection  scores plus an optional per-expert bias (loss-free balancing), for the choice only;
//   groups     with num_groups > 1, the experts form num_groups groups of consecutive ids; a token
//              keeps the topk_groups groups whose top max(1, k / topk_groups) selection values
//              sum highest (ties: lower group first) and chooses only among their experts;
//   choice     the k highest selection values in descending order (ties: lower id first);
//   weights    the unbiased scores of the k, divided by their sum when `renormalize` and k > 1,
//              times `scaling`.
struct MoeRouterSpec {
  int k = 2;
  bool sigmoid = false;
  bool renormalize = false;
  float scaling = 1.0f;
  int num_groups = 0;  // 0 or 1: no groups; at most kMaxRouterGroups
  int topk_groups = 1;
};
// Group-limited routing keeps each token's allowed groups in a 64-bit mask.
inline constexpr int kMaxRouterGroups = 64;
// The top-k lists of the router kernels hold up to 8 entries.
inline constexpr int kMaxRouterTopK = 8;

}  // namespace strata::ops
