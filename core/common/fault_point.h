// Fault-injection points: named places in strata's code where a test or a failure drill can make
// something happen (a delay, a hold, a callback), after RocksDB's TEST_SYNC_POINT.
//
//   STRATA_FAULT_POINT("checkpoint.before_commit", &step);
//
// Design decisions:
// - A fault hook is a point in the code, never a field of an options struct: production options
//   describe what strata does, not what a test wants to break.
// - The points compile away. With the CMake option STRATA_FAULT_INJECTION=ON (the default; the
//   generated core/common/fault_injection.h then defines the macro STRATA_FAULT_INJECTION) a
//   point asks FaultPoints what is armed under its name; a production build configured with
//   -DSTRATA_FAULT_INJECTION=OFF expands every point to `do {} while (0)`, and the point's
//   arguments are not even evaluated.
// - Two ways to arm a point. Tests in one process install callbacks (FaultPoints::Set / Clear).
//   Tests and drills that run real processes set ONE environment variable, STRATA_FAULTS, read
//   once when the process first reaches a point (or asks for EnvironmentStatus):
//
//     STRATA_FAULTS="checkpoint.before_commit=sleep_ms:3000,checkpoint.after_commit=hold_at_step:30"
//
//   Entries are POINT=ACTION separated by commas; the actions are
//     sleep_ms:N      the thread that reaches POINT sleeps N milliseconds (0 <= N <= 3600000);
//     hold_at_step:N  when POINT is reached at step N (N >= 1), the thread logs
//                     "...: holding here (fault injection) until the process is killed" and
//                     never returns, so a kill lands right after that point.
//     wait_for_file:PATH  while the file PATH does not exist, the thread that reaches POINT logs
//                     "...: waiting (fault injection) until 'PATH' exists" and waits (polling
//                     every 10 ms, at most 10 minutes): a test pauses the processes of a job
//                     between two steps by removing PATH and lets them go on by creating it
//                     again.
//   POINT must be one of KnownFaultPoints(); hold_at_step only at a point that carries a step.
//   A bad value is refused as a whole with a message naming STRATA_FAULTS, the entry and the valid
//   forms; `strata` checks it before doing anything else (EnvironmentStatus).
//
// The argument of a point is a `void*` the point's callbacks receive (RocksDB's convention); the
// points listed in KnownFaultPoints() that carry a step pass an `int64_t*` to it.
//
// Thread-safety: every member of FaultPoints may be called from any thread. A callback runs on the
// thread that reached the point, without any lock of FaultPoints held, so it may Set or Clear
// points itself. Clear does not wait for a callback another thread is running: stop the threads
// that reach a point before destroying what its callback uses.
//
// A point may run under its caller's locks (checkpoint.after_commit runs holding the
// CheckpointManager's mutex): a callback (and whatever it waits for) must not call back into the
// object that reached the point unless the point's description in KnownFaultPoints() says it may;
// it would deadlock.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/fault_injection.h"  // generated: STRATA_FAULT_INJECTION or not
#include "core/common/status.h"

namespace strata {

// The environment variable that arms points in a real process.
inline constexpr char kFaultsEnvVar[] = "STRATA_FAULTS";

// A point strata's code contains; STRATA_FAULTS may name only these.
struct FaultPointInfo {
  std::string_view name;
  bool carries_step;      // its argument is an int64_t* to the step it is reached at
  std::string_view what;  // where it is, for the error that lists the points
};
std::span<const FaultPointInfo> KnownFaultPoints();

// What a callback receives: the point's argument, as the point passed it.
using FaultCallback = std::function<void(void* arg)>;

// One action STRATA_FAULTS arms at a point.
struct FaultAction {
  enum class Kind { kSleepMs, kHoldAtStep, kWaitForFile };
  std::string point;
  Kind kind = Kind::kSleepMs;
  int64_t value = 0;  // milliseconds, or the step
  std::string path;   // kWaitForFile: the file to wait for
};

// Parses the text of STRATA_FAULTS (see the top of this file). Empty or all blank: no actions.
StatusOr<std::vector<FaultAction>> ParseFaultSpec(std::string_view spec);

class FaultPoints {
 public:
  // The process's one instance. Its first use reads STRATA_FAULTS and arms what it names.
  static FaultPoints& Instance();

  // Whether STRATA_FAULTS (as read once) was valid. Not OK also when it is set in a build without
  // fault points, where it could only be ignored, and when a variable strata no longer reads is
  // set (STRATA_FAULT_CHECKPOINT_COMMIT_DELAY_MS, STRATA_FAULT_CHECKPOINT_HOLD_AFTER; the message
  // names the STRATA_FAULTS entry that replaces it), so that a drill never runs without its fault.
  Status EnvironmentStatus() const { return env_status_; }

  // Runs `callback` whenever a thread reaches the point `name` (any name; the most recent Set of
  // a name wins), after the actions armed there.
  void Set(const std::string& name, FaultCallback callback);
  // Removes the callback of `name`; nothing if none is set.
  void Clear(const std::string& name);
  // Parses `spec` like STRATA_FAULTS and arms its actions beside those armed already; on an error
  // nothing is armed.
  Status Arm(std::string_view spec);
  // Removes every callback and every armed action, STRATA_FAULTS's included.
  void ClearAll();

  // What STRATA_FAULT_POINT calls: the actions armed at `name` in the order they were armed, then
  // its callback. Cheap (one atomic load) while nothing at all is armed.
  void Reached(std::string_view name, void* arg);

 private:
  FaultPoints();
  void RunAction(const FaultAction& action, std::string_view name, void* arg);

  Status env_status_;
  std::atomic<bool> any_armed_{false};
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const FaultCallback>, std::less<>> callbacks_;
  std::vector<FaultAction> actions_;
};

}  // namespace strata

#ifdef STRATA_FAULT_INJECTION
#define STRATA_FAULT_POINT(name, arg)                         \
  do {                                                        \
    ::strata::FaultPoints::Instance().Reached((name), (arg)); \
  } while (0)
#else
#define STRATA_FAULT_POINT(name, arg) \
  do {                                \
  } while (0)
#endif
