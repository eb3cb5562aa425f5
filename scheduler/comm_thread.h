// CommThread: one thread that runs a communicator's operations in the order they were submitted.
//
// A Communicator takes calls from one thread at a time, and every rank must issue the same
// operations in the same order. Submitting them to one FIFO thread keeps both true while the
// submitting thread goes on computing: the order is the program order of Submit, which is the
// same on every rank. Wait(ticket) blocks until that operation (and every one before it) finished
// and returns the first failure so far — which may be that of a later operation that has already
// finished too — or OK; the first failure is kept and every later operation is skipped (not run)
// with it, so a broken peer ends the step with one clear error.
//
// Threads: every member may be called from any thread; they synchronise on one mutex. The
// operations run on the CommThread's own thread, one at a time, in Submit order; for that order
// to match across ranks, the submissions of one communicator come from one thread. An operation
// must not Wait on its own CommThread (it would wait for itself). What an operation captures must
// live until it has finished (Wait for its ticket) — the destructor waits for everything
// submitted, skipped operations included, so an owner declares its CommThread after (destroys it
// before) what the operations use. A skipped operation is destroyed without being run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "core/common/clock.h"
#include "core/common/status.h"
#include "core/common/trace.h"

namespace strata::scheduler {

class CommThread {
 public:
  explicit CommThread(std::string name);
  ~CommThread();  // waits for what was submitted
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  using Ticket = int64_t;
  // `label` names the operation's span in the trace (when one is recorded).
  Ticket Submit(std::function<Status()> op, std::string label = "collective");
  // Waits for `ticket` (and everything submitted before it).
  [[nodiscard]] Status Wait(Ticket ticket);
  // Waits for everything submitted so far.
  [[nodiscard]] Status Drain();
  // Runs op on the thread and waits for it.
  [[nodiscard]] Status Run(std::function<Status()> op, std::string label = "collective") {
    return Wait(Submit(std::move(op), std::move(label)));
  }
  // The first error (OK while none).
  [[nodiscard]] Status status() const;
  // Seconds spent inside operations since the last call (for the step's communication time).
  double TakeBusySeconds();
  // Records every operation as a span on this thread's track ("comm: <name>"); null: none.
  void set_tracer(Tracer* tracer) { tracer_.store(tracer); }

 private:
  void Loop();

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::pair<std::function<Status()>, std::string>> queue_;
  std::atomic<Tracer*> tracer_{nullptr};
  bool named_ = false;
  Ticket submitted_ = 0, finished_ = 0;
  Status status_;
  double busy_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace strata::scheduler
