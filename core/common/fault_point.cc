#include "core/common/fault_point.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/common/logging.h"

namespace strata {
namespace {

// Every point in strata's code, so that STRATA_FAULTS can refuse a misspelt name instead of
// arming a point nothing reaches.
constexpr FaultPointInfo kKnownPoints[] = {
    {"checkpoint.before_commit", true,
     "in the checkpoint writer, between a checkpoint's synced extents and its commit; "
     "checkpoint/writer.cc"},
    {"checkpoint.after_commit", true,
     "in the checkpoint writer, once a checkpoint is committed and the ledger updated, holding "
     "the CheckpointManager's mutex: a callback must not call that CheckpointManager "
     "(NewestCommitted, PollError, Steps, CheckCompatible, ...), it would deadlock; "
     "checkpoint/writer.cc"},
    {"checkpoint.before_set_commit", true,
     "in the checkpoint writer, between a shard's local commit (the shard is prepared) and the "
     "commit of the checkpoint's global manifest; checkpoint/writer.cc"},
    {"checkpoint_set.before_ledger", true,
     "in CommitCheckpointSet, between the rename of a global manifest and the global ledger's "
     "update; checkpoint/checkpoint_set.cc"},
    {"coordinator.persist", false,
     "in the coordinator, before the synced write of its record, holding its state's mutex "
     "(heartbeats wait meanwhile); coordinator/state.cc"},
    {"checkpoint_set.before_delete", true,
     "in RemoveCheckpointSet and CommitCheckpointSet, between the global ledger's record of a "
     "removal and the delete of its manifest; checkpoint/checkpoint_set.cc"},
    {"train.after_step", true,
     "in the trainer, once a step's metrics line is written and before the step is reported "
     "(to the coordinator, in an elastic worker) or checkpointed; train/trainer.cc"},
};

constexpr int64_t kMaxSleepMs = 3600000;
constexpr std::chrono::minutes kWaitForFileLimit{10};

// Variables earlier strata read in place of STRATA_FAULTS, and the entry that does what each did.
// A drill still setting one would run without its fault: the environment check refuses them.
struct RetiredVariable {
  const char* name;
  const char* replacement;  // a STRATA_FAULTS entry but its value: the old variable's
};
constexpr RetiredVariable kRetiredVariables[] = {
    {"STRATA_FAULT_CHECKPOINT_COMMIT_DELAY_MS", "checkpoint.before_commit=sleep_ms:"},
    {"STRATA_FAULT_CHECKPOINT_HOLD_AFTER", "checkpoint.after_commit=hold_at_step:"},
};

// An error naming the first retired variable set, or OK.
Status CheckNoRetiredVariables() {
  for (const RetiredVariable& v : kRetiredVariables) {
    const char* value = std::getenv(v.name);
    if (value == nullptr) continue;
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is set ('%s'), but strata no longer reads it, so the fault it asks for would not "
        "happen; unset %s and set %s=\"%s%s\" instead",
        v.name, value, v.name, kFaultsEnvVar, v.replacement, value));
  }
  return absl::OkStatus();
}

const FaultPointInfo* FindPoint(std::string_view name) {
  for (const FaultPointInfo& p : kKnownPoints) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string ValidForms() {
  std::vector<std::string> points;
  for (const FaultPointInfo& p : kKnownPoints) {
    points.push_back(
        absl::StrFormat("%s (%s%s)", p.name, p.what, p.carries_step ? "; carries a step" : ""));
  }
  return absl::StrFormat(
      "%s is a comma-separated list of POINT=sleep_ms:MILLISECONDS (0 to %d), "
      "POINT=hold_at_step:STEP (1 or more; only at a point that carries a step) or "
      "POINT=wait_for_file:PATH (a path without ','), e.g. "
      "%s=\"checkpoint.before_commit=sleep_ms:3000,checkpoint.after_commit=hold_at_step:30\"; "
      "the points: %s",
      kFaultsEnvVar, kMaxSleepMs, kFaultsEnvVar, absl::StrJoin(points, ", "));
}

Status BadEntry(int index, absl::string_view entry, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s entry %d '%s': %s. %s", kFaultsEnvVar, index, entry, why, ValidForms()));
}

}  // namespace

std::span<const FaultPointInfo> KnownFaultPoints() { return kKnownPoints; }

StatusOr<std::vector<FaultAction>> ParseFaultSpec(std::string_view spec_text) {
  // This absl's string_view is its own type, not std::string_view.
  const absl::string_view spec(spec_text.data(), spec_text.size());
  std::vector<FaultAction> actions;
  if (absl::StripAsciiWhitespace(spec).empty()) return actions;
  int index = 0;
  for (absl::string_view raw : absl::StrSplit(spec, ',')) {
    ++index;
    const absl::string_view entry = absl::StripAsciiWhitespace(raw);
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos) return BadEntry(index, entry, "no '=' after the point");
    const absl::string_view point = absl::StripAsciiWhitespace(entry.substr(0, eq));
    const absl::string_view action = absl::StripAsciiWhitespace(entry.substr(eq + 1));
    const FaultPointInfo* info = FindPoint(std::string_view(point.data(), point.size()));
    if (info == nullptr) {
      return BadEntry(index, entry, absl::StrFormat("unknown point '%s'", point));
    }
    const size_t colon = action.find(':');
    if (colon == absl::string_view::npos) {
      return BadEntry(index, entry, absl::StrFormat("action '%s' has no ':VALUE'", action));
    }
    const absl::string_view kind = action.substr(0, colon);
    const absl::string_view value = action.substr(colon + 1);
    FaultAction a;
    a.point = std::string(point);
    if (kind == "wait_for_file") {
      a.kind = FaultAction::Kind::kWaitForFile;
      a.path = std::string(value);
      if (a.path.empty()) return BadEntry(index, entry, "wait_for_file needs a path");
      actions.push_back(std::move(a));
      continue;
    }
    if (!absl::SimpleAtoi(value, &a.value)) {
      return BadEntry(index, entry, absl::StrFormat("'%s' is not a whole number", value));
    }
    if (kind == "sleep_ms") {
      a.kind = FaultAction::Kind::kSleepMs;
      if (a.value < 0 || a.value > kMaxSleepMs) {
        return BadEntry(index, entry,
                        absl::StrFormat("sleep_ms must be 0 to %d, not %d", kMaxSleepMs, a.value));
      }
    } else if (kind == "hold_at_step") {
      a.kind = FaultAction::Kind::kHoldAtStep;
      if (a.value < 1) {
        return BadEntry(index, entry,
                        absl::StrFormat("hold_at_step must be 1 or more, not %d", a.value));
      }
      if (!info->carries_step) {
        return BadEntry(index, entry,
                        absl::StrFormat("point '%s' carries no step to hold at", point));
      }
    } else {
      return BadEntry(index, entry, absl::StrFormat("unknown action '%s'", kind));
    }
    actions.push_back(std::move(a));
  }
  return actions;
}

FaultPoints& FaultPoints::Instance() {
  static FaultPoints* points = new FaultPoints();  // never destroyed: points run until exit
  return *points;
}

FaultPoints::FaultPoints() {
  env_status_ = CheckNoRetiredVariables();
  if (!env_status_.ok()) return;
  const char* spec = std::getenv(kFaultsEnvVar);
  if (spec == nullptr) return;
#ifdef STRATA_FAULT_INJECTION
  env_status_ = Arm(spec);  // `strata` reports an error before it starts (EnvironmentStatus)
#else
  env_status_ = absl::FailedPreconditionError(absl::StrFormat(
      "%s is set ('%s'), but this strata was built with -DSTRATA_FAULT_INJECTION=OFF and has no "
      "fault points; unset %s, or rebuild with -DSTRATA_FAULT_INJECTION=ON",
      kFaultsEnvVar, spec, kFaultsEnvVar));
#endif
}

void FaultPoints::Set(const std::string& name, FaultCallback callback) {
  std::lock_guard<std::mutex> lock(mu_);
  callbacks_[name] = std::make_shared<const FaultCallback>(std::move(callback));
  any_armed_.store(true);
}

void FaultPoints::Clear(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  callbacks_.erase(name);
  any_armed_.store(!callbacks_.empty() || !actions_.empty());
}

Status FaultPoints::Arm(std::string_view spec) {
  ASSIGN_OR_RETURN(std::vector<FaultAction> actions, ParseFaultSpec(spec));
  std::lock_guard<std::mutex> lock(mu_);
  for (FaultAction& a : actions) actions_.push_back(std::move(a));
  any_armed_.store(!callbacks_.empty() || !actions_.empty());
  return absl::OkStatus();
}

void FaultPoints::ClearAll() {
  std::lock_guard<std::mutex> lock(mu_);
  callbacks_.clear();
  actions_.clear();
  any_armed_.store(false);
}

void FaultPoints::Reached(std::string_view name, void* arg) {
  if (!any_armed_.load()) return;
  std::vector<FaultAction> actions;
  std::shared_ptr<const FaultCallback> callback;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const FaultAction& a : actions_) {
      if (a.point == name) actions.push_back(a);
    }
    auto it = callbacks_.find(name);
    if (it != callbacks_.end()) callback = it->second;
  }
  for (const FaultAction& a : actions) RunAction(a, name, arg);
  if (callback != nullptr && *callback) (*callback)(arg);
}

void FaultPoints::RunAction(const FaultAction& action, std::string_view name, void* arg) {
  switch (action.kind) {
    case FaultAction::Kind::kSleepMs:
      std::this_thread::sleep_for(std::chrono::milliseconds(action.value));
      return;
    case FaultAction::Kind::kHoldAtStep: {
      if (arg == nullptr || *static_cast<const int64_t*>(arg) != action.value) return;
      STRATA_LOG(WARNING) << "fault point " << name << " at step " << action.value
                          << ": holding here (fault injection) until the process is killed";
      for (;;) pause();
    }
    case FaultAction::Kind::kWaitForFile: {
      if (access(action.path.c_str(), F_OK) == 0) return;
      const std::string at =
          arg == nullptr ? "" : absl::StrFormat(" at step %d", *static_cast<const int64_t*>(arg));
      STRATA_LOG(WARNING) << "fault point " << name << at << ": waiting (fault injection) until '"
                          << action.path << "' exists";
      // A test that died before it wrote the file leaves no process waiting for ever.
      const auto give_up = std::chrono::steady_clock::now() + kWaitForFileLimit;
      while (access(action.path.c_str(), F_OK) != 0) {
        if (std::chrono::steady_clock::now() > give_up) {
          STRATA_LOG(WARNING) << "fault point " << name << at << ": '" << action.path
                              << "' did not appear in 10 minutes; going on";
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return;
    }
  }
}

}  // namespace strata
