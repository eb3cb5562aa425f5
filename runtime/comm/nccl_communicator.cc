// The Communicator over NCCL, for device tensors: every pointer handed to it is CUDA device memory
// on the communicator's device. Built when the CUDA toolkit with NCCL is found; see
// nccl_unavailable.cc otherwise.
//
// Rendezvous: rank 0 makes the NCCL unique id and publishes it in the Store under
// "nccl/unique_id"; the others wait for it (within the timeout). The communicator is created
// non-blocking, so initialisation, like every operation, is polled against the timeout: a peer
// that never arrives or dies mid-operation gives DEADLINE_EXCEEDED / UNAVAILABLE naming the
// operation and this rank, never a hang. Operations are enqueued on the communicator's own stream
// and the call returns when they completed (the same contract as the Gloo communicator: the
// buffers are free to use on return). Abort (any thread) calls ncclCommAbort, which ends every
// call in flight; afterwards every call returns ABORTED.
//
// ncclCommAbort also frees the communicator, so comm_ is only used under mu_, after checking that
// no Abort came first, and Abort sets it to null under mu_. That covers the enqueue of an
// operation too: it is made under the lock, which costs an Abort from another thread no more than
// the enqueue itself, since on this non-blocking communicator it returns at once (ncclInProgress
// while NCCL still connects); the waits that follow take the lock only to poll.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_format.h"
#include "runtime/comm/communicator.h"

namespace strata::comm {
namespace {

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const CommOptions& options, int device) : options_(options), device_(device) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      if (finished_) {
        ncclCommAbort(comm_);
      } else {
        ncclCommDestroy(comm_);
      }
    }
    if (barrier_word_ != nullptr) cudaFree(barrier_word_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Init(Store& store) {
    if (cudaSetDevice(device_) != cudaSuccess) {
      return absl::FailedPreconditionError(
          absl::StrFormat("NCCL on rank %d: CUDA device %d is not usable", options_.rank, device_));
    }
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) {
      return absl::ResourceExhaustedError("NCCL: cannot create a CUDA stream");
    }
    ncclUniqueId id;
    const std::string key = "nccl/unique_id";
    if (options_.rank == 0) {
      if (ncclGetUniqueId(&id) != ncclSuccess) {
        return absl::UnavailableError("NCCL: ncclGetUniqueId failed (no network interface?)");
      }
      RETURN_IF_ERROR(store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
    } else {
      ASSIGN_OR_RETURN(std::string bytes, store.WaitGet(key, options_.timeout));
      if (bytes.size() != sizeof(id)) {
        return absl::DataLossError(absl::StrFormat(
            "NCCL on rank %d: the unique id in the store has %d bytes, not %d; is another job "
            "using the same store prefix?",
            options_.rank, bytes.size(), sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r =
        ncclCommInitRankConfig(&comm_, options_.world_size, id, options_.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) return Failed("init", r);
    return WaitComm("init");
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string backend() const override { return "nccl"; }

  Status AllReduce(float* data, size_t n) override {
    return Run("AllReduce",
               [&] { return ncclAllReduce(data, data, n, ncclFloat32, ncclSum, comm_, stream_); });
  }
  Status AllReduce(double* data, size_t n) override {
    return Run("AllReduce",
               [&] { return ncclAllReduce(data, data, n, ncclFloat64, ncclSum, comm_, stream_); });
  }
  Status AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, size_t element_bytes) override {
    const size_t W = static_cast<size_t>(options_.world_size);
    if (send_counts.size() != W || recv_counts.size() != W) {
      return absl::InvalidArgumentError(
          absl::StrFormat("AllToAllV on rank %d: %d send and %d receive counts for %d ranks",
                          options_.rank, send_counts.size(), recv_counts.size(), W));
    }
    for (size_t r = 0; r < W; ++r) {
      if (send_counts[r] < 0 || recv_counts[r] < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("AllToAllV on rank %d: negative count for rank %d", options_.rank, r));
      }
    }
    return Run("AllToAllV", [&] {
      // Bytes as ncclChar: any element size, one send and one receive per peer in one group.
      const char* s = static_cast<const char*>(send);
      char* d = static_cast<char*>(recv);
      ncclResult_t res = ncclGroupStart();
      size_t so = 0, ro = 0;
      for (size_t r = 0; r < W && res == ncclSuccess; ++r) {
        const size_t sb = static_cast<size_t>(send_counts[r]) * element_bytes;
        const size_t rb = static_cast<size_t>(recv_counts[r]) * element_bytes;
        if (sb > 0) res = ncclSend(s + so, sb, ncclChar, static_cast<int>(r), comm_, stream_);
        if (res == ncclSuccess && rb > 0) {
          res = ncclRecv(d + ro, rb, ncclChar, static_cast<int>(r), comm_, stream_);
        }
        so += sb;
        ro += rb;
      }
      ncclResult_t end = ncclGroupEnd();
      return res != ncclSuccess ? res : end;
    });
  }
  Status AllGather(const void* send, size_t bytes, void* recv) override {
    return Run("AllGather",
               [&] { return ncclAllGather(send, recv, bytes, ncclChar, comm_, stream_); });
  }
  Status Broadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= options_.world_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Broadcast from rank %d of %d", root, options_.world_size));
    }
    return Run("Broadcast",
               [&] { return ncclBroadcast(data, data, bytes, ncclChar, root, comm_, stream_); });
  }
  Status Barrier() override {
    // A one-element all-reduce on a device scratch word.
    if (barrier_word_ == nullptr && cudaMalloc(&barrier_word_, sizeof(float)) != cudaSuccess) {
      return absl::ResourceExhaustedError("NCCL Barrier: cannot allocate 4 bytes of device memory");
    }
    return Run("Barrier", [&] {
      return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
  }
  void Abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    why_ = why;
    finished_ = true;
    // ncclCommAbort ends the kernels in flight; the polling call then sees aborted_.
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

 private:
  template <typename Launch>
  Status Run(const char* op, Launch&& launch) {
    ncclResult_t r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_ || finished_) {
        return absl::AbortedError(absl::StrFormat(
            "%s on rank %d of %d: the communicator is finished (%s); build a new one", op,
            options_.rank, options_.world_size, aborted_ ? why_ : "an earlier call failed"));
      }
      cudaSetDevice(device_);
      r = launch();  // enqueues only (non-blocking communicator); comm_ is live under the lock
    }
    if (r != ncclSuccess && r != ncclInProgress) return Failed(op, r);
    RETURN_IF_ERROR(WaitComm(op));
    // Wait for the stream, polling so that a dead peer or Abort ends the wait.
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          finished_ = true;
        }
        return absl::InternalError(absl::StrFormat("%s on rank %d of %d: CUDA error %s", op,
                                                   options_.rank, options_.world_size,
                                                   cudaGetErrorString(e)));
      }
      RETURN_IF_ERROR(CheckAsync(op));
      if (std::chrono::steady_clock::now() > deadline) return TimedOut(op);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Polls the communicator's state while it is ncclInProgress (non-blocking init and calls).
  Status WaitComm(const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      ncclResult_t state;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (aborted_) return AbortedStatus(op);
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Failed(op, state);
      if (std::chrono::steady_clock::now() > deadline) return TimedOut(op);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  Status CheckAsync(const char* op) {
    ncclResult_t state;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return AbortedStatus(op);
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    }
    if (state == ncclSuccess || state == ncclInProgress) return absl::OkStatus();
    return Failed(op, state);
  }

  Status AbortedStatus(const char* op) const {
    return absl::AbortedError(
        absl::StrFormat("%s on rank %d of %d: %s", op, options_.rank, options_.world_size, why_));
  }

  Status TimedOut(const char* op) {
    Abort(absl::StrFormat("%s timed out", op));
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s on rank %d of %d failed after the %d ms timeout: a peer died, hung, or called another "
        "operation; the communicator must be rebuilt",
        op, options_.rank, options_.world_size, options_.timeout.count()));
  }

  Status Failed(const char* op, ncclResult_t r) {
    std::string last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (comm_ != nullptr) last = ncclGetLastError(comm_);
    }
    Abort(absl::StrFormat("%s failed", op));
    return absl::UnavailableError(absl::StrFormat(
        "%s on rank %d of %d failed: %s%s%s (a peer died or the network failed; the communicator "
        "must be rebuilt)",
        op, options_.rank, options_.world_size, ncclGetErrorString(r), last.empty() ? "" : ": ",
        last));
  }

  CommOptions options_;
  int device_;
  ncclComm_t comm_ = nullptr;  // null once aborted; guarded by mu_ once Init returned
  cudaStream_t stream_ = nullptr;
  float* barrier_word_ = nullptr;
  std::mutex mu_;
  bool aborted_ = false;
  std::atomic<bool> finished_{false};
  std::string why_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> ConnectNccl(std::shared_ptr<Store> store,
                                                    const CommOptions& options, int device) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in a world of %d ranks", options.rank, options.world_size));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(
        "NCCL needs a CUDA GPU and this machine has none; use the Gloo communicator for CPU "
        "tensors");
  }
  if (device < 0 || device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CUDA device %d does not exist (this machine has %d)", device, devices));
  }
  auto c = std::make_unique<NcclCommunicator>(options, device);
  RETURN_IF_ERROR(c->Init(*store));
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace strata::comm
