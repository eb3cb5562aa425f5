// TensorIndex: the SSD tier's metadata in RocksDB.
//
// Two kinds of keys:
//   t/<layer><expert><kind><version>  -> ExtentRecord   (where a stored tensor version is)
//   c/<step>                          -> CheckpointManifest
// (integers big-endian with the sign bit flipped, so keys sort numerically). A checkpoint's
// manifest and the index entries of the versions it introduced are written in one WriteBatch with
// a synced WAL, after their extents were written and fdatasync'ed: a crash leaves either the whole
// checkpoint or none of it. Bulk bytes never go through RocksDB.
//
// Thread-safe (RocksDB is): any thread may call any method, also at once. Results are returned by
// value; the index owns its RocksDB handle and closes it on destruction.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "proto/storage.pb.h"

namespace rocksdb {
class DB;
}

namespace strata::checkpoint {

using storage::CheckpointManifest;
using storage::TensorRef;

// What to do about a checkpoint list that cannot be trusted, for every message that reports one.
inline constexpr char kDamagedIndexRemedy[] =
    "nothing was changed. Restore the checkpoint folder from a copy, or train afresh with "
    "`strata train --start-over`, which moves the folder's contents aside";

class TensorIndex {
 public:
  // Opens the index in `dir` (RocksDB). When it does not exist: creates it if `create`, else
  // NOT_FOUND saying so. A damaged index is DATA_LOSS with RocksDB's reason; damage in the
  // write-ahead log other than a record torn at its end by a crash is reported as such, naming the
  // log file.
  [[nodiscard]] static StatusOr<std::unique_ptr<TensorIndex>> Open(const std::string& dir,
                                                                   bool create);
  // Whether `dir` holds an index (RocksDB's CURRENT file).
  static bool Exists(const std::string& dir);
  // Read-only, without RocksDB's lock: for listing and verifying while a training process holds
  // the index. It sees the index as it was when opened; its writing calls fail (INTERNAL, RocksDB's
  // "Not supported").
  [[nodiscard]] static StatusOr<std::unique_ptr<TensorIndex>> OpenReadOnly(const std::string& dir);
  ~TensorIndex();

  // Commits a checkpoint: the index entries of `new_versions` and the manifest, atomically, synced.
  [[nodiscard]] Status CommitCheckpoint(const CheckpointManifest& manifest,
                                        const std::vector<TensorRef>& new_versions);
  // Removes a checkpoint's manifest and the index entries of `unreferenced` (versions no other
  // checkpoint uses), atomically, synced.
  [[nodiscard]] Status RemoveCheckpoint(int64_t step, const std::vector<TensorRef>& unreferenced);
  // Every manifest, by increasing step.
  [[nodiscard]] StatusOr<std::vector<CheckpointManifest>> Checkpoints() const;
  // Every tensor-version entry (for rebuilding the SSD tier's allocation map).
  [[nodiscard]] StatusOr<std::vector<TensorRef>> TensorVersions() const;
  // Removes tensor-version entries (garbage left by an interrupted process).
  [[nodiscard]] Status RemoveVersions(const std::vector<TensorRef>& refs);

  static std::string TensorKey(const TensorRef& ref);
  const std::string& dir() const { return dir_; }

 private:
  TensorIndex() = default;
  std::string dir_;
  std::unique_ptr<rocksdb::DB> db_;
};

}  // namespace strata::checkpoint
