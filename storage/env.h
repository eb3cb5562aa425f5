// Env: every file-system call strata makes goes through this seam (after LevelDB's Env).
//
// Why a seam: storage code must be testable against faults it cannot provoke on a healthy disk
// (a failed write, a sync that never happened, a full device). Tests wrap the POSIX Env in one
// that injects such faults; production uses Env::Default(). Every error is a Status that names the
// path and the system error, so a user sees which file and why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "core/common/status.h"

namespace strata::storage {

// A read-only view of a whole file (memory-mapped by the POSIX Env). Valid until destroyed.
class ReadOnlyRegion {
 public:
  virtual ~ReadOnlyRegion() = default;
  virtual const uint8_t* data() const = 0;
  virtual size_t size() const = 0;
};

// A file written sequentially. Not thread-safe.
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

  // The process-wide POSIX Env. Never null; thread-safe.
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
};

}  // namespace strata::storage
