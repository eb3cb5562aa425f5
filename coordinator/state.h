// CoordinatorState: the coordinator's logic without sockets — generations, failures, the
// rendezvous store, the checkpoint catalog, and the RocksDB record a restart resumes from
//
// Calls:
// - The gRPC service (and tests) call it. Every call carries the job's token, checked first
//   (UNAUTHENTICATED otherwise).
// - A request that does not fit the state (a second Join of the same worker, a Join on another
//   kind of device than the job's workers, a report from an old generation or out of step order,
//   a Wait past its timeout) gets a status that says what and why, and changes nothing.
//
// Generations:
// - The first forms when `initial_workers` have joined, ranks in join order.
// - A failure (missed heartbeats, a broken stream) or a Leave forms the next one at once with the
//   survivors, in their order. A Join waits for the next step boundary (the step every member
//   reported done) and is appended.
// - Below `min_workers` no generation trains; the next forms as soon as enough workers are there.
// - Every change is synced to RocksDB before the call returns: the record under "state", each
//   generation under "log/<number>".
// - The record's timeline keeps, for each generation formed, when and why, who joined, failed or
//   left, the step boundary it formed at, and, once every member reported its start, the step it
//   started on and when: how long the re-form took and how many steps are trained again.
//
// The checkpoint catalog (record.catalog; catalog.h), for `strata status` and for a generation
// that goes back to a checkpoint:
// - Rank 0 reports a checkpoint when it starts writing it (prepare) and once it committed it. A
//   report can be lost (a coordinator killed in between, a re-form), so the catalog is reconciled
//   with the folder itself (the job config's checkpoint.dir) when the record opens and at every
//   checkpoint report: checkpoint::ListCheckpointSets, read-only, no lock a training process
//   holds, tolerant of commits and removals racing it.
// - A checkpoint with no global manifest stays "not complete" until a newer one commits or the
//   workers re-form (the new generation abandons the commit in flight).
// - The folder may lag rank 0 (an NFS client's cached listing; another folder at that path on the
//   coordinator's host): a commit rank 0 reported that the folder does not list stays complete, at
//   rank 0's word, while it is newer than every listed checkpoint, and goes once a newer one is
//   listed (it was pruned or removed).
// - A folder that cannot be read leaves the catalog as it was (plus rank 0's reports).
//   record.catalog_error says why, naming the folder; it is logged at ERROR once when it appears
//   or changes, at INFO once when it clears.
//
// Threads:
// - Safe for concurrent use: the gRPC server's threads and its failure detector (Tick) call it at
//   once. The state is under one mutex (annotated: clang checks it), and the RocksDB write happens
//   under it; the token check reads only the options.
// - The checkpoint folder is read without that mutex (a slow file system must not hold up
//   heartbeats), under a second one that keeps reconciliations and checkpoint reports in order,
//   taken before the first, never after.
// - Wait blocks its caller up to the timeout without holding the mutex. check_config runs under the
//   mutex on the Join caller's thread: it must not call back into the state.
// - job_config() returns a reference into the record, which other calls replace: use it only while
//   no other thread calls in (Snapshot returns a copy).
// - The state owns its RocksDB handle, and with it the folder's lock, until it is destroyed;
//   nothing may call it then.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/common/status.h"
#include "proto/coordinator.pb.h"
#include "proto/storage.pb.h"
#include "runtime/comm/store.h"

namespace rocksdb {
class DB;
}

namespace strata::coordinator {

struct CoordinatorOptions {
  std::string dir;    // RocksDB folder of the coordinator's record (created if missing)
  std::string token;  // every request must carry it
  int initial_workers = 1;
  int min_workers = 1;
  int max_workers = 1024;
  std::chrono::milliseconds heartbeat_timeout{2000};
  // A resumed record's members get this long to reconnect before the missing ones have failed.
  std::chrono::milliseconds restart_grace{8000};
  // The TLS files the coordinator serves with (recorded, so a restart serves the same way).
  std::string tls_cert, tls_key;
  // Checks a joiner's config (WorkerInfo.job_config) against the job's (the record's job_config);
  // a non-OK status refuses the Join with it. Unset: no check (tests of membership alone).
  std::function<Status(const std::string& job_config, const coordinator::WorkerInfo& worker)>
      check_config;
  // Given rank 0's metrics line of every step it reported and the state counted (not a retried
  // one): the coordinator's dashboard. Steps go up by one within a generation; a new generation
  // may go back. Called on the reporting gRPC thread, after the state's mutex is released; it
  // must not block (rank 0's next step waits for the reply). Unset: lines are checked and
  // dropped.
  std::function<void(const std::string& line)> on_metrics_line;
};

class CoordinatorState {
 public:
  using Time = std::chrono::steady_clock::time_point;

  // Opens (or creates) the record in options.dir. A record already there is resumed — its job
  // config wins over `job_config` — and its members count as alive from now on: they have
  // `restart_grace` to reconnect. The worker counts of `options` are recorded (a caller resuming a
  // record takes them from ReadRecord unless told otherwise).
  [[nodiscard]] static StatusOr<std::unique_ptr<CoordinatorState>> Open(
      const CoordinatorOptions& options, const std::string& job_config, Time now);
  // The record in `dir`, if there is one (std::nullopt for a folder without a record), read
  // without taking the folder's lock; for choosing the options to Open it with.
  [[nodiscard]] static StatusOr<std::optional<coordinator::CoordinatorRecord>> ReadRecord(
      const std::string& dir);
  ~CoordinatorState();

  struct JoinReply {
    bool admitted = false;  // false: pending until the next step boundary (or enough workers)
    int64_t generation = 0;
    int rank = -1;
  };
  [[nodiscard]] StatusOr<JoinReply> Join(const std::string& token,
                                         const coordinator::WorkerInfo& info, Time now);
  // Liveness; returns the current generation so the worker sees changes.
  [[nodiscard]] StatusOr<coordinator::Generation> Heartbeat(const std::string& token,
                                                            const std::string& id, Time now);
  // Worker `id` of generation `generation` finished `step` (each member reports every step in
  // order). Returns the current generation — a new one when this completed a step boundary with
  // joins pending. Rank 0 also gives each MoE layer's load balance in the step, which becomes
  // the record's moe_balance (for Status); a balance that is not rank 0's, has more than
  // kMaxMoeBalanceLayers layers, or holds a figure that is not finite, a negative max_over_mean
  // or cv, or a bias range half given or inverted is refused (INVALID_ARGUMENT naming the field),
  // and the step is not counted. Rank 0 may give the step's metrics line too, which goes to
  // options.on_metrics_line once the step is counted; one from another rank, or longer than
  // train::kMaxMetricsLineBytes (which a worker never sends), is refused the same way.
  [[nodiscard]] StatusOr<coordinator::Generation> ReportStep(
      const std::string& token, const std::string& id, int64_t generation, int64_t step, Time now,
      double loss = 0, double tokens_per_s = 0,
      const std::vector<coordinator::MoeLayerBalance>& moe_balance = {},
      const std::string& metrics_line = "") ABSL_LOCKS_EXCLUDED(mu_);
  // Worker `id` begins generation `generation` at `step`, the state it re-formed on: the
  // generation's first step. It must lie within one step of the last boundary (a failure can cut
  // the step after it short on some workers only), or up to config::CopiesLagSteps before it (a
  // TIERED job's buddy copies lag), or be a committed checkpoint of the catalog
  // (the state was lost and the job goes back) — in the job's first generation, anywhere its
  // workers resumed from — and agree with the other members'.
  // Rank 0 also gives the experts each rank holds, for Status.
  [[nodiscard]] StatusOr<coordinator::Generation> ReportStart(
      const std::string& token, const std::string& id, int64_t generation, int64_t step,
      const std::vector<int64_t>& experts_per_worker, Time now);
  // Rank 0 of the current generation prepares (commit false) or commits checkpoint `step`; the
  // catalog records the report, then is reconciled with the checkpoint folder (also after a
  // refused report: it says the folder changed). A folder that cannot be read does not fail the
  // report (see ReconcileCheckpoints).
  [[nodiscard]] Status Checkpoint(const std::string& token, const std::string& id,
                                  int64_t generation, int64_t step, bool commit);
  // Reads the committed checkpoints of the job's checkpoint.dir and records in the catalog which
  // checkpoints are complete and which shards each holds (ReconcileCatalog; synced when it
  // changes). A folder that cannot be read, or that holds no manifests/ while the catalog holds
  // complete checkpoints (it is not the folder rank 0 commits to: that one lies on a file system
  // this machine does not mount), changes nothing but record.catalog_error. A folder that was
  // read but does not show a commit rank 0 reported (ReconcileCatalog keeps it) is reconciled and
  // sets record.catalog_error too, naming the checkpoints it lacks. That error, naming the folder,
  // is returned (FAILED_PRECONDITION for a folder that was read) and logged when it is new. OK,
  // reading nothing, for a job without checkpoint.dir. Open, Checkpoint and ReportStart (for a
  // generation going back) call it.
  [[nodiscard]] Status ReconcileCheckpoints();
  [[nodiscard]] Status Leave(const std::string& token, const std::string& id, Time now);
  // The worker's stream broke: it has failed (no token: this comes from the service itself).
  [[nodiscard]] Status StreamBroken(const std::string& id, Time now);
  // The worker finished the job: it stays listed in its generation but is no longer watched, so
  // its exit is not a failure.
  void Finished(const std::string& id);
  // Members whose last heartbeat is older than the timeout have failed. Returns how many.
  [[nodiscard]] StatusOr<int> Tick(Time now);
  // Records the address the coordinator serves on (so a restart can serve there again).
  [[nodiscard]] Status SetListenAddress(const std::string& address);
  // The job finished and no member of its last generation is still attached or watched (pending
  // joiners do not count): nothing is left to serve.
  bool Done() const;

  // The rendezvous store (not persisted: a new generation rendezvouses afresh).
  [[nodiscard]] Status Set(const std::string& token, const std::string& key,
                           const std::string& value);
  [[nodiscard]] StatusOr<std::string> Get(const std::string& token, const std::string& key);
  [[nodiscard]] Status Wait(const std::string& token, const std::vector<std::string>& keys,
                            std::chrono::milliseconds timeout);
  [[nodiscard]] StatusOr<int64_t> Add(const std::string& token, const std::string& key,
                                      int64_t delta);

  // OK for the job's token, UNAUTHENTICATED otherwise (for calls that carry no other check).
  [[nodiscard]] Status Authenticate(const std::string& token) const { return CheckToken(token); }
  coordinator::CoordinatorRecord Snapshot() const;
  const std::string& job_config() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return record_.job_config();
  }

 private:
  CoordinatorState() = default;
  Status CheckToken(const std::string& token) const;
  // Forms generation number + 1 from `workers`, `gone` being the members of the current one that
  // failed or left (as `reason` says); records it in the timeline; persists. Locked.
  Status NewGenerationLocked(std::vector<coordinator::WorkerInfo> workers, const char* reason,
                             Time now, const std::vector<std::string>& gone = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReportStep under mu_; *counted says whether the step was counted now (not a retry).
  StatusOr<coordinator::Generation> ReportStepLocked(
      const std::string& id, int64_t generation, int64_t step, Time now, double loss,
      double tokens_per_s, const std::vector<coordinator::MoeLayerBalance>& moe_balance,
      const std::string& metrics_line, bool* counted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status RemoveLocked(const std::string& id, const char* reason, Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A report (step or start) must come from a member of the current generation.
  Status CheckReportLocked(const std::string& id, int64_t generation, int64_t step,
                           const char* what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves every member's last heartbeat `stalled` later when the coordinator itself stood still
  // that long (a slow synced write under mu_, opening its record): heartbeats waited meanwhile.
  // Stalls under a quarter of the heartbeat timeout are ignored. Locked.
  // Worker `id` was heard from at `now` (never moving its last heartbeat back).
  // from_member: a word from the worker itself (it ends a restart's grace), not a generation
  // that lists it.
  void SeenLocked(const std::string& id, Time now, bool from_member = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CreditStallLocked(std::chrono::steady_clock::duration stalled, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsMemberLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION when `info` trains on another kind of device (CPU or GPU) than a member
  // or a pending worker, naming both. A worker that does not say its device is of no known kind
  // and is not compared.
  Status CheckDeviceKindLocked(const coordinator::WorkerInfo& info) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records rank 0's checkpoint report in the catalog.
  Status RecordCheckpointReport(const std::string& id, int64_t generation, int64_t step,
                                bool commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // ReconcileCheckpoints without taking catalog_mu_.
  Status ReconcileWithFolder() ABSL_EXCLUSIVE_LOCKS_REQUIRED(catalog_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Open's part under mu_: the record read from db_ (or a new one for `job_config`), resumed
  // members given their restart grace from `now`, the options recorded, and all of it synced.
  Status LoadLocked(const std::string& job_config, Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the catalog follows the folder: the job has a checkpoint.dir and the last
  // reconciliation read it. Otherwise a checkpoint rank 0 reported prepared may also be one a
  // generation goes back to (its commit report may be on its way). Locked.
  bool CatalogFollowsFolderLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the job is in its first generation, before any step: it may start anywhere (its
  // workers resumed from a checkpoint).
  bool FirstGenerationLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rendezvous keys of `keys` not set yet.
  std::vector<std::string> MissingKeysLocked(const std::vector<std::string>& keys) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CoordinatorOptions options_;
  std::string checkpoint_dir_;  // the job config's checkpoint.dir, read at Open ("": none)
  int64_t copies_lag_ = 0;      // config::CopiesLagSteps of the job config, read at Open
  std::unique_ptr<rocksdb::DB> db_ ABSL_PT_GUARDED_BY(mu_);  // written under mu_
  // Orders checkpoint reports and reads of the folder; taken before mu_, never after.
  absl::Mutex catalog_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  absl::CondVar kv_cv_;  // kv_ changed
  coordinator::CoordinatorRecord record_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Time> last_seen_ ABSL_GUARDED_BY(mu_);  // members and pending workers
  // Not heard from since a restart (last_seen_: grace).
  std::set<std::string> in_grace_ ABSL_GUARDED_BY(mu_);
  // The recent stalls CreditStallLocked credited (when each ended, how long it was), the oldest
  // first, kept for a few heartbeat timeouts: a call's time read before one of them ended is moved
  // on by the part of it the call waited through.
  struct Stall {
    Time ended;
    std::chrono::steady_clock::duration length;
  };
  std::deque<Stall> stalls_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> reported_ ABSL_GUARDED_BY(mu_);  // member -> last step reported
  std::map<std::string, bool> started_ ABSL_GUARDED_BY(mu_);      // member -> sent its start report
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
};

// The most MoE layers a step report's balance may hold.
inline constexpr int kMaxMoeBalanceLayers = 4096;
// The generations the record's timeline keeps (the newest; older ones are dropped, the counts
// workers_failed, workers_left and workers_joined go on).
inline constexpr int kMaxTimelineEvents = 128;

// One MoE layer's load balance as `strata status` shows it:
// "moe layer 3: max/mean load 1.42, cv 0.31, bias [-0.012, 0.009]" (the bias only when given).
std::string MoeBalanceLine(const coordinator::MoeLayerBalance& layer);

// The rendezvous Store of workers in the coordinator's process (tests; the gRPC store calls the
// same methods remotely). The store keeps `state`, which must outlive it; any thread may use it.
std::shared_ptr<comm::Store> MakeCoordinatorStore(CoordinatorState* state, std::string token);

}  // namespace strata::coordinator
