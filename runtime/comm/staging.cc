#include "runtime/comm/staging.h"

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"

namespace strata::comm {
namespace {

// A pinned host buffer that grows (by half again, so that operations of varying size settle) to
// the largest size asked of it and is kept.
class HostBuffer {
 public:
  [[nodiscard]] StatusOr<char*> Get(size_t bytes) {
    if (buffer_ == nullptr || buffer_->bytes() < bytes) {
      const size_t have = buffer_ == nullptr ? 0 : buffer_->bytes();
      buffer_.reset();  // the old one goes before the new one is made
      ASSIGN_OR_RETURN(buffer_,
                       Buffer::AllocatePinned(std::max<size_t>({bytes, have + have / 2, 64})));
    }
    return static_cast<char*>(buffer_->data());
  }

 private:
  std::shared_ptr<Buffer> buffer_;
};

class StagingCommunicator : public Communicator {
 public:
  StagingCommunicator(std::unique_ptr<Communicator> host, Device device,
                      std::unique_ptr<CopyStream> stream, const StagingOptions& options)
      : host_(std::move(host)), device_(device), stream_(std::move(stream)), options_(options) {}
  ~StagingCommunicator() override {
    // Copies in flight borrow the pinned buffers: they finish before the buffers go.
    (void)stream_->Synchronize();
  }

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::string backend() const override {
    return absl::StrFormat("%s staged through pinned host memory (%s)", host_->backend(),
                           device_.ToString());
  }

  Status AllReduce(float* data, size_t n) override { return Done(AllReduceT(data, n)); }
  Status AllReduce(double* data, size_t n) override { return Done(AllReduceT(data, n)); }

  Status AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, size_t element_bytes) override {
    return Done([&]() -> Status {
      const size_t send_bytes = Total(send_counts) * element_bytes;
      const size_t recv_bytes = Total(recv_counts) * element_bytes;
      ASSIGN_OR_RETURN(char* hs, send_.Get(send_bytes));
      ASSIGN_OR_RETURN(char* hr, recv_.Get(recv_bytes));
      RETURN_IF_ERROR(ToHost(hs, send, send_bytes));
      RETURN_IF_ERROR(FromHost(host_->AllToAllV(hs, send_counts, hr, recv_counts, element_bytes)));
      return ToDevice(recv, hr, recv_bytes);
    }());
  }

  Status AllGather(const void* send, size_t bytes, void* recv) override {
    return Done([&]() -> Status {
      const size_t all = bytes * static_cast<size_t>(world_size());
      ASSIGN_OR_RETURN(char* hs, send_.Get(bytes));
      ASSIGN_OR_RETURN(char* hr, recv_.Get(all));
      RETURN_IF_ERROR(ToHost(hs, send, bytes));
      RETURN_IF_ERROR(FromHost(host_->AllGather(hs, bytes, hr)));
      return ToDevice(recv, hr, all);
    }());
  }

  Status Broadcast(void* data, size_t bytes, int root) override {
    return Done([&]() -> Status {
      ASSIGN_OR_RETURN(char* h, send_.Get(bytes));
      const bool mine = root == rank();
      RETURN_IF_ERROR(ToHost(h, mine ? data : nullptr, mine ? bytes : 0));
      RETURN_IF_ERROR(FromHost(host_->Broadcast(h, bytes, root)));
      return mine ? absl::OkStatus() : ToDevice(data, h, bytes);
    }());
  }

  Status Barrier() override { return host_->Barrier(); }
  void Abort(const std::string& why) override { host_->Abort(why); }

 private:
  static size_t Total(const std::vector<int64_t>& counts) {
    return static_cast<size_t>(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  }

  // Device -> host, complete on return. Always after the GPU's work so far (the kernels that
  // wrote the input, and those that may still read the memory the result is copied into), also
  // with nothing to copy.
  Status ToHost(char* host, const void* device, size_t bytes) {
    RETURN_IF_ERROR(stream_->WaitForDeviceWork());
    if (bytes == 0) return absl::OkStatus();
    RETURN_IF_ERROR(stream_->CopyAsync(host, device, bytes));
    return stream_->Synchronize();
  }
  // Host -> device, complete on return.
  Status ToDevice(void* device, const char* host, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    RETURN_IF_ERROR(stream_->CopyAsync(device, host, bytes));
    return stream_->Synchronize();
  }
  // The host operation's status, remembered as such for Done.
  Status FromHost(Status s) {
    host_failed_ = !s.ok();
    return s;
  }
  // An operation's end. On a failure no copy borrows the caller's buffers any more. A failure of
  // the host operation is the host communicator's to handle (it finishes itself where the failure
  // calls for it, and an invalid argument does not); a local one (a copy, a pinned allocation)
  // finishes the communicator as communicator.h promises: the host communicator is aborted, peers
  // fail at once rather than at their timeout, and every later call is ABORTED.
  Status Done(Status s) {
    if (s.ok()) return s;
    (void)stream_->Synchronize();
    if (!host_failed_) host_->Abort(std::string(s.message()));
    host_failed_ = false;
    return s;
  }

  // Chunk k lives in half k % 2. The stream orders each half's copies: chunk k's copy back to the
  // device is enqueued before chunk k + 2's copy into the same half, so one event per half marks
  // when its next chunk is on the host.
  template <typename T>
  Status AllReduceT(T* data, size_t n) {
    if (n == 0) return FromHost(host_->AllReduce(static_cast<T*>(nullptr), 0));
    const size_t per = std::min(n, std::max<size_t>(1, options_.chunk_bytes / sizeof(T)));
    const size_t chunks = (n + per - 1) / per;
    ASSIGN_OR_RETURN(char* base, send_.Get(2 * per * sizeof(T)));
    T* half[2] = {reinterpret_cast<T*>(base), reinterpret_cast<T*>(base) + per};
    auto size_of = [&](size_t k) { return std::min(per, n - k * per); };
    auto fetch = [&](size_t k) -> Status {
      RETURN_IF_ERROR(stream_->CopyAsync(half[k % 2], data + k * per, size_of(k) * sizeof(T)));
      return stream_->Record(&on_host_[k % 2]);
    };
    RETURN_IF_ERROR(stream_->WaitForDeviceWork());
    for (size_t k = 0; k < std::min<size_t>(2, chunks); ++k) RETURN_IF_ERROR(fetch(k));
    for (size_t k = 0; k < chunks; ++k) {
      RETURN_IF_ERROR(on_host_[k % 2].Synchronize());
      RETURN_IF_ERROR(FromHost(host_->AllReduce(half[k % 2], size_of(k))));
      RETURN_IF_ERROR(stream_->CopyAsync(data + k * per, half[k % 2], size_of(k) * sizeof(T)));
      if (k + 2 < chunks) RETURN_IF_ERROR(fetch(k + 2));
    }
    return stream_->Synchronize();
  }

  std::unique_ptr<Communicator> host_;
  const Device device_;
  std::unique_ptr<CopyStream> stream_;
  const StagingOptions options_;
  HostBuffer send_, recv_;
  CopyEvent on_host_[2];
  bool host_failed_ = false;  // the operation in progress failed in the host communicator
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> MakeStaging(std::unique_ptr<Communicator> host,
                                                    Device device, const StagingOptions& options) {
  if (host == nullptr) {
    return absl::InvalidArgumentError("MakeStaging: no host communicator to stage through");
  }
  if (options.chunk_bytes < 8) {
    return absl::InvalidArgumentError(
        absl::StrFormat("MakeStaging: chunk_bytes %d is below one double (8); the default is 4 MiB",
                        options.chunk_bytes));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CopyStream> stream, CopyStream::Create(device));
  return std::unique_ptr<Communicator>(
      new StagingCommunicator(std::move(host), device, std::move(stream), options));
}

}  // namespace strata::comm
