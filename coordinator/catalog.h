// The coordinator's checkpoint catalog: which checkpoints of the job exist, as its record keeps
// them
//
// - The catalog (CoordinatorRecord.catalog) lists checkpoints by increasing step: complete ones
//   (committed: the folder lists their set, or rank 0 reported the commit) and at most the newest
//   prepared one that has not committed yet.
// - ReconcileCatalog is pure and touches no file; CoordinatorState reads the folder and calls it
//   (coordinator/state.h, "The checkpoint catalog").
// - Threads: plain functions of their arguments; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "proto/coordinator.pb.h"
#include "proto/storage.pb.h"

namespace strata::coordinator {

// The newest complete checkpoints the catalog keeps.
inline constexpr int kCatalogCheckpoints = 16;

// The catalog `catalog` reconciled with `sets`, the committed sets of the job's checkpoint folder
// by increasing step (as checkpoint::ListCheckpointSets lists them), while the job is in generation
// `generation`. Every set is a complete entry with its shard names and sequence (keeping rank 0's
// reports of it). A complete entry the folder does not list stays, complete at rank 0's word, only
// when rank 0 reported its commit (commit_reported) and it is newer than every set: the folder may
// lag rank 0. Otherwise it goes: a newer set is listed, so it was pruned or removed (or it was
// found in the folder alone, which no longer holds it). An entry that is not complete stays, not
// complete, only while it is newer than every set and was prepared in `generation`. The newest
// kCatalogCheckpoints complete entries are kept. Returns the catalog by increasing step. Pure:
// touches no file.
std::vector<CatalogCheckpoint> ReconcileCatalog(const std::vector<CatalogCheckpoint>& catalog,
                                                const std::vector<storage::CheckpointSet>& sets,
                                                int64_t generation);

// `entries` by increasing step, keeping an entry that is not complete only when it is newer than
// every complete one (a newer commit ends it), and the newest kCatalogCheckpoints complete ones.
std::vector<CatalogCheckpoint> TidyCatalog(std::vector<CatalogCheckpoint> entries);
// The record's catalog as a list, and the list put back into the record.
std::vector<CatalogCheckpoint> CatalogOf(const CoordinatorRecord& record);
void SetCatalog(CoordinatorRecord* record, std::vector<CatalogCheckpoint> catalog);
// The catalog's entry of `step`, or null.
const CatalogCheckpoint* FindInCatalog(const CoordinatorRecord& record, int64_t step);
// How many of the catalog's checkpoints are complete.
int CompleteCheckpoints(const CoordinatorRecord& record);
// "20 (4 shards), 30 (not complete)": the catalog for a log line ("none" when empty).
std::string DescribeCatalog(const CoordinatorRecord& record);

}  // namespace strata::coordinator
