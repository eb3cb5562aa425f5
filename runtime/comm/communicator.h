// Communicator: the collectives strata's workers use, over Gloo (TCP) for CPU tensors; NCCL for
// device tensors comes with the CUDA backend behind the same interface.
//
// All ranks call the same operations in the same order (each call takes the next tag, so a
// mismatch is detected rather than mixed up). Calls on one communicator are made by one thread at
// a time; Abort may come from any thread. Every operation has the timeout of CommOptions: a peer
// that died or hangs makes the call return DEADLINE_EXCEEDED / UNAVAILABLE naming the operation,
// this rank and the peer when known ("peer rank 2 ([10.0.0.7]:41234)") — never a hang. After
// Abort (or any failure) the communicator is finished: it closes its connections, so that peers
// waiting on this rank fail too, every later call returns ABORTED, and the owner builds a new one
// for the next membership generation (under a new Store prefix).
//
// Ownership: an operation borrows its buffers for the call and has completed when it returns
// (also over NCCL), so they are free to reuse or free at once. rank(), world_size() and backend()
// may be called from any thread. Whoever owns the communicator keeps it alive until every thread
// that may call Abort on it has stopped.
//
// hierarchical.h wraps three communicators into one whose AllToAllV runs in two levels (inside
// the nodes, then across them).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "runtime/comm/store.h"

namespace strata::comm {

struct CommOptions {
  int rank = 0;
  int world_size = 1;
  // Every operation, and the rendezvous, must finish within this. Default: 30 s.
  std::chrono::milliseconds timeout{30000};
  // The address this rank listens on for its peers. Default: loopback.
  std::string hostname = "127.0.0.1";
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;

  // Element-wise sum over all ranks, in place.
  [[nodiscard]] virtual Status AllReduce(float* data, size_t n) = 0;
  [[nodiscard]] virtual Status AllReduce(double* data, size_t n) = 0;
  // Rank r sends send_counts[d] elements to rank d, taken in rank order from `send`, and receives
  // recv_counts[s] elements from rank s into `recv`, in rank order. Counts may be zero; the
  // counts of a pair must agree (what r sends to d is what d expects from r).
  [[nodiscard]] virtual Status AllToAllV(const void* send, const std::vector<int64_t>& send_counts,
                                         void* recv, const std::vector<int64_t>& recv_counts,
                                         size_t element_bytes) = 0;
  // `bytes` from every rank into `recv` (world_size * bytes), in rank order.
  [[nodiscard]] virtual Status AllGather(const void* send, size_t bytes, void* recv) = 0;
  // `bytes` of `root`'s `data` into every rank's `data`.
  [[nodiscard]] virtual Status Broadcast(void* data, size_t bytes, int root) = 0;
  [[nodiscard]] virtual Status Barrier() = 0;
  // Unblocks every call in flight on this rank with ABORTED and fails every later one; closes the
  // connections so that peers waiting on this rank fail fast too. Safe from any thread, also while
  // another thread is inside a call; idempotent. Over Gloo the Abort that finishes the
  // communicator returns once the call in flight has returned; an Abort after that one (also one
  // concurrent with it) or after a call failed returns at once, while a call may still be
  // returning. Over NCCL every Abort returns once an enqueue under way (immediate: the
  // communicator is non-blocking) and the first Abort's ncclCommAbort have.
  virtual void Abort(const std::string& why) = 0;

  template <typename T>
  [[nodiscard]] Status AllToAllV(const T* send, const std::vector<int64_t>& send_counts, T* recv,
                                 const std::vector<int64_t>& recv_counts) {
    return AllToAllV(static_cast<const void*>(send), send_counts, static_cast<void*>(recv),
                     recv_counts, sizeof(T));
  }
};

// Connects `options.world_size` ranks through `store` (each rank publishes its address under
// the store's keys and connects to every other: a full mesh of TCP pairs). The store is used only
// while connecting; the communicator does not keep it.
[[nodiscard]] StatusOr<std::unique_ptr<Communicator>> ConnectGloo(std::shared_ptr<Store> store,
                                                                  const CommOptions& options);

// Connects `options.world_size` ranks over NCCL on CUDA device `device`; the NCCL unique id travels
// through `store` (key "nccl/unique_id", made by rank 0). Every pointer given to its operations
// must be device memory on that device; each call returns once the operation completed on the
// device. FAILED_PRECONDITION on a machine without a GPU, UNIMPLEMENTED in a build without NCCL
// (configured without the CUDA toolkit). The store is used only while connecting.
[[nodiscard]] StatusOr<std::unique_ptr<Communicator>> ConnectNccl(std::shared_ptr<Store> store,
                                                                  const CommOptions& options,
                                                                  int device);

}  // namespace strata::comm
