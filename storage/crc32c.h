// CRC-32C (Castagnoli), the checksum of every SSD-tier extent.
//
// Uses the SSE4.2 crc32 instruction when the CPU has it (checked once at run time), three
// streams at a time (about 3x one stream; crc32c.cc says how), and a table otherwise; both give
// the same values (RFC 3720 test vectors, and the two paths compared on random lengths and
// alignments, in tests/storage).
//
// Pure functions: any thread, at any time; `data` is read during the call only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::storage {

// Continues a CRC-32C over `n` bytes: Crc32c(Crc32c(0, a), b) == Crc32c(0, a ++ b).
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(const void* data, size_t n) { return Crc32c(0, data, n); }

// The table path alone, whatever the CPU (the reference the fast path is tested against).
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);

// Whether the hardware instruction is used (for logs and benchmarks).
bool Crc32cIsHardwareAccelerated();

}  // namespace strata::storage
