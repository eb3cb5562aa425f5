// CopyShelf: versions of state blobs kept on the SSD for recovery, outside the tiered store.
//
// An elastic TIERED worker keeps copies of its own experts (from before the latest update) and
// buddy copies of other workers' experts here, so that a later membership generation can put the
// job's state together without the workers that left. A blob is `pieces` pieces of `piece_bytes`
// each (an expert's blob: its weights and Adam moments, one tensor per MoE layer and kind); a
// version of an item (the step its state is the result of) is held once every piece of it is
// written. The pieces are checksummed extents of an SsdTier of the shelf's own, in a
// PrivateFolder made under the parent given to Create (strata-copies-<pid>-XXXXXX) and removed
// with the shelf; nothing of it needs to survive the process (a worker that dies loses its
// copies, which is what the other workers' copies are for). The folder of a process killed before
// it could remove it is removed by the next shelf made under the same parent on that machine (a
// live shelf holds a flock on its folder's lock file, which tells the two apart). The shelf
// charges no memory budget: pieces pass through a bounce buffer as large as the most pieces one
// call moved.
//
// Ownership and threads: the shelf owns its tier, its folder and its bounce buffer. It is not
// thread-safe: one thread at a time calls it (the trainer's).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/common/status.h"
#include "storage/block_io.h"
#include "storage/io_memory.h"
#include "storage/private_folder.h"
#include "storage/ssd_tier.h"

namespace strata::storage {

class CopyShelf {
 public:
  struct Options {
    std::string parent_dir;  // the private folder is made under it (it must exist)
    uint64_t piece_bytes = 0;
    int pieces = 1;  // per blob
    UringOptions io;
    // Tests inject faults by wrapping the block I/O. Called once, inside Create.
    std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> wrap_io;
  };
  [[nodiscard]] static StatusOr<std::unique_ptr<CopyShelf>> Create(const Options& options);
  ~CopyShelf();

  // Writes pieces [first, first + count) of `item` at `version` (count * piece_bytes at `data`),
  // their transfers in flight together. Writing a piece again replaces it; on an error none of
  // them is written (the ones before stay as they were).
  [[nodiscard]] Status Write(int64_t version, int64_t item, int first, int count,
                             const float* data);
  [[nodiscard]] Status Write(int64_t version, int64_t item, int piece, const float* data) {
    return Write(version, item, piece, 1, data);
  }
  // Reads them back into `out` (count * piece_bytes); DATA_LOSS when their bytes changed on disk
  // (that version of the item is then dropped: it is no copy any more), NOT_FOUND when one was
  // never written (or was dropped).
  [[nodiscard]] Status Read(int64_t version, int64_t item, int first, int count, float* out);
  [[nodiscard]] Status Read(int64_t version, int64_t item, int piece, float* out) {
    return Read(version, item, piece, 1, out);
  }
  // The versions of `item` whose every piece is written, newest first.
  std::vector<int64_t> Versions(int64_t item) const;
  // Drops every version of `item` but the newest `keep` whole ones (a version not yet whole is
  // dropped too), freeing their space.
  void KeepNewest(int64_t item, int keep);
  // Drops every version of `item` other than `version`.
  void KeepOnly(int64_t item, int64_t version);
  // Drops the versions of `item` newer than `version`.
  void DropNewerThan(int64_t item, int64_t version);
  // Drops everything.
  void Clear();

  uint64_t piece_bytes() const { return options_.piece_bytes; }
  int pieces() const { return options_.pieces; }
  const std::string& dir() const { return folder_->path(); }
  uint64_t used_bytes() const { return tier_->used_bytes(); }
  SsdStats stats() const { return tier_->stats(); }

 private:
  explicit CopyShelf(Options options) : options_(std::move(options)) {}
  struct Blob {
    std::vector<StoredExtent> pieces;
    std::vector<bool> written;
    int missing = 0;
  };
  // Frees the extents of a version's pieces; returns `it` (for the caller to erase).
  std::map<int64_t, Blob>::iterator DropPieces(std::map<int64_t, Blob>::iterator it);
  std::string What(int64_t version, int64_t item, int piece) const;

  Options options_;
  std::unique_ptr<PrivateFolder> folder_;  // goes after the tier that has files open in it
  std::unique_ptr<SsdTier> tier_;
  [[nodiscard]] Status Reserve(uint64_t bytes);  // the bounce buffer holds at least `bytes`
  IoBuffer bounce_;
  std::map<int64_t, std::map<int64_t, Blob>> items_;  // item -> version -> blob
};

}  // namespace strata::storage
