// Env: the seam for strata's whole-file work (after LevelDB's Env): mapping the token file, the
// metrics log, the checkpoint ledger, the global manifests of sharded checkpoints and the folders
// that hold them. The SSD tier's data files go through BlockIo (block_io.h)
// and its index through RocksDB instead; neither uses this seam.
//
// Why a seam: storage code must be testable against faults it cannot provoke on a healthy disk
// (a failed write, a sync that never happened, a full device). An Env that injects such faults
// can wrap the POSIX one (the SSD tier's fault tests inject at BlockIo, with FaultInjectingIo);
// production uses Env::Default(). Every error is a Status that names the path and the system
// error, so a user sees which file and why.
//
// Ownership and threads: an Env is safe for concurrent use by multiple threads, also when two of
// them WriteFileAtomic the same path at once (one of the two contents wins, whole: the POSIX Env
// gives every call its own temporary, path.tmp.<pid>.<n>). The caller owns the region and file it
// returns; they do not refer back to the Env. A region may be read from any number of threads at
// once; a WritableFile is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/status.h"

namespace strata::storage {

// A read-only view of a whole file (memory-mapped by the POSIX Env). data() is valid until the
// region is destroyed; any thread may read it.
class ReadOnlyRegion {
 public:
  virtual ~ReadOnlyRegion() = default;
  virtual const uint8_t* data() const = 0;
  virtual size_t size() const = 0;
};

// A file written sequentially. Not thread-safe. Destroying it closes it (after a Flush) and drops
// any error: call Close to see one.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  [[nodiscard]] virtual Status Append(std::string_view data) = 0;
  // Hands buffered bytes to the OS (they survive a crash of this process, not of the machine).
  [[nodiscard]] virtual Status Flush() = 0;
  // Flush, then fdatasync (they survive a crash of the machine).
  [[nodiscard]] virtual Status Sync() = 0;
  [[nodiscard]] virtual Status Close() = 0;
};

class Env {
 public:
  virtual ~Env() = default;

  // The process-wide POSIX Env. Never null, never deleted; thread-safe.
  static Env* Default();

  [[nodiscard]] virtual StatusOr<std::unique_ptr<ReadOnlyRegion>> MapReadOnly(
      const std::string& path) = 0;
  // Creates (or truncates, when `truncate`) a file for appending.
  [[nodiscard]] virtual StatusOr<std::unique_ptr<WritableFile>> OpenWritable(
      const std::string& path, bool truncate) = 0;
  // Replaces `path` with `data` atomically: a reader sees the old or the new contents, never a
  // mix, also after a crash (write to a temporary, fdatasync, rename, fsync the folder).
  [[nodiscard]] virtual Status WriteFileAtomic(const std::string& path, std::string_view data) = 0;
  [[nodiscard]] virtual StatusOr<std::string> ReadFile(const std::string& path) = 0;
  [[nodiscard]] virtual StatusOr<uint64_t> FileSize(const std::string& path) = 0;
  virtual bool FileExists(const std::string& path) = 0;
  [[nodiscard]] virtual Status CreateDirs(const std::string& path) = 0;
  // Removes the file `path` (not a folder). NOT_FOUND naming the path when there is none, so a
  // caller that finishes an interrupted removal tests absl::IsNotFound and goes on. The removal
  // survives a crash of the machine only after a SyncDir of the folder that held it.
  [[nodiscard]] virtual Status DeleteFile(const std::string& path) = 0;
  // The names in the folder `path` (files, folders, anything but "." and ".."), sorted bytewise.
  // NOT_FOUND naming the path when the folder is missing; any other failure (not a folder, no
  // permission, an error while reading it) is an error too, never a shorter list.
  [[nodiscard]] virtual StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;
  // fsync of the folder `path`: the creates, renames and removals in it survive a crash of the
  // machine.
  [[nodiscard]] virtual Status SyncDir(const std::string& path) = 0;
};

}  // namespace strata::storage
