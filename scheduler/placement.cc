#include "scheduler/placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/logging.h"

namespace strata::scheduler {

StatusOr<ExpertPlacement> ExpertPlacement::Even(int64_t num_experts, int workers) {
  if (num_experts < 1 || workers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("cannot place ", num_experts, " experts on ",
                                                   workers, " workers: both must be positive"));
  }
  std::vector<int64_t> counts(workers, num_experts / workers);
  for (int64_t w = 0; w < num_experts % workers; ++w) ++counts[w];
  return FromCounts(counts);
}

StatusOr<ExpertPlacement> ExpertPlacement::FromCounts(const std::vector<int64_t>& counts) {
  if (counts.empty()) return absl::InvalidArgumentError("expert placement over zero workers");
  ExpertPlacement p;
  p.first_.assign(1, 0);
  for (size_t w = 0; w < counts.size(); ++w) {
    if (counts[w] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert placement: worker ", w, " has a negative count ", counts[w]));
    }
    p.first_.push_back(p.first_.back() + counts[w]);
  }
  if (p.first_.back() < 1) return absl::InvalidArgumentError("expert placement with no experts");
  return p;
}

int ExpertPlacement::Owner(int64_t expert) const {
  CHECK(expert >= 0 && expert < num_experts()) << "expert " << expert;
  // The last w with first_[w] <= expert (skips workers that own nothing).
  auto it = std::upper_bound(first_.begin(), first_.end(), expert);
  return static_cast<int>(it - first_.begin()) - 1;
}

std::string ExpertPlacement::ToString() const {
  std::string s;
  for (int w = 0; w < workers(); ++w) {
    absl::StrAppend(&s, w ? " " : "", "w", w, ":[", first_[w], ",", first_[w + 1], ")");
  }
  return s;
}

}  // namespace strata::scheduler
