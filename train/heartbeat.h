// Heartbeat: the elastic worker's heartbeat thread, beside training
//
// - Every `period` (100 ms) it asks the coordinator for the current generation.
// - A generation newer than the one training (set_training_generation) aborts the collectives in
//   flight through the abort callback, so the step ends at once and the worker re-forms.
// - A coordinator that no longer counts this worker in the job (NOT_FOUND: declared failed) marks
//   it expelled and aborts, once: it must leave, not wait on peers that re-formed without it.
// - A heartbeat that fails records the time in unreachable_ms() (the worker's own calls record
//   there too); once the coordinator answers again the worker is attached again.
//
// Threads: Start and Stop from the owner's thread, which also owns the Membership (it must
// outlive the Heartbeat). set_abort, set_training_generation and the accessors from any thread.
// The abort callback runs on the heartbeat thread under the Heartbeat's lock: set_abort(nullptr)
// returns only once no call of the old callback runs, so its target may go right after; the
// callback itself must not call set_abort (the analysis cannot see into it: it would deadlock).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "train/elastic_worker.h"

namespace strata::train {

class Heartbeat {
 public:
  // Aborts the collectives in flight: `why`, and the newer generation that explains it (INT64_MAX
  // when the worker was expelled), as Trainer::AbortCollectives takes them.
  using Abort = std::function<void(const std::string& why, int64_t newer_generation)>;

  Heartbeat(Membership& membership, std::string id,
            std::chrono::milliseconds period = std::chrono::milliseconds(100));
  ~Heartbeat();  // stops the thread
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Starts the thread (once); the worker has attached already.
  void Start();
  // Stops the thread and waits for it. Idempotent.
  void Stop();
  bool running() const { return thread_.joinable(); }

  // Whom a newer generation or an expulsion aborts (null: nobody, no trainer yet).
  void set_abort(Abort abort) ABSL_LOCKS_EXCLUDED(mu_);
  // The generation the worker trains in now: only a newer one aborts.
  void set_training_generation(int64_t generation) { training_generation_ = generation; }

  // The newest generation the heartbeats have seen (-1: none yet). Shared, so that a connect left
  // behind on a thread of its own may ask after the worker is gone.
  std::shared_ptr<const std::atomic<int64_t>> latest_generation() const {
    return latest_generation_;
  }
  // Whether the coordinator declared this worker failed (shared, as latest_generation).
  std::shared_ptr<const std::atomic<bool>> expelled() const { return expelled_; }
  // When the coordinator last failed to answer (SteadyMs; 0: never).
  std::atomic<int64_t>& unreachable_ms() { return unreachable_ms_; }

 private:
  void Loop();
  // One heartbeat and what it calls for; `reachable`: whether the last one was answered.
  void Beat(bool* reachable);
  void CallAbort(const std::string& why, int64_t newer_generation) ABSL_LOCKS_EXCLUDED(mu_);

  Membership& membership_;
  const std::string id_;
  const std::chrono::milliseconds period_;
  absl::Mutex mu_;
  Abort abort_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> training_generation_{-1};
  std::shared_ptr<std::atomic<int64_t>> latest_generation_ =
      std::make_shared<std::atomic<int64_t>>(-1);
  std::shared_ptr<std::atomic<bool>> expelled_ = std::make_shared<std::atomic<bool>>(false);
  std::atomic<int64_t> unreachable_ms_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace strata::train
