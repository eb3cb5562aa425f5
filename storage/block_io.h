// BlockIo: how the SSD tier moves bytes between its files and memory.
//
// UringIo is the real one: io_uring, one ring per calling thread (so stage threads never contend
// for a ring), requests split into `block_bytes` pieces with up to `queue_depth` in flight, and
// buffers inside registered regions submitted as READ_FIXED / WRITE_FIXED so the kernel does not
// map them per request. Run tells its caller when a request has gone to the kernel (`sent`) and
// when its last byte has arrived (`done`), so that checksums overlap the transfers: the SSD tier
// computes a write's CRC while it is in flight and checks a read's as soon as it lands. On a
// 2-core VM, CRCs computed before a batch of writes cost a fifth of its time.
//
// What can go wrong, and what is done about it:
//   - a short read or write (res < requested, e.g. at a page-cache boundary or under memory
//     pressure): the rest is queued again from where it stopped;
//   - -EAGAIN / -EINTR: the piece is queued again as it was;
//   - a read that returns 0 bytes before the end: the file is shorter than the index says —
//     DATA_LOSS naming the file and offset;
//   - any other error: the errno becomes a Status naming the operation, file and offset
//     (-ENOSPC becomes RESOURCE_EXHAUSTED).
// O_DIRECT needs buffers, offsets and lengths aligned to 4 KiB; the SSD tier guarantees that.
//
// FaultInjectingIo wraps another BlockIo and fails on purpose (a full disk after N bytes), for the
// fault tests; it is part of the product so that operators can rehearse failures too.
//
// Threads: Run, Allocate and Sync may be called from several threads at once (UringIo keeps one
// ring per calling thread, made on its first Run and kept until the BlockIo is destroyed or
// RegisterRegions is called). RegisterRegions must not run while any Run is in flight: it drops
// every thread's ring. A Run borrows its requests, their buffers and paths until it returns.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::storage {

struct IoRequest {
  int fd = -1;
  uint64_t offset = 0;
  void* buf = nullptr;
  uint64_t length = 0;
  bool write = false;
  const std::string* path = nullptr;  // for error messages
};

class BlockIo {
 public:
  virtual ~BlockIo() = default;
  // Memory that will be used for I/O; implementations may register it with the kernel. Call before
  // the first Run; may be called again to add regions, but never while a Run is in flight. The
  // regions stay registered for the life of the BlockIo (there is no unregister): keep them mapped
  // as long as it runs I/O, since a buffer at an address of a freed region would be sent as a fixed
  // buffer of the stale registration.
  virtual void RegisterRegions(const std::vector<iovec>& regions) = 0;
  // Called on the thread inside Run as soon as every byte of requests[index] has been transferred,
  // while later requests may still be in flight (so checking one extent overlaps reading the
  // next). Not called for a request that failed. An error it returns becomes Run's result.
  using RequestDone = std::function<Status(size_t index)>;
  // Performs all requests, waiting for all of them; the first error is returned (the others still
  // complete). Exception: when the ring itself fails (io_uring_submit or io_uring_wait_cqe returns
  // an error) UringIo returns that error at once, with pieces possibly still in flight.
  [[nodiscard]] virtual Status Run(std::span<const IoRequest> requests,
                                   const RequestDone& done) = 0;
  [[nodiscard]] Status Run(std::span<const IoRequest> requests) { return Run(requests, nullptr); }
  // As Run(requests, done), and `sent` is called on the same thread once every piece of
  // requests[index] has been handed to the kernel, while it is in flight, so that work which only
  // reads a write's buffer (its checksum) overlaps the transfer instead of preceding it. The
  // buffer must not be written until Run returns. An error `sent` returns becomes Run's result.
  // This default, for a BlockIo that cannot overlap, calls `sent` for every request first.
  [[nodiscard]] virtual Status Run(std::span<const IoRequest> requests, const RequestDone& done,
                                   const RequestDone& sent);
  // Reserves [offset, offset + length) of a file on disk (posix_fallocate).
  [[nodiscard]] virtual Status Allocate(int fd, uint64_t offset, uint64_t length,
                                        const std::string& path) = 0;
  // fdatasync.
  [[nodiscard]] virtual Status Sync(int fd, const std::string& path) = 0;
  // Whether registered (fixed) buffers are in use; false after a failed registration. Any thread,
  // also while Runs are in flight.
  virtual bool registered() const = 0;
};

struct UringOptions {
  uint32_t queue_depth = 32;
  uint64_t block_bytes = 1 << 20;
};

// Fails with UNAVAILABLE when the kernel refuses io_uring (e.g. a seccomp filter).
[[nodiscard]] StatusOr<std::unique_ptr<BlockIo>> MakeUringIo(const UringOptions& options);

// Passes everything through to `base` until `write_budget` bytes were written (or an Allocate would
// pass allocate_budget bytes), then fails those with ENOSPC, as a full disk does. Owns `base`. The
// budgets are atomics, so they may be set from any thread; a call is checked against its budget
// and counted in one atomic step, so calls racing on several threads never pass it together.
class FaultInjectingIo : public BlockIo {
 public:
  explicit FaultInjectingIo(std::unique_ptr<BlockIo> base) : base_(std::move(base)) {}
  void set_write_budget(int64_t bytes) { write_budget_ = bytes; }
  void set_allocate_budget(int64_t bytes) { allocate_budget_ = bytes; }
  int64_t bytes_written() const { return written_.load(); }

  void RegisterRegions(const std::vector<iovec>& regions) override {
    base_->RegisterRegions(regions);
  }
  using BlockIo::Run;
  Status Run(std::span<const IoRequest> requests, const RequestDone& done) override;
  Status Run(std::span<const IoRequest> requests, const RequestDone& done,
             const RequestDone& sent) override;
  Status Allocate(int fd, uint64_t offset, uint64_t length, const std::string& path) override;
  Status Sync(int fd, const std::string& path) override { return base_->Sync(fd, path); }
  bool registered() const override { return base_->registered(); }

 private:
  std::unique_ptr<BlockIo> base_;
  std::atomic<int64_t> write_budget_{-1};  // -1: unlimited
  std::atomic<int64_t> allocate_budget_{-1};
  std::atomic<int64_t> written_{0};
  std::atomic<int64_t> allocated_{0};
};

// A Status for an errno from `op` on `path` at `offset`.
Status IoErrnoStatus(int err, const char* op, const std::string& path, uint64_t offset);

}  // namespace strata::storage
