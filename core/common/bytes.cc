#include "core/common/bytes.h"

#include <cctype>
#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
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

StatusOr<uint64_t> ParseBytes(const std::string& text) {
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' is not a size: write bytes (1048576) or a number with a binary unit (512KiB, "
        "1.5 GiB, 16G)",
        text));
  };
  const std::string s(absl::StripAsciiWhitespace(text));
  size_t unit_at = s.size();
  while (unit_at > 0 && std::isalpha(static_cast<unsigned char>(s[unit_at - 1]))) --unit_at;
  const std::string number(absl::StripAsciiWhitespace(s.substr(0, unit_at)));
  const std::string unit = absl::AsciiStrToLower(s.substr(unit_at));
  static const struct {
    const char* name;
    int shift;
  } kUnits[] = {{"", 0},     {"b", 0},  {"k", 10},   {"kib", 10}, {"m", 20},
                {"mib", 20}, {"g", 30}, {"gib", 30}, {"t", 40},   {"tib", 40}};
  int shift = -1;
  for (const auto& u : kUnits) {
    if (unit == u.name) shift = u.shift;
  }
  double v = 0;
  if (shift < 0 || number.empty() || !absl::SimpleAtod(number, &v) || !(v >= 0)) return bad();
  const double bytes = std::ldexp(v, shift);
  if (bytes != std::floor(bytes) || bytes >= 18446744073709551616.0) return bad();
  return static_cast<uint64_t>(bytes);
}

}  // namespace strata
