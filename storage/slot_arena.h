// SlotArena: a tier's memory, cut into equal slots of one tensor each.
//
// Every tensor the tiered store holds for one model has the same size (an expert's parameters,
// gradient or Adam moment), so a tier is a set of equal slots: no fragmentation, O(1) allocation.
// With a byte budget the arena is one block allocated up front (huge-page I/O memory, see
// io_memory.h) — charged to the tier's
// MemoryBudget and registered with io_uring for fixed-buffer transfers. Without one it grows a
// slot at a time.
//
// On a GPU (device = cuda:N) the arena is cudaMalloc memory under the same budget, one block or
// one buffer per slot as above. A host arena can be page-locked for the GPU (`pin`): its block is
// then both registered with io_uring and pinned with cudaHostRegister, so the SSD reads into it
// directly and the GPU copies out of it by DMA, at full speed and asynchronously.
//
// Not thread-safe: the store calls it under its lock. A slot's memory never moves: data(slot) is
// valid until the arena is destroyed, and the slot's holder may use it without the lock.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "core/device/device.h"
#include "storage/io_memory.h"

namespace strata::storage {

class SlotArena {
 public:
  // slot_bytes is rounded up to 4 KiB. budget_bytes == 0: unlimited (grow on demand). The arena
  // charges its memory to `budget` (may be null), which must outlive it.
  [[nodiscard]] static StatusOr<std::unique_ptr<SlotArena>> Create(
      std::string name, uint64_t slot_bytes, uint64_t budget_bytes, MemoryBudget* budget,
      Device device = Device::Cpu(), bool pin = false);
  ~SlotArena();

  // A free slot index, or -1 when there is none: a limited arena has all its slots taken, or an
  // unlimited one could not grow (its budget refused the slot, or memory or pinning failed).
  int Allocate();
  void Free(int slot);
  float* data(int slot) const { return reinterpret_cast<float*>(ptrs_[slot]); }

  bool limited() const { return limited_; }
  int capacity() const { return limited_ ? static_cast<int>(ptrs_.size()) : -1; }
  int in_use() const { return in_use_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t bytes_in_use() const { return static_cast<uint64_t>(in_use_) * slot_bytes_; }
  const std::string& name() const { return name_; }
  Device device() const { return device_; }
  bool pinned() const { return pinned_; }
  // The one block of a limited host arena, for io_uring registration (empty when unlimited or on
  // a GPU).
  std::vector<iovec> Regions() const;

 private:
  SlotArena() = default;
  std::string name_;
  uint64_t slot_bytes_ = 0;
  bool limited_ = false;
  IoBuffer block_;  // limited: every slot
  uint64_t block_bytes_ = 0;
  std::vector<IoBuffer> grown_;  // unlimited: one buffer per slot
  Device device_;
  bool pin_ = false;                          // page-lock host memory for the GPU
  bool pinned_ = false;                       // the block is page-locked (pin_ and a GPU present)
  std::vector<std::shared_ptr<Buffer>> gpu_;  // on a GPU: the block, or one buffer per slot
  MemoryBudget* budget_ = nullptr;
  std::vector<char*> ptrs_;
  std::vector<int> free_;
  int in_use_ = 0;
};

}  // namespace strata::storage
