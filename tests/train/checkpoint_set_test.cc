// The global manifests and ledger of a sharded checkpoint folder, on real files: sets committed
// and listed back field by field, sets that are not whole refused with nothing written, manifests
// deleted, cut and flipped on disk, a committer SIGKILLed between its manifest and its ledger, and
// listings beside a committer.
#include "train/checkpoint_set.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <thread>

#include "core/common/fault_point.h"
#include "google/protobuf/text_format.h"
#include "storage/crc32c.h"
#include "tests/test_util.h"
#include "train/ledger_text.h"

namespace strata::train {
namespace {

using strata::testing::ReadFile;
using strata::testing::TempDir;
using strata::testing::WriteFile;

// CRC-32C of "123456789": the check value of RFC 3720 (B.4), not computed here.
constexpr char kLocalManifest[] = "123456789";
constexpr uint32_t kLocalManifestCrc = 0xE3069283u;

// Two MoE layers (blocks 1 and 3) of 8 experts, three dense tensors.
CheckpointSetLayout Layout() {
  CheckpointSetLayout layout;
  layout.moe_layers = {1, 3};
  layout.experts_per_layer = 8;
  layout.dense = {"embed", "ln_f", "block0.attn"};
  return layout;
}

void AddRange(storage::ShardEntry* shard, int32_t layer, int32_t first, int32_t count) {
  storage::ExpertRange* r = shard->add_experts();
  r->set_layer(layer);
  r->set_first(first);
  r->set_count(count);
}

// A shard whose local manifest is kLocalManifest, holding experts first .. first + 3 of both
// MoE layers and `dense`.
void AddShard(CheckpointSet& set, const std::string& name, uint64_t local_sequence, int32_t first,
              const std::vector<std::string>& dense) {
  storage::ShardEntry* shard = set.add_shards();
  shard->set_name(name);
  shard->set_local_sequence(local_sequence);
  shard->set_local_manifest_crc32c(kLocalManifestCrc);
  AddRange(shard, 1, first, 4);
  AddRange(shard, 3, first, 4);
  for (const std::string& d : dense) shard->add_dense(d);
}

// A whole set: r0 holds experts 0-3 of both layers and `embed`, r1 experts 4-7 and the rest.
CheckpointSet WholeSet(int64_t step) {
  CheckpointSet set;
  set.set_step(step);
  set.set_created_unix_ms(1700000000000 + step);
  set.set_config_hash(0xabc000 + step);
  set.set_model_config("d_model: 32");
  set.set_seed(5);
  set.set_optimizer_steps(step * 2);
  set.set_storage_mode("TIERED");
  set.set_workers(2);
  AddShard(set, "r0", step + 1, 0, {"embed"});
  AddShard(set, "r1", step + 2, 4, {"ln_f", "block0.attn"});
  return set;
}

std::string ManifestFile(const std::string& dir, int64_t step) {
  return dir + "/manifests/" + std::to_string(step) + ".manifest";
}

// Every file under `dir` with its bytes.
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) files[e.path().string()] = ReadFile(e.path().string());
  }
  return files;
}

// The ledger as the file holds it, parsed here from its text (the checksum line is a comment).
storage::CheckpointLedger ReadLedger(const std::string& dir) {
  storage::CheckpointLedger ledger;
  EXPECT_TRUE(
      google::protobuf::TextFormat::ParseFromString(ReadFile(dir + "/manifests/LEDGER"), &ledger));
  return ledger;
}

std::vector<std::pair<int64_t, uint64_t>> LiveOf(const storage::CheckpointLedger& ledger) {
  std::vector<std::pair<int64_t, uint64_t>> live;
  for (const auto& e : ledger.live()) live.push_back({e.step(), e.sequence()});
  return live;
}

std::vector<int64_t> StepsOf(const std::vector<CheckpointSet>& sets) {
  std::vector<int64_t> steps;
  for (const auto& s : sets) steps.push_back(s.step());
  return steps;
}

class CheckpointSetTest : public ::testing::Test {
 protected:
  void Commit(int64_t step) {
    auto s = CommitCheckpointSet(dir_.path(), Layout(), WholeSet(step));
    ASSERT_TRUE(s.ok()) << s.status();
  }
  TempDir dir_;
};

TEST_F(CheckpointSetTest, CommitsThreeSetsAndListsThemBackFieldByField) {
  for (int64_t step : {10, 20, 30}) Commit(step);
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(sets->size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const int64_t step = 10 * (i + 1);
    const CheckpointSet& s = (*sets)[i];
    SCOPED_TRACE(step);
    EXPECT_EQ(s.step(), step);
    EXPECT_EQ(s.created_unix_ms(), 1700000000000 + step);
    EXPECT_EQ(s.config_hash(), 0xabc000u + step);
    EXPECT_EQ(s.model_config(), "d_model: 32");
    EXPECT_EQ(s.seed(), 5u);
    EXPECT_EQ(s.optimizer_steps(), step * 2);
    EXPECT_EQ(s.storage_mode(), "TIERED");
    EXPECT_EQ(s.workers(), 2);
    EXPECT_EQ(s.sequence(), static_cast<uint64_t>(i + 1));
    EXPECT_EQ(s.has_previous_step(), i > 0);
    if (i > 0) {
      EXPECT_EQ(s.previous_step(), step - 10);
      EXPECT_EQ(s.previous_sequence(), static_cast<uint64_t>(i));
    }
    ASSERT_EQ(s.shards_size(), 2);
    EXPECT_EQ(s.shards(0).name(), "r0");
    EXPECT_EQ(s.shards(0).local_sequence(), static_cast<uint64_t>(step + 1));
    EXPECT_EQ(s.shards(0).local_manifest_crc32c(), kLocalManifestCrc);
    ASSERT_EQ(s.shards(0).experts_size(), 2);
    EXPECT_EQ(s.shards(0).experts(1).layer(), 3);
    EXPECT_EQ(s.shards(0).experts(1).first(), 0);
    EXPECT_EQ(s.shards(0).experts(1).count(), 4);
    ASSERT_EQ(s.shards(1).dense_size(), 2);
    EXPECT_EQ(s.shards(1).dense(1), "block0.attn");
    EXPECT_EQ(s.shards(1).experts(0).first(), 4);
    // The file is the serialized set and 4 bytes of checksum: it parses to what was listed.
    const std::string bytes = ReadFile(ManifestFile(dir_.path(), step));
    ASSERT_GT(bytes.size(), 4u);
    CheckpointSet on_disk;
    ASSERT_TRUE(on_disk.ParseFromString(bytes.substr(0, bytes.size() - 4)));
    EXPECT_EQ(on_disk.SerializeAsString(), s.SerializeAsString());
  }
  const storage::CheckpointLedger ledger = ReadLedger(dir_.path());
  EXPECT_EQ(ledger.last_sequence(), 3u);
  EXPECT_EQ(LiveOf(ledger), (std::vector<std::pair<int64_t, uint64_t>>{{10, 1}, {20, 2}, {30, 3}}));
  EXPECT_EQ(ledger.removing_size(), 0);
  // A legacy single-shard folder keeps its own DIR/LEDGER: the global one is not there.
  EXPECT_FALSE(std::filesystem::exists(dir_.File("LEDGER")));
  // Only the manifests and the ledger: no temporaries left.
  EXPECT_EQ(Snapshot(dir_.path()).size(), 4u);
}

TEST_F(CheckpointSetTest, AnEmptyFolderListsNothing) {
  auto sets = ListCheckpointSets(dir_.File("none"));
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_TRUE(sets->empty());
}

TEST_F(CheckpointSetTest, ASetThatIsNotWholeIsRefusedNamingWhatAndWritesNothing) {
  struct Case {
    std::string what;
    std::function<void(CheckpointSet&)> change;
    std::vector<std::string> expected;  // substrings of the error
  };
  const std::vector<Case> cases = {
      {"expert 5 of layer 3 missing",
       [](CheckpointSet& s) {
         s.mutable_shards(1)->mutable_experts(1)->set_count(1);  // 4 only
         AddRange(s.mutable_shards(1), 3, 6, 2);
       },
       {"layer 3, expert 5: in no shard"}},
      {"experts 2-3 of layer 1 twice",
       [](CheckpointSet& s) { AddRange(s.mutable_shards(1), 1, 2, 2); },
       {"layer 1, experts 2-3: in more than one shard (r0, r1)"}},
      {"a dense name twice",
       [](CheckpointSet& s) { s.mutable_shards(1)->add_dense("embed"); },
       {"dense tensor 'embed' is in more than one shard (r0, r1)"}},
      {"a dense name missing",
       [](CheckpointSet& s) { s.mutable_shards(1)->mutable_dense()->RemoveLast(); },
       {"dense tensors in no shard: 'block0.attn'"}},
      {"a layer that is not MoE",
       [](CheckpointSet& s) { AddRange(s.mutable_shards(0), 2, 0, 1); },
       {"shard 'r0' lists experts of layer 2, which is not an MoE layer (those are: 1, 3)"}},
      {"a range past the layer's end",
       [](CheckpointSet& s) { s.mutable_shards(1)->mutable_experts(0)->set_count(5); },
       {"shard 'r1' lists experts first 4 count 5 of layer 1, outside the layer's experts 0-7"}},
      {"a shard name twice",
       [](CheckpointSet& s) { s.mutable_shards(1)->set_name("r0"); },
       {"shard name 'r0' is used twice"}},
      {"a bad shard name",
       [](CheckpointSet& s) { s.mutable_shards(1)->set_name("../r1"); },
       {"shard name '../r1' does not start with p0, r or w"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    // Into an empty folder: not even manifests/ appears.
    TempDir empty;
    CheckpointSet set = WholeSet(40);
    c.change(set);
    auto s = CommitCheckpointSet(empty.path(), Layout(), set);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("step 40 is not whole"), std::string::npos) << s.status();
    for (const std::string& e : c.expected) {
      EXPECT_NE(s.status().message().find(e), std::string::npos) << s.status();
    }
    EXPECT_TRUE(std::filesystem::is_empty(empty.path()));
    // Beside committed sets: every file as it was.
    TempDir used;
    ASSERT_TRUE(CommitCheckpointSet(used.path(), Layout(), WholeSet(10)).ok());
    const auto before = Snapshot(used.path());
    EXPECT_FALSE(CommitCheckpointSet(used.path(), Layout(), set).ok());
    EXPECT_EQ(Snapshot(used.path()), before);
  }
}

TEST_F(CheckpointSetTest, AStepAlreadyCommittedIsRefused) {
  Commit(10);
  const auto before = Snapshot(dir_.path());
  auto s = CommitCheckpointSet(dir_.path(), Layout(), WholeSet(10));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAlreadyExists) << s.status();
  EXPECT_EQ(Snapshot(dir_.path()), before);
}

TEST_F(CheckpointSetTest, SequencesChainAndAreNeverGivenTwice) {
  Commit(10);
  Commit(20);
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 20).ok());
  Commit(30);
  Commit(25);  // an older step commits after a newer one: the chain follows commit order
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 25, 30}));
  // 20 had sequence 2: 30 gets 3, and follows 10 (sequence 1), the newest when it committed.
  EXPECT_EQ((*sets)[2].sequence(), 3u);
  EXPECT_EQ((*sets)[2].previous_step(), 10);
  EXPECT_EQ((*sets)[2].previous_sequence(), 1u);
  EXPECT_EQ((*sets)[1].sequence(), 4u);
  EXPECT_EQ((*sets)[1].previous_step(), 30);
  EXPECT_EQ((*sets)[1].previous_sequence(), 3u);
  EXPECT_EQ(ReadLedger(dir_.path()).last_sequence(), 4u);
}

TEST_F(CheckpointSetTest, RemoveThenList) {
  for (int64_t step : {10, 20, 30}) Commit(step);
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 20).ok());
  EXPECT_FALSE(std::filesystem::exists(ManifestFile(dir_.path(), 20)));
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 30}));
  const storage::CheckpointLedger ledger = ReadLedger(dir_.path());
  EXPECT_EQ(LiveOf(ledger), (std::vector<std::pair<int64_t, uint64_t>>{{10, 1}, {30, 3}}));
  EXPECT_EQ(ledger.removing_size(), 0);
  EXPECT_EQ(ledger.last_sequence(), 3u);
  Status missing = RemoveCheckpointSet(dir_.path(), 99);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("no checkpoint 99"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("10, 30"), std::string::npos) << missing;
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 10).ok());
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 30).ok());
  sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_TRUE(sets->empty());
}

// A removal the ledger recorded but whose manifest is still there (a remover stopped between the
// two) is hidden, and finished by the next commit.
TEST_F(CheckpointSetTest, AnInterruptedRemovalIsHiddenAndFinished) {
  Commit(10);
  Commit(20);
  const std::string manifest20 = ReadFile(ManifestFile(dir_.path(), 20));
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 20).ok());
  // The state after the first ledger write: 20 recorded as being removed, its manifest still there.
  storage::CheckpointLedger removing = ReadLedger(dir_.path());
  storage::LedgerEntry* e = removing.add_removing();
  e->set_step(20);
  e->set_sequence(2);
  WriteFile(dir_.File("manifests/LEDGER"), LedgerText(removing));
  WriteFile(ManifestFile(dir_.path(), 20), manifest20);
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_EQ(StepsOf(*sets), (std::vector<int64_t>{10}));
  Commit(30);
  EXPECT_FALSE(std::filesystem::exists(ManifestFile(dir_.path(), 20)));
  EXPECT_EQ(ReadLedger(dir_.path()).removing_size(), 0);
  // And a removed set that comes back whole (a restored backup) is not taken as committed.
  WriteFile(ManifestFile(dir_.path(), 20), manifest20);
  auto back = ListCheckpointSets(dir_.path());
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(back.status().message().find("checkpoint 20: its manifest '" +
                                         ManifestFile(dir_.path(), 20) + "' (sequence 2)"),
            std::string::npos)
      << back.status();
  EXPECT_NE(back.status().message().find("a removed checkpoint came back"), std::string::npos);
}

enum class Damage { kDelete, kTruncate, kFlipByte };

class DamagedManifestTest : public CheckpointSetTest,
                            public ::testing::WithParamInterface<Damage> {};

TEST_P(DamagedManifestTest, IsReportedNamingTheStepAndFile) {
  for (int64_t step : {10, 20, 30}) Commit(step);
  const std::string path = ManifestFile(dir_.path(), 20);
  std::string bytes = ReadFile(path);
  std::string expected;
  switch (GetParam()) {
    case Damage::kDelete:
      std::filesystem::remove(path);
      expected = "checkpoint 20: its manifest '" + path + "' (sequence 2) is missing";
      break;
    case Damage::kTruncate:
      WriteFile(path, bytes.substr(0, bytes.size() / 2));
      expected = "checkpoint 20: its manifest '" + path + "' fails its checksum";
      break;
    case Damage::kFlipByte:
      bytes[bytes.size() / 3] ^= 0x10;
      WriteFile(path, bytes);
      expected = "checkpoint 20: its manifest '" + path + "' fails its checksum";
      break;
  }
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_FALSE(sets.ok());
  EXPECT_EQ(sets.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(sets.status().message().find(expected), std::string::npos) << sets.status();
  EXPECT_EQ(sets.status().message().find("checkpoint 10"), std::string::npos) << sets.status();
  // Nothing commits into a folder whose list cannot be trusted ...
  const auto before = Snapshot(dir_.path());
  auto commit = CommitCheckpointSet(dir_.path(), Layout(), WholeSet(40));
  EXPECT_EQ(commit.status().code(), absl::StatusCode::kDataLoss) << commit.status();
  EXPECT_EQ(Snapshot(dir_.path()), before);
  // ... until the damaged checkpoint is removed.
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 20).ok());
  sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 30}));
  Commit(40);
}

INSTANTIATE_TEST_SUITE_P(Damages, DamagedManifestTest,
                         ::testing::Values(Damage::kDelete, Damage::kTruncate, Damage::kFlipByte));

TEST_F(CheckpointSetTest, ADamagedLedgerIsNamed) {
  Commit(10);
  std::string text = ReadFile(dir_.File("manifests/LEDGER"));
  text[text.find("sequence: 1")] = 'S';
  WriteFile(dir_.File("manifests/LEDGER"), text);
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_FALSE(sets.ok());
  EXPECT_NE(
      sets.status().message().find("global checkpoint ledger '" + dir_.File("manifests/LEDGER")),
      std::string::npos)
      << sets.status();
}

TEST_F(CheckpointSetTest, VerifyShardRefsNamesTheShardThatFails) {
  const CheckpointSet set = WholeSet(10);  // r0 local sequence 11, r1 12
  std::map<std::pair<std::string, uint64_t>, std::string> shards = {{{"r0", 11}, kLocalManifest},
                                                                    {{"r1", 12}, kLocalManifest}};
  auto reader = [&](const std::string& shard, uint64_t sequence) -> StatusOr<std::string> {
    auto it = shards.find({shard, sequence});
    if (it == shards.end()) {
      return absl::NotFoundError("no local manifest " + std::to_string(sequence) + " in shard " +
                                 shard);
    }
    return it->second;
  };
  EXPECT_TRUE(VerifyShardRefs(dir_.path(), set, reader).ok());

  shards[{"r1", 12}] = "123456788";  // one byte different
  Status s = VerifyShardRefs(dir_.path(), set, reader);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("checkpoint 10"), std::string::npos) << s;
  EXPECT_NE(s.message().find("shard 'r1' (local manifest sequence 12): its local manifest's "
                             "CRC-32C is"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("recorded e3069283"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("'r0'"), std::string::npos) << s;

  shards.erase({"r1", 12});
  shards[{"r1", 13}] = kLocalManifest;  // a newer local manifest is not the one the set names
  s = VerifyShardRefs(dir_.path(), set, reader);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("shard 'r1' (local manifest sequence 12): no local manifest 12"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("1 of 2 shards fail"), std::string::npos) << s;
}

TEST(ShardNameTest, AcceptsTheThreeFormsAndRefusesTheRest) {
  for (const std::string& ok : std::vector<std::string>{
           "p0", "r0", "r7", "r2147483647", "w7", "wnode-3.a_b", "w" + std::string(64, 'x')}) {
    EXPECT_TRUE(ValidateShardName(ok).ok()) << ok << ": " << ValidateShardName(ok);
  }
  for (const std::string& bad :
       std::vector<std::string>{"", "p1", "p", "r", "r01", "r-1", "r2147483648", "rx", "x3", "w",
                                "w/..", "w a", "../r0", "r0/", "w:1", "w" + std::string(65, 'x')}) {
    Status s = ValidateShardName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message().find("shard name '" + bad + "'"), std::string::npos) << s;
  }
}

TEST(ExpertLayoutTest, FollowsMoeEvery) {
  config::ModelConfig model;
  model.set_n_layers(5);
  model.set_moe_every(2);
  model.mutable_moe()->set_num_experts(6);
  const CheckpointSetLayout layout = ExpertLayoutOf(model);
  EXPECT_EQ(layout.moe_layers, (std::vector<int32_t>{1, 3}));  // (i + 1) % 2 == 0
  EXPECT_EQ(layout.experts_per_layer, 6);
  model.set_moe_every(0);
  EXPECT_TRUE(ExpertLayoutOf(model).moe_layers.empty());
}

// A committer SIGKILLed between the rename of its manifest and the ledger's update: the set
// committed (it follows the ledger's newest), so it is listed, and the next commit records it.
// Twice in a row, the second following the first.
TEST_F(CheckpointSetTest, ACommitterKilledBeforeTheLedgerLeavesACommittedSet) {
#ifndef STRATA_FAULT_INJECTION
  GTEST_SKIP() << "this build compiled fault points out (-DSTRATA_FAULT_INJECTION=OFF)";
#endif
  for (int64_t step : {10, 20, 30}) Commit(step);
  const std::string ledger_before = ReadFile(dir_.File("manifests/LEDGER"));
  auto commit_and_die = [&](int64_t step) {
    pid_t pid = fork();
    if (pid == 0) {
      FaultPoints::Instance().Set("checkpoint_set.before_ledger", [](void* arg) {
        if (*static_cast<int64_t*>(arg) > 0) raise(SIGKILL);
      });
      (void)CommitCheckpointSet(dir_.path(), Layout(), WholeSet(step));
      _exit(0);  // not reached
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  };
  commit_and_die(40);
  EXPECT_TRUE(std::filesystem::exists(ManifestFile(dir_.path(), 40)));
  EXPECT_EQ(ReadFile(dir_.File("manifests/LEDGER")), ledger_before);  // never updated
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 20, 30, 40}));
  EXPECT_EQ((*sets)[3].sequence(), 4u);
  EXPECT_EQ((*sets)[3].previous_step(), 30);
  EXPECT_EQ((*sets)[3].previous_sequence(), 3u);

  commit_and_die(50);
  EXPECT_EQ(ReadFile(dir_.File("manifests/LEDGER")), ledger_before);
  sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 20, 30, 40, 50}));
  EXPECT_EQ((*sets)[4].previous_step(), 40);

  Commit(60);
  const storage::CheckpointLedger ledger = ReadLedger(dir_.path());
  EXPECT_EQ(LiveOf(ledger), (std::vector<std::pair<int64_t, uint64_t>>{
                                {10, 1}, {20, 2}, {30, 3}, {40, 4}, {50, 5}, {60, 6}}));
  EXPECT_EQ(ledger.last_sequence(), 6u);

  // An unrecorded manifest that does not follow the ledger's newest (here: 50's, with the
  // predecessor changed and its checksum made right) is named, not listed.
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 60).ok());
  CheckpointSet stray = (*sets)[4];
  stray.set_step(70);
  stray.set_sequence(9);
  stray.set_previous_step(20);
  stray.set_previous_sequence(2);
  // Write the stray set by the format the header documents: bytes, then CRC-32C little-endian.
  std::string bytes = stray.SerializeAsString();
  const uint32_t crc = storage::Crc32c(bytes.data(), bytes.size());
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>(crc >> (8 * i)));
  WriteFile(ManifestFile(dir_.path(), 70), bytes);
  auto stray_list = ListCheckpointSets(dir_.path());
  ASSERT_FALSE(stray_list.ok());
  EXPECT_NE(stray_list.status().message().find(
                "checkpoint 70: its manifest '" + ManifestFile(dir_.path(), 70) +
                "' (sequence 9) is not in the global ledger and does not follow the newest "
                "checkpoint before it (step 50, sequence 5)"),
            std::string::npos)
      << stray_list.status();
}

// Listings beside a committer that commits and removes: never an error.
TEST_F(CheckpointSetTest, ListingBesideACommitterIsNeverAnError) {
  std::atomic<bool> done{false}, stop{false};
  Status writer_status;
  std::thread writer([&] {
    for (int64_t step = 1; step <= 150 && writer_status.ok() && !stop; ++step) {
      auto s = CommitCheckpointSet(dir_.path(), Layout(), WholeSet(step));
      writer_status = s.status();
      if (writer_status.ok() && step > 2)
        writer_status = RemoveCheckpointSet(dir_.path(), step - 2);
    }
    done = true;
  });
  int listings = 0;
  Status listed;
  while (!done && listed.ok()) {
    listed = ListCheckpointSets(dir_.path()).status();
    ++listings;
  }
  stop = true;
  writer.join();
  ASSERT_TRUE(listed.ok()) << "listing " << listings << ": " << listed;
  ASSERT_TRUE(writer_status.ok()) << writer_status;
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_EQ(StepsOf(*sets), (std::vector<int64_t>{149, 150}));
  EXPECT_GT(listings, 0);
}

}  // namespace
}  // namespace strata::train
