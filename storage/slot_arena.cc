#include "storage/slot_arena.h"

#include <sys/uio.h>

#include "absl/strings/str_format.h"

namespace strata::storage {

StatusOr<std::unique_ptr<SlotArena>> SlotArena::Create(std::string name, uint64_t slot_bytes,
                                                       uint64_t budget_bytes,
                                                       MemoryBudget* budget) {
  std::unique_ptr<SlotArena> a(new SlotArena);
  a->name_ = std::move(name);
  a->slot_bytes_ = (slot_bytes + 4095) / 4096 * 4096;
  a->budget_ = budget;
  a->limited_ = budget_bytes > 0;
  if (!a->limited_) return a;
  const uint64_t slots = budget_bytes / a->slot_bytes_;
  if (slots == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the %s tier's budget of %d bytes holds no tensor of %d bytes", a->name_,
                        budget_bytes, a->slot_bytes_));
  }
  a->block_bytes_ = slots * a->slot_bytes_;
  if (budget != nullptr) RETURN_IF_ERROR(budget->Reserve(a->block_bytes_));
  auto block = IoBuffer::Allocate(a->block_bytes_);
  if (!block.ok()) {
    if (budget != nullptr) budget->Release(a->block_bytes_);
    return absl::ResourceExhaustedError(
        absl::StrFormat("the %s tier: %s", a->name_, block.status().message()));
  }
  a->block_ = *std::move(block);
  for (uint64_t i = 0; i < slots; ++i) a->ptrs_.push_back(a->block_.data() + i * a->slot_bytes_);
  for (int i = static_cast<int>(slots) - 1; i >= 0; --i) a->free_.push_back(i);
  return a;
}

SlotArena::~SlotArena() {
  if (limited_) {
    if (budget_ != nullptr) budget_->Release(block_bytes_);
    return;
  }
  if (budget_ != nullptr) budget_->Release(ptrs_.size() * slot_bytes_);
}

int SlotArena::Allocate() {
  if (!free_.empty()) {
    const int s = free_.back();
    free_.pop_back();
    ++in_use_;
    return s;
  }
  if (limited_) return -1;
  if (budget_ != nullptr && !budget_->Reserve(slot_bytes_).ok()) return -1;
  auto buf = IoBuffer::Allocate(slot_bytes_);
  if (!buf.ok()) {
    if (budget_ != nullptr) budget_->Release(slot_bytes_);
    return -1;
  }
  ptrs_.push_back(buf->data());
  grown_.push_back(*std::move(buf));
  ++in_use_;
  return static_cast<int>(ptrs_.size()) - 1;
}

void SlotArena::Free(int slot) {
  free_.push_back(slot);
  --in_use_;
}

std::vector<iovec> SlotArena::Regions() const {
  if (!limited_) return {};
  return {iovec{block_.data(), block_bytes_}};
}

}  // namespace strata::storage
