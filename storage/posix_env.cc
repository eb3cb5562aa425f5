#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "storage/env.h"

namespace strata::storage {
namespace {

Status IoError(const std::string& what, const std::string& path, int err) {
  std::string msg = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(absl::StrCat(msg, "; free space on that disk"));
    default:
      return absl::InternalError(msg);
  }
}

class MappedRegion : public ReadOnlyRegion {
 public:
  MappedRegion(void* addr, size_t size) : addr_(addr), size_(size) {}
  ~MappedRegion() override {
    if (addr_ != nullptr) munmap(addr_, size_);
  }
  const uint8_t* data() const override { return static_cast<const uint8_t*>(addr_); }
  size_t size() const override { return size_; }

 private:
  void* addr_;
  size_t size_;
};

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) (void)Close();
  }
  Status Append(std::string_view data) override {
    buf_.append(data);
    if (buf_.size() >= (1 << 16)) return Flush();
    return absl::OkStatus();
  }
  Status Flush() override {
    size_t off = 0;
    while (off < buf_.size()) {
      ssize_t n = ::write(fd_, buf_.data() + off, buf_.size() - off);
      if (n < 0) {
        if (errno == EINTR) continue;
        return IoError("cannot write", path_, errno);
      }
      off += static_cast<size_t>(n);
    }
    buf_.clear();
    return absl::OkStatus();
  }
  Status Sync() override {
    RETURN_IF_ERROR(Flush());
    if (::fdatasync(fd_) != 0) return IoError("cannot sync", path_, errno);
    return absl::OkStatus();
  }
  Status Close() override {
    if (fd_ < 0) return absl::OkStatus();
    Status s = Flush();
    if (::close(fd_) != 0 && s.ok()) s = IoError("cannot close", path_, errno);
    fd_ = -1;
    return s;
  }

 private:
  std::string path_;
  int fd_;
  std::string buf_;
};

class PosixEnv : public Env {
 public:
  StatusOr<std::unique_ptr<ReadOnlyRegion>> MapReadOnly(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return IoError("cannot open", path, errno);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      return IoError("cannot stat", path, err);
    }
    size_t size = static_cast<size_t>(st.st_size);
    void* addr = nullptr;
    if (size > 0) {
      addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (addr == MAP_FAILED) {
        int err = errno;
        ::close(fd);
        return IoError("cannot map", path, err);
      }
    }
    ::close(fd);
    return std::unique_ptr<ReadOnlyRegion>(new MappedRegion(addr, size));
  }

  StatusOr<std::unique_ptr<WritableFile>> OpenWritable(const std::string& path,
                                                       bool truncate) override {
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (truncate ? O_TRUNC : O_APPEND);
    int fd = ::open(path.c_str(), flags, 0644);
    if (fd < 0) return IoError("cannot open for writing", path, errno);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(path, fd));
  }

  Status WriteFileAtomic(const std::string& path, std::string_view data) override {
    // A temporary of its own for every call (process id and a counter), so that threads replacing
    // the same path at once never write into one file: the last rename wins, whole.
    static std::atomic<uint64_t> calls{0};
    std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", calls.fetch_add(1));
    {
      ASSIGN_OR_RETURN(auto file, OpenWritable(tmp, /*truncate=*/true));
      Status s = file->Append(data);
      if (s.ok()) s = file->Sync();
      if (s.ok()) s = file->Close();
      if (!s.ok()) {
        ::unlink(tmp.c_str());
        return s;
      }
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      return IoError("cannot rename into", path, err);
    }
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    return SyncDir(parent.empty() ? std::string(".") : parent.string());
  }

  StatusOr<std::string> ReadFile(const std::string& path) override {
    ASSIGN_OR_RETURN(auto region, MapReadOnly(path));
    return std::string(reinterpret_cast<const char*>(region->data()), region->size());
  }

  StatusOr<uint64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return IoError("cannot stat", path, errno);
    return static_cast<uint64_t>(st.st_size);
  }

  bool FileExists(const std::string& path) override { return ::access(path.c_str(), F_OK) == 0; }

  Status CreateDirs(const std::string& path) override {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) return IoError("cannot create folder", path, ec.value());
    return absl::OkStatus();
  }

  Status DeleteFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return IoError("cannot remove", path, errno);
    return absl::OkStatus();
  }

  StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return IoError("cannot list folder", path, errno);
    std::vector<std::string> names;
    // readdir returns null both at the end and on an error; only errno tells them apart.
    for (;;) {
      errno = 0;
      const struct dirent* e = ::readdir(d);
      if (e == nullptr) break;
      const std::string_view name = e->d_name;
      if (name != "." && name != "..") names.emplace_back(name);
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) return IoError("cannot list folder", path, err);
    std::sort(names.begin(), names.end());
    return names;
  }

  Status SyncDir(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return IoError("cannot open folder", path, errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return IoError("cannot sync folder", path, err);
    return absl::OkStatus();
  }
};

}  // namespace

Env* Env::Default() {
  static PosixEnv* env = new PosixEnv;
  return env;
}

}  // namespace strata::storage
