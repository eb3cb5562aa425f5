// The checkpoint index on a real RocksDB: commits, listing, removal and reopening; a damaged
// MANIFEST; and a write-ahead log torn at its end (a crash: the last commit is dropped) against
// one damaged before its end (an error naming the log, and the log left as it was).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/tensor_index.h"
#include "tests/test_util.h"

namespace strata::checkpoint {
namespace {

using strata::testing::TempDir;

TEST(TensorIndexTest, CommitListRemoveReopenAndErrors) {
  TempDir dir;
  const std::string path = dir.File("index");
  auto missing = TensorIndex::Open(path, false);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_NE(missing.status().message().find("no checkpoint index"), std::string::npos);
  {
    auto index = TensorIndex::Open(path, true);
    ASSERT_TRUE(index.ok()) << index.status();
    for (int64_t step : {20, 10}) {
      CheckpointManifest m;
      m.set_step(step);
      TensorRef r;
      r.set_layer(1);
      r.set_expert(-1);
      r.set_kind(2);
      r.set_version(static_cast<uint64_t>(step));
      r.mutable_extent()->set_file(0);
      r.mutable_extent()->set_offset(4096 * static_cast<uint64_t>(step));
      *m.add_tensors() = r;
      ASSERT_TRUE((*index)->CommitCheckpoint(m, {r}).ok());
    }
  }
  auto index = TensorIndex::Open(path, false);
  ASSERT_TRUE(index.ok()) << index.status();
  auto cps = (*index)->Checkpoints();
  ASSERT_TRUE(cps.ok());
  ASSERT_EQ(cps->size(), 2u);
  EXPECT_EQ((*cps)[0].step(), 10);  // sorted by step
  auto versions = (*index)->TensorVersions();
  ASSERT_TRUE(versions.ok());
  ASSERT_EQ(versions->size(), 2u);
  EXPECT_EQ((*versions)[0].layer(), 1);
  EXPECT_EQ((*versions)[0].expert(), -1);
  EXPECT_EQ((*versions)[0].kind(), 2);
  ASSERT_TRUE((*index)->RemoveCheckpoint(10, {(*cps)[0].tensors(0)}).ok());
  EXPECT_EQ((*index)->Checkpoints()->size(), 1u);
  EXPECT_EQ((*index)->TensorVersions()->size(), 1u);
  index->reset();
  // Damage: overwrite RocksDB's MANIFEST files with garbage.
  for (const auto& f : std::filesystem::directory_iterator(path)) {
    if (f.path().filename().string().rfind("MANIFEST", 0) == 0) {
      std::ofstream(f.path(), std::ios::binary | std::ios::trunc) << "garbage garbage garbage";
    }
  }
  auto damaged = TensorIndex::Open(path, false);
  ASSERT_FALSE(damaged.ok());
  EXPECT_NE(damaged.status().message().find(path), std::string::npos) << damaged.status();
}

// Checkpoint manifests of steps 10, 20, ..., 50 committed into a new index at `path`, left in
// its write-ahead log (closing RocksDB does not flush the log to a table file).
void WriteFiveCommitsToTheWal(const std::string& path) {
  auto index = TensorIndex::Open(path, true);
  ASSERT_TRUE(index.ok()) << index.status();
  for (int64_t step = 10; step <= 50; step += 10) {
    CheckpointManifest m;
    m.set_step(step);
    m.set_model_config(std::string(200, 'x'));  // records of a few hundred bytes
    ASSERT_TRUE((*index)->CommitCheckpoint(m, {}).ok());
  }
}

std::string OnlyWal(const std::string& path) {
  std::vector<std::string> wals;
  for (const auto& f : std::filesystem::directory_iterator(path)) {
    if (f.path().extension() == ".log" && f.file_size() > 0) wals.push_back(f.path().string());
  }
  EXPECT_EQ(wals.size(), 1u);
  return wals.empty() ? "" : wals[0];
}

std::vector<int64_t> Steps(TensorIndex& index) {
  std::vector<int64_t> out;
  auto cps = index.Checkpoints();
  EXPECT_TRUE(cps.ok()) << cps.status();
  if (cps.ok()) {
    for (const auto& m : *cps) out.push_back(m.step());
  }
  return out;
}

// A record torn at the WAL's end (what a crash can leave) drops only that commit; damage before the
// end fails the open, naming the log, instead of silently dropping every later commit.
TEST(TensorIndexTest, TornWalTailIsDroppedDamageBeforeTheEndIsAnError) {
  TempDir dir;
  for (const char* name : {"torn", "flipped"}) {
    WriteFiveCommitsToTheWal(dir.File(name));
  }
  {
    const std::string wal = OnlyWal(dir.File("torn"));
    std::filesystem::resize_file(wal, std::filesystem::file_size(wal) - 10);
    for (bool read_only : {true, false}) {
      auto index = read_only ? TensorIndex::OpenReadOnly(dir.File("torn"))
                             : TensorIndex::Open(dir.File("torn"), false);
      ASSERT_TRUE(index.ok()) << index.status();
      EXPECT_EQ(Steps(**index), (std::vector<int64_t>{10, 20, 30, 40}));
    }
  }
  const std::string path = dir.File("flipped");
  const std::string wal = OnlyWal(path);
  std::string bytes = strata::testing::ReadFile(wal);
  for (size_t i = bytes.size() / 2; i < bytes.size() / 2 + 16; ++i) bytes[i] ^= 0x5a;
  strata::testing::WriteFile(wal, bytes);
  for (bool read_only : {true, false}) {
    auto index = read_only ? TensorIndex::OpenReadOnly(path) : TensorIndex::Open(path, false);
    ASSERT_FALSE(index.ok()) << "read_only " << read_only;
    EXPECT_TRUE(absl::IsDataLoss(index.status())) << index.status();
    EXPECT_NE(index.status().message().find("write-ahead log (" + wal + ")"), std::string::npos)
        << index.status();
    EXPECT_NE(index.status().message().find("--start-over"), std::string::npos) << index.status();
  }
  EXPECT_EQ(strata::testing::ReadFile(wal), bytes) << "a refused open changed the log";
}

}  // namespace
}  // namespace strata::checkpoint
