#include "checkpoint/manager_internal.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <utility>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata::checkpoint {

StatusOr<std::vector<CheckpointManager::FolderEntry>> CheckpointManager::ReadFolder(
    const std::string& dir) {
  if (!std::filesystem::is_directory(dir)) {
    return absl::NotFoundError(absl::StrFormat("checkpoint folder '%s' does not exist", dir));
  }
  ASSIGN_OR_RETURN(std::vector<CheckpointSet> sets, ListCheckpointSets(dir));
  // Each shard's live local checkpoints, read once (read-only: a process may be training). A
  // shard whose folder is gone fails only the checkpoints that name it; one whose index or ledger
  // cannot be trusted makes the whole listing fail, as a damaged folder does.
  std::map<std::string, StatusOr<std::vector<CheckpointManifest>>> shards;
  for (const std::string& name :
       IsFolderShard(dir) ? std::vector<std::string>{"."} : std::vector<std::string>{}) {
    ASSIGN_OR_RETURN(std::vector<CheckpointManifest> local, ReadList(dir));
    shards.emplace(name, std::move(local));
  }
  for (const CheckpointSet& cs : sets) {
    for (const storage::ShardEntry& se : cs.shards()) {
      if (shards.count(se.name())) continue;
      const std::string sdir = ShardDir(dir, se.name());
      if (!std::filesystem::is_directory(sdir)) {
        shards.emplace(se.name(), absl::NotFoundError(
                                      absl::StrFormat("the shard's folder '%s' is missing", sdir)));
        continue;
      }
      StatusOr<std::vector<CheckpointManifest>> local = ReadList(sdir);
      if (!local.ok()) {
        return Status(local.status().code(), absl::StrFormat("shard %s of '%s': %s", se.name(), dir,
                                                             local.status().message()));
      }
      shards.emplace(se.name(), std::move(local));
    }
  }
  // A set removed while the shards were read (a run prunes beside `strata ckpt`) is not listed:
  // its shards may have let its local checkpoints go already.
  ASSIGN_OR_RETURN(std::vector<CheckpointSet> after, ListCheckpointSets(dir));
  std::set<int64_t> still;
  for (const CheckpointSet& cs : after) still.insert(cs.step());
  std::erase_if(sets, [&](const CheckpointSet& cs) { return !still.count(cs.step()); });
  auto shard_list =
      [&](const std::string& name) -> const StatusOr<std::vector<CheckpointManifest>>& {
    return shards.at(name);
  };
  std::map<int64_t, FolderEntry> entries;
  if (shards.count(".")) {
    const auto& local = shard_list(".");
    for (const CheckpointManifest& m : *local) {
      if (m.sharded()) continue;  // part of a set: listed with it
      FolderEntry& e = entries[m.step()];
      e.step = m.step();
      e.parts.push_back({".", m});
    }
  }
  for (CheckpointSet& cs : sets) {
    FolderEntry& e = entries[cs.step()];
    e.step = cs.step();
    e.parts.clear();
    for (const storage::ShardEntry& se : cs.shards()) {
      FolderEntry::Part part{se.name()};
      const auto& local = shard_list(se.name());
      if (!local.ok()) {
        part.local = Status(local.status().code(), absl::StrCat(Where(cs.step(), se.name()), ": ",
                                                                local.status().message()));
      } else {
        part.local = absl::NotFoundError(absl::StrFormat(
            "%s: the shard has no local checkpoint of that step (the global manifest names "
            "sequence %d): the shard was deleted or rewritten",
            Where(cs.step(), se.name()), se.local_sequence()));
        for (const CheckpointManifest& m : *local) {
          if (m.step() != cs.step()) continue;
          Status match = MatchesSet(m, cs, se.name());
          part.local = match.ok() ? StatusOr<CheckpointManifest>(m) : match;
        }
      }
      e.parts.push_back(std::move(part));
    }
    e.set = std::move(cs);
  }
  std::vector<FolderEntry> out;
  for (auto& [step, e] : entries) out.push_back(std::move(e));
  return out;
}

StatusOr<std::vector<CheckpointInfo>> CheckpointManager::List(const std::string& dir) {
  ASSIGN_OR_RETURN(std::vector<FolderEntry> entries, ReadFolder(dir));
  std::vector<CheckpointInfo> out;
  for (const FolderEntry& e : entries) {
    CheckpointInfo i;
    i.step = e.step;
    int64_t snapshot_ms = std::numeric_limits<int64_t>::max();
    for (const FolderEntry::Part& part : e.parts) {
      i.shards.push_back(part.shard);
      if (!part.local.ok()) {
        if (i.problem.empty()) i.problem = std::string(part.local.status().message());
        continue;
      }
      const CheckpointManifest& m = *part.local;
      if (m.created_unix_ms() > 0) snapshot_ms = std::min(snapshot_ms, m.created_unix_ms());
      if (!e.set) {
        i.created_unix_ms = m.created_unix_ms();
        i.config_hash = m.config_hash();
        i.storage_mode = m.storage_mode();
      }
      i.tensors += m.tensors_size();
      for (const TensorRef& r : m.tensors()) i.stored_bytes += r.extent().length();
    }
    if (e.set) {
      i.created_unix_ms = e.set->created_unix_ms();
      if (snapshot_ms <= i.created_unix_ms) i.write_ms = i.created_unix_ms - snapshot_ms;
      i.config_hash = e.set->config_hash();
      i.storage_mode = e.set->storage_mode();
    }
    out.push_back(std::move(i));
  }
  return out;
}

Status CheckpointManager::Verify(const std::string& dir, int64_t step,
                                 std::vector<std::string>* report) {
  ASSIGN_OR_RETURN(std::vector<FolderEntry> entries, ReadFolder(dir));
  std::map<std::string, std::unique_ptr<storage::SsdTier>> ssds;  // by shard, opened once
  int bad = 0, checked = 0;
  for (const FolderEntry& e : entries) {
    if (step >= 0 && e.step != step) continue;
    ++checked;
    Status s;
    uint64_t bytes = 0;
    int extents = 0;
    for (const FolderEntry::Part& part : e.parts) {
      s = part.local.status();
      if (!s.ok()) break;
      auto& ssd = ssds[part.shard];
      if (!ssd) {
        CheckpointOptions o;
        StatusOr<std::unique_ptr<storage::SsdTier>> opened = OpenSsd(o, ShardDir(dir, part.shard));
        if (!opened.ok()) {
          s = opened.status();
          break;
        }
        ssd = *std::move(opened);
      }
      for (const TensorRef& r : part.local->tensors()) {
        if (!r.has_extent()) continue;
        s = ssd->Verify(FromRecord(r.extent()), Describe(r, e.step, part.shard));
        if (!s.ok()) break;
        bytes += r.extent().bytes();
        ++extents;
      }
      if (!s.ok()) break;
    }
    if (s.ok()) {
      report->push_back(absl::StrFormat(
          "checkpoint %d: ok (%d shard%s, %d extents, %.1f MiB, every CRC-32C matches)", e.step,
          e.parts.size(), e.parts.size() == 1 ? "" : "s", extents, bytes / 1048576.0));
    } else {
      ++bad;
      report->push_back(absl::StrFormat("checkpoint %d: FAILED: %s", e.step, s.message()));
    }
  }
  if (checked == 0) {
    return absl::NotFoundError(step >= 0
                                   ? absl::StrFormat("no checkpoint of step %d in '%s'", step, dir)
                                   : absl::StrFormat("no checkpoints in '%s'", dir));
  }
  if (bad > 0) {
    return absl::DataLossError(
        absl::StrFormat("%d of %d checkpoints in '%s' failed verification", bad, checked, dir));
  }
  return absl::OkStatus();
}

}  // namespace strata::checkpoint
