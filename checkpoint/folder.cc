#include "checkpoint/manager_internal.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <optional>
#include <utility>
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "checkpoint/ledger_text.h"
#include "core/common/logging.h"

namespace strata::checkpoint {

namespace {

// A checkpoint of a folder written before sharding, as the one-shard set workers read it as: the
// shard "." holds every tensor it lists.
CheckpointSet FolderShardSet(const CheckpointManifest& cm) {
  CheckpointSet cs;
  cs.set_step(cm.step());
  cs.set_config_hash(cm.config_hash());
  cs.set_model_config(cm.model_config());
  cs.set_seed(cm.seed());
  cs.set_optimizer_steps(cm.optimizer_steps());
  cs.set_storage_mode(cm.storage_mode());
  storage::ShardEntry* e = cs.add_shards();
  e->set_name(".");
  e->set_local_sequence(cm.sequence());
  e->set_local_manifest_crc32c(ManifestCrc(cm));
  std::map<int32_t, std::pair<int32_t, int32_t>> ranges;  // block -> first, last
  std::set<std::string> dense;
  for (const TensorRef& r : cm.tensors()) {
    if (r.expert() < 0) {
      dense.insert(r.name());
      continue;
    }
    auto [it, fresh] = ranges.try_emplace(r.layer(), r.expert(), r.expert());
    it->second.first = std::min(it->second.first, r.expert());
    it->second.second = std::max(it->second.second, r.expert());
  }
  for (const auto& [block, range] : ranges) {
    storage::ExpertRange* er = e->add_experts();
    er->set_layer(block);
    er->set_first(range.first);
    er->set_count(range.second - range.first + 1);
  }
  for (const std::string& d : dense) e->add_dense(d);
  return cs;
}

}  // namespace

CheckpointOptions CheckpointOptionsOf(const config::JobConfig& cfg) {
  CheckpointOptions co;
  co.dir = cfg.checkpoint().dir();
  co.keep = cfg.checkpoint().keep();
  co.io.queue_depth = cfg.storage().io_queue_depth();
  co.io.block_bytes = cfg.storage().io_block_bytes();
  co.file_bytes = cfg.storage().ssd_file_bytes();
  co.capacity_bytes = cfg.storage().ssd_capacity_bytes();
  return co;
}

uint64_t CheckpointManager::ConfigHash(const config::ModelConfig& model) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : ModelText(model)) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

StatusOr<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(
    const CheckpointOptions& options, bool must_exist) {
  std::unique_ptr<CheckpointManager> m(new CheckpointManager);
  m->options_ = options;
  {
    absl::MutexLock lock(&m->mu_);  // no other thread has it yet: for the analysis
    RETURN_IF_ERROR(m->OpenFolder(must_exist));
    RETURN_IF_ERROR(m->OpenIndex(must_exist));
    RETURN_IF_ERROR(m->MarkListedExtents());
    if (!must_exist) RETURN_IF_ERROR(m->Tidy());
  }
  if (options.committer) m->ReclaimIdleShards();
  return m;
}

Status CheckpointManager::OpenFolder(bool must_exist) {
  const std::string& dir = options_.dir;
  if (must_exist && !std::filesystem::is_directory(dir)) {
    return absl::NotFoundError(
        absl::StrFormat("checkpoint folder '%s' does not exist: nothing to resume from", dir));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot create checkpoint folder '%s': %s", dir, ec.message()));
  }
  // One committer at a time: a training job's (one process, or rank 0), or `strata ckpt rm`.
  if (options_.committer) {
    ASSIGN_OR_RETURN(lock_fd_, LockFolder(dir + "/LOCK", dir));
  }
  if (options_.start_over && options_.committer) {
    if (must_exist) {
      return absl::InvalidArgumentError(
          "--start-over moves the checkpoint folder's contents aside, --resume continues from "
          "them: pass one of them");
    }
    RETURN_IF_ERROR(MoveAside(dir));
  }
  // The committed sets first: a folder whose global manifests are damaged is not trained into.
  ASSIGN_OR_RETURN(sets_, ListCheckpointSets(dir));
  // A folder written before sharding is written on in place by one process; workers write their
  // own shards beside it.
  if (IsFolderShard(dir) && options_.committer && options_.shard == "p0") {
    shard_name_.assign(1, '.');  // the folder itself (= "." trips GCC 12's -Wrestrict)
    shard_dir_ = dir;
  } else {
    RETURN_IF_ERROR(ValidateShardName(options_.shard));
    if (options_.shard == ".") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the shard '.' is the folder '%s' itself, kept for folders written before sharding; "
          "write a shard named p0, r<rank> or w<id>",
          dir));
    }
    shard_name_ = options_.shard;
    shard_dir_ = ShardDir(dir, options_.shard);
    std::filesystem::create_directories(shard_dir_, ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrFormat("cannot create checkpoint shard '%s': %s", shard_dir_, ec.message()));
    }
    ASSIGN_OR_RETURN(shard_lock_fd_, LockFolder(shard_dir_ + "/LOCK", shard_dir_));
  }
  // Reports of checkpoints no longer in flight (a job stopped while saving): a new job's committer
  // opens before any worker saves. They are not checkpoints: a resume clears them too.
  if (options_.committer) {
    std::filesystem::remove_all(PreparedRoot(dir), ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrFormat(
          "cannot clear '%s' of old prepared reports: %s", PreparedRoot(dir), ec.message()));
    }
  }
  // Workers beside a folder written before sharding read its checkpoints as one-shard sets of the
  // shard "." (never written, pruned or removed by them).
  if (shard_name_ != "." && IsFolderShard(dir)) {
    ASSIGN_OR_RETURN(std::vector<CheckpointManifest> old, ReadList(dir));
    for (const CheckpointManifest& cm : old) {
      if (!cm.sharded()) folder_sets_.push_back(FolderShardSet(cm));
    }
  }
  return absl::OkStatus();
}

Status CheckpointManager::OpenIndex(bool must_exist) {
  const std::string& dir = options_.dir;
  const std::string& shard = shard_dir_;
  const bool has_index = TensorIndex::Exists(shard + "/index");
  if (!has_index) RETURN_IF_ERROR(CheckNoIndexIsNoLoss(shard));
  // Resuming opens the index read-only: nothing in the folder changes until the checkpoint has
  // passed every check (Resume reopens it for writing). A shard that is gone while sets name it
  // starts empty: those sets fail their checks, and older ones may still resume.
  if (must_exist && (has_index || sets_.empty())) {
    ASSIGN_OR_RETURN(index_, TensorIndex::OpenReadOnly(shard + "/index"));
  } else {
    ASSIGN_OR_RETURN(index_, TensorIndex::Open(shard + "/index", true));
  }
  ASSIGN_OR_RETURN(ssd_, OpenSsd(options_, shard));
  ASSIGN_OR_RETURN(std::vector<CheckpointManifest> indexed, index_->Checkpoints());
  ASSIGN_OR_RETURN(std::optional<std::string> ledger, ReadLedgerText(shard));
  ASSIGN_OR_RETURN(CheckedList list, CheckList(shard, ledger, ledger, std::move(indexed)));
  removing_ = std::move(list.removing);
  last_sequence_ = list.last_sequence;
  // A local checkpoint of a set exists only if the set committed naming it; one no committed set
  // names was prepared by a process stopped before the commit (or its set was removed), and goes.
  for (CheckpointManifest& cm : list.live) {
    const CheckpointSet* set = nullptr;
    for (const CheckpointSet& cs : sets_) {
      if (cs.step() == cm.step()) set = &cs;
    }
    const storage::ShardEntry* e = set ? FindShard(*set, shard_name_) : nullptr;
    if (!cm.sharded() || (e != nullptr && e->local_sequence() == cm.sequence())) {
      manifests_.push_back(std::move(cm));
      continue;
    }
    STRATA_LOG(INFO) << "shard " << shard_name_ << " of " << dir
                     << ": the local checkpoint of step " << cm.step()
                     << " was prepared but never committed; its space is reclaimed";
    removing_.push_back(std::move(cm));
  }
  for (const CheckpointManifest& cm : manifests_) {
    for (const TensorRef& r : cm.tensors()) {
      if (r.has_extent()) listed_[KeyOf(r)]++;
    }
  }
  return absl::OkStatus();
}

Status CheckpointManager::MarkListedExtents() {
  // Space that no checkpoint refers to (an interrupted checkpoint, spilled working state) is free.
  // An extent beyond the end of its data file is damage to the checkpoints that list it (Verify
  // and Resume name them), not to the folder.
  ASSIGN_OR_RETURN(std::vector<TensorRef> versions, index_->TensorVersions());
  for (const TensorRef& r : versions) {
    auto& next = next_version_[{r.layer(), r.expert(), r.kind()}];
    next = std::max(next, r.version());
    if (!listed_.count(KeyOf(r))) continue;
    if (!ssd_->InFiles(FromRecord(r.extent()).extent)) {
      outside_.insert(KeyOf(r));
      continue;
    }
    Status s = ssd_->MarkUsed(FromRecord(r.extent()).extent);
    if (!s.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "the checkpoint index in '%s' does not match its data files (%s); nothing was changed",
          options_.dir, s.message()));
    }
  }
  return absl::OkStatus();
}

void CheckpointManager::ReclaimIdleShards() {
  // Shards no process writes now (a job that shrank, a worker job resumed by one process) let go
  // of the local checkpoints no committed set names. The committer opens before any other worker
  // of its job, so a shard in use here is another process's (a worker declared lost but still
  // running): left to it.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.dir + "/shards", ec)) {
    const std::string name = entry.path().filename().string();
    if (name == shard_name_ || name == "." || !ValidateShardName(name).ok()) continue;
    CheckpointOptions o = options_;
    o.shard = name;
    o.committer = false;
    o.start_over = false;
    StatusOr<std::unique_ptr<CheckpointManager>> idle = Open(o, /*must_exist=*/false);
    if (!idle.ok() && !absl::IsUnavailable(idle.status())) {
      STRATA_LOG(WARNING) << "shard " << name << " of " << options_.dir
                          << " was not tidied: " << idle.status().message();
    }
  }
}

Status CheckpointManager::ReopenWritable() {
  index_.reset();
  ASSIGN_OR_RETURN(index_, TensorIndex::Open(shard_dir_ + "/index", false));
  return Tidy();
}

Status CheckpointManager::Tidy() {
  for (const CheckpointManifest& cm : removing_) {
    std::vector<TensorRef> unreferenced;
    for (const TensorRef& r : cm.tensors()) {
      if (r.has_extent() && !listed_.count(KeyOf(r))) unreferenced.push_back(r);
    }
    STRATA_LOG(INFO) << "finishing the removal of the local checkpoint " << cm.step() << " from "
                     << shard_dir_;
    RETURN_IF_ERROR(index_->RemoveCheckpoint(cm.step(), unreferenced));
  }
  removing_.clear();
  return WriteLedger();
}

Status CheckpointManager::WriteLedger(const CheckpointManifest* removing) {
  storage::CheckpointLedger ledger;
  ledger.set_format(1);
  ledger.set_last_sequence(last_sequence_);
  for (const CheckpointManifest& cm : manifests_) {
    storage::LedgerEntry* e = &cm == removing ? ledger.add_removing() : ledger.add_live();
    e->set_step(cm.step());
    e->set_sequence(cm.sequence());
  }
  for (const CheckpointManifest& cm : removing_) {
    storage::LedgerEntry* e = ledger.add_removing();
    e->set_step(cm.step());
    e->set_sequence(cm.sequence());
  }
  Status s = StoreLedger(shard_dir_, ledger);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrFormat("updating the checkpoint ledger of '%s': %s",
                                                  shard_dir_, s.message()));
  }
  return absl::OkStatus();
}

CheckpointManager::~CheckpointManager() {
  cancel_ = true;
  if (writer_.joinable()) writer_.join();
  index_.reset();
  Unlock(shard_lock_fd_);
  Unlock(lock_fd_);
}

std::vector<int64_t> CheckpointManager::Steps() const {
  absl::MutexLock lock(&mu_);
  return StepsLocked();
}

std::vector<int64_t> CheckpointManager::StepsLocked() const {
  std::set<int64_t> steps;
  for (const CheckpointSet& cs : sets_) steps.insert(cs.step());
  for (const CheckpointSet& cs : folder_sets_) steps.insert(cs.step());
  for (const CheckpointManifest& cm : manifests_) steps.insert(cm.step());
  return {steps.begin(), steps.end()};
}

Status CheckpointManager::CheckCompatible(const config::JobConfig& config) const {
  const uint64_t hash = ConfigHash(config.model());
  auto check = [&](const auto& m) -> Status {
    if (m.config_hash() == hash) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %d in '%s' was written for a different model (%s); resume it with the "
        "model it was trained with, or start a new run in another folder. Nothing was changed",
        m.step(), options_.dir, ConfigDiff(m.model_config(), ModelText(config.model()))));
  };
  absl::MutexLock lock(&mu_);
  for (const CheckpointSet& cs : sets_) RETURN_IF_ERROR(check(cs));
  for (const CheckpointSet& cs : folder_sets_) RETURN_IF_ERROR(check(cs));
  for (const CheckpointManifest& m : manifests_) RETURN_IF_ERROR(check(m));
  return absl::OkStatus();
}

Status CheckpointManager::ReclaimUnnamed(bool every) {
  ASSIGN_OR_RETURN(std::vector<CheckpointSet> sets, ListCheckpointSets(options_.dir));
  absl::MutexLock lock(&mu_);
  sets_ = std::move(sets);
  if (sets_.empty() && !every) return absl::OkStatus();
  const int64_t below = every ? std::numeric_limits<int64_t>::max() : sets_.back().step();
  std::vector<int64_t> unnamed;
  for (const CheckpointManifest& cm : manifests_) {
    if (!cm.sharded() || cm.step() >= below) continue;
    const storage::ShardEntry* e = nullptr;
    for (const CheckpointSet& cs : sets_) {
      if (cs.step() == cm.step()) e = FindShard(cs, shard_name_);
    }
    if (e == nullptr || e->local_sequence() != cm.sequence()) unnamed.push_back(cm.step());
  }
  // Only the local part: a set of that step naming another sequence is not this shard's to drop.
  for (int64_t step : unnamed) {
    auto it = std::find_if(manifests_.begin(), manifests_.end(),
                           [&](const CheckpointManifest& m) { return m.step() == step; });
    STRATA_LOG(INFO) << "shard " << shard_name_ << " of " << options_.dir
                     << ": no committed set names its local checkpoint of step " << step
                     << "; its space is reclaimed";
    RETURN_IF_ERROR(RemoveLocalLocked(it));
  }
  return absl::OkStatus();
}

Status CheckpointManager::Continue(int64_t generation, bool committer,
                                   std::shared_ptr<std::atomic<bool>> abandoned,
                                   scheduler::TieredExpertScheduler* tiered) {
  if (shard_name_ == ".") {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the checkpoint folder '%s' was written before sharding, and its one shard is the folder "
        "itself, held with the committer's lock: a new generation cannot keep it; close this "
        "checkpoint manager and open the folder again",
        options_.dir));
  }
  // The previous generation's checkpoint in flight ends here, so that no writer work crosses
  // generations: a committer waiting for reports gives up (the workers may be gone), a persist's
  // own writes finish. Its failure is the old generation's: the new one saves again.
  cancel_ = true;
  Status in_flight = Wait();
  cancel_ = false;
  if (!in_flight.ok()) {
    STRATA_LOG(WARNING) << "generation " << generation << " continues without the checkpoint "
                        << "the previous generation left in flight: " << in_flight.message();
  }
  {
    absl::MutexLock lock(&mu_);
    writer_status_ = absl::OkStatus();
    writer_done_ = true;
    // A store that holds this shard's checkpoint versions is reached through its scheduler of
    // now: a re-form may have handed it to another one.
    if (tiered_ != nullptr) {
      if (tiered == nullptr) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "shard %s of '%s' continues without the TIERED scheduler whose store holds its "
            "checkpoints' versions; pass the scheduler that holds that store now",
            shard_name_, options_.dir));
      }
      tiered_ = tiered;
    }
  }
  if (committer && lock_fd_ < 0) {
    ASSIGN_OR_RETURN(lock_fd_, LockFolder(options_.dir + "/LOCK", options_.dir));
  } else if (!committer && lock_fd_ >= 0) {
    Unlock(std::exchange(lock_fd_, -1));
  }
  options_.committer = committer;
  options_.generation = generation;
  options_.abandoned = std::move(abandoned);
  // The reports of older generations are of checkpoints that can no longer commit; this
  // generation's workers may already be reporting theirs.
  if (committer) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(PreparedRoot(options_.dir), ec)) {
      int64_t g = 0;
      if (!absl::SimpleAtoi(entry.path().filename().string(), &g) || g >= generation) continue;
      std::error_code removed;
      std::filesystem::remove_all(entry.path(), removed);
      if (removed) {
        return absl::PermissionDeniedError(
            absl::StrFormat("cannot clear '%s' of generation %d's prepared reports: %s",
                            entry.path().string(), g, removed.message()));
      }
    }
  }
  // The old committer committed (or not) just before it stopped: what this shard prepared for a
  // set that never committed goes, releasing only what no checkpoint and no live tensor uses.
  return ReclaimUnnamed(/*every=*/true);
}

StatusOr<std::vector<CheckpointManifest>> CheckpointManager::ReadList(const std::string& dir) {
  if (!TensorIndex::Exists(dir + "/index")) RETURN_IF_ERROR(CheckNoIndexIsNoLoss(dir));
  // A training process may be changing the folder: the ledger is read before and after the index.
  ASSIGN_OR_RETURN(std::optional<std::string> before, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(auto index, TensorIndex::OpenReadOnly(dir + "/index"));
  ASSIGN_OR_RETURN(auto indexed, index->Checkpoints());
  ASSIGN_OR_RETURN(std::optional<std::string> after, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(CheckedList list, CheckList(dir, before, after, std::move(indexed)));
  return std::move(list.live);
}

}  // namespace strata::checkpoint
