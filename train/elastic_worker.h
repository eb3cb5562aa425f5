// The elastic worker: one worker of a job whose membership a coordinator owns
// (`strata worker --coordinator`), for its whole life.
//
// - RunElasticWorker joins the job, keeps a heartbeat beside training, and trains every
//   membership generation that holds this worker with one Trainer: created for the first,
//   `Reform`ed for each one after it.
// - It is a state machine (ElasticWorker): joining -> waiting for a generation -> training ->
//   finishing, each state a method that returns the next.
// - A newer generation seen by the heartbeat aborts the collectives in flight; a failed step waits
//   for the generation that explains it; a coordinator that restarts is retried for
//   elastic.coordinator_patience_ms and outwaited for its restart grace (docs/elastic.md).
// - The coordinator is reached through `Membership`, plain calls in proto/coordinator.proto's
//   messages: coordinator/ implements it over gRPC (coordinator/membership_client.h), tests with a
//   fake in the same process. Nothing here links gRPC.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/common/logging.h"
#include "core/common/status.h"
#include "proto/coordinator.pb.h"
#include "runtime/comm/store.h"
#include "train/trainer.h"

namespace strata::train {

// The coordinator as one worker sees it. The calls are those of proto/coordinator.proto's
// service; errors use its codes (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNKNOWN or INTERNAL
// while the coordinator cannot be reached or is restarting; they are retried).
//
// Threads: RunElasticWorker calls it from two threads at the same time — its own, which also runs
// the trainer and so reports steps, starts and checkpoints, and its heartbeat thread (Heartbeat,
// and Attach after the coordinator answers again) — so an implementation must be safe for
// concurrent use. Attach and Detach never overlap each other. The caller owns it; it must outlive
// RunElasticWorker.
class Membership {
 public:
  virtual ~Membership() = default;
  // Where the coordinator is, as messages to the user name it ("HOST:PORT").
  virtual std::string address() const = 0;
  // Asks to join the job. RESOURCE_EXHAUSTED: the job is at its maximum; ALREADY_EXISTS: a worker
  // with this id is already pending or a member.
  [[nodiscard]] virtual StatusOr<coordinator::JoinReply> Join(
      const coordinator::WorkerInfo& info) = 0;
  // The current generation (which may not hold this worker yet).
  [[nodiscard]] virtual StatusOr<coordinator::Generation> Heartbeat(const std::string& id) = 0;
  // Worker `id` of `generation` finished `step`; answers the current generation.
  // FAILED_PRECONDITION: `generation` is no longer current.
  [[nodiscard]] virtual StatusOr<coordinator::Generation> ReportStep(const std::string& id,
                                                                     int64_t generation,
                                                                     int64_t step, double loss,
                                                                     double tokens_per_s) = 0;
  // ReportStep with rank 0's load balance of each MoE layer in the step and the step's metrics
  // line (in the same report, for the coordinator's status and dashboard; the loop calls this
  // one, with neither from the other ranks). The default drops both: a Membership that shows
  // none need not implement it.
  [[nodiscard]] virtual StatusOr<coordinator::Generation> ReportStepWithBalance(
      const std::string& id, int64_t generation, int64_t step, double loss, double tokens_per_s,
      const std::vector<coordinator::MoeLayerBalance>& moe_balance,
      const std::string& metrics_line = "") {
    (void)moe_balance;
    (void)metrics_line;
    return ReportStep(id, generation, step, loss, tokens_per_s);
  }
  // Worker `id` begins `generation` at `step`; rank 0 names the experts each rank holds.
  [[nodiscard]] virtual StatusOr<coordinator::Generation> ReportStart(
      const std::string& id, int64_t generation, int64_t step,
      const std::vector<int64_t>& experts_per_worker) = 0;
  // Rank 0: checkpoint `step` is being written (committed false) or is durable (true).
  [[nodiscard]] virtual Status ReportCheckpoint(const std::string& id, int64_t generation,
                                                int64_t step, bool committed) = 0;
  // Opens the link the coordinator watches (its breaking fails the worker at once); called again
  // when a coordinator that did not answer answers again. Detach(true) closes it as finished
  // (not a failure).
  [[nodiscard]] virtual Status Attach(const std::string& id) = 0;
  [[nodiscard]] virtual Status Detach(bool finished) = 0;
  // The coordinator's record: whether the job finished, its step.
  [[nodiscard]] virtual StatusOr<coordinator::CoordinatorRecord> GetStatus() = 0;
  // The rendezvous store; the loop works under each generation's prefix of it.
  virtual std::shared_ptr<comm::Store> store() = 0;
};

// How RunElasticWorker ended.
struct ElasticWorkerEnd {
  // OK: this worker is done — it trained to the job's last step, or the job finished without it.
  // Otherwise why it stopped.
  Status status;
  // OK without training to the end: why, for the user ("the job at ... finished before this
  // worker got to train"); empty otherwise.
  std::string message;
  // Trained to the job's last step: the trainer (for its evaluations; RunElasticWorker owns it
  // and it lives only until on_end returns) and this worker's rank in the last generation. Null
  // otherwise.
  const Trainer* trainer = nullptr;
  int rank = -1;
};

struct ElasticWorkerOptions {
  // This worker as the coordinator lists it: id (unique within the job), host (the address its
  // peers reach it at), threads, and its config's job part for the coordinator to check.
  coordinator::WorkerInfo info;
  // What the worker trains with: the job's config (its elastic section sets the patience, restart
  // grace and heartbeat timeout used here) and this machine's settings. `progress` says whether
  // the worker shows the progress line while it is rank 0. `worker`, `on_step` and
  // `on_checkpoint` are the loop's own.
  TrainOptions train;
  // Called once, on RunElasticWorker's thread, when the worker is done and before it leaves the
  // coordinator (while it is still listed): the caller reports the end to the user. May be null.
  std::function<void(const ElasticWorkerEnd&)> on_end;
};

// Each MoE layer's load balance in step result `r` (train::SummarizeBalance of r.moe, in the
// model's order), as rank 0 reports it: `layers` are the model's MoE layers
// (MoeTransformer::moe_layers()), which name the block each sits in. The bias range only for a
// layer with loss-free balancing.
std::vector<coordinator::MoeLayerBalance> MoeBalanceOf(
    const StepResult& r, const std::vector<model::MoeTransformer::MoeLayerRef>& layers);

// Runs one worker of `membership`'s job until the job reaches its last step, the job finishes
// without it, or it fails; returns ElasticWorkerEnd::status. Blocks; the caller's thread trains.
[[nodiscard]] Status RunElasticWorker(Membership& membership, ElasticWorkerOptions options);

// Milliseconds on the steady clock (the time RetryWhileUnreachable records).
inline int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Calls `call` until the coordinator answers (it may be restarting): UNAVAILABLE,
// DEADLINE_EXCEEDED, CANCELLED, UNKNOWN and INTERNAL are retried every 200 ms for up to `patience`
// (elastic.coordinator_patience_ms), other answers returned as they are (also after retries: an
// answer is not a silence). A call still failing so after `patience` returns UNAVAILABLE saying
// so, with the last error. Each failed try stores the
// time (SteadyMs) in *unreachable_ms. `call` returns a Status-carrying value (StatusOr). Any thread
// may call it; it blocks that thread while it retries.
template <typename Call>
auto RetryWhileUnreachable(const char* what, const std::string& address,
                           std::chrono::milliseconds patience, Call call,
                           std::atomic<int64_t>* unreachable_ms = nullptr) -> decltype(call()) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  bool told = false;
  while (true) {
    auto r = call();
    const absl::StatusCode code = r.status().code();
    // CANCELLED, UNKNOWN, INTERNAL: the server went away in the middle of the call (a connection
    // reset mid-call surfaces as any of them), or could not write its record for a moment.
    const bool retryable =
        code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
        code == absl::StatusCode::kCancelled || code == absl::StatusCode::kUnknown ||
        code == absl::StatusCode::kInternal;
    if (r.ok() || !retryable || std::chrono::steady_clock::now() > deadline) {
      if (!r.ok() && retryable && told) {
        return decltype(call())(absl::UnavailableError(absl::StrFormat(
            "%s: the coordinator at %s did not answer for %d s (elastic.coordinator_patience_ms); "
            "last error: %s",
            what, address, patience.count() / 1000, r.status().message())));
      }
      return r;
    }
    if (unreachable_ms != nullptr) *unreachable_ms = SteadyMs();
    if (!told) {
      STRATA_LOG(WARNING) << what << ": the coordinator at " << address
                          << " does not answer; retrying for up to " << patience.count() / 1000
                          << " s (" << r.status().message() << ")";
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace strata::train
