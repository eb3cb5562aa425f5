// Byte counts as people read them.
//
// - FormatBytes: "512 B", "1.5 GiB" (binary units, one decimal); the largest uint64_t reads "more
//   than 16 EiB" (the saturated figure of an estimate that overflowed).
// - A pure function: safe from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

std::string FormatBytes(uint64_t bytes);

}  // namespace strata
