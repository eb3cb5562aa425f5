// Byte counts as people read them.
//
// - FormatBytes: "512 B", "1.5 GiB" (binary units, one decimal); the largest uint64_t reads "more
//   than 16 EiB" (the saturated figure of an estimate that overflowed).
// - ParseBytes: what a user types for a size: "1048576", "512 KiB", "1.5GiB", "16G" (K, M, G, T,
//   with or without "iB": binary units) or "100 B"; INVALID_ARGUMENT naming the text and the
//   forms otherwise (a negative, fractional-byte or overflowing size included).
// - Pure functions: safe from any thread.
#pragma once

#include <cstdint>
#include <string>

#include "core/common/status.h"

namespace strata {

std::string FormatBytes(uint64_t bytes);
[[nodiscard]] StatusOr<uint64_t> ParseBytes(const std::string& text);

}  // namespace strata
