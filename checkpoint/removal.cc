#include "checkpoint/manager_internal.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <utility>
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/common/logging.h"

namespace strata::checkpoint {

void CheckpointManager::ReleaseVersion(const TensorRef& r) {
  const StoredExtent s = FromRecord(r.extent());
  if (outside_.count(KeyOf(r))) {  // never marked used: nothing to give back
    if (!listed_.count(KeyOf(r))) outside_.erase(KeyOf(r));
    return;
  }
  if (tiered_ != nullptr && r.expert() >= 0) {
    tiered_->store().UnrefVersion(
        storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())},
        r.version());
    return;
  }
  if (!listed_.count(KeyOf(r))) ssd_->Free(s.extent);
}

Status CheckpointManager::RemoveLocked(int64_t step) {
  auto it = std::find_if(manifests_.begin(), manifests_.end(),
                         [&](const CheckpointManifest& m) { return m.step() == step; });
  auto set = std::find_if(sets_.begin(), sets_.end(),
                          [&](const CheckpointSet& cs) { return cs.step() == step; });
  auto folder_set = std::find_if(folder_sets_.begin(), folder_sets_.end(),
                                 [&](const CheckpointSet& cs) { return cs.step() == step; });
  if (folder_set != folder_sets_.end()) {
    folder_sets_.erase(folder_set);  // not this process's to remove: only no longer counted
    if (it == manifests_.end() && set == sets_.end()) return absl::OkStatus();
  }
  if (it == manifests_.end() && set == sets_.end()) {
    return absl::NotFoundError(
        absl::StrFormat("no checkpoint of step %d in '%s'", step, options_.dir));
  }
  // The global manifest goes first: from then on the checkpoint does not exist, and a process
  // stopped before the local one goes leaves a local checkpoint no set names, which the next open
  // reclaims.
  if (set != sets_.end() && options_.committer) {
    RETURN_IF_ERROR(RemoveCheckpointSet(options_.dir, step));
    sets_.erase(set);
  }
  if (it == manifests_.end()) return absl::OkStatus();  // the shard had lost it
  return RemoveLocalLocked(it);
}

Status CheckpointManager::RemoveLocalLocked(std::vector<CheckpointManifest>::iterator it) {
  const int64_t step = it->step();
  // The ledger records the removal first: a process killed before the index forgets the
  // checkpoint leaves one that the next open neither lists nor takes for a resurrected one.
  RETURN_IF_ERROR(WriteLedger(&*it));
  std::vector<TensorRef> unreferenced;
  std::vector<TensorRef> stored;
  for (const TensorRef& r : it->tensors()) {
    if (!r.has_extent()) continue;
    stored.push_back(r);
    if (--listed_[KeyOf(r)] == 0) {
      listed_.erase(KeyOf(r));
      unreferenced.push_back(r);
    }
  }
  Status s = index_->RemoveCheckpoint(step, unreferenced);
  if (!s.ok()) {
    for (const TensorRef& r : stored) listed_[KeyOf(r)]++;
    WriteLedger().IgnoreError();  // it is still there: best effort, Tidy finishes it otherwise
    return s;
  }
  for (const TensorRef& r : stored) ReleaseVersion(r);
  manifests_.erase(it);
  return WriteLedger();
}

Status CheckpointManager::ReplaceFrom(int64_t step) {
  std::vector<int64_t> later;
  {
    absl::MutexLock lock(&mu_);
    for (const int64_t s : StepsLocked()) {
      if (s >= step) later.push_back(s);
    }
  }
  if (later.empty()) return absl::OkStatus();
  if (!options_.committer) {
    // The global manifest goes first, and only the committer removes it: a part that a committed
    // set still names stays until the committer (saving the same step) has removed that set.
    const auto deadline = std::chrono::steady_clock::now() + options_.commit_timeout;
    for (;;) {
      ASSIGN_OR_RETURN(std::vector<CheckpointSet> sets, ListCheckpointSets(options_.dir));
      std::vector<int64_t> named;
      {
        absl::MutexLock lock(&mu_);
        for (const CheckpointSet& cs : sets) {
          const storage::ShardEntry* e = FindShard(cs, shard_name_);
          if (cs.step() < step || e == nullptr) continue;
          for (const CheckpointManifest& cm : manifests_) {
            if (cm.step() == cs.step() && cm.sequence() == e->local_sequence()) {
              named.push_back(cs.step());
            }
          }
        }
        sets_ = std::move(sets);
      }
      if (named.empty()) break;
      if (cancel_ || (options_.abandoned && options_.abandoned->load())) {
        return absl::AbortedError(absl::StrFormat(
            "checkpoint %d in '%s' is to be saved again, but the job stopped while its committed "
            "set was still to be removed",
            named.front(), options_.dir));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "checkpoint%s %s in '%s' must be saved again, and the committer (rank 0) did not "
            "remove the committed set%s within %d ms, so shard %s keeps its part%s (see rank 0's "
            "log)",
            named.size() == 1 ? "" : "s", absl::StrJoin(named, ", "), options_.dir,
            named.size() == 1 ? "" : "s", options_.commit_timeout.count(), shard_name_,
            named.size() == 1 ? "" : "s"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  for (auto it = later.rbegin(); it != later.rend(); ++it) {
    STRATA_LOG(WARNING) << absl::StrFormat(
        "checkpoint %d in '%s' (shard %s) is removed: training went back to step %d, and saves "
        "its checkpoints again from there",
        *it, options_.dir, shard_name_, step);
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(RemoveLocked(*it));
  }
  return absl::OkStatus();
}

Status CheckpointManager::Remove(const std::string& dir, int64_t step) {
  StatusOr<std::vector<CheckpointSet>> sets = ListCheckpointSets(dir);
  if (!sets.ok()) {
    // Damaged global manifests keep the folder from opening; removing the named step is the way
    // out, and needs no shard: a local checkpoint its set named is reclaimed at the next open.
    ASSIGN_OR_RETURN(const int fd, LockFolder(dir + "/LOCK", dir));
    Status s = RemoveCheckpointSet(dir, step);
    Unlock(fd);
    return s;
  }
  auto set = std::find_if(sets->begin(), sets->end(),
                          [&](const CheckpointSet& cs) { return cs.step() == step; });
  if (set == sets->end() && !IsFolderShard(dir)) {
    std::vector<int64_t> steps;
    for (const CheckpointSet& cs : *sets) steps.push_back(cs.step());
    return absl::NotFoundError(absl::StrFormat(
        "no checkpoint of step %d in '%s'; it holds %s", step, dir,
        steps.empty() ? std::string("none") : "steps " + absl::StrJoin(steps, ", ")));
  }
  if (set == sets->end() || (set->shards_size() == 1 && set->shards(0).name() == ".")) {
    // A checkpoint of a folder written before sharding (or written on in place): one process's.
    CheckpointOptions o;
    o.dir = dir;
    ASSIGN_OR_RETURN(auto m, Open(o, /*must_exist=*/true));
    absl::MutexLock lock(&m->mu_);
    RETURN_IF_ERROR(m->ReopenWritable());
    return m->RemoveLocked(step);
  }
  // The global manifest goes under the committer's lock (refused while a job trains here); then
  // each shard still there opens as its writer would, which lets go of the local checkpoint no
  // set names any more.
  ASSIGN_OR_RETURN(const int fd, LockFolder(dir + "/LOCK", dir));
  Status s = RemoveCheckpointSet(dir, step);
  for (const storage::ShardEntry& e : set->shards()) {
    if (!s.ok()) break;
    if (!std::filesystem::is_directory(ShardDir(dir, e.name()))) continue;
    CheckpointOptions o;
    o.dir = dir;
    o.shard = e.name();
    o.committer = false;
    StatusOr<std::unique_ptr<CheckpointManager>> shard = Open(o, /*must_exist=*/false);
    if (!shard.ok()) {
      STRATA_LOG(WARNING) << "checkpoint " << step << " is removed; shard " << e.name()
                          << " lets its part go when it is next opened: " << shard.status();
    }
  }
  Unlock(fd);
  return s;
}

}  // namespace strata::checkpoint
