#include "train/heartbeat.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/common/logging.h"

namespace strata::train {

Heartbeat::Heartbeat(Membership& membership, std::string id, std::chrono::milliseconds period)
    : membership_(membership), id_(std::move(id)), period_(period) {}

Heartbeat::~Heartbeat() { Stop(); }

void Heartbeat::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void Heartbeat::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::set_abort(Abort abort) {
  absl::MutexLock lock(&mu_);
  abort_ = std::move(abort);
}

void Heartbeat::CallAbort(const std::string& why, int64_t newer_generation) {
  absl::MutexLock lock(&mu_);
  if (abort_) abort_(why, newer_generation);
}

void Heartbeat::Loop() {
  bool reachable = true;
  while (!stop_.load()) {
    Beat(&reachable);
    std::this_thread::sleep_for(period_);
  }
}

void Heartbeat::Beat(bool* reachable) {
  const std::string address = membership_.address();
  StatusOr<coordinator::Generation> hb = membership_.Heartbeat(id_);
  if (!hb.ok() && hb.status().code() == absl::StatusCode::kNotFound) {
    if (!expelled_->exchange(true)) {
      STRATA_LOG(ERROR) << "worker " << id_ << ": the coordinator at " << address
                        << " no longer counts this worker in the job (" << hb.status().message()
                        << "); it stops";
      CallAbort("the coordinator declared this worker failed", std::numeric_limits<int64_t>::max());
    }
    return;
  }
  if (!hb.ok()) {
    unreachable_ms_ = SteadyMs();
    if (*reachable) {
      STRATA_LOG(WARNING) << "worker " << id_ << ": heartbeat to " << address
                          << " failed (training pauses at its next step report until it "
                             "answers): "
                          << hb.status().message();
    }
    *reachable = false;
    return;
  }
  if (!*reachable) {
    unreachable_ms_ = SteadyMs();
    Status a = membership_.Attach(id_);
    STRATA_LOG(INFO) << "worker " << id_ << ": the coordinator at " << address << " answers again"
                     << (a.ok() ? "" : "; reattaching failed: ") << (a.ok() ? "" : a.message());
    *reachable = a.ok();
  }
  *latest_generation_ = std::max(latest_generation_->load(), hb->number());
  if (hb->number() > training_generation_.load()) {
    CallAbort(absl::StrFormat("generation %d formed (%s)", hb->number(), hb->reason()),
              hb->number());
  }
}

}  // namespace strata::train
