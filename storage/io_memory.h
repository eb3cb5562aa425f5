// IoBuffer: memory that the SSD tier reads into and writes from.
//
// O_DIRECT needs 4 KiB alignment; on top of that, a buffer of 2 MiB or more is 2 MiB-aligned and
// advised as transparent huge pages (MADV_HUGEPAGE). With 4 KiB pages every direct transfer maps
// and unmaps one page per 4 KiB for the device; with huge pages a 32 MiB read touches 16 of them
// (docs/storage.md, "Measurements behind the design"). Where the kernel has THP off, the advice is
// ignored and the buffer is still correctly aligned.
//
// The memory comes from mmap, zero-filled, and is returned to the system when the buffer dies.
// An IoBuffer owns it alone (move-only): data() is valid until the buffer is destroyed or moved
// from. Nothing synchronises access to the bytes; whoever holds the buffer orders its users.
#pragma once

#include <cstdint>
#include <utility>

#include "core/common/status.h"

namespace strata::storage {

class IoBuffer {
 public:
  IoBuffer() = default;
  // A buffer of at least `bytes` (rounded up to 4 KiB, or to 2 MiB from 2 MiB on).
  [[nodiscard]] static StatusOr<IoBuffer> Allocate(uint64_t bytes);
  ~IoBuffer() { Reset(); }
  IoBuffer(IoBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        huge_(std::exchange(o.huge_, false)) {}
  IoBuffer& operator=(IoBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      huge_ = std::exchange(o.huge_, false);
    }
    return *this;
  }
  IoBuffer(const IoBuffer&) = delete;
  IoBuffer& operator=(const IoBuffer&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }  // the rounded size: all of it is usable
  // 2 MiB-aligned, a multiple of 2 MiB, and advised as huge pages.
  bool huge_pages() const { return huge_; }

 private:
  void Reset();
  char* data_ = nullptr;
  uint64_t size_ = 0;
  bool huge_ = false;
};

}  // namespace strata::storage
