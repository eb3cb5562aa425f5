#include "storage/ssd_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_format.h"
#include "core/common/clock.h"
#include "core/common/logging.h"
#include "storage/crc32c.h"
#include "storage/io_memory.h"

namespace strata::storage {
namespace {

std::string DataFileName(const std::string& dir, uint32_t file) {
  return absl::StrFormat("%s/data-%05d.bin", dir, file);
}

}  // namespace

SsdTier::SsdTier(SsdOptions options, std::unique_ptr<BlockIo> io)
    : options_(std::move(options)),
      io_(std::move(io)),
      alloc_(kSsdGranule, options_.file_bytes, options_.capacity_bytes, options_.grow_bytes) {}

SsdTier::~SsdTier() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdOptions& options,
                                                 std::unique_ptr<BlockIo> io) {
  if (options.file_bytes < kSsdGranule) {
    return absl::InvalidArgumentError("storage.ssd_file_bytes must be at least 4096");
  }
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot create the SSD tier folder '%s': %s", options.dir, ec.message()));
  }
  std::unique_ptr<SsdTier> t(new SsdTier(options, std::move(io)));
  std::lock_guard<std::mutex> lock(t->mu_);
  for (uint32_t f = 0;; ++f) {
    const std::string path = DataFileName(options.dir, f);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) break;
    RETURN_IF_ERROR(t->OpenFileLocked(f));
    t->alloc_.AdoptFile(f, static_cast<uint64_t>(st.st_size));
  }
  return t;
}

Status SsdTier::OpenFileLocked(uint32_t file) {
  while (fds_.size() <= file) {
    fds_.push_back(-1);
    paths_.push_back(DataFileName(options_.dir, static_cast<uint32_t>(paths_.size())));
  }
  if (fds_[file] >= 0) return absl::OkStatus();
  int fd = ::open(paths_[file].c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EINVAL) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "'%s': the file system under the SSD tier does not support O_DIRECT (tmpfs does not); "
        "point storage.ssd_dir / --checkpoint-dir at a disk-backed folder",
        paths_[file]));
  }
  if (fd < 0) return IoErrnoStatus(errno, "open", paths_[file], 0);
  fds_[file] = fd;
  return absl::OkStatus();
}

StatusOr<Extent> SsdTier::AllocateLocked(uint64_t bytes) {
  ExtentAllocator::Growth grow;
  ASSIGN_OR_RETURN(Extent e, alloc_.Allocate(bytes, &grow));
  if (grow.needed) {
    Status s = OpenFileLocked(grow.file);
    const uint64_t old = alloc_.file_size(grow.file);
    if (s.ok()) s = io_->Allocate(fds_[grow.file], old, grow.new_size - old, paths_[grow.file]);
    if (!s.ok()) {
      alloc_.AbortGrowth(grow, e);
      return s;
    }
    alloc_.CommitGrowth(grow);
  }
  return e;
}

Status SsdTier::WriteMany(std::span<const WriteItem> items) {
  std::vector<IoRequest> reqs;
  std::vector<Extent> allocated;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const WriteItem& it : items) {
      auto e = AllocateLocked(it.bytes);
      if (!e.ok()) {
        for (const Extent& a : allocated) alloc_.Release(a);
        return e.status();
      }
      allocated.push_back(*e);
      reqs.push_back(IoRequest{fds_[e->file], e->offset, const_cast<void*>(it.buf), e->length, true,
                               &paths_[e->file]});
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    // Zero the padding so the bytes on disk are deterministic.
    char* base = static_cast<char*>(const_cast<void*>(items[i].buf));
    std::memset(base + items[i].bytes, 0, allocated[i].length - items[i].bytes);
  }
  // Each extent's CRC is computed once its last piece is on its way to the disk, while it and
  // the others are in flight (both only read the buffer), not before the first byte moves.
  auto checksum = [&](size_t i) -> Status {
    *items[i].out =
        StoredExtent{allocated[i], items[i].bytes, Crc32c(items[i].buf, items[i].bytes)};
    return absl::OkStatus();
  };
  Stopwatch w;
  Status s = io_->Run(reqs, nullptr, checksum);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s.ok()) {
    for (const Extent& a : allocated) alloc_.Release(a);
    return s;
  }
  for (const Extent& a : allocated) {
    unsynced_.insert(a.file);
    stats_.bytes_written += a.length;
  }
  stats_.writes += items.size();
  stats_.write_seconds += w.Seconds();
  return absl::OkStatus();
}

StatusOr<StoredExtent> SsdTier::Write(const void* buf, uint64_t bytes) {
  StoredExtent out;
  WriteItem item{buf, bytes, &out};
  RETURN_IF_ERROR(WriteMany(std::span<const WriteItem>(&item, 1)));
  return out;
}

Status SsdTier::Read(const StoredExtent& e, void* buf, const std::string& what) {
  ReadItem item{&e, buf, &what};
  return ReadMany(std::span<const ReadItem>(&item, 1));
}

Status SsdTier::ReadMany(std::span<const ReadItem> items) {
  std::vector<IoRequest> reqs;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const ReadItem& it : items) {
      const Extent& x = it.stored->extent;
      if (x.file >= fds_.size() || fds_[x.file] < 0) {
        return absl::DataLossError(absl::StrFormat(
            "%s: the index points at SSD-tier file %d, which does not exist in '%s'", *it.what,
            x.file, options_.dir));
      }
      if (x.offset + x.length > alloc_.file_size(x.file)) {
        return absl::DataLossError(absl::StrFormat(
            "%s: the index places it at bytes [%d, %d) of '%s', which holds only %d bytes: the "
            "file is shorter than the index says (it was cut short)",
            *it.what, x.offset, x.offset + x.length, paths_[x.file], alloc_.file_size(x.file)));
      }
      reqs.push_back(IoRequest{fds_[x.file], x.offset, it.buf, x.length, false, &paths_[x.file]});
      bytes += x.length;
    }
  }
  // Each extent's CRC is checked as soon as its last byte arrives, while the rest are in flight.
  bool corrupt = false;  // the error is a CRC mismatch, already named
  auto check = [&](size_t i) -> Status {
    const ReadItem& it = items[i];
    const StoredExtent& e = *it.stored;
    const uint32_t crc = Crc32c(it.buf, e.bytes);
    if (crc == e.crc) return absl::OkStatus();
    corrupt = true;
    return absl::DataLossError(absl::StrFormat(
        "%s is corrupt: CRC-32C of %d bytes at offset %d of '%s' is %08x, the index recorded "
        "%08x; the SSD tier copy cannot be used (resume falls back to an earlier checkpoint; "
        "`strata ckpt verify` checks them all)",
        *it.what, e.bytes, e.extent.offset, FilePath(e.extent.file), crc, e.crc));
  };
  Stopwatch w;
  Status s = io_->Run(reqs, check);
  if (!s.ok()) {
    if (corrupt) return s;
    const std::string& what = items.size() == 1 ? *items[0].what : std::string("SSD-tier read");
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_read += bytes;
  stats_.reads += items.size();
  stats_.read_seconds += w.Seconds();
  return absl::OkStatus();
}

Status SsdTier::Verify(const StoredExtent& e, const std::string& what) {
  ASSIGN_OR_RETURN(IoBuffer buf, IoBuffer::Allocate(e.extent.length));
  return Read(e, buf.data(), what);
}

Status SsdTier::Sync() {
  std::set<uint32_t> files;
  // Each file's descriptor and name, taken under the lock: a stage thread may open a new file (and
  // grow fds_) while this thread syncs.
  std::vector<std::pair<int, const std::string*>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    files.swap(unsynced_);
    for (uint32_t f : files) targets.emplace_back(fds_[f], &paths_[f]);
  }
  for (const auto& [fd, path] : targets) {
    Status s = io_->Sync(fd, *path);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      unsynced_.insert(files.begin(), files.end());
      return s;
    }
  }
  return absl::OkStatus();
}

void SsdTier::Free(const Extent& e) {
  std::lock_guard<std::mutex> lock(mu_);
  alloc_.Release(e);
}

std::vector<std::string> SsdTier::DataFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (uint32_t f = 0;; ++f) {
    std::string path = DataFileName(dir, f);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) break;
    out.push_back(std::move(path));
  }
  return out;
}

bool SsdTier::InFiles(const Extent& e) const {
  std::lock_guard<std::mutex> lock(mu_);
  return e.offset + e.length <= alloc_.file_size(e.file);
}

Status SsdTier::MarkUsed(const Extent& e) {
  std::lock_guard<std::mutex> lock(mu_);
  return alloc_.MarkUsed(e);
}

std::string SsdTier::FilePath(uint32_t file) const {
  std::lock_guard<std::mutex> lock(mu_);
  return file < paths_.size() ? paths_[file] : DataFileName(options_.dir, file);
}

uint64_t SsdTier::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return alloc_.used_bytes();
}

SsdStats SsdTier::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace strata::storage
