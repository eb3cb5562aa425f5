// PrivateFolder: a folder of one process's own under a shared parent (/tmp, storage.ssd_dir),
// removed with the object, and removed by the next one made beside it when its process was
// killed before it could remove it (SIGKILL, an uncaught SIGTERM, a crash).
//
// Its name is `<prefix><pid>-XXXXXX`, and for its whole life the process holds an exclusive
// flock on `<folder>/lock`. Create first sweeps the parent: a folder whose name is `<prefix>`,
// a process id, '-' and more, and whose lock file nobody holds, belongs to no live process and
// goes, with a log line naming what it held (`what`), the process id, the path and the bytes it
// freed. A live folder is never swept, also by a process in another PID namespace (a container)
// sharing the parent, where its process id means nothing: the flock is held by an open file of a
// live process, whatever namespace it is in, and it goes with that process (a kill -9 too). A new
// folder is made as `<prefix>new-<pid>-XXXXXX` — a name the sweep skips, since no process id
// follows the prefix — locked, and only then renamed, so no sweep ever sees it unlocked. A folder
// without a lock file (made before folders took locks) is judged by the process id in its name,
// which is right only within one PID namespace. Anything else under the parent that starts with
// the prefix (a name without a process id, such as the `<prefix>XXXXXX` of older releases) is left
// alone: whether a process still has files open in it cannot be known cheaply.
//
// The flock protects against the sweep only: it needs a file system with working flock (local
// disks, tmpfs; not every network file system). Nothing of the folder is meant to outlive the
// process.
//
// Ownership and threads: the object owns the folder, everything in it, and the lock's file
// descriptor; whoever puts files in the folder must close them before the object goes. Create may
// be called from any thread (also several at once, in one or several processes, under one
// parent); one object is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::storage {

class PrivateFolder {
 public:
  // A folder a sweep removed.
  struct Swept {
    int pid = 0;  // of the process that made it (per its name)
    std::string path;
    uint64_t bytes = 0;  // disk space its files took (allocated blocks)
  };

  // Sweeps `parent` (RemoveAbandoned), then makes, locks and names a folder of this process in it.
  // `parent` must exist. `prefix` ends in '-' ("strata-ssd-"); `what` names the folder's contents
  // in messages ("the SSD tier"). PERMISSION_DENIED, naming the folder, the errno text and what to
  // do, when the folder cannot be made, locked or named; INVALID_ARGUMENT for an empty parent.
  [[nodiscard]] static StatusOr<std::unique_ptr<PrivateFolder>> Create(const std::string& parent,
                                                                       const std::string& prefix,
                                                                       const std::string& what);
  // Removes the folder and everything in it, then releases the lock.
  ~PrivateFolder();
  PrivateFolder(const PrivateFolder&) = delete;
  PrivateFolder& operator=(const PrivateFolder&) = delete;

  // Removes the folders named `<prefix><pid>-...` under `parent` that no live process holds (see
  // above), logging each one; returns them. A parent that cannot be read sweeps nothing.
  static std::vector<Swept> RemoveAbandoned(const std::string& parent, const std::string& prefix,
                                            const std::string& what);

  const std::string& path() const { return path_; }
  // What the sweep run by Create removed.
  const std::vector<Swept>& swept() const { return swept_; }

 private:
  PrivateFolder() = default;

  std::string path_;
  int lock_fd_ = -1;  // holds an exclusive flock on path_/lock for the object's life
  std::vector<Swept> swept_;
};

}  // namespace strata::storage
