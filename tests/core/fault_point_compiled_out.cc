// fault_point_test's translation unit without STRATA_FAULT_INJECTION: what every point becomes in
// a build configured with -DSTRATA_FAULT_INJECTION=OFF.
#include "core/common/fault_injection.h"
#undef STRATA_FAULT_INJECTION
#include <string>

#include "core/common/fault_point.h"

namespace strata {

// Like every variable used only by points, the parameters are [[maybe_unused]]: compiled out,
// nothing refers to them.
void ReachPointCompiledOut([[maybe_unused]] const std::string& name,
                           [[maybe_unused]] int* evaluations) {
  STRATA_FAULT_POINT((++*evaluations, name), (++*evaluations, static_cast<void*>(evaluations)));
}

}  // namespace strata
