#include "coordinator/catalog.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace strata::coordinator {

std::vector<CatalogCheckpoint> TidyCatalog(std::vector<CatalogCheckpoint> entries) {
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.step() < b.step(); });
  int64_t newest = 0;
  int complete = 0;
  for (const auto& e : entries) {
    if (!e.complete()) continue;
    newest = std::max(newest, e.step());
    ++complete;
  }
  int too_many = complete - kCatalogCheckpoints;
  std::vector<CatalogCheckpoint> out;
  for (auto& e : entries) {
    if (e.complete() ? too_many-- > 0 : e.step() <= newest) continue;
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<CatalogCheckpoint> CatalogOf(const coordinator::CoordinatorRecord& record) {
  return {record.catalog().begin(), record.catalog().end()};
}

void SetCatalog(coordinator::CoordinatorRecord* record, std::vector<CatalogCheckpoint> catalog) {
  record->clear_catalog();
  for (auto& e : catalog) *record->add_catalog() = std::move(e);
}

const CatalogCheckpoint* FindInCatalog(const coordinator::CoordinatorRecord& record, int64_t step) {
  for (const auto& e : record.catalog()) {
    if (e.step() == step) return &e;
  }
  return nullptr;
}

int CompleteCheckpoints(const coordinator::CoordinatorRecord& record) {
  return static_cast<int>(std::count_if(record.catalog().begin(), record.catalog().end(),
                                        [](const CatalogCheckpoint& e) { return e.complete(); }));
}

// "20 (4 shards), 30 (not complete)": the catalog for a log line.
std::string DescribeCatalog(const coordinator::CoordinatorRecord& record) {
  std::vector<std::string> parts;
  for (const auto& e : record.catalog()) {
    if (!e.complete()) {
      parts.push_back(absl::StrFormat("%d (not complete)", e.step()));
    } else if (e.sequence() == 0) {
      parts.push_back(absl::StrFormat("%d (reported committed)", e.step()));
    } else {
      parts.push_back(absl::StrFormat("%d (%d shards)", e.step(), e.shards_size()));
    }
  }
  return parts.empty() ? std::string("none") : absl::StrJoin(parts, ", ");
}

std::vector<CatalogCheckpoint> ReconcileCatalog(const std::vector<CatalogCheckpoint>& catalog,
                                                const std::vector<storage::CheckpointSet>& sets,
                                                int64_t generation) {
  std::map<int64_t, const CatalogCheckpoint*> reported;
  for (const auto& e : catalog) reported[e.step()] = &e;
  std::vector<CatalogCheckpoint> out;
  int64_t newest = 0;
  for (const storage::CheckpointSet& set : sets) {
    CatalogCheckpoint e;
    if (auto it = reported.find(set.step()); it != reported.end()) {
      e.set_generation(it->second->generation());
      e.set_commit_reported(it->second->commit_reported());
    }
    e.set_step(set.step());
    e.set_complete(true);
    e.set_sequence(set.sequence());
    for (const auto& shard : set.shards()) e.add_shards(shard.name());
    out.push_back(std::move(e));
    newest = std::max(newest, set.step());
  }
  for (const auto& e : catalog) {
    const bool listed = std::any_of(sets.begin(), sets.end(),
                                    [&](const auto& set) { return set.step() == e.step(); });
    if (listed || e.step() <= newest) continue;
    // The folder is the truth about what committed once it lists something newer (a complete
    // entry it lacks then was pruned or removed), but its listing may lag rank 0's commit report,
    // and only the current generation can still commit a prepared checkpoint.
    if (e.complete() ? e.commit_reported() : e.generation() == generation) out.push_back(e);
  }
  return TidyCatalog(std::move(out));
}

}  // namespace strata::coordinator
