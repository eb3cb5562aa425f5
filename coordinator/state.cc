#include "coordinator/state.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_set.h"
#include "coordinator/catalog.h"
#include "core/common/fault_point.h"
#include "core/common/logging.h"
#include "google/protobuf/text_format.h"
#include "proto/config.pb.h"
#include "proto/config_io.h"
#include "train/metrics.h"

namespace strata::coordinator {

namespace {

// A member whose last step a restarted coordinator does not know yet.
constexpr int64_t kUnknownStep = std::numeric_limits<int64_t>::min();

int64_t UnixMillisNow() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Appends to `next` the timeline event of its generation, just formed: `first` for the job's
// first, `before_ids` the members it follows, `gone` those of them that failed (or left).
void AddTimelineEvent(coordinator::CoordinatorRecord* next, bool first,
                      const std::set<std::string>& before_ids, const std::vector<std::string>& gone,
                      bool left) {
  const coordinator::Generation& g = next->generation();
  coordinator::GenerationEvent e;
  e.set_number(g.number());
  e.set_reason(g.reason());
  e.set_formed_unix_ms(UnixMillisNow());
  e.set_workers(g.workers_size());
  e.set_boundary_step(g.first_step());
  for (const auto& w : g.workers()) {
    if (!before_ids.count(w.id())) e.add_joined(w.id());
  }
  if (g.workers_size() == 0) {
    for (const auto& w : next->pending()) {
      if (before_ids.count(w.id())) e.add_waiting(w.id());
    }
  }
  for (const std::string& id : gone) (left ? e.add_left() : e.add_failed())->assign(id);
  if (!first) next->set_workers_joined(next->workers_joined() + e.joined_size());
  next->set_workers_failed(next->workers_failed() + e.failed_size());
  next->set_workers_left(next->workers_left() + e.left_size());
  *next->add_timeline() = std::move(e);
  auto* t = next->mutable_timeline();
  if (t->size() > kMaxTimelineEvents) t->DeleteSubrange(0, t->size() - kMaxTimelineEvents);
}

// Worker `id` failed (or left) while it waited in a generation too small to train: a member of
// the one before, so it counts, and the waiting generation's event names it.
void NoteWaitingDeparture(coordinator::CoordinatorRecord* r, const std::string& id, bool left) {
  if (r->generation().workers_size() > 0 || r->timeline_size() == 0) return;
  coordinator::GenerationEvent* e = r->mutable_timeline(r->timeline_size() - 1);
  if (e->number() != r->generation().number() ||
      std::find(e->waiting().begin(), e->waiting().end(), id) == e->waiting().end()) {
    return;
  }
  (left ? e->add_left() : e->add_failed())->assign(id);
  if (left) {
    r->set_workers_left(r->workers_left() + 1);
  } else {
    r->set_workers_failed(r->workers_failed() + 1);
  }
}

Status FromRocks(const rocksdb::Status& s, const std::string& what, const std::string& dir) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsCorruption()) {
    return absl::DataLossError(absl::StrFormat(
        "the coordinator's record in '%s' is damaged (%s: %s); restore the folder from a copy, or "
        "start the job afresh with an empty folder (workers then resume from its checkpoints)",
        dir, what, s.ToString()));
  }
  return absl::InternalError(
      absl::StrFormat("%s the coordinator's record in '%s': %s", what, dir, s.ToString()));
}

std::string LogKey(int64_t generation) { return absl::StrFormat("log/%020d", generation); }

// A step report's MoE balance is what a worker's trainer computed, and a worker of another build
// (or with corrupt statistics) may send anything: it is checked before it reaches the record,
// whose figures `strata status` prints.
Status CheckMoeBalance(const std::vector<coordinator::MoeLayerBalance>& balance,
                       const std::string& id, int64_t step) {
  const auto refuse = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s' reported step %d with %s; the step is not counted (the worker's step "
        "statistics are corrupt, or its strata build does not match the coordinator's)",
        id, step, what));
  };
  if (balance.size() > static_cast<size_t>(kMaxMoeBalanceLayers)) {
    return refuse(
        absl::StrFormat("StepReport.moe_balance of %d MoE layers, more than the %d a "
                        "report may hold",
                        balance.size(), kMaxMoeBalanceLayers));
  }
  for (size_t i = 0; i < balance.size(); ++i) {
    const coordinator::MoeLayerBalance& b = balance[i];
    const auto field = [&](const char* name) {
      return absl::StrFormat("StepReport.moe_balance[%d].%s", i, name);
    };
    if (b.block() < 0) {
      return refuse(absl::StrFormat("%s = %d, a negative block index", field("block"), b.block()));
    }
    for (const auto& [name, value] :
         {std::pair{"max_over_mean", b.max_over_mean()}, std::pair{"cv", b.cv()}}) {
      if (!std::isfinite(value) || value < 0) {
        return refuse(
            absl::StrFormat("%s = %g (it must be finite and not negative)", field(name), value));
      }
    }
    if (b.has_bias_min() != b.has_bias_max()) {
      return refuse(absl::StrFormat("%s without %s (a bias range needs both)",
                                    field(b.has_bias_min() ? "bias_min" : "bias_max"),
                                    b.has_bias_min() ? "bias_max" : "bias_min"));
    }
    for (const auto& [name, value] :
         {std::pair{"bias_min", b.bias_min()}, std::pair{"bias_max", b.bias_max()}}) {
      if (!std::isfinite(value)) {
        return refuse(absl::StrFormat("%s = %g (it must be finite)", field(name), value));
      }
    }
    if (b.bias_min() > b.bias_max()) {
      return refuse(absl::StrFormat("%s = %g above %s = %g", field("bias_min"), b.bias_min(),
                                    field("bias_max"), b.bias_max()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

CoordinatorState::~CoordinatorState() = default;

StatusOr<std::unique_ptr<CoordinatorState>> CoordinatorState::Open(
    const CoordinatorOptions& options, const std::string& job_config, Time now) {
  if (options.token.empty()) {
    return absl::InvalidArgumentError("the coordinator needs a job token (none was given)");
  }
  if (options.min_workers < 1 || options.initial_workers < options.min_workers ||
      options.max_workers < options.initial_workers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workers must satisfy 1 <= min (%d) <= initial (%d) <= max (%d)",
                        options.min_workers, options.initial_workers, options.max_workers));
  }
  const auto opening = std::chrono::steady_clock::now();
  std::unique_ptr<CoordinatorState> c(new CoordinatorState);
  c->options_ = options;
  rocksdb::Options ro;
  ro.create_if_missing = true;
  ro.paranoid_checks = true;
  ro.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  ro.keep_log_file_num = 2;
  rocksdb::DB* db = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(ro, options.dir, &db), "opening", options.dir));
  {
    absl::MutexLock lock(&c->mu_);
    c->db_.reset(db);
    RETURN_IF_ERROR(c->LoadLocked(job_config, now));
  }
  // A report lost with a coordinator that stopped (a commit it never heard of, a prepare whose
  // workers died) is read from the folder now. A folder it cannot read is logged, not fatal: the
  // job goes on with the catalog it had.
  (void)c->ReconcileCheckpoints();
  {
    // A restart's grace counts from when the coordinator can answer, not from before it opened
    // its record (which a busy disk can make take seconds).
    absl::MutexLock lock(&c->mu_);
    c->CreditStallLocked(std::chrono::steady_clock::now() - opening, "opening its record");
  }
  return c;
}

Status CoordinatorState::LoadLocked(const std::string& job_config, Time now) {
  std::string bytes;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), "state", &bytes);
  if (s.ok()) {
    if (!record_.ParseFromString(bytes)) {
      return absl::DataLossError(absl::StrFormat(
          "the coordinator's record in '%s' does not parse; restore the folder from a copy, or "
          "start the job afresh with an empty folder",
          options_.dir));
    }
    // Resumed: members and pending workers get `restart_grace` from now to reconnect (a
    // member that died while no coordinator ran is found when it is over), and a member's next
    // step report is taken as it comes (it may have trained past the last boundary the record
    // holds).
    const Time grace = now + options_.restart_grace - options_.heartbeat_timeout;
    for (const auto& w : record_.generation().workers()) {
      last_seen_[w.id()] = grace;
      in_grace_.insert(w.id());
      reported_[w.id()] = kUnknownStep;
    }
    for (const auto& w : record_.pending()) {
      last_seen_[w.id()] = grace;
      in_grace_.insert(w.id());
    }
  } else if (s.IsNotFound()) {
    record_.set_job_config(job_config);
    record_.mutable_generation()->set_number(0);
    record_.mutable_generation()->set_reason("waiting for workers");
    record_.set_step(0);
  } else {
    return FromRocks(s, "reading", options_.dir);
  }
  // A record whose job config was never given (a coordinator refused before) takes this one.
  if (record_.job_config().empty()) record_.set_job_config(job_config);
  record_.set_initial_workers(options_.initial_workers);
  record_.set_tls_cert(options_.tls_cert);
  record_.set_tls_key(options_.tls_key);
  record_.set_min_workers(options_.min_workers);
  record_.set_max_workers(options_.max_workers);
  record_.set_opened(record_.opened() + 1);
  config::JobConfig job;
  if (google::protobuf::TextFormat::ParseFromString(record_.job_config(), &job)) {
    checkpoint_dir_ = job.checkpoint().dir();
    copies_lag_ = config::CopiesLagSteps(job);
  } else {
    STRATA_LOG(WARNING) << "the job config in the coordinator's record in '" << options_.dir
                        << "' does not parse: its checkpoint catalog is not checked against the "
                           "checkpoint folder";
  }
  return PersistLocked();
}

StatusOr<std::optional<coordinator::CoordinatorRecord>> CoordinatorState::ReadRecord(
    const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "CURRENT", ec)) return std::nullopt;
  rocksdb::Options ro;
  ro.paranoid_checks = true;
  ro.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  rocksdb::DB* raw = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::OpenForReadOnly(ro, dir, &raw), "opening", dir));
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string bytes;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), "state", &bytes);
  if (s.IsNotFound()) return std::nullopt;
  RETURN_IF_ERROR(FromRocks(s, "reading", dir));
  coordinator::CoordinatorRecord record;
  if (!record.ParseFromString(bytes)) {
    return absl::DataLossError(absl::StrFormat(
        "the coordinator's record in '%s' does not parse; restore the folder from a copy, or "
        "start the job afresh with an empty folder",
        dir));
  }
  return record;
}

Status CoordinatorState::SetListenAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (record_.listen() == address) return absl::OkStatus();
  coordinator::CoordinatorRecord before = record_;
  record_.set_listen(address);
  Status s = PersistLocked();
  if (!s.ok()) record_ = before;
  return s;
}

bool CoordinatorState::Done() const {
  absl::MutexLock lock(&mu_);
  if (!record_.finished()) return false;
  for (const auto& w : record_.generation().workers()) {
    if (last_seen_.count(w.id())) return false;
  }
  return true;
}

Status CoordinatorState::CheckToken(const std::string& token) const {
  // Compared in time independent of where the strings differ: a caller learns nothing of the
  // token from how long a refusal takes.
  const std::string& want = options_.token;
  unsigned char diff = token.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < token.size() ? token[i] : 0));
  }
  if (diff != 0) {
    return absl::UnauthenticatedError(
        "the request does not carry this job's token; workers started by `strata launch` get it "
        "from STRATA_JOB_TOKEN, others must be given it");
  }
  return absl::OkStatus();
}

bool CoordinatorState::IsMemberLocked(const std::string& id) const {
  for (const auto& w : record_.generation().workers()) {
    if (w.id() == id) return true;
  }
  return false;
}

bool CoordinatorState::CatalogFollowsFolderLocked() const {
  return !checkpoint_dir_.empty() && record_.catalog_error().empty();
}

Status CoordinatorState::ReconcileCheckpoints() {
  absl::MutexLock serial(&catalog_mu_);
  return ReconcileWithFolder();
}

Status CoordinatorState::ReconcileWithFolder() {
  if (checkpoint_dir_.empty()) return absl::OkStatus();
  // Read without mu_: the folder may be slow, and it is only read (no lock, no write), so a
  // training job writing it is never held up and a listing racing its commits is still a list
  // of what committed.
  // A folder where no checkpoint was ever committed has no manifests/ (a removal leaves it).
  std::error_code ec;
  const bool committed_here =
      std::filesystem::exists(std::filesystem::path(checkpoint_dir_) / "manifests", ec);
  StatusOr<std::vector<storage::CheckpointSet>> sets = std::vector<storage::CheckpointSet>();
  if (ec) {
    sets = absl::UnavailableError(ec.message());
  } else if (committed_here) {
    sets = checkpoint::ListCheckpointSets(checkpoint_dir_);
  }
  absl::MutexLock lock(&mu_);
  // Before its first checkpoint that is how a job's folder is; after it, such a folder is not the
  // one rank 0 writes (another machine's, not mounted here), and it says nothing of the catalog.
  const bool unseen = sets.ok() && !committed_here && CompleteCheckpoints(record_) > 0;
  coordinator::CoordinatorRecord before = record_;
  Status read = absl::OkStatus();
  // The error names no catalog entry that a report changes, so it stays the same string while
  // its cause does, and is logged and synced once.
  if (!sets.ok() || unseen) {
    const std::string why =
        unseen ? std::string(
                     "it holds no global manifests (no manifests/ folder), yet the catalog "
                     "holds committed checkpoints: it is not the folder rank 0 commits "
                     "to (mount that one here at the same path), or it was emptied")
               : absl::StrCat(sets.status().message(), " (`strata ckpt ls ", checkpoint_dir_,
                              "` shows the same)");
    read = Status(unseen ? absl::StatusCode::kFailedPrecondition : sets.status().code(),
                  absl::StrFormat("the coordinator could not read the checkpoint folder '%s' "
                                  "(checkpoint.dir) to check its catalog: %s. The catalog keeps "
                                  "what it held and takes rank 0's reports at their word",
                                  checkpoint_dir_, why));
  } else {
    SetCatalog(&record_,
               ReconcileCatalog(CatalogOf(record_), *sets, record_.generation().number()));
    // What ReconcileCatalog kept at rank 0's word.
    std::vector<int64_t> unlisted;
    for (const auto& e : record_.catalog()) {
      if (e.complete() && std::none_of(sets->begin(), sets->end(),
                                       [&](const auto& set) { return set.step() == e.step(); })) {
        unlisted.push_back(e.step());
      }
    }
    if (!unlisted.empty()) {
      read = absl::FailedPreconditionError(absl::StrFormat(
          "the checkpoint folder '%s' (checkpoint.dir) does not show checkpoint%s %s that rank 0 "
          "reported committed: this machine's listing of its manifests/ may lag (an NFS client's "
          "cached listing, up to a minute by default), or it is not the folder rank 0 commits to "
          "(mount that one here at the same path). The catalog holds %s complete at rank 0's word "
          "until the folder lists %s or a newer checkpoint",
          checkpoint_dir_, unlisted.size() == 1 ? "" : "s", absl::StrJoin(unlisted, ", "),
          unlisted.size() == 1 ? "it" : "them", unlisted.size() == 1 ? "it" : "them"));
    }
  }
  if (read.ok()) {
    record_.clear_catalog_error();
  } else {
    record_.set_catalog_error(std::string(read.message()));
  }
  if (record_.catalog_error() != before.catalog_error()) {
    if (!read.ok()) {
      STRATA_LOG(ERROR) << read.message() << " (catalog: " << DescribeCatalog(record_) << ")";
    } else {
      STRATA_LOG(INFO) << "the coordinator reads the checkpoint folder '" << checkpoint_dir_
                       << "' again and its catalog follows it: " << DescribeCatalog(record_);
    }
  }
  if (record_.SerializeAsString() == before.SerializeAsString()) return read;
  // Said when the folder tells something the reports did not (a commit never reported, a
  // checkpoint gone), not for the shards it adds to each reported commit, nor beside the error
  // line above (which names the catalog).
  auto completeness = [](const coordinator::CoordinatorRecord& r) {
    std::vector<std::pair<int64_t, bool>> v;
    for (const auto& e : r.catalog()) v.emplace_back(e.step(), e.complete());
    return v;
  };
  if (record_.catalog_error() == before.catalog_error() &&
      completeness(record_) != completeness(before)) {
    STRATA_LOG(INFO) << "checkpoint catalog, checked against '" << checkpoint_dir_
                     << "': " << DescribeCatalog(record_) << " (it held " << DescribeCatalog(before)
                     << ")";
  }
  Status s = PersistLocked();
  if (!s.ok()) {
    record_ = before;
    return s;
  }
  return read;
}

Status CoordinatorState::PersistLocked() {
  rocksdb::WriteBatch batch;
  batch.Put("state", record_.SerializeAsString());
  batch.Put(LogKey(record_.generation().number()), record_.generation().SerializeAsString());
  rocksdb::WriteOptions wo;
  wo.sync = true;
  const auto started = std::chrono::steady_clock::now();
  // Drills stall the write here (sleep_ms), as a disk busy with other writers does.
  STRATA_FAULT_POINT("coordinator.persist", nullptr);
  Status s = FromRocks(db_->Write(wo, &batch), "writing", options_.dir);
  CreditStallLocked(std::chrono::steady_clock::now() - started, "a synced write of its record");
  return s;
}

void CoordinatorState::SeenLocked(const std::string& id, Time now, bool from_member) {
  // A time read before a credited stall ended (the call waited for mu_ through it, or made the
  // write that stalled) is moved on by the part of that stall after it, as the credit moved every
  // heartbeat: the coordinator's stall is not held against a worker by a report that waited for
  // it, however many writes it waited behind. A member's time never goes back (a call that read
  // the clock early must not undo a later heartbeat or a credit), except that the first word from
  // a member after a restart replaces its grace: from then on the usual timeout applies.
  Time seen = now;
  for (const Stall& stall : stalls_) {
    if (stall.ended > now) seen += std::min(stall.length, stall.ended - now);
  }
  auto [it, inserted] = last_seen_.try_emplace(id, seen);
  if (inserted || (from_member && in_grace_.erase(id) > 0)) {
    it->second = seen;
  } else {
    it->second = std::max(it->second, seen);
  }
}

void CoordinatorState::CreditStallLocked(std::chrono::steady_clock::duration stalled,
                                         const char* what) {
  // Heartbeats wait for mu_ while the coordinator is stalled: the time is the coordinator's, not
  // a sign that the workers are gone (a disk busy with other writers has held a synced write up
  // for seconds). Short stalls are below what a heartbeat timeout notices, and crediting them
  // would let a busy coordinator (a write at every step boundary) put off finding a dead worker.
  if (stalled < options_.heartbeat_timeout / 4) return;
  const Time ended = std::chrono::steady_clock::now();
  for (auto& [id, seen] : last_seen_) seen += stalled;
  stalls_.push_back({ended, stalled});
  while (stalls_.size() > 1 && stalls_.front().ended < ended - 4 * options_.heartbeat_timeout) {
    stalls_.pop_front();
  }
  STRATA_LOG(WARNING) << absl::StrFormat(
      "the coordinator stood still for %d ms (%s); the workers' heartbeats are not held against "
      "them for that time",
      std::chrono::duration_cast<std::chrono::milliseconds>(stalled).count(), what);
}

Status CoordinatorState::NewGenerationLocked(std::vector<coordinator::WorkerInfo> workers,
                                             const char* reason, Time now,
                                             const std::vector<std::string>& gone) {
  if (record_.finished()) return absl::OkStatus();  // the job is done: nobody re-forms
  // The members a join is new to: the current generation's, or, while it is too small to train,
  // those that wait in it.
  std::set<std::string> before_ids;
  for (const auto& w : record_.generation().workers()) before_ids.insert(w.id());
  if (record_.generation().workers_size() == 0 && record_.timeline_size() > 0) {
    const auto& last = record_.timeline(record_.timeline_size() - 1);
    before_ids.insert(last.waiting().begin(), last.waiting().end());
  }
  coordinator::CoordinatorRecord next = record_;
  coordinator::Generation* g = next.mutable_generation();
  g->set_number(record_.generation().number() + 1);
  g->clear_workers();
  // Every member re-forms for a new generation anyway: the pending joins come in with it, after
  // the members (a failure must not leave them waiting for a step boundary that the smaller
  // generation may never reach, nor out of the record).
  for (const auto& p : record_.pending()) {
    if (std::none_of(workers.begin(), workers.end(),
                     [&](const coordinator::WorkerInfo& w) { return w.id() == p.id(); })) {
      workers.push_back(p);
    }
  }
  const bool enough = static_cast<int>(workers.size()) >= options_.min_workers;
  if (enough) {
    for (auto& w : workers) *g->add_workers() = std::move(w);
    g->set_reason(reason);
  } else {
    // Too few to train: they wait (as pending joins) for more.
    next.clear_pending();
    g->set_reason(absl::StrFormat("waiting for workers (%d of at least %d)", workers.size(),
                                  options_.min_workers));
    for (auto& w : workers) *next.add_pending() = std::move(w);
  }
  g->set_first_step(record_.step());
  if (enough) next.clear_pending();
  AddTimelineEvent(&next, record_.generation().number() == 0, before_ids, gone,
                   std::string(reason) == "leave");
  if (CatalogFollowsFolderLocked()) {
    // The new generation abandons the commit in flight: a checkpoint that is not complete now
    // never will be (one that committed just before is found in the folder at the next check).
    std::vector<CatalogCheckpoint> kept;
    for (const auto& e : next.catalog()) {
      if (e.complete()) kept.push_back(e);
    }
    SetCatalog(&next, std::move(kept));
  }
  const coordinator::CoordinatorRecord before = record_;
  record_ = std::move(next);
  Status s = PersistLocked();
  if (!s.ok()) {
    record_ = before;  // nothing changes when the record cannot be written
    return s;
  }
  reported_.clear();
  started_.clear();
  for (const auto& w : record_.generation().workers()) {
    reported_[w.id()] = record_.step();
    // Not a word from the member: one still reconnecting after a restart keeps its grace.
    SeenLocked(w.id(), now, /*from_member=*/false);
  }
  return absl::OkStatus();
}

namespace {

// "cpu" or "cuda": the kind of a WorkerInfo's device; empty when the worker did not say (a worker
// of an older strata, whose kind is unknown).
std::string DeviceKind(const coordinator::WorkerInfo& w) {
  return w.device().substr(0, w.device().find(':'));
}

}  // namespace

Status CoordinatorState::CheckDeviceKindLocked(const coordinator::WorkerInfo& info) const {
  const std::string kind = DeviceKind(info);
  if (kind.empty()) return absl::OkStatus();
  auto check = [&](const coordinator::WorkerInfo& other) -> Status {
    const std::string theirs = DeviceKind(other);
    if (theirs.empty() || theirs == kind) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker '%s' trains on %s, but the job's workers train on %s (worker '%s': %s); a job's "
        "workers all train on the CPU or all on GPUs. %s, or start the job again on the devices "
        "you want",
        info.id(), info.device(), theirs, other.id(), other.device(),
        theirs == "cpu" ? "Start it with --device cpu"
                        : "Start it with --device cuda on a machine with a GPU"));
  };
  for (const auto& w : record_.generation().workers()) RETURN_IF_ERROR(check(w));
  for (const auto& w : record_.pending()) RETURN_IF_ERROR(check(w));
  return absl::OkStatus();
}

StatusOr<CoordinatorState::JoinReply> CoordinatorState::Join(const std::string& token,
                                                             const coordinator::WorkerInfo& info,
                                                             Time now) {
  RETURN_IF_ERROR(CheckToken(token));
  if (info.id().empty()) {
    return absl::InvalidArgumentError("Join without a worker id; give each worker a unique id");
  }
  absl::MutexLock lock(&mu_);
  if (record_.finished()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the job finished at step %d; worker '%s' has nothing to join", record_.step(), info.id()));
  }
  if (options_.check_config) RETURN_IF_ERROR(options_.check_config(record_.job_config(), info));
  const bool pending = std::any_of(record_.pending().begin(), record_.pending().end(),
                                   [&](const auto& w) { return w.id() == info.id(); });
  if (IsMemberLocked(info.id()) || pending) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "worker '%s' has already joined (%s of generation %d); a restarted worker needs a new id",
        info.id(), pending ? "pending" : "a member", record_.generation().number()));
  }
  RETURN_IF_ERROR(CheckDeviceKindLocked(info));
  const int total = record_.generation().workers_size() + record_.pending_size();
  if (total >= options_.max_workers) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the job already has %d workers, its maximum (max_workers); worker '%s' was not admitted",
        total, info.id()));
  }
  JoinReply reply;
  const bool training = record_.generation().workers_size() > 0;
  const int needed =
      record_.generation().number() == 0 ? options_.initial_workers : options_.min_workers;
  if (!training && record_.pending_size() + 1 >= needed) {
    // Enough to start (or restart) training now: no step is running to wait for.
    std::vector<coordinator::WorkerInfo> workers(record_.pending().begin(),
                                                 record_.pending().end());
    workers.push_back(info);
    RETURN_IF_ERROR(NewGenerationLocked(
        std::move(workers), record_.generation().number() == 0 ? "start" : "join", now));
    reply.admitted = true;
    reply.rank = record_.generation().workers_size() - 1;
  } else {
    coordinator::CoordinatorRecord before = record_;
    *record_.add_pending() = info;
    Status s = PersistLocked();
    if (!s.ok()) {
      record_ = before;
      return s;
    }
    SeenLocked(info.id(), now);
  }
  reply.generation = record_.generation().number();
  return reply;
}

StatusOr<coordinator::Generation> CoordinatorState::Heartbeat(const std::string& token,
                                                              const std::string& id, Time now) {
  RETURN_IF_ERROR(CheckToken(token));
  absl::MutexLock lock(&mu_);
  auto it = last_seen_.find(id);
  if (it == last_seen_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "worker '%s' is not part of the job (it never joined, or it was declared failed); it "
        "must Join again with a new id",
        id));
  }
  SeenLocked(id, now);
  return record_.generation();
}

Status CoordinatorState::CheckReportLocked(const std::string& id, int64_t generation, int64_t step,
                                           const char* what) const {
  const int64_t current = record_.generation().number();
  if (generation != current) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker '%s' %s %d of generation %d, but the job is in generation %d; it must re-form "
        "its communicators for generation %d first",
        id, what, step, generation, current, current));
  }
  if (reported_.find(id) == reported_.end()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("worker '%s' is not a member of generation %d", id, current));
  }
  return absl::OkStatus();
}

StatusOr<coordinator::Generation> CoordinatorState::ReportStep(
    const std::string& token, const std::string& id, int64_t generation, int64_t step, Time now,
    double loss, double tokens_per_s, const std::vector<coordinator::MoeLayerBalance>& moe_balance,
    const std::string& metrics_line) {
  RETURN_IF_ERROR(CheckToken(token));
  bool counted = false;
  StatusOr<coordinator::Generation> g;
  {
    absl::MutexLock lock(&mu_);
    g = ReportStepLocked(id, generation, step, now, loss, tokens_per_s, moe_balance, metrics_line,
                         &counted);
  }
  if (counted && !metrics_line.empty() && options_.on_metrics_line) {
    options_.on_metrics_line(metrics_line);
  }
  return g;
}

StatusOr<coordinator::Generation> CoordinatorState::ReportStepLocked(
    const std::string& id, int64_t generation, int64_t step, Time now, double loss,
    double tokens_per_s, const std::vector<coordinator::MoeLayerBalance>& moe_balance,
    const std::string& metrics_line, bool* counted) {
  // A stale generation first: its worker re-forms, whatever else the report holds.
  RETURN_IF_ERROR(CheckReportLocked(id, generation, step, "reported step"));
  RETURN_IF_ERROR(CheckMoeBalance(moe_balance, id, step));
  const bool rank0 =
      record_.generation().workers_size() > 0 && record_.generation().workers(0).id() == id;
  if (!moe_balance.empty() && !rank0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s' reported step %d with StepReport.moe_balance, but it is not rank 0 of "
        "generation %d (rank 0 alone reports the load balance); the step is not counted",
        id, step, generation));
  }
  if (!metrics_line.empty() && !rank0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s' reported step %d with StepReport.metrics_line, but it is not rank 0 of "
        "generation %d (rank 0 alone reports the metrics line); the step is not counted",
        id, step, generation));
  }
  if (metrics_line.size() > train::kMaxMetricsLineBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s' reported step %d with a StepReport.metrics_line of %d bytes, more than the "
        "%d a report may carry; the step is not counted",
        id, step, metrics_line.size(), train::kMaxMetricsLineBytes));
  }
  auto it = reported_.find(id);
  if (it->second == kUnknownStep && step >= record_.step()) {
    it->second = step - 1;  // the first report to a restarted coordinator
  }
  if (step == it->second) {
    SeenLocked(id, now);
    return record_.generation();  // a retried report that was already counted
  }
  if (step != it->second + 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker '%s' reported step %d out of order: its last reported step is %d, so the next "
        "must be %d",
        id, step, it->second, it->second + 1));
  }
  it->second = step;
  SeenLocked(id, now);
  // A step of the generation trained: every member started it (a coordinator restarted during
  // the re-form has not seen every start report).
  if (record_.timeline_size() > 0) {
    coordinator::GenerationEvent* e = record_.mutable_timeline(record_.timeline_size() - 1);
    if (e->number() == generation && e->started_unix_ms() == 0) {
      e->set_started_unix_ms(UnixMillisNow());
      if (e->first_step() < 0) e->set_first_step(record_.generation().first_step());
    }
  }
  if (!moe_balance.empty()) {
    record_.clear_moe_balance();
    for (const auto& b : moe_balance) *record_.add_moe_balance() = b;
    record_.set_moe_balance_step(step);
  }
  int64_t boundary = step;
  for (const auto& [w, s] : reported_) boundary = std::min(boundary, s);
  if (boundary > record_.step()) {
    coordinator::CoordinatorRecord before = record_;
    record_.set_step(boundary);
    record_.set_loss(loss);
    if (tokens_per_s > 0) record_.set_tokens_per_s(tokens_per_s);
    if (record_.pending_size() > 0) {
      // A step boundary: the joiners come in after the current members, in join order.
      std::vector<coordinator::WorkerInfo> workers(record_.generation().workers().begin(),
                                                   record_.generation().workers().end());
      for (const auto& w : record_.pending()) workers.push_back(w);
      Status s = NewGenerationLocked(std::move(workers), "join", now);
      if (!s.ok()) {
        record_ = before;
        return s;
      }
    } else {
      Status s = PersistLocked();
      if (!s.ok()) {
        record_ = before;
        return s;
      }
    }
  }
  *counted = true;
  return record_.generation();
}

bool CoordinatorState::FirstGenerationLocked() const {
  return record_.generation().number() == 1 && record_.step() == 0;
}

StatusOr<coordinator::Generation> CoordinatorState::ReportStart(
    const std::string& token, const std::string& id, int64_t generation, int64_t step,
    const std::vector<int64_t>& experts_per_worker, Time now) {
  RETURN_IF_ERROR(CheckToken(token));
  bool going_back = false;
  {
    absl::MutexLock lock(&mu_);
    const CatalogCheckpoint* e = FindInCatalog(record_, step);
    going_back = step > 0 && !FirstGenerationLocked() &&
                 (step < record_.step() - copies_lag_ || step > record_.step() + 1) &&
                 (e == nullptr || !e->complete());
  }
  // A generation going back to a checkpoint the catalog does not hold as complete: its commit
  // report may still be on its way (or lost with a re-form), so the folder is asked.
  if (going_back) (void)ReconcileCheckpoints();
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckReportLocked(id, generation, step, "started at step"));
  const int64_t current = record_.generation().number();
  auto it = reported_.find(id);
  const bool first = FirstGenerationLocked();
  // Step 0 counts as a checkpoint until one is committed: a job that lost state before its first
  // checkpoint starts over from its beginning, which every run shares. Otherwise only a complete
  // checkpoint does — or, while the catalog cannot follow the folder, the one rank 0 reported
  // writing (its commit report may still be on its way while the other members, which went back
  // to it with rank 0, report their start).
  const CatalogCheckpoint* entry = FindInCatalog(record_, step);
  const bool catalogued = (step == 0 && CompleteCheckpoints(record_) == 0) ||
                          (entry != nullptr && entry->complete()) ||
                          (step > 0 && entry != nullptr && !CatalogFollowsFolderLocked());
  // A TIERED job's buddy copies may be up to copies_lag_ steps older than the boundary.
  if (!first && !(catalogued && step <= record_.step()) &&
      (step < record_.step() - copies_lag_ || step > record_.step() + 1)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "worker '%s' started generation %d at step %d, but the job's last step boundary is %d: a "
        "generation starts there, one step later,%s or at a committed checkpoint (complete in "
        "the catalog `strata status` lists)",
        id, current, step, record_.step(),
        copies_lag_ > 0
            ? absl::StrFormat(" up to %d steps before (elastic.replica_every),", copies_lag_)
            : std::string()));
  }
  for (const auto& [w, started] : started_) {
    if (started && reported_.at(w) != step && w != id) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "worker '%s' started generation %d at step %d, but worker '%s' started it at step %d; "
          "the members disagree on the state they re-formed on",
          id, current, step, w, reported_.at(w)));
    }
  }
  coordinator::CoordinatorRecord before = record_;
  it->second = step;
  started_[id] = true;
  SeenLocked(id, now);
  record_.mutable_generation()->set_first_step(step);
  if (record_.timeline_size() > 0 &&
      record_.timeline(record_.timeline_size() - 1).number() == current) {
    coordinator::GenerationEvent* e = record_.mutable_timeline(record_.timeline_size() - 1);
    e->set_first_step(step);
    bool all_started = true;  // (a loop, not a lambda: the lock analysis sees mu_ held here)
    for (const auto& w : record_.generation().workers()) {
      auto st = started_.find(w.id());
      all_started = all_started && st != started_.end() && st->second;
    }
    if (all_started && e->started_unix_ms() == 0) e->set_started_unix_ms(UnixMillisNow());
  }
  if (!experts_per_worker.empty()) {
    record_.clear_experts_per_worker();
    for (int64_t n : experts_per_worker) record_.add_experts_per_worker(n);
  }
  int64_t boundary = step;
  for (const auto& [w, s] : reported_) boundary = std::min(boundary, s);
  if (boundary > record_.step() || step < record_.step())
    record_.set_step(std::min(boundary, step));
  Status s = PersistLocked();
  if (!s.ok()) {
    record_ = before;
    return s;
  }
  return record_.generation();
}

Status CoordinatorState::Checkpoint(const std::string& token, const std::string& id,
                                    int64_t generation, int64_t step, bool commit) {
  RETURN_IF_ERROR(CheckToken(token));
  absl::MutexLock serial(&catalog_mu_);
  Status s = RecordCheckpointReport(id, generation, step, commit);
  (void)ReconcileWithFolder();  // logged there; the report stands either way
  return s;
}

Status CoordinatorState::RecordCheckpointReport(const std::string& id, int64_t generation,
                                                int64_t step, bool commit) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckReportLocked(id, generation, step,
                                    commit ? "committed checkpoint" : "prepared checkpoint"));
  const auto& g = record_.generation();
  if (g.workers_size() == 0 || g.workers(0).id() != id) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "worker '%s' reported a checkpoint, but rank 0 of generation %d writes them", id,
        g.number()));
  }
  if (step <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat("checkpoint step %d must be positive", step));
  }
  coordinator::CoordinatorRecord before = record_;
  std::vector<CatalogCheckpoint> catalog = CatalogOf(record_);
  auto e = std::find_if(catalog.begin(), catalog.end(),
                        [&](const CatalogCheckpoint& c) { return c.step() == step; });
  if (e == catalog.end()) {
    e = catalog.insert(catalog.end(), CatalogCheckpoint());
    e->set_step(step);
  }
  if (!commit || e->generation() == 0) e->set_generation(generation);
  if (commit) {
    // At its word until the folder is read (right after this).
    e->set_commit_reported(true);
    e->set_complete(true);
  }
  SetCatalog(&record_, TidyCatalog(std::move(catalog)));
  Status s = PersistLocked();
  if (!s.ok()) record_ = before;
  return s;
}

Status CoordinatorState::RemoveLocked(const std::string& id, const char* reason, Time now) {
  last_seen_.erase(id);
  in_grace_.erase(id);
  if (!IsMemberLocked(id)) {
    coordinator::CoordinatorRecord before = record_;
    NoteWaitingDeparture(&record_, id, std::string(reason) == "leave");
    auto* p = record_.mutable_pending();
    p->erase(std::remove_if(p->begin(), p->end(), [&](const auto& w) { return w.id() == id; }),
             p->end());
    Status s = PersistLocked();
    if (!s.ok()) record_ = before;
    return s;
  }
  std::vector<coordinator::WorkerInfo> survivors;
  for (const auto& w : record_.generation().workers()) {
    if (w.id() != id) survivors.push_back(w);
  }
  return NewGenerationLocked(std::move(survivors), reason, now, {id});
}

Status CoordinatorState::Leave(const std::string& token, const std::string& id, Time now) {
  RETURN_IF_ERROR(CheckToken(token));
  absl::MutexLock lock(&mu_);
  if (!last_seen_.count(id)) {
    return absl::NotFoundError(absl::StrFormat("worker '%s' is not part of the job", id));
  }
  return RemoveLocked(id, "leave", now);
}

Status CoordinatorState::StreamBroken(const std::string& id, Time now) {
  absl::MutexLock lock(&mu_);
  if (!last_seen_.count(id)) return absl::OkStatus();  // already gone
  return RemoveLocked(id, "failure", now);
}

void CoordinatorState::Finished(const std::string& id) {
  absl::MutexLock lock(&mu_);
  last_seen_.erase(id);
  in_grace_.erase(id);
  if (!IsMemberLocked(id) || record_.finished()) return;
  record_.set_finished(true);
  Status s = PersistLocked();
  if (!s.ok()) {
    record_.set_finished(false);
    STRATA_LOG(ERROR) << "recording that the job finished: " << s.message();
  }
}

StatusOr<int> CoordinatorState::Tick(Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> late;
  for (const auto& [id, seen] : last_seen_) {
    if (now - seen > options_.heartbeat_timeout) late.push_back(id);
  }
  if (late.empty()) return 0;
  auto is_late = [&](const coordinator::WorkerInfo& w) {
    return std::find(late.begin(), late.end(), w.id()) != late.end();
  };
  // All of them at once: one new generation, however many failed together.
  std::vector<std::string> why;  // said once the new generation is written
  for (const std::string& id : late) {
    why.push_back(absl::StrFormat(
        "worker '%s' declared failed: no heartbeat for %d ms (heartbeat_timeout_ms %d)%s", id,
        std::chrono::duration_cast<std::chrono::milliseconds>(now - last_seen_.at(id)).count(),
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.heartbeat_timeout).count(),
        in_grace_.count(id) > 0 ? ", and it did not come back after the restart" : ""));
  }
  const coordinator::CoordinatorRecord before = record_;
  for (const std::string& id : late) NoteWaitingDeparture(&record_, id, /*left=*/false);
  auto* p = record_.mutable_pending();
  p->erase(std::remove_if(p->begin(), p->end(), is_late), p->end());
  std::vector<coordinator::WorkerInfo> survivors;
  std::vector<std::string> failed;
  for (const auto& w : record_.generation().workers()) {
    if (is_late(w)) {
      failed.push_back(w.id());
    } else {
      survivors.push_back(w);
    }
  }
  Status s = !failed.empty() ? NewGenerationLocked(std::move(survivors), "failure", now, failed)
                             : PersistLocked();
  if (!s.ok()) {
    record_ = before;
    return s;
  }
  for (const std::string& line : why) STRATA_LOG(WARNING) << line;
  for (const std::string& id : late) {
    last_seen_.erase(id);
    in_grace_.erase(id);
  }
  return static_cast<int>(late.size());
}

Status CoordinatorState::Set(const std::string& token, const std::string& key,
                             const std::string& value) {
  RETURN_IF_ERROR(CheckToken(token));
  {
    absl::MutexLock lock(&mu_);
    kv_[key] = value;
  }
  kv_cv_.SignalAll();
  return absl::OkStatus();
}

StatusOr<std::string> CoordinatorState::Get(const std::string& token, const std::string& key) {
  RETURN_IF_ERROR(CheckToken(token));
  absl::MutexLock lock(&mu_);
  auto it = kv_.find(key);
  if (it == kv_.end()) return absl::NotFoundError(absl::StrCat("key '", key, "' is not set"));
  return it->second;
}

std::vector<std::string> CoordinatorState::MissingKeysLocked(
    const std::vector<std::string>& keys) const {
  std::vector<std::string> missing;
  for (const auto& k : keys) {
    if (!kv_.count(k)) missing.push_back(k);
  }
  return missing;
}

Status CoordinatorState::Wait(const std::string& token, const std::vector<std::string>& keys,
                              std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(CheckToken(token));
  // On the steady clock: a wall clock stepped meanwhile neither cuts nor stretches the wait.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  absl::MutexLock lock(&mu_);
  std::vector<std::string> missing = MissingKeysLocked(keys);
  for (auto left = deadline - std::chrono::steady_clock::now();
       !missing.empty() && left > std::chrono::steady_clock::duration::zero();
       left = deadline - std::chrono::steady_clock::now()) {
    kv_cv_.WaitWithTimeout(&mu_, absl::FromChrono(left));
    missing = MissingKeysLocked(keys);
  }
  if (missing.empty()) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrFormat(
      "waited %d ms for the rendezvous keys %s; a worker of this generation never published them "
      "(it died, or it is in another generation)",
      timeout.count(), absl::StrJoin(missing, ", ")));
}

StatusOr<int64_t> CoordinatorState::Add(const std::string& token, const std::string& key,
                                        int64_t delta) {
  RETURN_IF_ERROR(CheckToken(token));
  int64_t value = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = kv_.find(key);
    if (it != kv_.end() && !absl::SimpleAtoi(it->second, &value)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("Add on key '%s', which holds '%s', not an integer", key, it->second));
    }
    value += delta;
    kv_[key] = absl::StrCat(value);
  }
  kv_cv_.SignalAll();
  return value;
}

coordinator::CoordinatorRecord CoordinatorState::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return record_;
}

std::string MoeBalanceLine(const coordinator::MoeLayerBalance& layer) {
  std::string line = absl::StrFormat("moe layer %d: max/mean load %.2f, cv %.2f", layer.block(),
                                     layer.max_over_mean(), layer.cv());
  if (layer.has_bias_min() && layer.has_bias_max()) {
    absl::StrAppendFormat(&line, ", bias [%.3g, %.3g]", layer.bias_min(), layer.bias_max());
  }
  return line;
}

namespace {

class CoordinatorStore : public comm::Store {
 public:
  CoordinatorStore(CoordinatorState* state, std::string token)
      : state_(state), token_(std::move(token)) {}
  Status Set(const std::string& key, const std::string& value) override {
    return state_->Set(token_, key, value);
  }
  StatusOr<std::string> Get(const std::string& key) override { return state_->Get(token_, key); }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    return state_->Wait(token_, keys, timeout);
  }
  StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    return state_->Add(token_, key, delta);
  }

 private:
  CoordinatorState* state_;
  std::string token_;
};

}  // namespace

std::shared_ptr<comm::Store> MakeCoordinatorStore(CoordinatorState* state, std::string token) {
  return std::make_shared<CoordinatorStore>(state, std::move(token));
}

}  // namespace strata::coordinator
