#include "storage/block_io.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_format.h"
#include "core/common/logging.h"

namespace strata::storage {

Status IoErrnoStatus(int err, const char* op, const std::string& path, uint64_t offset) {
  std::string msg =
      absl::StrFormat("%s '%s' at offset %d: %s", op, path, offset, std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) {
    return absl::ResourceExhaustedError(
        absl::StrCat(msg,
                     "; the disk under the SSD tier is full: free space or point "
                     "storage.ssd_dir / --checkpoint-dir at a larger disk"));
  }
  if (err == EIO) return absl::DataLossError(msg);
  return absl::InternalError(msg);
}

namespace {

// One ring; used by one thread at a time.
class Ring {
 public:
  Ring(uint32_t depth, const std::vector<iovec>& regions, std::atomic<bool>* registered) {
    int r = io_uring_queue_init(depth, &ring_, 0);
    if (r < 0) {
      error_ = -r;
      return;
    }
    ok_ = true;
    if (!regions.empty() && *registered) {
      r = io_uring_register_buffers(&ring_, regions.data(), static_cast<unsigned>(regions.size()));
      if (r < 0) {
        STRATA_LOG(WARNING) << "io_uring could not register " << regions.size()
                            << " buffer region(s) (" << std::strerror(-r)
                            << "); the SSD tier falls back to unregistered I/O. Raise the "
                               "locked-memory limit (ulimit -l) to use registered buffers.";
        *registered = false;
      } else {
        registered_ = true;
      }
    }
  }
  ~Ring() {
    if (ok_) io_uring_queue_exit(&ring_);
  }
  bool ok() const { return ok_; }
  int error() const { return error_; }
  bool registered() const { return registered_; }
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
  bool ok_ = false;
  bool registered_ = false;
  int error_ = 0;
};

class UringIo : public BlockIo {
 public:
  explicit UringIo(const UringOptions& o) : options_(o) {}
  ~UringIo() override {
    std::lock_guard<std::mutex> lock(mu_);
    rings_.clear();
  }

  void RegisterRegions(const std::vector<iovec>& regions) override {
    std::lock_guard<std::mutex> lock(mu_);
    // io_uring takes fixed buffers of at most 1 GiB each: larger regions go in as several. A
    // request that straddles two of them is sent unregistered.
    constexpr size_t kMaxFixedBuffer = size_t{1} << 30;
    for (const iovec& r : regions) {
      for (size_t off = 0; off < r.iov_len; off += kMaxFixedBuffer) {
        regions_.push_back(iovec{static_cast<char*>(r.iov_base) + off,
                                 std::min(kMaxFixedBuffer, r.iov_len - off)});
      }
    }
    rings_.clear();  // rings register their regions on creation
  }

  bool registered() const override { return registered_; }

  using BlockIo::Run;
  Status Run(std::span<const IoRequest> requests, const RequestDone& done) override {
    return Run(requests, done, nullptr);
  }

  Status Run(std::span<const IoRequest> requests, const RequestDone& done,
             const RequestDone& sent) override {
    Ring* ring = nullptr;
    std::vector<iovec> regions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& slot = rings_[std::this_thread::get_id()];
      if (!slot) slot = std::make_unique<Ring>(options_.queue_depth, regions_, &registered_);
      ring = slot.get();
      regions = regions_;
    }
    if (!ring->ok()) {
      return absl::UnavailableError(absl::StrFormat(
          "io_uring is not available (%s): the SSD tier needs Linux 5.6+ with io_uring allowed",
          std::strerror(ring->error())));
    }
    // Pieces of at most block_bytes, submitted with at most queue_depth in flight.
    struct Piece {
      const IoRequest* req;
      uint64_t offset;
      char* buf;
      uint64_t length;
      bool last = false;  // the request's last piece, first time out (not a re-queued rest)
    };
    std::deque<Piece> pending;
    // Bytes of each request still to move; a failed request's count is set to UINT64_MAX.
    std::vector<uint64_t> remaining(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) remaining[i] = requests[i].length;
    for (const IoRequest& r : requests) {
      for (uint64_t done = 0; done < r.length; done += options_.block_bytes) {
        const uint64_t n = std::min<uint64_t>(options_.block_bytes, r.length - done);
        pending.push_back(
            Piece{&r, r.offset + done, static_cast<char*>(r.buf) + done, n, done + n == r.length});
      }
    }
    std::vector<Piece> slots(options_.queue_depth);
    std::vector<int> free_slots;
    for (int i = static_cast<int>(options_.queue_depth) - 1; i >= 0; --i) free_slots.push_back(i);
    Status first_error;
    uint32_t in_flight = 0;
    io_uring* ring_ptr = ring->get();
    // Requests whose last byte arrived, for `done`: handled after the queue was refilled, so the
    // device stays busy meanwhile.
    std::vector<size_t> finished;
    // Requests whose last piece went to the kernel in this round, for `sent`: handled after the
    // submit, while they are in flight.
    std::vector<size_t> submitted;
    auto run_callbacks = [](std::vector<size_t>& indices, const RequestDone& fn) -> Status {
      Status status;
      for (size_t i : indices) {
        if (Status s = fn(i); !s.ok() && status.ok()) status = s;
      }
      indices.clear();
      return status;
    };
    while (!pending.empty() || in_flight > 0) {
      uint32_t queued = 0;
      while (!pending.empty() && !free_slots.empty()) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring_ptr);
        if (sqe == nullptr) break;
        const int s = free_slots.back();
        free_slots.pop_back();
        slots[s] = pending.front();
        pending.pop_front();
        const Piece& p = slots[s];
        const int buf_index = ring->registered() ? RegionOf(regions, p.buf, p.length) : -1;
        if (p.req->write) {
          if (buf_index >= 0) {
            io_uring_prep_write_fixed(sqe, p.req->fd, p.buf, static_cast<unsigned>(p.length),
                                      p.offset, buf_index);
          } else {
            io_uring_prep_write(sqe, p.req->fd, p.buf, static_cast<unsigned>(p.length), p.offset);
          }
        } else {
          if (buf_index >= 0) {
            io_uring_prep_read_fixed(sqe, p.req->fd, p.buf, static_cast<unsigned>(p.length),
                                     p.offset, buf_index);
          } else {
            io_uring_prep_read(sqe, p.req->fd, p.buf, static_cast<unsigned>(p.length), p.offset);
          }
        }
        io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(s));
        if (p.last && sent) submitted.push_back(static_cast<size_t>(p.req - requests.data()));
        ++queued;
      }
      if (queued > 0) {
        int r = io_uring_submit(ring_ptr);
        if (r < 0) return IoErrnoStatus(-r, "io_uring submit", "(ring)", 0);
        in_flight += queued;
      }
      if (!submitted.empty()) {
        if (Status s = run_callbacks(submitted, sent); first_error.ok()) first_error = s;
      }
      if (!finished.empty()) {
        if (Status s = run_callbacks(finished, done); first_error.ok()) first_error = s;
      }
      if (in_flight == 0) continue;
      io_uring_cqe* cqe = nullptr;
      int r = io_uring_wait_cqe(ring_ptr, &cqe);
      if (r == -EINTR) continue;
      if (r < 0) return IoErrnoStatus(-r, "io_uring wait", "(ring)", 0);
      // Reap everything that is ready.
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(ring_ptr, head, cqe) {
        ++seen;
        --in_flight;
        const int s = static_cast<int>(io_uring_cqe_get_data64(cqe));
        Piece p = slots[s];
        free_slots.push_back(s);
        const int res = cqe->res;
        const std::string& path = p.req->path ? *p.req->path : kUnknownPath;
        const size_t index = static_cast<size_t>(p.req - requests.data());
        if (res == -EAGAIN || res == -EINTR) {
          p.last = false;         // `sent` already ran for it
          pending.push_front(p);  // try the same piece again
        } else if (res < 0) {
          remaining[index] = UINT64_MAX;
          if (first_error.ok()) {
            first_error = IoErrnoStatus(-res, p.req->write ? "write" : "read", path, p.offset);
          }
        } else if (res == 0 && p.length > 0) {
          remaining[index] = UINT64_MAX;
          if (first_error.ok()) {
            first_error = absl::DataLossError(absl::StrFormat(
                "%s '%s' at offset %d returned no bytes: the file is shorter than the index says",
                p.req->write ? "write" : "read", path, p.offset));
          }
        } else {
          if (static_cast<uint64_t>(res) < p.length) {
            // Short transfer: queue the rest from where it stopped.
            pending.push_front(Piece{p.req, p.offset + static_cast<uint64_t>(res), p.buf + res,
                                     p.length - static_cast<uint64_t>(res), false});
          }
          if (remaining[index] != UINT64_MAX) {
            remaining[index] -= static_cast<uint64_t>(res);
            if (remaining[index] == 0 && done) finished.push_back(index);
          }
        }
      }
      io_uring_cq_advance(ring_ptr, seen);
    }
    if (Status s = run_callbacks(finished, done); first_error.ok()) first_error = s;
    return first_error;
  }

  Status Allocate(int fd, uint64_t offset, uint64_t length, const std::string& path) override {
    int r = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(length));
    if (r != 0) return IoErrnoStatus(r, "fallocate", path, offset);
    return absl::OkStatus();
  }

  Status Sync(int fd, const std::string& path) override {
    if (fdatasync(fd) != 0) return IoErrnoStatus(errno, "fdatasync", path, 0);
    return absl::OkStatus();
  }

 private:
  static inline const std::string kUnknownPath = "(file)";

  // The registered region holding [buf, buf + len), or -1.
  static int RegionOf(const std::vector<iovec>& regions, const char* buf, uint64_t len) {
    for (size_t i = 0; i < regions.size(); ++i) {
      const char* base = static_cast<const char*>(regions[i].iov_base);
      if (buf >= base && buf + len <= base + regions[i].iov_len) return static_cast<int>(i);
    }
    return -1;
  }

  UringOptions options_;
  std::mutex mu_;
  std::vector<iovec> regions_;
  // Becomes false when a registration fails (in a Run, under mu_); registered() reads it from any
  // thread without the lock.
  std::atomic<bool> registered_{true};
  std::unordered_map<std::thread::id, std::unique_ptr<Ring>> rings_;
};

}  // namespace

StatusOr<std::unique_ptr<BlockIo>> MakeUringIo(const UringOptions& options) {
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError("storage.io_queue_depth must be in [1, 4096]");
  }
  if (options.block_bytes < 4096 || options.block_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(
        "storage.io_block_bytes must be a positive multiple of 4096 (O_DIRECT alignment)");
  }
  // Probe once so a kernel without io_uring is reported before any state is touched.
  io_uring probe;
  int r = io_uring_queue_init(2, &probe, 0);
  if (r < 0) {
    return absl::UnavailableError(absl::StrFormat(
        "io_uring is not available (%s): the SSD tier needs Linux 5.6+ with io_uring allowed "
        "(check /proc/sys/kernel/io_uring_disabled and the container's seccomp profile)",
        std::strerror(-r)));
  }
  io_uring_queue_exit(&probe);
  return std::unique_ptr<BlockIo>(new UringIo(options));
}

namespace {

// Counts `n` more bytes in `used` unless that would pass `budget` (negative: unlimited). Check and
// count are one atomic step, so calls racing on several threads never pass the budget together.
bool TakeFromBudget(std::atomic<int64_t>& used, int64_t budget, int64_t n) {
  int64_t now = used.load();
  do {
    if (budget >= 0 && now + n > budget) return false;
  } while (!used.compare_exchange_weak(now, now + n));
  return true;
}

}  // namespace

Status BlockIo::Run(std::span<const IoRequest> requests, const RequestDone& done,
                    const RequestDone& sent) {
  if (sent) {
    for (size_t i = 0; i < requests.size(); ++i) RETURN_IF_ERROR(sent(i));
  }
  return Run(requests, done);
}

Status FaultInjectingIo::Run(std::span<const IoRequest> requests, const RequestDone& done) {
  return Run(requests, done, nullptr);
}

Status FaultInjectingIo::Run(std::span<const IoRequest> requests, const RequestDone& done,
                             const RequestDone& sent) {
  int64_t bytes = 0;
  const IoRequest* first_write = nullptr;
  for (const IoRequest& r : requests) {
    if (r.write) {
      bytes += static_cast<int64_t>(r.length);
      if (first_write == nullptr) first_write = &r;
    }
  }
  if (first_write != nullptr && !TakeFromBudget(written_, write_budget_.load(), bytes)) {
    return IoErrnoStatus(ENOSPC, "write", first_write->path ? *first_write->path : "(file)",
                         first_write->offset);
  }
  return base_->Run(requests, done, sent);
}

Status FaultInjectingIo::Allocate(int fd, uint64_t offset, uint64_t length,
                                  const std::string& path) {
  if (!TakeFromBudget(allocated_, allocate_budget_.load(), static_cast<int64_t>(length))) {
    return IoErrnoStatus(ENOSPC, "fallocate", path, offset);
  }
  return base_->Allocate(fd, offset, length, path);
}

}  // namespace strata::storage
