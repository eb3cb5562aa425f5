#include "core/common/bytes.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata {

std::string FormatBytes(uint64_t b) {
  if (b == std::numeric_limits<uint64_t>::max()) return "more than 16 EiB";
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.1f %s", v, kUnits[u]);
}

}  // namespace strata
