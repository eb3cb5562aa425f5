// ExtentAllocator: space in the SSD tier's files, handed out in aligned extents.
//
// Each file is a sequence of `granule`-byte units (4 KiB: the O_DIRECT alignment). Free space is a
// set of runs per file, first fit, with neighbours coalesced on release. A file grows (in steps of
// grow_bytes, up to its size limit) only when no free run fits; new files are added up to the
// total capacity. The allocator does no I/O: the SSD tier asks it for room and grows the files.
//
// Not thread-safe: the SSD tier calls it under its own lock.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::storage {

struct Extent {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;  // bytes, a multiple of the granule
  bool operator==(const Extent& o) const {
    return file == o.file && offset == o.offset && length == o.length;
  }
};

class ExtentAllocator {
 public:
  // Files hold at most file_bytes each; all files together at most capacity_bytes (0: no limit).
  ExtentAllocator(uint64_t granule, uint64_t file_bytes, uint64_t capacity_bytes,
                  uint64_t grow_bytes = 64ull << 20);

  uint64_t granule() const { return granule_; }
  uint64_t RoundUp(uint64_t bytes) const { return (bytes + granule_ - 1) / granule_ * granule_; }

  // Finds room for `bytes` (rounded up). When that needs a file to grow or a new file, *grow gets
  // the file and its new size (the caller extends the file, then calls CommitGrowth). Fails with
  // RESOURCE_EXHAUSTED when the capacity is reached.
  struct Growth {
    bool needed = false;
    uint32_t file = 0;
    uint64_t new_size = 0;
    uint64_t extent_end = 0;  // end of the extent that needed the growth
  };
  [[nodiscard]] StatusOr<Extent> Allocate(uint64_t bytes, Growth* grow);
  // Records that a growth reported by Allocate happened (the extent it returned is then valid).
  void CommitGrowth(const Growth& grow);
  // Forgets a growth that failed, and the extent allocated with it.
  void AbortGrowth(const Growth& grow, const Extent& extent);

  void Release(const Extent& e);
  // Marks an extent as used (rebuilding the map from the index after a restart).
  [[nodiscard]] Status MarkUsed(const Extent& e);

  uint64_t used_bytes() const { return used_; }
  uint64_t file_size(uint32_t file) const { return file < sizes_.size() ? sizes_[file] : 0; }
  uint32_t files() const { return static_cast<uint32_t>(sizes_.size()); }
  // Grows the bookkeeping of a file that exists on disk with this size (restart).
  void AdoptFile(uint32_t file, uint64_t size);

 private:
  void InsertFree(uint32_t file, uint64_t offset, uint64_t length);

  uint64_t granule_, file_bytes_, capacity_, grow_bytes_;
  std::vector<uint64_t> sizes_;                     // current size of each file
  std::vector<std::map<uint64_t, uint64_t>> free_;  // per file: offset -> length
  uint64_t used_ = 0;
  uint64_t total_size_ = 0;
};

}  // namespace strata::storage
