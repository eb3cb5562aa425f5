// WorkerComms: the communicators of one membership generation of a worker, and their abort.
//
// - A generation connects up to three Gloo communicators, in the same order on every worker: all
//   workers ("world/"), its expert-parallel group ("ep/<g>/", two-level when parallel.local_size
//   asks for it) and its expert replicas ("replicas/<i>/"), each under its prefix of the
//   generation's store.
// - Abort unblocks the collectives in flight with ABORTED and marks the generation's checkpoint in
//   flight abandoned, so that a worker can leave a generation that a newer one replaced.
//
// Ownership and threads:
// - The trainer owns one WorkerComms and keeps it alive longer than the reducers and exchanges
//   that borrow its communicators.
// - Connect and Reset run on the training thread; it alone replaces the communicators, under mu_.
// - Abort may run on any thread at any time; world(), ep() and replicas() on any thread, though
//   only the training thread may use what they return (communicator.h: one caller at a time).
//   They read atomics, not the lock: an Abort holds the lock while it unblocks the calls in flight,
//   and the training thread must not queue behind it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/common/status.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"

namespace strata::train {

// Whether every worker's `mine` is OK (collective over `world`): this worker's error, or
// FAILED_PRECONDITION saying `others_failed` ("rank 0 could not open ...") when another one failed.
[[nodiscard]] Status AllWorkersOk(comm::Communicator& world, Status mine,
                                  const std::string& others_failed);

class WorkerComms {
 public:
  struct Layout {
    int rank = 0;
    int world_size = 1;
    int group_size = 1;  // workers of an expert-parallel group (a divisor of world_size)
    int local_size = 0;  // ranks per node for a two-level all-to-all; 0 or >= group_size: flat
  };
  // Connects this generation's communicators: all workers; with groups of more than one worker,
  // the group and, with several groups, the copies of this worker's experts. `superseded` is
  // WorkerOptions::superseded: when it turns true a connect in flight is left behind (a Gloo
  // connect cannot be interrupted; its thread ends at the timeout) and Connect returns ABORTED.
  [[nodiscard]] Status Connect(std::shared_ptr<comm::Store> store, const comm::CommOptions& options,
                               const Layout& layout, const std::function<bool()>& superseded)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Unblocks the collectives in flight with ABORTED, from any thread. With `newer_generation`,
  // only when these communicators are of an older generation: a late call for the generation they
  // belong to already does nothing.
  void Abort(const std::string& why, int64_t newer_generation = std::numeric_limits<int64_t>::max())
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the communicators (their users must be gone); `generation` is the one to come.
  void Reset(int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // The flag the generation's checkpoint manager polls to stop waiting for reports of a
  // checkpoint that can no longer commit: set by Abort (and already set when Abort ran since the
  // last Reset).
  std::shared_ptr<std::atomic<bool>> CheckpointAbandonFlag() ABSL_LOCKS_EXCLUDED(mu_);

  // Collectives over every worker of the generation that cost nothing in one process: with no
  // world communicator (one process, never connected), Barrier returns at once and SumOverWorkers
  // leaves the values as they are (they are the sums already). Training thread only.
  [[nodiscard]] Status Barrier() const ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] Status SumOverWorkers(double* data, size_t n) const ABSL_LOCKS_EXCLUDED(mu_);

  // Null when not connected (and ep()/replicas() without groups or with one).
  comm::Communicator* world() const { return world_ptr_.load(std::memory_order_acquire); }
  comm::Communicator* ep() const { return ep_ptr_.load(std::memory_order_acquire); }
  comm::Communicator* replicas() const { return replicas_ptr_.load(std::memory_order_acquire); }

 private:
  // Stores a newly connected communicator in *slot, aborting it at once when Abort ran since the
  // last Reset.
  void Adopt(std::unique_ptr<comm::Communicator> c, std::unique_ptr<comm::Communicator>* slot,
             std::atomic<comm::Communicator*>* ptr) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::unique_ptr<comm::Communicator> world_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<comm::Communicator> ep_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<comm::Communicator> replicas_ ABSL_GUARDED_BY(mu_);
  std::optional<std::string> aborted_why_ ABSL_GUARDED_BY(mu_);  // until Reset
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;                  // of the communicators
  std::shared_ptr<std::atomic<bool>> checkpoint_abandoned_ ABSL_GUARDED_BY(mu_);
  // The communicators' addresses for world(), ep() and replicas(), written under mu_ with them, so
  // that the training thread never waits for the lock an Abort holds while it unblocks a call.
  std::atomic<comm::Communicator*> world_ptr_{nullptr}, ep_ptr_{nullptr}, replicas_ptr_{nullptr};
};

}  // namespace strata::train
