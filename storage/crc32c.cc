// The hardware path runs three CRCs side by side. The crc32 instruction takes 3 cycles but a core
// can start one every cycle, so a single dependency chain (each step needs the previous CRC) uses
// a third of it: about 8 bytes per 3 cycles, ~7 GB/s, which on the SSD tier's 2-core reference VM
// was a third of a read batch's time after the disk had finished. Three chains over three
// adjacent blocks keep the unit busy; their CRCs are then joined: the CRC register is linear, so
// the register after blocks A then B is (register after A) shifted over |B| zero bytes, XOR the
// register of B started from zero, and a shift over a fixed length is a 32x32 bit matrix, applied
// as four 256-entry tables (Mark Adler's crc32c.c does the same). Blocks of 8 KiB amortise the
// join; blocks of 256 bytes take most of what is left; the tail runs one chain.
#include "storage/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace strata::storage {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t Software(uint32_t crc, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// a(x) * b(x) mod P(x), polynomials in the reflected bit order (bit 31 is x^0).
constexpr uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 n) mod P(x): what a CRC register is multiplied by when n zero bytes pass through it.
constexpr uint32_t ZeroBytesOperator(uint64_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t square = 1u << 30;  // x^1, then x^2, x^4, ...
  for (uint64_t bits = 8 * n; bits != 0; bits >>= 1) {
    if (bits & 1) result = MultModP(result, square);
    square = MultModP(square, square);
  }
  return result;
}

// The register shifted over `n` zero bytes, as four table lookups.
using ShiftTables = std::array<std::array<uint32_t, 256>, 4>;
constexpr ShiftTables MakeShiftTables(uint64_t n) {
  const uint32_t op = ZeroBytesOperator(n);
  ShiftTables t{};
  for (uint32_t k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = MultModP(op, b << (8 * k));
  }
  return t;
}

inline uint32_t Shift(const ShiftTables& t, uint32_t crc) {
  return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
}

constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;
constexpr ShiftTables kLongShift = MakeShiftTables(kLong);
constexpr ShiftTables kShortShift = MakeShiftTables(kShort);

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Runs three chains over [p, p + 3 block) per round while at least 3 blocks remain.
__attribute__((target("sse4.2"))) inline uint32_t ThreeWay(uint32_t crc, const uint8_t*& p,
                                                           size_t& n, size_t block,
                                                           const ShiftTables& shift) {
  while (n >= 3 * block) {
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    const uint8_t* end = p + block;
    do {
      c0 = _mm_crc32_u64(c0, Load64(p));
      c1 = _mm_crc32_u64(c1, Load64(p + block));
      c2 = _mm_crc32_u64(c2, Load64(p + 2 * block));
      p += 8;
    } while (p < end);
    crc = Shift(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    crc = Shift(shift, crc) ^ static_cast<uint32_t>(c2);
    p += 2 * block;
    n -= 3 * block;
  }
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t Hardware(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ThreeWay(crc, p, n, kLong, kLongShift);
  crc = ThreeWay(crc, p, n, kShort, kShortShift);
  uint64_t c = crc;
  while (n >= 8) {
    c = _mm_crc32_u64(c, Load64(p));
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

bool HasHardware() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (HasHardware()) return ~Hardware(crc, p, n);
#endif
  return ~Software(crc, p, n);
}

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n) {
  return ~Software(~crc, static_cast<const uint8_t*>(data), n);
}

bool Crc32cIsHardwareAccelerated() { return HasHardware(); }

}  // namespace strata::storage
