// SsdTier: tensors as checksummed extents in preallocated O_DIRECT files.
//
// The folder holds data files data-00000.bin, data-00001.bin, ...; space in them is handed out by
// an ExtentAllocator (4 KiB granules), reserved with fallocate as files grow (so a full disk shows
// up as a clear error when space is reserved, not as a torn write), and moved with io_uring
// (BlockIo). Every extent's payload carries a CRC-32C kept by the caller (the index); Read checks
// it and reports a mismatch as DATA_LOSS naming the file and offset; an extent beyond the end of
// its file (one cut short) is DATA_LOSS naming the file and its size.
//
// Write does not sync: spilled working state need not survive a crash. Durable writes (checkpoints)
// call Sync after their extents and only then record them in the index — extent, fdatasync, index
// entry — so the index never points at bytes that may not be on disk.
//
// Thread-safe: allocation is under a mutex; transfers from different threads run concurrently
// (each thread has its own io_uring), and so does Sync with writes that open new data files (a
// checkpoint syncing while stage threads spill): a file's descriptor and name, once opened, stay
// where they are until the tier is destroyed. The tier owns its BlockIo and its files' descriptors;
// it is shared (std::shared_ptr) by the tiered store and the checkpoints that use one folder. Every
// buffer, extent and name a call takes is borrowed until the call returns.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "storage/block_io.h"
#include "storage/extent_allocator.h"

namespace strata::storage {

inline constexpr uint64_t kSsdGranule = 4096;

struct SsdOptions {
  std::string dir;
  uint64_t file_bytes = 1ull << 30;   // largest size of one data file
  uint64_t capacity_bytes = 0;        // all files together; 0: limited by the disk
  uint64_t grow_bytes = 64ull << 20;  // files grow (fallocate) in steps of this
};

// Where a tensor's bytes are, and their checksum.
struct StoredExtent {
  Extent extent;
  uint64_t bytes = 0;  // payload (extent.length is that rounded up to 4 KiB)
  uint32_t crc = 0;    // CRC-32C of the payload
};

struct SsdStats {
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t reads = 0, writes = 0;
  double read_seconds = 0, write_seconds = 0;  // time inside transfers (summed over threads)
};

class SsdTier {
 public:
  // Opens (creating it if needed) the folder; existing data files are adopted with all their space
  // free until MarkUsed says otherwise.
  [[nodiscard]] static StatusOr<std::unique_ptr<SsdTier>> Open(const SsdOptions& options,
                                                               std::unique_ptr<BlockIo> io);
  ~SsdTier();

  // Registers memory that will be read into or written from (the host tier's arena). Not while any
  // transfer is in flight (see BlockIo::RegisterRegions).
  void RegisterRegions(const std::vector<iovec>& regions) { io_->RegisterRegions(regions); }

  // Writes `bytes` bytes at `buf` (4 KiB aligned, with room for the rounded-up length) into a new
  // extent. The CRC is computed here. Although `buf` is const, the padding from `bytes` up to the
  // rounded-up length is zeroed in place, so that the bytes on disk are deterministic.
  [[nodiscard]] StatusOr<StoredExtent> Write(const void* buf, uint64_t bytes);
  // Several writes with their transfers in flight together (checkpoints); padding zeroed as in
  // Write, CRCs computed while the transfers run. On error, every extent allocated by this call is
  // released and the `out`s are unspecified.
  struct WriteItem {
    const void* buf;
    uint64_t bytes;
    StoredExtent* out;
  };
  [[nodiscard]] Status WriteMany(std::span<const WriteItem> items);

  // Reads an extent into `buf` (aligned, room for extent.length) and checks its CRC. `what` names
  // the tensor in errors ("layer 3 expert 5 weights v7").
  [[nodiscard]] Status Read(const StoredExtent& e, void* buf, const std::string& what);
  // Several reads with their transfers in flight together; the first failure.
  struct ReadItem {
    const StoredExtent* stored;
    void* buf;
    const std::string* what;
  };
  [[nodiscard]] Status ReadMany(std::span<const ReadItem> items);
  // Reads and checks without keeping the bytes (verification).
  [[nodiscard]] Status Verify(const StoredExtent& e, const std::string& what);

  // fdatasync of every file written since the last Sync.
  [[nodiscard]] Status Sync();

  void Free(const Extent& e);
  [[nodiscard]] Status MarkUsed(const Extent& e);
  // Whether the extent lies within the data files as they are (a file cut short loses extents).
  bool InFiles(const Extent& e) const;

  std::string FilePath(uint32_t file) const;
  // The data files in `dir` that Open would adopt.
  static std::vector<std::string> DataFiles(const std::string& dir);
  const std::string& dir() const { return options_.dir; }
  uint64_t used_bytes() const;
  SsdStats stats() const;
  BlockIo& io() { return *io_; }  // valid for the tier's life

 private:
  SsdTier(SsdOptions options, std::unique_ptr<BlockIo> io);
  [[nodiscard]] StatusOr<Extent> AllocateLocked(uint64_t bytes);
  [[nodiscard]] Status OpenFileLocked(uint32_t file);

  SsdOptions options_;
  std::unique_ptr<BlockIo> io_;
  mutable std::mutex mu_;
  ExtentAllocator alloc_;
  std::vector<int> fds_;  // read and grown under mu_ only
  // Grown under mu_, but requests and Sync keep pointers to its names while their I/O runs outside
  // the lock: a deque never moves its elements when it grows at the end.
  std::deque<std::string> paths_;
  std::set<uint32_t> unsynced_;
  SsdStats stats_;
};

}  // namespace strata::storage
