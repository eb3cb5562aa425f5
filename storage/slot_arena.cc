#include "storage/slot_arena.h"

#include <sys/uio.h>

#include "absl/strings/str_format.h"

namespace strata::storage {

StatusOr<std::unique_ptr<SlotArena>> SlotArena::Create(std::string name, uint64_t slot_bytes,
                                                       uint64_t budget_bytes, MemoryBudget* budget,
                                                       Device device, bool pin) {
  std::unique_ptr<SlotArena> a(new SlotArena);
  a->name_ = std::move(name);
  a->slot_bytes_ = (slot_bytes + 4095) / 4096 * 4096;
  a->budget_ = budget;
  a->limited_ = budget_bytes > 0;
  a->device_ = device;
  a->pin_ = pin && device.is_cpu();
  if (!a->limited_) return a;
  const uint64_t slots = budget_bytes / a->slot_bytes_;
  if (slots == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the %s tier's budget of %d bytes holds no tensor of %d bytes", a->name_,
                        budget_bytes, a->slot_bytes_));
  }
  a->block_bytes_ = slots * a->slot_bytes_;
  if (!device.is_cpu()) {
    // The budget is charged by the buffer itself.
    auto block = Buffer::Allocate(device, a->block_bytes_, budget);
    if (!block.ok()) {
      return Status(block.status().code(),
                    absl::StrFormat("the %s tier on %s: %s", a->name_, device.ToString(),
                                    block.status().message()));
    }
    char* base = static_cast<char*>((*block)->data());
    a->gpu_.push_back(*std::move(block));
    for (uint64_t i = 0; i < slots; ++i) a->ptrs_.push_back(base + i * a->slot_bytes_);
    for (int i = static_cast<int>(slots) - 1; i >= 0; --i) a->free_.push_back(i);
    return a;
  }
  // From here the arena holds the reservation: its destructor returns it on every failure below.
  if (budget != nullptr) {
    Status reserved = budget->Reserve(a->block_bytes_);
    if (!reserved.ok()) {
      a->budget_ = nullptr;  // nothing was charged
      return Status(reserved.code(),
                    absl::StrFormat("the %s tier: %s", a->name_, reserved.message()));
    }
  }
  auto block = IoBuffer::Allocate(a->block_bytes_);
  if (!block.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("the %s tier: %s", a->name_, block.status().message()));
  }
  a->block_ = *std::move(block);
  if (a->pin_) {
    auto pinned = PinHostMemory(a->block_.data(), a->block_bytes_);
    if (!pinned.ok()) {
      return Status(pinned.status().code(),
                    absl::StrFormat("the %s tier: %s", a->name_, pinned.status().message()));
    }
    a->pinned_ = *pinned;
  }
  for (uint64_t i = 0; i < slots; ++i) a->ptrs_.push_back(a->block_.data() + i * a->slot_bytes_);
  for (int i = static_cast<int>(slots) - 1; i >= 0; --i) a->free_.push_back(i);
  return a;
}

SlotArena::~SlotArena() {
  if (!device_.is_cpu()) return;  // the GPU buffers return their bytes to the budget themselves
  if (pinned_) UnpinHostMemory(block_.data());
  for (const IoBuffer& b : grown_) {
    if (pin_) UnpinHostMemory(b.data());
  }
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
  if (!device_.is_cpu()) {
    auto buf = Buffer::Allocate(device_, slot_bytes_, budget_);
    if (!buf.ok()) return -1;
    ptrs_.push_back(static_cast<char*>((*buf)->data()));
    gpu_.push_back(*std::move(buf));
    ++in_use_;
    return static_cast<int>(ptrs_.size()) - 1;
  }
  if (budget_ != nullptr && !budget_->Reserve(slot_bytes_).ok()) return -1;
  auto buf = IoBuffer::Allocate(slot_bytes_);
  if (!buf.ok()) {
    if (budget_ != nullptr) budget_->Release(slot_bytes_);
    return -1;
  }
  if (pin_ && !PinHostMemory(buf->data(), slot_bytes_).ok()) {
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
  if (!limited_ || !device_.is_cpu()) return {};
  return {iovec{block_.data(), block_bytes_}};
}

}  // namespace strata::storage
