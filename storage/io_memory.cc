#include "storage/io_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_format.h"

namespace strata::storage {
namespace {
constexpr uint64_t kPage = 4096;
constexpr uint64_t kHugePage = uint64_t{2} << 20;
}  // namespace

StatusOr<IoBuffer> IoBuffer::Allocate(uint64_t bytes) {
  const bool huge = bytes >= kHugePage;
  const uint64_t align = huge ? kHugePage : kPage;
  const uint64_t size = (std::max<uint64_t>(bytes, 1) + align - 1) / align * align;
  // Map one alignment unit more than needed and trim both ends to the aligned middle.
  const uint64_t mapped = huge ? size + kHugePage : size;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot map %d bytes of I/O memory: %s", size, std::strerror(errno)));
  }
  char* base = static_cast<char*>(p);
  char* aligned = base;
  if (huge) {
    const auto addr = reinterpret_cast<uintptr_t>(base);
    aligned = base + ((kHugePage - addr % kHugePage) % kHugePage);
    const uint64_t head = static_cast<uint64_t>(aligned - base);
    const uint64_t tail = mapped - head - size;
    if (head > 0) munmap(base, head);
    if (tail > 0) munmap(aligned + size, tail);
    madvise(aligned, size, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
  }
  IoBuffer b;
  b.data_ = aligned;
  b.size_ = size;
  b.huge_ = huge;
  return b;
}

void IoBuffer::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  huge_ = false;
}

}  // namespace strata::storage
