// What the coordinator's checkpoint catalog and a checkpoint folder say is complete, in one form
// that tests compare: (step, global-ledger sequence, shard names in the manifest's order).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "checkpoint/checkpoint_set.h"
#include "proto/coordinator.pb.h"

namespace strata::testing {

using CatalogEntry = std::tuple<int64_t, uint64_t, std::vector<std::string>>;

// The complete checkpoints of a coordinator's catalog.
inline std::vector<CatalogEntry> CompleteInCatalog(const coordinator::CoordinatorRecord& r) {
  std::vector<CatalogEntry> out;
  for (const auto& e : r.catalog()) {
    if (e.complete()) {
      out.emplace_back(e.step(), e.sequence(),
                       std::vector<std::string>(e.shards().begin(), e.shards().end()));
    }
  }
  return out;
}

// The committed checkpoints of the folder `dir`, read from its own global manifests.
inline std::vector<CatalogEntry> CommittedInFolder(const std::string& dir) {
  auto sets = checkpoint::ListCheckpointSets(dir);
  EXPECT_TRUE(sets.ok()) << sets.status();
  std::vector<CatalogEntry> out;
  for (const auto& set : sets.ok() ? *sets : std::vector<storage::CheckpointSet>{}) {
    std::vector<std::string> names;
    for (const auto& shard : set.shards()) names.push_back(shard.name());
    out.emplace_back(set.step(), set.sequence(), names);
  }
  return out;
}

}  // namespace strata::testing
