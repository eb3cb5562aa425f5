#include "storage/private_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "core/common/bytes.h"
#include "core/common/logging.h"

namespace strata::storage {
namespace {

constexpr char kLockFile[] = "/lock";
constexpr char kHint[] = "point storage.ssd_dir (or TMPDIR) at a local, writable folder";

// The process id in `<prefix><pid>-<rest>`, or 0 for any other name (`<prefix>new-<pid>-...`
// while it is being made, `<prefix>XXXXXX` of older releases).
int PidOf(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return 0;
  const std::string rest = name.substr(prefix.size());
  const size_t dash = rest.find('-');
  if (dash == std::string::npos || dash == 0 || dash + 1 == rest.size()) return 0;
  const std::string digits = rest.substr(0, dash);
  if (!std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); })) {
    return 0;
  }
  int pid = 0;
  return absl::SimpleAtoi(digits, &pid) && pid > 0 ? pid : 0;
}

// Disk space taken by the files under `dir` (their allocated blocks: the SSD tier's data files
// are grown ahead of their contents).
uint64_t AllocatedBytes(const std::filesystem::path& dir) {
  uint64_t bytes = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(
           dir, std::filesystem::directory_options::skip_permission_denied, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st;
    if (::lstat(it->path().c_str(), &st) == 0) bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return bytes;
}

}  // namespace

std::vector<PrivateFolder::Swept> PrivateFolder::RemoveAbandoned(const std::string& parent,
                                                                 const std::string& prefix,
                                                                 const std::string& what) {
  std::vector<Swept> swept;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    const int pid = PidOf(entry.path().filename().string(), prefix);
    if (pid == 0) continue;
    std::error_code type_ec;
    if (!entry.is_directory(type_ec) || entry.is_symlink(type_ec)) continue;
    const std::string lock = entry.path().string() + kLockFile;
    // Held until the folder is gone, so that two sweeps do not both count it.
    const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        ::close(fd);
        continue;  // its process is alive, in whatever PID namespace
      }
    } else if (errno != ENOENT || kill(pid, 0) == 0 || errno != ESRCH) {
      // No lock file: alive by its process id (or not ours to judge). A lock file that cannot
      // be opened (no descriptors, no permission) says nothing: keep the folder.
      continue;
    }
    Swept s{pid, entry.path().string(), AllocatedBytes(entry.path())};
    std::error_code removed;
    std::filesystem::remove_all(entry.path(), removed);
    if (fd >= 0) ::close(fd);
    if (removed) {
      STRATA_LOG(WARNING) << "cannot remove " << s.path << ", " << what << " of process " << pid
                          << " (gone): " << removed.message();
      continue;
    }
    STRATA_LOG(INFO) << "removed " << what << " of process " << pid << " (gone) in " << s.path
                     << ", freeing " << FormatBytes(s.bytes);
    swept.push_back(std::move(s));
  }
  return swept;
}

StatusOr<std::unique_ptr<PrivateFolder>> PrivateFolder::Create(const std::string& parent,
                                                               const std::string& prefix,
                                                               const std::string& what) {
  if (parent.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a folder for %s needs a parent folder; %s", what, kHint));
  }
  std::unique_ptr<PrivateFolder> f(new PrivateFolder);
  f->swept_ = RemoveAbandoned(parent, prefix, what);
  // Made under a name the sweep skips (no process id after the prefix), locked, and only then
  // given its name: a sweep elsewhere never sees it unlocked. From here on, an error leaves
  // nothing behind: the destructor removes whatever path_ names.
  const std::string tmpl = absl::StrFormat("%s/%snew-%d-XXXXXX", parent, prefix, getpid());
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot create a folder for %s in '%s' (as '%s'): %s; %s", what, parent,
                        tmpl, std::strerror(errno), kHint));
  }
  f->path_ = buf.data();
  f->lock_fd_ = ::open((f->path_ + kLockFile).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (f->lock_fd_ < 0 || flock(f->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat("cannot lock '%s%s' for %s: %s; %s",
                                                       f->path_, kLockFile, what,
                                                       std::strerror(errno), kHint));
  }
  const std::string named =
      absl::StrFormat("%s/%s%d-%s", parent, prefix, getpid(), f->path_.substr(f->path_.size() - 6));
  if (std::rename(f->path_.c_str(), named.c_str()) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat("cannot rename '%s' to '%s' for %s: %s; %s",
                                                       f->path_, named, what, std::strerror(errno),
                                                       kHint));
  }
  f->path_ = named;
  return f;
}

PrivateFolder::~PrivateFolder() {
  // Removed while still locked, so that no sweep elsewhere counts or removes it half-removed.
  if (!path_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

}  // namespace strata::storage
