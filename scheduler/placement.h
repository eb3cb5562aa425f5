// ExpertPlacement: which worker owns which experts of an MoE layer.
//
// Experts are placed in contiguous ranges, worker w owning [first(w), first(w) + count(w)), so
// rows permuted in expert order are also grouped by destination worker and one all-to-all-v moves
// them. The even split gives every worker E / W experts (the first E % W one more); an uneven
// split takes explicit counts (e.g. fewer experts on a slower worker).
//
// A value type: copies are independent, and its const members may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::scheduler {

class ExpertPlacement {
 public:
  // Even split of num_experts over workers (both >= 1).
  [[nodiscard]] static StatusOr<ExpertPlacement> Even(int64_t num_experts, int workers);
  // Worker w owns experts_per_worker[w] experts (each >= 0, summing to >= 1).
  [[nodiscard]] static StatusOr<ExpertPlacement> FromCounts(
      const std::vector<int64_t>& experts_per_worker);

  int workers() const { return static_cast<int>(first_.size()) - 1; }
  int64_t num_experts() const { return first_.back(); }
  int64_t first(int worker) const { return first_[worker]; }
  int64_t count(int worker) const { return first_[worker + 1] - first_[worker]; }
  // The worker that owns `expert` (binary search over the ranges).
  int Owner(int64_t expert) const;
  // "w0:[0,4) w1:[4,8)"
  std::string ToString() const;

 private:
  std::vector<int64_t> first_;  // [workers + 1] prefix sums of the counts
};

}  // namespace strata::scheduler
