// The global manifests and ledger of a sharded checkpoint folder, on real files: sets committed
// and listed back field by field, sets that are not whole refused with nothing written, manifests
// deleted, cut and flipped on disk, a committer SIGKILLed between its manifest and its ledger (also
// right after an interrupted removal of its step), a remover SIGKILLed between its ledger and its
// delete, file operations failed through the Env, listings beside a committer, and the shard names
// of worker ids.
#include "checkpoint/checkpoint_set.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include "checkpoint/ledger_text.h"
#include "core/common/fault_point.h"
#include "google/protobuf/text_format.h"
#include "storage/crc32c.h"
#include "tests/test_util.h"

namespace strata::checkpoint {
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

// Writes the ledger that a remover of `removing` (step, sequence) leaves when it stops right after
// recording the removal: `live` listed, `removing` being removed, sequences given up to `last`.
void WriteRemovingLedger(const std::string& dir, std::vector<std::pair<int64_t, uint64_t>> live,
                         std::pair<int64_t, uint64_t> removing, uint64_t last) {
  storage::CheckpointLedger ledger;
  ledger.set_format(1);
  ledger.set_last_sequence(last);
  for (const auto& [step, sequence] : live) {
    storage::LedgerEntry* e = ledger.add_live();
    e->set_step(step);
    e->set_sequence(sequence);
  }
  storage::LedgerEntry* e = ledger.add_removing();
  e->set_step(removing.first);
  e->set_sequence(removing.second);
  WriteFile(dir + "/manifests/LEDGER", LedgerText(ledger));
}

// Runs `work` in a child process that is SIGKILLed when it reaches the fault point `point` at
// step `step`; fails the test unless it died there.
void RunAndKillAt(const std::string& point, int64_t step, const std::function<void()>& work) {
  pid_t pid = fork();
  if (pid == 0) {
    FaultPoints::Instance().Set(point, [step](void* arg) {
      if (*static_cast<int64_t*>(arg) == step) raise(SIGKILL);
    });
    work();
    _exit(0);  // the point was not reached
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "the child was not killed at " << point << " (status " << status << ")";
}

// The POSIX Env, with every call recorded as "Operation path", and DeleteFile failing while
// `fail_deletes` is set.
class RecordingEnv : public storage::Env {
 public:
  StatusOr<std::unique_ptr<storage::ReadOnlyRegion>> MapReadOnly(const std::string& path) override {
    Record("MapReadOnly", path);
    return base_->MapReadOnly(path);
  }
  StatusOr<std::unique_ptr<storage::WritableFile>> OpenWritable(const std::string& path,
                                                                bool truncate) override {
    Record("OpenWritable", path);
    return base_->OpenWritable(path, truncate);
  }
  Status WriteFileAtomic(const std::string& path, std::string_view data) override {
    Record("WriteFileAtomic", path);
    return base_->WriteFileAtomic(path, data);
  }
  StatusOr<std::string> ReadFile(const std::string& path) override {
    Record("ReadFile", path);
    return base_->ReadFile(path);
  }
  StatusOr<uint64_t> FileSize(const std::string& path) override {
    Record("FileSize", path);
    return base_->FileSize(path);
  }
  bool FileExists(const std::string& path) override {
    Record("FileExists", path);
    return base_->FileExists(path);
  }
  Status CreateDirs(const std::string& path) override {
    Record("CreateDirs", path);
    return base_->CreateDirs(path);
  }
  Status DeleteFile(const std::string& path) override {
    Record("DeleteFile", path);
    if (fail_deletes) return absl::UnavailableError("injected: the disk went away");
    return base_->DeleteFile(path);
  }
  StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    Record("ListDir", path);
    return base_->ListDir(path);
  }
  Status SyncDir(const std::string& path) override {
    Record("SyncDir", path);
    return base_->SyncDir(path);
  }

  // The calls since the last Take, and none after it.
  std::vector<std::string> Take() { return std::exchange(calls_, {}); }
  bool fail_deletes = false;

 private:
  void Record(const char* op, const std::string& path) {
    calls_.push_back(std::string(op) + " " + path);
  }
  storage::Env* base_ = storage::Env::Default();
  std::vector<std::string> calls_;
};

bool Has(const std::vector<std::string>& calls, const std::string& call) {
  return std::find(calls.begin(), calls.end(), call) != calls.end();
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
      {"a dense name the model does not have",
       [](CheckpointSet& s) { s.mutable_shards(0)->add_dense("block9.attn"); },
       {"dense tensors the model does not have: 'block9.attn' (r0)"}},
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

TEST(ShardNameTest, AcceptsTheFourFormsAndRefusesTheRest) {
  // A w-name fills at most a folder name of 255 bytes: "w" and 254 characters. "." is the folder
  // itself (written before sharding).
  for (const std::string& ok :
       std::vector<std::string>{"p0", ".", "r0", "r7", "r2147483647", "w7", "wnode-3.a_b",
                                "w" + std::string(64, 'x'), "w" + std::string(254, 'x')}) {
    EXPECT_TRUE(ValidateShardName(ok).ok()) << ok << ": " << ValidateShardName(ok);
  }
  for (const std::string& bad : std::vector<std::string>{
           "", "p1", "p", "..", "./", "r", "r01", "r-1", "r2147483648", "rx", "x3", "w", "w/..",
           "w a", "../r0", "r0/", "w:1", "w" + std::string(255, 'x')}) {
    Status s = ValidateShardName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message().find("shard name '" + bad + "'"), std::string::npos) << s;
  }
}

// The inverse of the encoding the header documents, written here from that text: kept characters
// as they are, "_XX" as the byte XX. nullopt for what no worker id encodes to.
std::optional<std::string> DecodeWorkerShardName(const std::string& name) {
  if (name.empty() || name[0] != 'w') return std::nullopt;
  std::string id;
  for (size_t i = 1; i < name.size(); ++i) {
    if (name[i] != '_') {
      id.push_back(name[i]);
      continue;
    }
    if (i + 2 >= name.size()) return std::nullopt;
    const std::string hex = name.substr(i + 1, 2);
    if (hex.find_first_not_of("0123456789abcdef") != std::string::npos) return std::nullopt;
    id.push_back(static_cast<char>(std::stoi(hex, nullptr, 16)));
    i += 2;
  }
  return id;
}

TEST(ShardNameTest, WorkerIdsEncodeOneToOneIntoValidNames) {
  const std::vector<std::pair<std::string, std::string>> by_hand = {
      {"7", "w7"},
      {"host:1234", "whost_3a1234"},
      {"node-3.example.org", "wnode-3.example.org"},
      {"a_b", "wa_5fb"},
      {"a_", "wa_5f"},
      {"a_5f", "wa_5f5f"},
      {"A B/..", "wA_20B_2f.."},
      {std::string("\x00\xff", 2), "w_00_ff"},
  };
  for (const auto& [id, expected] : by_hand) {
    auto name = ShardNameOfWorker(id);
    ASSERT_TRUE(name.ok()) << name.status();
    EXPECT_EQ(*name, expected);
  }
  // Pairs an encoding that is not one to one would confuse: an escape and the text it spells, '_'
  // and its own escape, case in the hex digits, bytes above 0x7f.
  std::vector<std::string> ids = {"a_", "a_5f",   "a_5F",   "a:",      "a_3a",     "a_3A", "_",
                                  "__", "_5f",    "5f",     "a",       "A",        ".",    "..",
                                  "-",  "host:1", "host_1", "host:1:", "\xc3\xa9", "\xe9"};
  for (int b = 0; b < 256; ++b) ids.push_back(std::string(1, static_cast<char>(b)) + "x");
  std::map<std::string, std::string> owner;  // name -> id
  for (const std::string& id : ids) {
    auto name = ShardNameOfWorker(id);
    ASSERT_TRUE(name.ok()) << name.status();
    EXPECT_TRUE(ValidateShardName(*name).ok()) << ValidateShardName(*name);
    EXPECT_EQ(DecodeWorkerShardName(*name), id) << *name;
    auto [it, fresh] = owner.emplace(*name, id);
    EXPECT_TRUE(fresh) << "'" << it->second << "' and '" << id << "' both make " << *name;
  }
  // The longest id that fits, and one byte more; an empty id.
  auto longest = ShardNameOfWorker(std::string(84, ':') + "ab");  // 84 * 3 + 2 = 254
  ASSERT_TRUE(longest.ok()) << longest.status();
  EXPECT_EQ(longest->size(), 255u);
  EXPECT_TRUE(ValidateShardName(*longest).ok());
  auto too_long = ShardNameOfWorker(std::string(84, ':') + "abc");
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("worker id '" + std::string(84, ':') +
                                             "abc' (87 "
                                             "bytes) makes a shard name of 255 characters"),
            std::string::npos)
      << too_long.status();
  EXPECT_NE(too_long.status().message().find("shorter --id"), std::string::npos);
  EXPECT_EQ(ShardNameOfWorker("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointSetLayoutTest, FollowsTheModelsMoeLayersAndKeepsItsDenseNames) {
  config::ModelConfig model;
  model.set_n_layers(5);
  model.mutable_moe()->set_num_experts(6);
  // Block i has an MoE FFN when (i + 1) % moe_every == 0, by hand:
  for (const auto& [moe_every, layers] : std::vector<std::pair<int, std::vector<int32_t>>>{
           {2, {1, 3}}, {1, {0, 1, 2, 3, 4}}, {3, {2}}, {6, {}}, {0, {}}}) {
    model.set_moe_every(moe_every);
    const CheckpointSetLayout layout = CheckpointSetLayoutOf(model, {"embed", "ln_f"});
    EXPECT_EQ(layout.moe_layers, layers) << "moe_every " << moe_every;
    EXPECT_EQ(layout.experts_per_layer, 6);
    EXPECT_EQ(layout.dense, (std::vector<std::string>{"embed", "ln_f"}));
  }
}

// The layout a model gives checks the dense tensors: one the set leaves out and one the model does
// not have are refused, each named; a model with no dense names refuses a set that holds one.
TEST(CheckpointSetLayoutTest, ACommitChecksTheModelsDenseNames) {
  config::ModelConfig model;
  model.set_n_layers(4);
  model.set_moe_every(2);  // blocks 1 and 3, as WholeSet's shards hold
  model.mutable_moe()->set_num_experts(8);
  const CheckpointSetLayout layout =
      CheckpointSetLayoutOf(model, {"embed", "block0.attn", "ln_f", "lm_head"});
  TempDir dir;
  CheckpointSet set = WholeSet(10);  // holds embed, ln_f, block0.attn
  set.mutable_shards(0)->add_dense("block5.attn");
  auto s = CommitCheckpointSet(dir.path(), layout, set);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("dense tensors in no shard: 'lm_head'"), std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("dense tensors the model does not have: 'block5.attn' (r0)"),
            std::string::npos)
      << s.status();
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  set.mutable_shards(0)->mutable_dense()->RemoveLast();
  set.mutable_shards(0)->add_dense("lm_head");
  s = CommitCheckpointSet(dir.path(), layout, set);
  ASSERT_TRUE(s.ok()) << s.status();

  auto none = CommitCheckpointSet(dir.path(), CheckpointSetLayoutOf(model, {}), WholeSet(20));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find(
                "dense tensors the model does not have: 'block0.attn' (r1), 'embed' (r0)"),
            std::string::npos)
      << none.status();
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
    RunAndKillAt("checkpoint_set.before_ledger", step,
                 [&] { (void)CommitCheckpointSet(dir_.path(), Layout(), WholeSet(step)); });
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

// A removal of step 20 stopped after its ledger update (its manifest still there, or deleted
// already), then a new commit of step 20 SIGKILLed between its manifest and its ledger: the new
// set committed, so it is listed, and the next commit keeps and records it; the old removal never
// hides or deletes it.
TEST_F(CheckpointSetTest, ACommitOfAStepBeingRemovedKilledBeforeItsLedgerStaysCommitted) {
#ifndef STRATA_FAULT_INJECTION
  GTEST_SKIP() << "this build compiled fault points out (-DSTRATA_FAULT_INJECTION=OFF)";
#endif
  for (const bool manifest_left : {true, false}) {
    SCOPED_TRACE(manifest_left ? "old manifest still there" : "old manifest deleted");
    TempDir dir;
    ASSERT_TRUE(CommitCheckpointSet(dir.path(), Layout(), WholeSet(10)).ok());
    ASSERT_TRUE(CommitCheckpointSet(dir.path(), Layout(), WholeSet(20)).ok());
    WriteRemovingLedger(dir.path(), {{10, 1}}, {20, 2}, 2);
    if (!manifest_left) std::filesystem::remove(ManifestFile(dir.path(), 20));
    auto sets = ListCheckpointSets(dir.path());
    ASSERT_TRUE(sets.ok()) << sets.status();
    ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10}));

    CheckpointSet again = WholeSet(20);
    again.set_seed(6);  // tells the new set from the old one
    RunAndKillAt("checkpoint_set.before_ledger", 20,
                 [&] { (void)CommitCheckpointSet(dir.path(), Layout(), again); });
    // The commit finished the removal, and the ledger forgot it, before its manifest appeared.
    EXPECT_EQ(ReadLedger(dir.path()).removing_size(), 0);
    sets = ListCheckpointSets(dir.path());
    ASSERT_TRUE(sets.ok()) << sets.status();
    ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 20}));
    EXPECT_EQ((*sets)[1].seed(), 6u);
    EXPECT_EQ((*sets)[1].sequence(), 3u);  // 2 was the removed set's
    EXPECT_EQ((*sets)[1].previous_step(), 10);

    ASSERT_TRUE(CommitCheckpointSet(dir.path(), Layout(), WholeSet(30)).ok());
    sets = ListCheckpointSets(dir.path());
    ASSERT_TRUE(sets.ok()) << sets.status();
    ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 20, 30}));
    EXPECT_EQ((*sets)[1].seed(), 6u);
    const storage::CheckpointLedger ledger = ReadLedger(dir.path());
    EXPECT_EQ(LiveOf(ledger),
              (std::vector<std::pair<int64_t, uint64_t>>{{10, 1}, {20, 3}, {30, 4}}));
    EXPECT_EQ(ledger.removing_size(), 0);
  }
}

// A `removing` entry names a sequence: beside it, the manifest of the same step with another
// sequence (committed again, unrecorded) is listed, and finishing the removal leaves it.
TEST_F(CheckpointSetTest, ARemovingEntryCoversOnlyItsOwnSequence) {
  Commit(10);
  Commit(20);
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 20).ok());
  CheckpointSet again = WholeSet(20);
  again.set_seed(6);
  ASSERT_TRUE(CommitCheckpointSet(dir_.path(), Layout(), again).ok());  // sequence 3
  WriteRemovingLedger(dir_.path(), {{10, 1}}, {20, 2}, 2);
  auto sets = ListCheckpointSets(dir_.path());
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 20}));
  EXPECT_EQ((*sets)[1].sequence(), 3u);
  Commit(30);
  EXPECT_EQ(ReadFile(ManifestFile(dir_.path(), 20)).empty(), false);
  const storage::CheckpointLedger ledger = ReadLedger(dir_.path());
  EXPECT_EQ(LiveOf(ledger), (std::vector<std::pair<int64_t, uint64_t>>{{10, 1}, {20, 3}, {30, 4}}));
  EXPECT_EQ(ledger.removing_size(), 0);
}

// A remover SIGKILLed between the ledger's record of the removal and the manifest's delete: the
// set is hidden, its manifest still there, and the next commit, or the next removal, finishes it.
TEST_F(CheckpointSetTest, ARemoverKilledBeforeTheDeleteLeavesTheSetHiddenUntilFinished) {
#ifndef STRATA_FAULT_INJECTION
  GTEST_SKIP() << "this build compiled fault points out (-DSTRATA_FAULT_INJECTION=OFF)";
#endif
  for (const bool by_commit : {true, false}) {
    SCOPED_TRACE(by_commit ? "finished by a commit" : "finished by a removal");
    TempDir dir;
    for (int64_t step : {10, 20, 30}) {
      ASSERT_TRUE(CommitCheckpointSet(dir.path(), Layout(), WholeSet(step)).ok());
    }
    RunAndKillAt("checkpoint_set.before_delete", 20,
                 [&] { (void)RemoveCheckpointSet(dir.path(), 20); });
    EXPECT_TRUE(std::filesystem::exists(ManifestFile(dir.path(), 20)));
    storage::CheckpointLedger ledger = ReadLedger(dir.path());
    EXPECT_EQ(LiveOf(ledger), (std::vector<std::pair<int64_t, uint64_t>>{{10, 1}, {30, 3}}));
    ASSERT_EQ(ledger.removing_size(), 1);
    EXPECT_EQ(ledger.removing(0).step(), 20);
    EXPECT_EQ(ledger.removing(0).sequence(), 2u);
    auto sets = ListCheckpointSets(dir.path());
    ASSERT_TRUE(sets.ok()) << sets.status();
    EXPECT_EQ(StepsOf(*sets), (std::vector<int64_t>{10, 30}));

    if (by_commit) {
      ASSERT_TRUE(CommitCheckpointSet(dir.path(), Layout(), WholeSet(40)).ok());
    } else {
      ASSERT_TRUE(RemoveCheckpointSet(dir.path(), 10).ok());
    }
    EXPECT_FALSE(std::filesystem::exists(ManifestFile(dir.path(), 20)));
    ledger = ReadLedger(dir.path());
    EXPECT_EQ(ledger.removing_size(), 0);
    EXPECT_EQ(LiveOf(ledger),
              by_commit ? (std::vector<std::pair<int64_t, uint64_t>>{{10, 1}, {30, 3}, {40, 4}})
                        : (std::vector<std::pair<int64_t, uint64_t>>{{30, 3}}));
    sets = ListCheckpointSets(dir.path());
    ASSERT_TRUE(sets.ok()) << sets.status();
    EXPECT_EQ(StepsOf(*sets),
              by_commit ? (std::vector<int64_t>{10, 30, 40}) : (std::vector<int64_t>{30}));
  }
}

// Every file operation goes through the Env it is given: the folder is listed, the manifest
// deleted and the folder synced through it, and a delete that fails there fails the removal,
// leaving the set hidden until a removal that succeeds.
TEST_F(CheckpointSetTest, FileOperationsGoThroughTheEnv) {
  RecordingEnv env;
  const std::string manifests = dir_.File("manifests");
  ASSERT_TRUE(CommitCheckpointSet(dir_.path(), Layout(), WholeSet(10), &env).ok());
  ASSERT_TRUE(CommitCheckpointSet(dir_.path(), Layout(), WholeSet(20), &env).ok());
  std::vector<std::string> calls = env.Take();
  EXPECT_TRUE(Has(calls, "SyncDir " + dir_.path())) << "a new manifests/ folder is synced";
  EXPECT_TRUE(Has(calls, "ListDir " + manifests));
  EXPECT_TRUE(Has(calls, "WriteFileAtomic " + ManifestFile(dir_.path(), 20)));

  env.fail_deletes = true;
  const Status failed = RemoveCheckpointSet(dir_.path(), 10, &env);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_NE(failed.message().find("injected"), std::string::npos) << failed;
  calls = env.Take();
  EXPECT_TRUE(Has(calls, "DeleteFile " + ManifestFile(dir_.path(), 10)));
  EXPECT_TRUE(std::filesystem::exists(ManifestFile(dir_.path(), 10)));
  auto sets = ListCheckpointSets(dir_.path(), &env);
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_EQ(StepsOf(*sets), (std::vector<int64_t>{20}));

  env.fail_deletes = false;
  ASSERT_TRUE(RemoveCheckpointSet(dir_.path(), 20, &env).ok());
  calls = env.Take();
  EXPECT_TRUE(Has(calls, "DeleteFile " + ManifestFile(dir_.path(), 10)));
  EXPECT_TRUE(Has(calls, "DeleteFile " + ManifestFile(dir_.path(), 20)));
  EXPECT_TRUE(Has(calls, "SyncDir " + manifests));
  EXPECT_FALSE(std::filesystem::exists(ManifestFile(dir_.path(), 10)));
  EXPECT_FALSE(std::filesystem::exists(ManifestFile(dir_.path(), 20)));
  sets = ListCheckpointSets(dir_.path(), &env);
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_TRUE(sets->empty());
  EXPECT_EQ(ReadLedger(dir_.path()).removing_size(), 0);
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
}  // namespace strata::checkpoint
