#include "storage/extent_allocator.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/common/logging.h"

namespace strata::storage {

ExtentAllocator::ExtentAllocator(uint64_t granule, uint64_t file_bytes, uint64_t capacity_bytes,
                                 uint64_t grow_bytes)
    : granule_(granule),
      file_bytes_(file_bytes / granule * granule),
      capacity_(capacity_bytes),
      grow_bytes_(std::max<uint64_t>(granule, grow_bytes / granule * granule)) {
  CHECK_GT(granule_, 0u);
  CHECK_GE(file_bytes_, granule_);
}

void ExtentAllocator::InsertFree(uint32_t file, uint64_t offset, uint64_t length) {
  auto& m = free_[file];
  auto next = m.lower_bound(offset);
  // Merge with the following run.
  if (next != m.end() && offset + length == next->first) {
    length += next->second;
    next = m.erase(next);
  }
  // Merge with the preceding run.
  if (next != m.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += length;
      return;
    }
  }
  m.emplace(offset, length);
}

StatusOr<Extent> ExtentAllocator::Allocate(uint64_t bytes, Growth* grow) {
  *grow = Growth{};
  const uint64_t len = RoundUp(std::max<uint64_t>(bytes, 1));
  if (len > file_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a tensor of %d bytes does not fit in one SSD-tier file of %d bytes; raise "
                        "storage.ssd_file_bytes",
                        bytes, file_bytes_));
  }
  for (uint32_t f = 0; f < free_.size(); ++f) {
    for (auto it = free_[f].begin(); it != free_[f].end(); ++it) {
      if (it->second < len) continue;
      Extent e{f, it->first, len};
      const uint64_t rest = it->second - len, rest_off = it->first + len;
      free_[f].erase(it);
      if (rest > 0) free_[f].emplace(rest_off, rest);
      used_ += len;
      return e;
    }
  }
  // Grow the last file, or add one, by grow_bytes at a time where the limits allow.
  auto room = [&](uint64_t more) { return capacity_ == 0 || total_size_ + more <= capacity_; };
  auto grown = [&](uint64_t size, uint64_t end) {
    uint64_t target = std::max(end, std::min(file_bytes_, size + grow_bytes_));
    if (capacity_ != 0) target = std::max(end, std::min(target, size + (capacity_ - total_size_)));
    return target;
  };
  if (!sizes_.empty()) {
    const uint32_t f = static_cast<uint32_t>(sizes_.size() - 1);
    // A free tail of the last file becomes the start of the new extent.
    uint64_t start = sizes_[f];
    auto& m = free_[f];
    bool tail = false;
    if (!m.empty()) {
      auto last = std::prev(m.end());
      if (last->first + last->second == sizes_[f]) {
        start = last->first;
        tail = true;
      }
    }
    const uint64_t end = start + len;
    if (end <= file_bytes_ && room(end - sizes_[f])) {
      if (tail) m.erase(std::prev(m.end()));
      *grow = Growth{true, f, grown(sizes_[f], end), end};
      used_ += len;
      return Extent{f, start, len};
    }
  }
  if (!room(len)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the SSD tier is full: %d of %d bytes (storage.ssd_capacity_bytes) in use and %d more "
        "needed; raise the capacity, keep fewer checkpoints (checkpoint.keep), or free disk space",
        total_size_, capacity_, len));
  }
  const uint32_t f = static_cast<uint32_t>(sizes_.size());
  *grow = Growth{true, f, grown(0, len), len};
  used_ += len;
  return Extent{f, 0, len};
}

void ExtentAllocator::CommitGrowth(const Growth& grow) {
  if (!grow.needed) return;
  if (grow.file == sizes_.size()) {
    sizes_.push_back(0);
    free_.emplace_back();
  }
  total_size_ += grow.new_size - sizes_[grow.file];
  sizes_[grow.file] = grow.new_size;
  if (grow.new_size > grow.extent_end) {
    InsertFree(grow.file, grow.extent_end, grow.new_size - grow.extent_end);
  }
}

void ExtentAllocator::AbortGrowth(const Growth& grow, const Extent& extent) {
  used_ -= extent.length;
  if (grow.file < sizes_.size() && extent.offset < sizes_[grow.file]) {
    // Part of the extent lay in the existing file (a free tail): give that part back.
    InsertFree(grow.file, extent.offset, sizes_[grow.file] - extent.offset);
  }
}

void ExtentAllocator::Release(const Extent& e) {
  CHECK(e.file < free_.size() && e.offset + e.length <= sizes_[e.file])
      << "release of an extent outside the files: file " << e.file << " offset " << e.offset;
  used_ -= e.length;
  InsertFree(e.file, e.offset, e.length);
}

void ExtentAllocator::AdoptFile(uint32_t file, uint64_t size) {
  while (sizes_.size() <= file) {
    sizes_.push_back(0);
    free_.emplace_back();
  }
  size = size / granule_ * granule_;
  if (size > sizes_[file]) {
    InsertFree(file, sizes_[file], size - sizes_[file]);
    total_size_ += size - sizes_[file];
    sizes_[file] = size;
  }
}

Status ExtentAllocator::MarkUsed(const Extent& e) {
  if (e.file >= free_.size() || e.offset + e.length > sizes_[e.file] || e.offset % granule_ ||
      e.length % granule_) {
    return absl::DataLossError(
        absl::StrFormat("the index refers to file %d bytes [%d, %d), outside the SSD tier's files",
                        e.file, e.offset, e.offset + e.length));
  }
  auto& m = free_[e.file];
  auto it = m.upper_bound(e.offset);
  if (it == m.begin()) return absl::DataLossError("index extents overlap");
  --it;
  if (it->first > e.offset || it->first + it->second < e.offset + e.length) {
    return absl::DataLossError(
        absl::StrFormat("two index entries share bytes of file %d at offset %d", e.file, e.offset));
  }
  const uint64_t run_off = it->first, run_len = it->second;
  m.erase(it);
  if (e.offset > run_off) m.emplace(run_off, e.offset - run_off);
  const uint64_t end = e.offset + e.length, run_end = run_off + run_len;
  if (run_end > end) m.emplace(end, run_end - end);
  used_ += e.length;
  return absl::OkStatus();
}

}  // namespace strata::storage
