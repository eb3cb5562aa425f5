// Checkpoints and resume with the real parts: real `strata` processes killed with SIGKILL, bytes
// flipped in real data files, a disk made full by the fault-injecting block I/O, a damaged and a
// missing RocksDB index, and an incompatible config.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/checkpoint_set.h"
#include "checkpoint/tensor_index.h"
#include "core/common/fault_injection.h"
#include "google/protobuf/text_format.h"
#include "proto/config_io.h"
#include "scheduler/tiered_scheduler.h"
#include "storage/crc32c.h"
#include "tests/test_util.h"
#include "train/trainer.h"

// Tests that arm fault points in the strata binary (STRATA_FAULTS) need a build that compiled
// them in (the default; -DSTRATA_FAULT_INJECTION=OFF compiles them out and strata refuses
// STRATA_FAULTS).
#ifdef STRATA_FAULT_INJECTION
#define STRATA_SKIP_WITHOUT_FAULT_POINTS() \
  do {                                     \
  } while (0)
#else
#define STRATA_SKIP_WITHOUT_FAULT_POINTS() \
  GTEST_SKIP() << "this build compiled fault points out (-DSTRATA_FAULT_INJECTION=OFF)"
#endif

namespace strata::train {
namespace {

using checkpoint::CheckpointInfo;
using checkpoint::CheckpointManager;
using checkpoint::CheckpointOptions;
using checkpoint::CheckpointSet;
using checkpoint::CheckpointSetLayout;
using checkpoint::CheckpointShare;
using checkpoint::CommitCheckpointSet;
using checkpoint::DealDenseParameters;
using checkpoint::ListCheckpointSets;
using checkpoint::RemoveCheckpointSet;

using strata::testing::ListedSteps;
using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

// The one shard `strata train` writes in the checkpoint folder `ck`.
std::string Shard(const std::string& ck) { return ck + "/shards/p0"; }

std::string ConfigText(const std::string& mode, int d_model = 32) {
  return "seed: 5\n"
         "model { seq_len: 16 d_model: " +
         std::to_string(d_model) +
         " n_layers: 2 n_heads: 2\n"
         "        moe { num_experts: 8 top_k: 2 d_expert: 32 } }\n"
         "data { path: \"text.txt\" }\n"
         "train { steps: 40 global_batch: 8 lr: 0.004 warmup_steps: 2 eval_every: 0 "
         "eval_batches: 1 threads: 2 }\n"
         "storage { mode: " +
         mode + " io_block_bytes: 8192" +
         // The device budget holds the dense state (strata refuses one that cannot).
         (mode == "TIERED"
              ? " device_budget_bytes: " + std::to_string(d_model == 32 ? 400000 : 800000) +
                    " host_budget_bytes: 140000"
              : "") +
         " }\n";
}

// step -> loss from a metrics file.
std::map<int, std::string> Losses(const std::string& metrics) {
  std::map<int, std::string> out;
  for (const auto& line : absl::StrSplit(ReadFile(metrics), '\n', absl::SkipEmpty())) {
    std::string l(line);
    const int step = std::stoi(l.substr(l.find("\"step\":") + 7));
    const size_t at = l.find("\"loss\":") + 7;
    out[step] = l.substr(at, l.find(',', at) - at);  // the printed digits
  }
  return out;
}

class CheckpointTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(40000));
    WriteFile(dir_.File("job.textproto"), ConfigText(GetParam()));
    // The uninterrupted run every resumed run is compared with.
    auto r = RunCommand(Strata("--metrics-out " + dir_.File("full.jsonl")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    full_ = Losses(dir_.File("full.jsonl"));
    ASSERT_EQ(full_.size(), 40u);
  }
  std::string Strata(const std::string& flags) const {
    return "cd " + dir_.path() + " && " + kStrata + " train --config job.textproto --quiet " +
           flags;
  }
  // Runs training into `ckdir` in the background and SIGKILLs it once `marker` appears in its log.
  void RunAndKill(const std::string& ckdir, const std::string& marker,
                  const std::string& env = "") {
    const std::string log = dir_.File("kill.log");
    std::filesystem::remove(log);
    pid_t pid = fork();
    if (pid == 0) {
      const std::string cmd = "cd " + dir_.path() + " && " + env + " exec " + kStrata +
                              " train --config job.textproto --quiet --checkpoint-dir " + ckdir +
                              " --checkpoint-every 10 > " + log + " 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (ReadFile(log).find(marker) == std::string::npos) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "never saw: " << marker << "\n"
                                                            << ReadFile(log);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  }
  // Resumes into `ckdir` and checks the resumed steps against the uninterrupted run.
  void ResumeAndCompare(const std::string& ckdir, int expect_from) {
    const std::string metrics = dir_.File("resumed.jsonl");
    auto r = RunCommand(Strata("--checkpoint-dir " + ckdir +
                               " --checkpoint-every 10 --resume --metrics-out " + metrics));
    resume_output_ = r.output;
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from checkpoint " + std::to_string(expect_from)),
              std::string::npos)
        << r.output;
    auto resumed = Losses(metrics);
    ASSERT_EQ(resumed.size(), static_cast<size_t>(40 - expect_from));
    for (const auto& [step, loss] : resumed) {
      EXPECT_EQ(loss, full_.at(step)) << "step " << step << " differs after resuming";
    }
  }
  TempDir dir_;
  std::map<int, std::string> full_;
  std::string resume_output_;  // of the last ResumeAndCompare
};

TEST_P(CheckpointTest, SigkillMidCheckpointResumesFromLastCompleteOneBitwise) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  // Hold each commit for 3 s and kill while checkpoint 20 is written but not committed.
  RunAndKill(ck, "checkpoint 20: ", "STRATA_FAULTS=checkpoint.before_commit=sleep_ms:3000");
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  ASSERT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_NE(ls.output.find("        10  "), std::string::npos) << ls.output;
  EXPECT_EQ(ls.output.find("        20  "), std::string::npos) << "20 was never committed";
  ResumeAndCompare(ck, 10);
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

TEST_P(CheckpointTest, FlippedByteIsNamedAndResumeFallsBackToThePreviousCheckpoint) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "checkpoint 30 committed",
             "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:30");
  // A tensor version that only checkpoint 30 lists.
  std::string file;
  uint64_t offset = 0;
  {
    auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
    ASSERT_TRUE(index.ok()) << index.status();
    auto cps = (*index)->Checkpoints();
    ASSERT_TRUE(cps.ok());
    ASSERT_EQ(cps->back().step(), 30);
    std::set<std::string> older;
    for (const auto& m : *cps) {
      if (m.step() == 30) continue;
      for (const auto& t : m.tensors()) older.insert(checkpoint::TensorIndex::TensorKey(t));
    }
    for (const auto& t : cps->back().tensors()) {
      if (t.has_extent() && !older.count(checkpoint::TensorIndex::TensorKey(t))) {
        char name[32];
        std::snprintf(name, sizeof(name), "/data-%05u.bin", t.extent().file());
        file = Shard(ck) + name;
        offset = t.extent().offset() + t.extent().bytes() / 2;
        break;
      }
    }
  }
  ASSERT_FALSE(file.empty());
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(c ^ 0x10));
  }
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 1) << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 30: FAILED"), std::string::npos) << verify.output;
  EXPECT_NE(verify.output.find(file), std::string::npos) << "the error names the file";
  EXPECT_NE(verify.output.find("checkpoint 20: ok"), std::string::npos) << verify.output;
  ResumeAndCompare(ck, 20);
}

// The folder's layout, read with the storage layer's own tools: one shard p0 holding each
// checkpoint's local manifest, and for each checkpoint a global manifest naming that local manifest
// by sequence and CRC, with every expert of every MoE layer and every dense tensor in it.
TEST_P(CheckpointTest, OneProcessWritesOneShardAndAGlobalManifestPerCheckpoint) {
  const std::string ck = dir_.File("ck");
  auto r = RunCommand(Strata("--checkpoint-dir " + ck + " --checkpoint-every 10"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(std::filesystem::exists(ck + "/index")) << "the shard's index lives in its folder";
  auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
  ASSERT_TRUE(index.ok()) << index.status();
  auto locals = (*index)->Checkpoints();
  ASSERT_TRUE(locals.ok()) << locals.status();
  auto sets = ListCheckpointSets(ck);
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(sets->size(), 3u) << "keep 3";
  ASSERT_EQ(locals->size(), 3u) << "the shard keeps what the sets name, nothing more";
  for (size_t i = 0; i < 3; ++i) {
    const CheckpointSet& cs = (*sets)[i];
    const storage::CheckpointManifest& m = (*locals)[i];
    EXPECT_EQ(cs.step(), static_cast<int64_t>(20 + 10 * i));
    EXPECT_EQ(m.step(), cs.step());
    EXPECT_TRUE(m.sharded());
    EXPECT_EQ(cs.storage_mode(), GetParam());
    EXPECT_EQ(cs.optimizer_steps(), m.optimizer_steps());
    EXPECT_EQ(cs.config_hash(), m.config_hash());
    ASSERT_EQ(cs.shards_size(), 1);
    const storage::ShardEntry& e = cs.shards(0);
    EXPECT_EQ(e.name(), "p0");
    EXPECT_EQ(e.local_sequence(), m.sequence());
    const std::string bytes = m.SerializeAsString();
    EXPECT_EQ(e.local_manifest_crc32c(), storage::Crc32c(bytes.data(), bytes.size()));
    // Every expert of both MoE blocks, in one range each.
    ASSERT_EQ(e.experts_size(), 2);
    for (int b = 0; b < 2; ++b) {
      EXPECT_EQ(e.experts(b).layer(), b);
      EXPECT_EQ(e.experts(b).first(), 0);
      EXPECT_EQ(e.experts(b).count(), 8);
    }
    // The dense names are those the local manifest stores, each once.
    std::set<std::string> dense;
    for (const auto& t : m.tensors()) {
      if (t.expert() < 0) dense.insert(t.name());
    }
    EXPECT_EQ(std::set<std::string>(e.dense().begin(), e.dense().end()), dense);
    EXPECT_EQ(static_cast<size_t>(e.dense_size()), dense.size());
  }
}

// A process killed with its shard prepared (the local checkpoint committed) but before the global
// manifest: that checkpoint never existed. The previous one is the newest, resumes bitwise, and
// the prepared local checkpoint is reclaimed.
TEST_P(CheckpointTest, KilledBetweenTheShardAndTheGlobalCommitLeavesThePreviousCheckpoint) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "holding here", "STRATA_FAULTS=checkpoint.before_set_commit=hold_at_step:20");
  {
    auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
    ASSERT_TRUE(index.ok()) << index.status();
    auto locals = (*index)->Checkpoints();
    ASSERT_TRUE(locals.ok());
    ASSERT_EQ(locals->size(), 2u) << "the shard holds the prepared 20 beside 10";
    EXPECT_EQ(locals->back().step(), 20);
  }
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  ASSERT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{10})) << ls.output;
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
  ResumeAndCompare(ck, 10);
  EXPECT_NE(resume_output_.find("local checkpoint of step 20 was prepared but never committed"),
            std::string::npos)
      << resume_output_;
  ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30, 40})) << ls.output;
  verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

// The global manifest of 30 names a local manifest the shard does not have (its CRC differs): the
// shard changed after the commit. `verify` names the checkpoint and the shard; resume skips 30 for
// 20 and continues bitwise.
TEST_P(CheckpointTest, AShardThatNoLongerMatchesItsGlobalManifestIsNamedAndSkipped) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "holding here", "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:30");
  const std::string path = ck + "/manifests/30.manifest";
  std::string bytes = ReadFile(path);
  ASSERT_GT(bytes.size(), 4u);
  CheckpointSet cs;
  ASSERT_TRUE(cs.ParseFromArray(bytes.data(), static_cast<int>(bytes.size() - 4)));
  cs.mutable_shards(0)->set_local_manifest_crc32c(cs.shards(0).local_manifest_crc32c() ^ 1);
  // Rewritten whole, with a checksum of its own that matches: only the reference is wrong.
  bytes = cs.SerializeAsString();
  const uint32_t crc = storage::Crc32c(bytes.data(), bytes.size());
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
  WriteFile(path, bytes);
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 1) << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 30: FAILED: checkpoint 30, shard p0: the shard's local "
                               "manifest has CRC-32C"),
            std::string::npos)
      << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 20: ok"), std::string::npos) << verify.output;
  ResumeAndCompare(ck, 20);
  EXPECT_NE(resume_output_.find("checkpoint 30 cannot be used"), std::string::npos)
      << resume_output_;
}

// A checkpoint's only shard deleted: `ls` still lists the checkpoints and says what is missing,
// `verify` fails naming the shard's folder, `--resume` refuses saying why, and `rm`
// removes the checkpoints that can no longer be read.
TEST_P(CheckpointTest, ADeletedShardIsNamedByEveryTool) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "holding here", "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:20");
  std::filesystem::remove_all(Shard(ck));
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  ASSERT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{10, 20})) << ls.output;
  EXPECT_NE(ls.output.find("the shard's folder '" + Shard(ck) + "' is missing"), std::string::npos)
      << ls.output;
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 1) << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 20: FAILED: checkpoint 20, shard p0: the shard's "
                               "folder"),
            std::string::npos)
      << verify.output;
  EXPECT_NE(verify.output.find("2 of 2 checkpoints"), std::string::npos) << verify.output;
  auto r = RunCommand(Strata("--checkpoint-dir " + ck + " --resume"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no checkpoint in '" + ck + "' passes its checks"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("shard p0"), std::string::npos) << r.output;
  // Not resuming: the folder still holds checkpoints, so a fresh run is refused as well.
  r = RunCommand(Strata("--checkpoint-dir " + ck));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("already holds checkpoints (the newest of step 20)"), std::string::npos)
      << r.output;
  for (const char* step : {"20", "10"}) {
    auto rm = RunCommand(kStrata + " ckpt rm " + ck + " " + step);
    EXPECT_EQ(rm.exit_code, 0) << rm.output;
  }
  ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{})) << ls.output;
}

TEST_P(CheckpointTest, MissingOrDamagedIndexAndIncompatibleConfigTouchNothing) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "checkpoint 20 committed",
             "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:20");
  auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& f : std::filesystem::recursive_directory_iterator(ck)) {
      if (f.is_regular_file() && f.path().filename() != "LOCK") {
        files[f.path().string()] = ReadFile(f.path().string());
      }
    }
    return files;
  };
  // Incompatible config.
  WriteFile(dir_.File("job.textproto"), ConfigText(GetParam(), /*d_model=*/48));
  auto before = snapshot();
  auto r = RunCommand(Strata("--checkpoint-dir " + ck + " --resume"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("different model"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checkpoint has d_model: 32"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("config has d_model: 48"), std::string::npos) << r.output;
  EXPECT_TRUE(snapshot() == before) << "an incompatible resume changed the folder";
  WriteFile(dir_.File("job.textproto"), ConfigText(GetParam()));
  // Damaged index.
  for (const auto& f : std::filesystem::directory_iterator(Shard(ck) + "/index")) {
    if (f.path().filename().string().rfind("MANIFEST", 0) == 0) {
      std::ofstream(f.path(), std::ios::binary | std::ios::trunc) << "not a manifest";
    }
  }
  before = snapshot();
  r = RunCommand(Strata("--checkpoint-dir " + ck + " --resume"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("checkpoint index"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(Shard(ck) + "/index"), std::string::npos) << r.output;
  EXPECT_TRUE(snapshot() == before) << "a damaged index must not be modified";
  // Missing index.
  std::filesystem::remove_all(Shard(ck) + "/index");
  before = snapshot();
  r = RunCommand(Strata("--checkpoint-dir " + ck + " --resume"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("no checkpoint index"), std::string::npos) << r.output;
  EXPECT_TRUE(snapshot() == before);
}

// The RocksDB write-ahead logs of a checkpoint folder's index that hold data.
std::vector<std::string> WalFiles(const std::string& ck) {
  std::vector<std::string> out;
  for (const auto& f : std::filesystem::directory_iterator(Shard(ck) + "/index")) {
    if (f.path().extension() == ".log" && f.file_size() > 0) out.push_back(f.path().string());
  }
  return out;
}

// Every file under a folder but its lock, with its bytes.
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir)) {
    if (f.is_regular_file() && f.path().filename() != "LOCK") {
      files[f.path().string()] = ReadFile(f.path().string());
    }
  }
  return files;
}

// Checkpoints 20, 30 and 40 (10 was pruned, keep 3), all still in the index's WAL: the process
// that wrote them was killed, so RocksDB never flushed them to a table file.
class CheckpointFolderDamageTest : public CheckpointTest {
 protected:
  void WriteFourCheckpoints(const std::string& ck) {
    RunAndKill(ck, "holding here", "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:40");
    auto ls = RunCommand(kStrata + " ckpt ls " + ck);
    ASSERT_EQ(ls.exit_code, 0) << ls.output;
    ASSERT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30, 40})) << ls.output;
    ASSERT_EQ(WalFiles(ck).size(), 1u) << "the test needs the index's entries in one WAL";
  }
  // ls, verify and resume all fail at open, each with `expect` in its message, and change
  // nothing in the folder.
  void ExpectEveryToolRefuses(const std::string& ck, const std::vector<std::string>& expect) {
    const auto before = Snapshot(ck);
    for (const std::string& cmd :
         {kStrata + " ckpt ls " + ck, kStrata + " ckpt verify " + ck,
          Strata("--checkpoint-dir " + ck + " --checkpoint-every 10 --resume")}) {
      auto r = RunCommand(cmd);
      EXPECT_EQ(r.exit_code, 1) << cmd << "\n" << r.output;
      EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << cmd << "\n" << r.output;
      for (const std::string& e : expect) {
        EXPECT_NE(r.output.find(e), std::string::npos) << cmd << ": expected '" << e << "' in\n"
                                                       << r.output;
      }
    }
    EXPECT_TRUE(Snapshot(ck) == before) << "a refused open changed the folder";
  }
};

TEST_P(CheckpointFolderDamageTest, FlippedBytesInTheIndexWalAreAnErrorAtOpen) {
  const std::string ck = dir_.File("ck");
  WriteFourCheckpoints(ck);
  const std::string wal = WalFiles(ck)[0];
  std::string bytes = ReadFile(wal);
  for (size_t i = bytes.size() / 2; i < bytes.size() / 2 + 64; ++i) bytes[i] ^= 0x5a;
  WriteFile(wal, bytes);
  ExpectEveryToolRefuses(ck, {Shard(ck) + "/index", "write-ahead log", wal, "--start-over"});
}

TEST_P(CheckpointFolderDamageTest, IndexWalCutInHalfIsDetected) {
  const std::string ck = dir_.File("ck");
  WriteFourCheckpoints(ck);
  const std::string wal = WalFiles(ck)[0];
  std::filesystem::resize_file(wal, std::filesystem::file_size(wal) / 2);
  // What the index alone now says: RocksDB may replay the first half as if its tail had been torn
  // by a crash. The checkpoints it lost and the ones it brought back must be named.
  std::vector<std::string> expect = {ck, "--start-over"};
  auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
  if (index.ok()) {
    auto cps = (*index)->Checkpoints();
    ASSERT_TRUE(cps.ok()) << cps.status();
    std::set<int64_t> now, written = {20, 30, 40};
    for (const auto& m : *cps) now.insert(m.step());
    index->reset();
    std::vector<std::string> missing, back;
    for (int64_t s : written) {
      if (!now.count(s)) missing.push_back(std::to_string(s));
    }
    for (int64_t s : now) {
      if (!written.count(s)) back.push_back(std::to_string(s));
    }
    ASSERT_FALSE(missing.empty() && back.empty()) << "cutting the WAL changed nothing";
    if (!missing.empty()) {
      expect.push_back("checkpoints missing from the index: " + absl::StrJoin(missing, ", "));
    }
    if (!back.empty()) {
      expect.push_back("removed checkpoints back in the index: " + absl::StrJoin(back, ", "));
    }
  } else {
    expect.push_back("write-ahead log");
  }
  ExpectEveryToolRefuses(ck, expect);
}

TEST_P(CheckpointFolderDamageTest, MissingIndexBesideDataIsRefusedUnlessStartingOver) {
  const std::string ck = dir_.File("ck");
  WriteFourCheckpoints(ck);
  std::filesystem::remove_all(Shard(ck) + "/index");
  uint64_t data_bytes = 0;
  for (const auto& f : std::filesystem::directory_iterator(Shard(ck))) {
    if (f.path().filename().string().rfind("data-", 0) == 0) data_bytes += f.file_size();
  }
  ASSERT_GT(data_bytes, 0u);
  const auto before = Snapshot(ck);
  const std::string size = absl::StrFormat("%.1f MiB", data_bytes / 1048576.0);
  for (const std::string& flags : {std::string("--resume"), std::string()}) {
    auto r = RunCommand(Strata("--checkpoint-dir " + ck + " --checkpoint-every 10 " + flags));
    EXPECT_EQ(r.exit_code, 1) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("no checkpoint index"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(ck), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(size), std::string::npos) << "names the data's size\n" << r.output;
    EXPECT_NE(r.output.find("--start-over"), std::string::npos) << r.output;
    EXPECT_TRUE(Snapshot(ck) == before) << flags << " changed the folder";
  }
  // Starting over moves the old contents aside, byte for byte, and trains afresh.
  const std::string metrics = dir_.File("fresh.jsonl");
  auto r = RunCommand(Strata("--checkpoint-dir " + ck + " --checkpoint-every 10 --start-over " +
                             "--metrics-out " + metrics));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(Losses(metrics), full_) << "a fresh run is the uninterrupted run";
  std::string aside;
  for (const auto& f : std::filesystem::directory_iterator(dir_.path())) {
    if (f.path().filename().string().rfind("ck.old-", 0) == 0) aside = f.path().string();
  }
  ASSERT_FALSE(aside.empty()) << r.output;
  EXPECT_NE(r.output.find(aside), std::string::npos) << "says where the old data went\n"
                                                     << r.output;
  std::map<std::string, std::string> moved;
  for (const auto& [path, data] : Snapshot(aside)) moved[ck + path.substr(aside.size())] = data;
  EXPECT_TRUE(moved == before) << "the old data was not moved aside intact";
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  ASSERT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30, 40})) << ls.output;
  // --start-over and --resume contradict each other.
  r = RunCommand(Strata("--checkpoint-dir " + ck + " --resume --start-over"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--start-over"), std::string::npos) << r.output;
}

TEST_P(CheckpointFolderDamageTest, TruncatedDataFileDamagesOnlyTheCheckpointsCutOff) {
  const std::string ck = dir_.File("ck");
  WriteFourCheckpoints(ck);
  // Cut the data file just after the last byte checkpoints 20 and 30 use: only 40's own extents
  // (written last) lie beyond.
  uint64_t keep_end = 0, cut_40 = 0;
  std::string file;
  {
    auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
    ASSERT_TRUE(index.ok()) << index.status();
    auto cps = (*index)->Checkpoints();
    ASSERT_TRUE(cps.ok());
    ASSERT_EQ(cps->size(), 3u);
    for (const auto& m : *cps) {
      for (const auto& t : m.tensors()) {
        if (!t.has_extent()) continue;
        ASSERT_EQ(t.extent().file(), 0u) << "the test expects one data file";
        if (m.step() != 40)
          keep_end = std::max(keep_end, t.extent().offset() + t.extent().length());
      }
    }
    for (const auto& t : cps->back().tensors()) {
      if (t.has_extent() && t.extent().offset() + t.extent().length() > keep_end) ++cut_40;
    }
  }
  ASSERT_GT(cut_40, 0u) << "no extent of checkpoint 40 lies after those of 20 and 30";
  file = Shard(ck) + "/data-00000.bin";
  ASSERT_GT(std::filesystem::file_size(file), keep_end);
  std::filesystem::resize_file(file, keep_end);
  std::filesystem::copy(ck, dir_.File("ck2"), std::filesystem::copy_options::recursive);
  const std::string ck2 = dir_.File("ck2");

  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 1) << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 20: ok"), std::string::npos) << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 30: ok"), std::string::npos) << verify.output;
  EXPECT_NE(verify.output.find("checkpoint 40: FAILED"), std::string::npos) << verify.output;
  EXPECT_NE(verify.output.find(file), std::string::npos) << "names the data file\n"
                                                         << verify.output;
  EXPECT_NE(verify.output.find("1 of 3 checkpoints"), std::string::npos) << verify.output;

  // Resume skips 40, saying why, and continues from 30 exactly as the uninterrupted run.
  ResumeAndCompare(ck, 30);
  EXPECT_NE(resume_output_.find("checkpoint 40 cannot be used"), std::string::npos)
      << resume_output_;
  EXPECT_NE(resume_output_.find(file + "', which holds only " + std::to_string(keep_end)),
            std::string::npos)
      << resume_output_;
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30, 40})) << ls.output;
  verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;

  // `ckpt rm` removes the damaged checkpoint; the others still verify.
  auto rm = RunCommand(kStrata + " ckpt rm " + ck2 + " 40");
  EXPECT_EQ(rm.exit_code, 0) << rm.output;
  ls = RunCommand(kStrata + " ckpt ls " + ck2);
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30})) << ls.output;
  verify = RunCommand(kStrata + " ckpt verify " + ck2);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

// `strata ckpt ls` beside a run that commits and prunes a checkpoint every step: the index and
// the ledger change under it, and it never takes that for damage.
TEST_P(CheckpointFolderDamageTest, ListingWhileTrainingCommitsAndPrunesIsNeverAnError) {
  const std::string ck = dir_.File("ck");
  const std::string log = dir_.File("train.log");
  pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd =
        Strata("--checkpoint-dir " + ck + " --checkpoint-every 1 > " + log + " 2>&1");
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int listings = 0, status = 0;
  std::set<int64_t> seen;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (!std::filesystem::exists(ck + "/manifests/LEDGER")) continue;
    auto ls = RunCommand(kStrata + " ckpt ls " + ck);
    ASSERT_EQ(ls.exit_code, 0) << "listing " << listings << " while training:\n" << ls.output;
    for (int64_t step : ListedSteps(ls.output)) seen.insert(step);
    ++listings;
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadFile(log);
  EXPECT_GE(seen.size(), 3u) << "the listings saw the list change (" << listings << " listings)";
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{38, 39, 40})) << ls.output;
}

// What a crash can leave around the ledger is not damage: a commit the ledger never heard of
// (killed between the two), if it follows the ledger's newest checkpoint; and a removal the ledger
// recorded but the index never did, which is hidden and finished by the next writable open.
TEST_P(CheckpointFolderDamageTest, CrashWindowsAroundTheLedgerAreNotDamage) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "holding here", "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:30");
  std::vector<storage::CheckpointManifest> written;  // 10, 20, 30
  {
    auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
    ASSERT_TRUE(index.ok()) << index.status();
    auto cps = (*index)->Checkpoints();
    ASSERT_TRUE(cps.ok());
    written = *cps;
  }
  ASSERT_EQ(written.size(), 3u);
  ASSERT_LT(written[1].sequence(), written[2].sequence());
  auto sets = ListCheckpointSets(ck);
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(sets->size(), 3u);
  // A local checkpoint in the shard (and, with `set`, the global manifest naming it).
  auto commit = [&](int64_t step, uint64_t sequence, uint64_t previous_sequence, bool set) {
    auto index = checkpoint::TensorIndex::Open(Shard(ck) + "/index", false);
    ASSERT_TRUE(index.ok()) << index.status();
    storage::CheckpointManifest m = written[2];  // the same tensors as checkpoint 30
    m.set_step(step);
    m.set_sequence(sequence);
    m.set_previous_step(30);
    m.set_previous_sequence(previous_sequence);
    ASSERT_TRUE((*index)->CommitCheckpoint(m, {}).ok());
    if (!set) return;
    CheckpointSet cs = sets->back();
    cs.set_step(step);
    cs.clear_sequence();
    cs.clear_previous_step();
    cs.clear_previous_sequence();
    cs.mutable_shards(0)->set_local_sequence(sequence);
    const std::string bytes = m.SerializeAsString();
    cs.mutable_shards(0)->set_local_manifest_crc32c(storage::Crc32c(bytes.data(), bytes.size()));
    CheckpointSetLayout layout;
    for (const auto& r : cs.shards(0).experts()) layout.moe_layers.push_back(r.layer());
    layout.experts_per_layer = 8;
    layout.dense.assign(cs.shards(0).dense().begin(), cs.shards(0).dense().end());
    auto committed = CommitCheckpointSet(ck, layout, cs);
    ASSERT_TRUE(committed.ok()) << committed.status();
  };
  auto forget = [&](int64_t step) {
    auto index = checkpoint::TensorIndex::Open(Shard(ck) + "/index", false);
    ASSERT_TRUE(index.ok()) << index.status();
    ASSERT_TRUE((*index)->RemoveCheckpoint(step, {}).ok());
    Status removed = RemoveCheckpointSet(ck, step);
    ASSERT_TRUE(removed.ok() || absl::IsNotFound(removed)) << removed;
  };
  // Committed after checkpoint 30, the shard's ledger not told: listed.
  commit(40, written[2].sequence() + 1, written[2].sequence(), /*set=*/true);
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{10, 20, 30, 40})) << ls.output;
  forget(40);
  // One that does not follow checkpoint 30 came from elsewhere.
  commit(50, written[2].sequence() + 7, written[1].sequence(), /*set=*/false);
  ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ls.exit_code, 1) << ls.output;
  EXPECT_NE(ls.output.find("checkpoints the ledger never recorded: 50"), std::string::npos)
      << ls.output;
  forget(50);
  // A removal of 10 stopped after its global manifest went and the shard's ledger recorded the
  // removal, before the shard's index forgot it.
  ASSERT_TRUE(RemoveCheckpointSet(ck, 10).ok());
  storage::CheckpointLedger ledger;
  ledger.set_format(1);
  ledger.set_last_sequence(written[2].sequence());
  for (int i : {1, 2}) {
    ledger.add_live()->set_step(written[i].step());
    ledger.mutable_live(i - 1)->set_sequence(written[i].sequence());
  }
  ledger.add_removing()->set_step(10);
  ledger.mutable_removing(0)->set_sequence(written[0].sequence());
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(ledger, &text));
  WriteFile(Shard(ck) + "/LEDGER",
            text + absl::StrFormat("# crc32c %08x\n", storage::Crc32c(text.data(), text.size())));
  ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30})) << ls.output;
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
  // The next writable open finishes the removal in the index.
  auto rm = RunCommand(kStrata + " ckpt rm " + ck + " 20");
  EXPECT_EQ(rm.exit_code, 0) << rm.output;
  auto index = checkpoint::TensorIndex::OpenReadOnly(Shard(ck) + "/index");
  ASSERT_TRUE(index.ok()) << index.status();
  auto cps = (*index)->Checkpoints();
  ASSERT_TRUE(cps.ok());
  ASSERT_EQ(cps->size(), 1u);
  EXPECT_EQ((*cps)[0].step(), 30);
  index->reset();
  ResumeAndCompare(ck, 30);
}

// A folder written before sharding, and before manifests carried sequence numbers and the ledger,
// still opens: it is the shard ".", its checkpoints stand alone, and new ones are written beside
// them with global manifests naming that shard.
TEST_P(CheckpointFolderDamageTest, FolderWrittenBeforeShardingStillOpens) {
  STRATA_SKIP_WITHOUT_FAULT_POINTS();
  const std::string ck = dir_.File("ck");
  RunAndKill(ck, "holding here", "STRATA_FAULTS=checkpoint.after_commit=hold_at_step:30");
  // The old layout: the one shard's index and data files directly in the folder.
  for (const auto& f : std::filesystem::directory_iterator(Shard(ck))) {
    const std::string name = f.path().filename().string();
    if (name == "index" || name.rfind("data-", 0) == 0) {
      std::filesystem::rename(f.path(), ck + "/" + name);
    }
  }
  std::filesystem::remove_all(ck + "/shards");
  std::filesystem::remove_all(ck + "/manifests");
  {
    auto index = checkpoint::TensorIndex::Open(ck + "/index", false);
    ASSERT_TRUE(index.ok()) << index.status();
    auto cps = (*index)->Checkpoints();
    ASSERT_TRUE(cps.ok());
    for (auto m : *cps) {
      const auto fields = m.GetDescriptor();
      for (int i = 0; i < fields->field_count(); ++i) {
        if (fields->field(i)->number() >= 10) m.GetReflection()->ClearField(&m, fields->field(i));
      }
      ASSERT_TRUE((*index)->CommitCheckpoint(m, {}).ok());
    }
  }
  for (const auto& f : std::filesystem::directory_iterator(ck)) {
    const std::string name = f.path().filename().string();
    if (name != "index" && name != "LOCK" && name.rfind("data-", 0) != 0) {
      std::filesystem::remove_all(f.path());
    }
  }
  auto ls = RunCommand(kStrata + " ckpt ls " + ck);
  ASSERT_EQ(ls.exit_code, 0) << ls.output;
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{10, 20, 30})) << ls.output;
  auto verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
  ResumeAndCompare(ck, 30);
  ls = RunCommand(kStrata + " ckpt ls " + ck);
  EXPECT_EQ(ListedSteps(ls.output), (std::vector<int64_t>{20, 30, 40})) << ls.output;
  EXPECT_FALSE(std::filesystem::exists(ck + "/shards")) << "written on in place";
  auto sets = ListCheckpointSets(ck);
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(sets->size(), 1u) << "the old checkpoints have no global manifest, 40 has one";
  EXPECT_EQ((*sets)[0].step(), 40);
  ASSERT_EQ((*sets)[0].shards_size(), 1);
  EXPECT_EQ((*sets)[0].shards(0).name(), ".");
  verify = RunCommand(kStrata + " ckpt verify " + ck);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;
}

INSTANTIATE_TEST_SUITE_P(Modes, CheckpointFolderDamageTest,
                         ::testing::Values("IN_MEMORY", "TIERED"),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Modes, CheckpointTest, ::testing::Values("IN_MEMORY", "TIERED"),
                         [](const auto& info) { return info.param; });

// A full disk while writing a checkpoint: a clear error, and the previous checkpoint still
// verifies. The disk fills through the fault-injecting block I/O under the real io_uring one.
TEST(CheckpointDiskFullTest, ClearErrorAndPreviousCheckpointStillVerifies) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  auto cfg = config::ParseJobConfig(ConfigText("IN_MEMORY"), "job.textproto", dir.path());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  cfg->mutable_checkpoint()->set_dir(dir.File("ck"));
  cfg->mutable_checkpoint()->set_every(10);
  storage::FaultInjectingIo* fault = nullptr;
  TrainOptions o;
  o.config = *cfg;
  o.progress = false;
  o.wrap_io = [&](std::unique_ptr<storage::BlockIo> io) {
    auto f = std::make_unique<storage::FaultInjectingIo>(std::move(io));
    fault = f.get();
    return std::unique_ptr<storage::BlockIo>(std::move(f));
  };
  // Room for one checkpoint and a half: the second one runs out.
  int64_t per_checkpoint = 0;
  {
    auto probe = Trainer::Create(o);
    ASSERT_TRUE(probe.ok()) << probe.status();
    for (int i = 0; i < 10; ++i) ASSERT_TRUE((*probe)->Step().ok());
    ASSERT_TRUE((*probe)
                    ->checkpoints()
                    ->Save(10, *cfg, (*probe)->model(), *(*probe)->optimizer_for_test(), nullptr,
                           (*probe)->context())
                    .ok());
    ASSERT_TRUE((*probe)->checkpoints()->Wait().ok());
    per_checkpoint = fault->bytes_written();
  }
  std::filesystem::remove_all(dir.File("ck"));
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  fault->set_write_budget(per_checkpoint * 3 / 2);
  Status s = (*t)->Run();
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("checkpoint of step 20"), std::string::npos) << s;
  EXPECT_NE(s.message().find("full"), std::string::npos) << s;
  EXPECT_NE(s.message().find("previous checkpoints are intact"), std::string::npos) << s;
  t->reset();
  std::vector<std::string> report;
  EXPECT_TRUE(CheckpointManager::Verify(dir.File("ck"), 10, &report).ok());
  auto list = CheckpointManager::List(dir.File("ck"));
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].step, 10);
}

TEST(CheckpointKeepTest, KeepsTheLastKAndReusesTheirSpace) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  // In memory every checkpoint is a full copy, so without reuse the space would grow 20-fold.
  auto cfg = config::ParseJobConfig(ConfigText("IN_MEMORY"), "job.textproto", dir.path());
  ASSERT_TRUE(cfg.ok());
  cfg->mutable_checkpoint()->set_dir(dir.File("ck"));
  cfg->mutable_checkpoint()->set_every(2);
  cfg->mutable_checkpoint()->set_keep(2);
  TrainOptions o;
  o.config = *cfg;
  o.progress = false;
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->Run().ok());
  const uint64_t used = (*t)->checkpoints()->ssd()->used_bytes();
  t->reset();
  auto list = CheckpointManager::List(dir.File("ck"));
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].step, 38);
  EXPECT_EQ((*list)[1].step, 40);
  EXPECT_EQ(used, (*list)[0].stored_bytes + (*list)[1].stored_bytes)
      << "20 checkpoints were written; only the 2 kept may hold space";
}

// Every parameter value and both Adam moments the optimizer holds, in its order.
std::vector<const Tensor*> StateTensors(const model::AdamW& opt) {
  std::vector<const Tensor*> out;
  for (size_t i = 0; i < opt.params().size(); ++i) {
    out.push_back(&opt.params()[i]->value);
    out.push_back(&opt.first_moment(i));
    out.push_back(&opt.second_moment(i));
  }
  return out;
}

std::vector<std::vector<float>> OptimizerState(Trainer& t) {
  std::vector<std::vector<float>> out;
  for (const Tensor* x : StateTensors(*t.optimizer_for_test())) {
    out.emplace_back(x->f32(), x->f32() + x->numel());
  }
  return out;
}

std::vector<int64_t> StepsIn(const std::string& ck) {
  std::vector<int64_t> steps;
  auto list = CheckpointManager::List(ck);
  EXPECT_TRUE(list.ok()) << list.status();
  if (list.ok()) {
    for (const CheckpointInfo& info : *list) steps.push_back(info.step);
  }
  return steps;
}

TrainOptions JobIn(const TempDir& dir, const std::string& mode) {
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  auto cfg = config::ParseJobConfig(ConfigText(mode), "job.textproto", dir.path());
  CHECK(cfg.ok()) << cfg.status();
  cfg->mutable_checkpoint()->set_dir(dir.File("ck"));
  TrainOptions o;
  o.config = *cfg;
  o.progress = false;
  return o;
}

// Save copies host tensors on its writer thread while the next step's forward and backward run;
// the update waits for that copy (FinishSnapshot). Here the "update" scribbles over every
// parameter and moment the moment FinishSnapshot returns: the checkpoint must still hold the
// state Save was called on, bitwise.
TEST(CheckpointSnapshotTest, TheCheckpointHoldsTheStateAtSaveThoughTheUpdateFollowsAtOnce) {
  TempDir dir;
  TrainOptions o = JobIn(dir, "IN_MEMORY");
  std::vector<std::vector<float>> saved;
  {
    auto t = Trainer::Create(o);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int i = 0; i < 5; ++i) ASSERT_TRUE((*t)->Step().ok());
    saved = OptimizerState(**t);
    for (int round = 0; round < 2; ++round) {  // the second reuses the first's buffers
      ASSERT_TRUE((*t)->checkpoints()
                      ->Save(5 + round, o.config, (*t)->model(), *(*t)->optimizer_for_test(),
                             nullptr, (*t)->context())
                      .ok());
      (*t)->checkpoints()->FinishSnapshot();
      for (const Tensor* x : StateTensors(*(*t)->optimizer_for_test())) {
        std::fill(x->f32(), x->f32() + x->numel(), -1.0f - static_cast<float>(round));
      }
      ASSERT_TRUE((*t)->checkpoints()->Wait().ok());
      // The next round saves the state again: put it back.
      const std::vector<const Tensor*> xs = StateTensors(*(*t)->optimizer_for_test());
      for (size_t k = 0; k < xs.size(); ++k)
        std::copy(saved[k].begin(), saved[k].end(), xs[k]->f32());
    }
  }
  o.resume = true;
  auto r = Trainer::Create(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->resumed_from(), 6);
  const std::vector<std::vector<float>> resumed = OptimizerState(**r);
  ASSERT_EQ(resumed.size(), saved.size());
  for (size_t k = 0; k < saved.size(); ++k) {
    ASSERT_EQ(resumed[k], saved[k])
        << "tensor " << k / 3 << " (kind " << k % 3 << ") is not the state Save was called on";
  }
}

// Training that went back behind its checkpoints (an elastic generation replaying from older
// copies) saves their steps again: the old checkpoints of that step and later ones go first,
// their space with them, and the new one is what resumes.
class CheckpointReplaceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointReplaceTest, SavingAnEarlierStepAgainReplacesItAndTheLaterOnes) {
  TempDir dir;
  TrainOptions o = JobIn(dir, GetParam());
  std::vector<std::vector<float>> at_20;
  {
    auto t = Trainer::Create(o);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int step = 1; step <= 20; ++step) {
      ASSERT_TRUE((*t)->Step().ok());
      if (step % 5 == 0) {
        ASSERT_TRUE((*t)->checkpoints()
                        ->Save(step, o.config, (*t)->model(), *(*t)->optimizer_for_test(),
                               (*t)->tiered(), (*t)->context())
                        .ok());
      }
    }
    ASSERT_TRUE((*t)->checkpoints()->Wait().ok());
    EXPECT_EQ(StepsIn(dir.File("ck")), (std::vector<int64_t>{10, 15, 20}));
    // The state of step 20, saved as step 10's.
    at_20 = OptimizerState(**t);
    ASSERT_TRUE((*t)->checkpoints()
                    ->Save(10, o.config, (*t)->model(), *(*t)->optimizer_for_test(), (*t)->tiered(),
                           (*t)->context())
                    .ok());
    ASSERT_TRUE((*t)->checkpoints()->Wait().ok());
    if (GetParam() == "IN_MEMORY") {
      auto list = CheckpointManager::List(dir.File("ck"));
      ASSERT_TRUE(list.ok());
      ASSERT_EQ(list->size(), 1u);
      EXPECT_EQ((*t)->checkpoints()->ssd()->used_bytes(), (*list)[0].stored_bytes)
          << "the replaced checkpoints' extents must be free again";
    }
  }
  EXPECT_EQ(StepsIn(dir.File("ck")), (std::vector<int64_t>{10}));
  std::vector<std::string> report;
  EXPECT_TRUE(CheckpointManager::Verify(dir.File("ck"), -1, &report).ok())
      << absl::StrJoin(report, "\n");
  o.resume = true;
  auto r = Trainer::Create(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->resumed_from(), 10);
  // TIERED: the optimizer holds the dense state; the experts live in the store.
  const std::vector<std::vector<float>> resumed = OptimizerState(**r);
  ASSERT_EQ(resumed.size(), at_20.size());
  for (size_t k = 0; k < at_20.size(); ++k) {
    ASSERT_EQ(resumed[k], at_20[k]) << "tensor " << k / 3 << " (kind " << k % 3
                                    << ") is the old checkpoint's, not the new one's";
  }
}

// The same with two shards: a committer (r0, experts 0-3) and a worker (r1, experts 4-7), each
// with half the dense state, saving at once as a job's workers do. Every tensor holds the round's
// number, so the resume shows which save each part came from.
TEST(CheckpointReplaceShardsTest, EveryShardReplacesItsPartsAndTheCommitterItsSets) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  auto cfg = config::ParseJobConfig(ConfigText("IN_MEMORY"), "job.textproto", dir.path());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const std::string ck = dir.File("ck");
  ThreadPool pool(1);
  ops::Context ctx{&pool};
  struct Worker {
    std::unique_ptr<model::MoeTransformer> model;
    std::unique_ptr<model::AdamW> opt;
    std::unique_ptr<CheckpointManager> ckpt;
    CheckpointShare share;
  };
  std::vector<Worker> workers(2);
  for (int k = 0; k < 2; ++k) {
    model::ModelOptions mo;
    mo.config = cfg->model();
    mo.seed = cfg->seed();
    mo.first_local_expert = 4 * k;
    mo.num_local_experts = 4;
    auto m = model::MoeTransformer::Create(ctx, mo);
    ASSERT_TRUE(m.ok()) << m.status();
    workers[k].model = *std::move(m);
    workers[k].opt =
        std::make_unique<model::AdamW>(workers[k].model->Parameters(), model::AdamWOptions{});
  }
  const std::vector<std::set<std::string>> dealt = DealDenseParameters(*workers[0].model, 2);
  for (int k = 0; k < 2; ++k) {  // the committer opens first
    CheckpointOptions co;
    co.dir = ck;
    co.shard = absl::StrCat("r", k);
    co.committer = k == 0;
    auto m = CheckpointManager::Open(co, /*must_exist=*/false);
    ASSERT_TRUE(m.ok()) << m.status();
    workers[k].ckpt = *std::move(m);
    workers[k].share.dense = dealt[k];
    workers[k].share.workers = 2;
    if (k == 0) workers[k].share.shards = {"r0", "r1"};
  }
  // `worker_first`: the worker saves alone for a while before the committer starts.
  auto save = [&](int64_t step, float fill, bool worker_first = false) {
    for (Worker& w : workers) {
      for (const Tensor* x : StateTensors(*w.opt)) std::fill(x->f32(), x->f32() + x->numel(), fill);
    }
    std::vector<Status> status(2);
    std::vector<std::thread> threads;
    for (int k : {1, 0}) {
      threads.emplace_back([&, k] {
        Worker& w = workers[k];
        status[k] = w.ckpt->Save(step, *cfg, *w.model, *w.opt, nullptr, ctx, w.share);
        if (status[k].ok()) status[k] = w.ckpt->Wait();
      });
      if (worker_first && k == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        // The worker must not have touched its parts of the committed sets: they still verify.
        std::vector<std::string> report;
        EXPECT_TRUE(CheckpointManager::Verify(ck, -1, &report).ok())
            << "a worker removed its part of a set that is still committed: "
            << absl::StrJoin(report, "; ");
        EXPECT_EQ(StepsIn(ck), (std::vector<int64_t>{10, 20}));
      }
    }
    for (auto& t : threads) t.join();
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(status[k].ok()) << "r" << k << ": " << status[k];
  };
  save(10, 1.0f);
  save(20, 2.0f);
  EXPECT_EQ(StepsIn(ck), (std::vector<int64_t>{10, 20}));
  save(10, 3.0f, /*worker_first=*/true);  // went back behind both
  workers.clear();
  EXPECT_EQ(StepsIn(ck), (std::vector<int64_t>{10}));
  std::vector<std::string> report;
  EXPECT_TRUE(CheckpointManager::Verify(ck, -1, &report).ok()) << absl::StrJoin(report, "\n");
  // One process holding every expert resumes it, reading each part from its shard.
  model::ModelOptions mo;
  mo.config = cfg->model();
  mo.seed = cfg->seed();
  auto whole = model::MoeTransformer::Create(ctx, mo);
  ASSERT_TRUE(whole.ok()) << whole.status();
  model::AdamW opt((*whole)->Parameters(), model::AdamWOptions{});
  CheckpointOptions co;
  co.dir = ck;
  auto reader = CheckpointManager::Open(co, /*must_exist=*/true);
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto step = (*reader)->Resume(*cfg, **whole, opt, nullptr, ctx);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 10);
  for (const Tensor* x : StateTensors(opt)) {
    for (int64_t i = 0; i < x->numel(); ++i) {
      ASSERT_EQ(x->f32()[i], 3.0f) << "a part of an old checkpoint was resumed";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CheckpointReplaceTest, ::testing::Values("IN_MEMORY", "TIERED"),
                         [](const auto& info) { return info.param; });

// A new membership generation keeps each worker's shard open (CheckpointManager::Continue). The
// tests run a committer and a worker in one process, as CheckpointReplaceShardsTest does; each
// tensor holds a pattern of its name, kind and the round, so a resume shows what it came from.
float Pattern(const std::string& name, int kind, float round, int64_t i) {
  return round + static_cast<float>(std::hash<std::string>{}(name) % 1000) * 1e-3f +
         static_cast<float>(kind) * 0.25f + static_cast<float>(i % 4096) * 1e-5f;
}

// Fills every parameter the optimizer holds and both its moments with the round's pattern.
void FillState(model::AdamW& opt, float round) {
  for (size_t p = 0; p < opt.params().size(); ++p) {
    const std::string& name = opt.params()[p]->name;
    const Tensor* kinds[] = {&opt.params()[p]->value, &opt.first_moment(p), &opt.second_moment(p)};
    for (int k = 0; k < 3; ++k) {
      for (int64_t i = 0; i < kinds[k]->numel(); ++i) {
        kinds[k]->f32()[i] = Pattern(name, k, round, i);
      }
    }
  }
}

// One process of the job: a model holding experts [first, first + count), its optimizer, its
// shard's checkpoint manager and (TIERED) a scheduler whose store shares the shard's SSD tier.
struct ShardWorker {
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<model::AdamW> opt;
  std::unique_ptr<CheckpointManager> ckpt;
  std::unique_ptr<scheduler::TieredExpertScheduler> tiered;
  std::shared_ptr<std::atomic<bool>> abandoned = std::make_shared<std::atomic<bool>>(false);
  CheckpointShare share;

  ShardWorker() = default;
  // As the trainer does: the checkpoint writer first, then the store (the model lets go of it).
  ~ShardWorker() {
    ckpt.reset();
    if (model) model->AttachResidency(nullptr);
    tiered.reset();
  }
  // Saves `step` and (`wait`) waits for its persist and commit.
  Status Save(int64_t step, const config::JobConfig& cfg, ops::Context& ctx, bool wait = true) {
    Status s = ckpt->Save(step, cfg, *model, *opt, tiered.get(), ctx, share);
    return s.ok() && wait ? ckpt->Wait() : s;
  }
};

StatusOr<std::unique_ptr<model::MoeTransformer>> ModelOf(const config::JobConfig& cfg,
                                                         ops::Context& ctx, int first, int count,
                                                         bool unbound = false) {
  model::ModelOptions mo;
  mo.config = cfg.model();
  mo.seed = cfg.seed();
  mo.first_local_expert = first;
  mo.num_local_experts = count;
  mo.unbound_experts = unbound;
  return model::MoeTransformer::Create(ctx, mo);
}

// Opens `shard` of `ck` for a worker of `generation` holding experts [first, first + count).
void OpenShardWorker(const config::JobConfig& cfg, ops::Context& ctx, const std::string& ck,
                     const std::string& shard, bool committer, int64_t generation, int first,
                     int count, bool tiered, ShardWorker* w) {
  auto m = ModelOf(cfg, ctx, first, count, tiered);
  ASSERT_TRUE(m.ok()) << m.status();
  w->model = *std::move(m);
  w->opt = std::make_unique<model::AdamW>(
      tiered ? w->model->DenseParameters() : w->model->Parameters(), model::AdamWOptions{});
  CheckpointOptions co;
  co.dir = ck;
  co.shard = shard;
  co.committer = committer;
  co.generation = generation;
  co.abandoned = w->abandoned;
  auto c = CheckpointManager::Open(co, /*must_exist=*/false);
  ASSERT_TRUE(c.ok()) << c.status();
  w->ckpt = *std::move(c);
  if (!tiered) return;
  scheduler::TieredOptions to;
  to.storage = cfg.storage();
  to.seed = cfg.seed();
  to.ssd_dir = ck;
  to.shared_ssd = w->ckpt->ssd();
  auto s = scheduler::TieredExpertScheduler::Create(*w->model, to);
  ASSERT_TRUE(s.ok()) << s.status();
  w->tiered = *std::move(s);
  w->model->AttachResidency(w->tiered.get());
}

// A prepared report `ck`/prepared/<generation>/<step>/<shard>, as a worker leaves one.
void PlantReport(const std::string& ck, int64_t generation, int64_t step,
                 const std::string& shard) {
  const std::string folder = absl::StrFormat("%s/prepared/%d/%d", ck, generation, step);
  std::filesystem::create_directories(folder);
  WriteFile(folder + "/" + shard, "");
  ASSERT_TRUE(std::filesystem::exists(folder + "/" + shard));
}

// Every step a checkpoint manager opened read-only finds in a shard's index.
std::vector<int64_t> LocalSteps(const std::string& shard_dir, uint64_t* stored_bytes = nullptr) {
  std::vector<int64_t> steps;
  auto index = checkpoint::TensorIndex::OpenReadOnly(shard_dir + "/index");
  EXPECT_TRUE(index.ok()) << index.status();
  if (!index.ok()) return steps;
  auto listed = (*index)->Checkpoints();
  EXPECT_TRUE(listed.ok()) << listed.status();
  if (!listed.ok()) return steps;
  std::set<std::tuple<int, int, int, uint64_t>> counted;
  if (stored_bytes) *stored_bytes = 0;
  for (const storage::CheckpointManifest& m : *listed) {
    steps.push_back(m.step());
    for (const storage::TensorRef& r : m.tensors()) {
      if (!r.has_extent() || !counted.insert({r.layer(), r.expert(), r.kind(), r.version()}).second)
        continue;
      if (stored_bytes) *stored_bytes += r.extent().length();
    }
  }
  return steps;
}

// Resumes the folder into one process holding every expert (IN_MEMORY), reading each part from
// its shard; returns the step.
int64_t ResumeWhole(const config::JobConfig& cfg, ops::Context& ctx, const std::string& ck,
                    std::unique_ptr<model::MoeTransformer>* model,
                    std::unique_ptr<model::AdamW>* opt) {
  auto m = ModelOf(cfg, ctx, 0, -1);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return -1;
  *model = *std::move(m);
  *opt = std::make_unique<model::AdamW>((*model)->Parameters(), model::AdamWOptions{});
  CheckpointOptions co;
  co.dir = ck;
  auto reader = CheckpointManager::Open(co, /*must_exist=*/true);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return -1;
  auto step = (*reader)->Resume(cfg, **model, **opt, nullptr, ctx);
  EXPECT_TRUE(step.ok()) << step.status();
  return step.ok() ? *step : -1;
}

// A job of two: the committer r0 (experts 0-3, in memory) and the worker r1 (experts 4-7, in
// memory or, `tiered_worker`, in a TIERED store), each with half the dense state, generation 1.
class CheckpointContinueTest : public ::testing::Test {
 protected:
  void Start(const std::string& mode, bool tiered_worker) {
    WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(40000));
    auto cfg = config::ParseJobConfig(ConfigText(mode), "job.textproto", dir_.path());
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = *std::move(cfg);
    workers_ = std::vector<ShardWorker>(2);
    for (int k = 0; k < 2; ++k) {  // the committer opens first
      OpenShardWorker(cfg_, ctx_, ck_, absl::StrCat("r", k), k == 0, 1, 4 * k, 4,
                      k == 1 && tiered_worker, &workers_[k]);
      if (HasFatalFailure()) return;
    }
    const std::vector<std::set<std::string>> dealt = DealDenseParameters(*workers_[0].model, 2);
    for (int k = 0; k < 2; ++k) {
      workers_[k].share.dense = dealt[k];
      workers_[k].share.workers = 2;
    }
    workers_[0].share.shards = {"r0", "r1"};
  }
  // Both save `step` at once, as a job's workers do, and wait for the commit.
  void SaveBoth(int64_t step) {
    std::vector<Status> status(2);
    std::vector<std::thread> threads;
    for (int k : {1, 0}) {
      threads.emplace_back([&, k] { status[k] = workers_[k].Save(step, cfg_, ctx_); });
    }
    for (auto& t : threads) t.join();
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(status[k].ok()) << "r" << k << ": " << status[k];
  }
  TempDir dir_;
  const std::string ck_ = dir_.File("ck");
  config::JobConfig cfg_;
  ThreadPool pool_{1};
  ops::Context ctx_{&pool_};
  std::vector<ShardWorker> workers_;
};

// A dead rank 0: the committer (r0) and a worker (r1) commit steps 10 and 20; the worker prepares
// 30, which the committer never commits. The worker goes on as the committer of generation 2,
// alone: the folder lists 10 and 20, its part of 30 and that part's space are gone, and the step
// it commits alone resumes bitwise.
TEST_F(CheckpointContinueTest, AWorkerTakesOverAsCommitterAndDropsWhatNeverCommitted) {
  Start("IN_MEMORY", /*tiered_worker=*/false);
  if (HasFatalFailure()) return;
  for (int64_t step : {10, 20}) {
    for (ShardWorker& w : workers_) FillState(*w.opt, static_cast<float>(step));
    SaveBoth(step);
    if (HasFatalFailure()) return;
  }
  ASSERT_EQ(StepsIn(ck_), (std::vector<int64_t>{10, 20}));
  uint64_t committed_bytes = 0;
  ASSERT_EQ(LocalSteps(ck_ + "/shards/r1", &committed_bytes), (std::vector<int64_t>{10, 20}));
  // Step 30: the committer waits for the worker's report and dies waiting (its destructor gives
  // up, as its process's end would); the worker prepares its part afterwards, and nobody commits.
  FillState(*workers_[0].opt, 30.0f);
  ASSERT_TRUE(workers_[0].Save(30, cfg_, ctx_, /*wait=*/false).ok());
  workers_[0].ckpt.reset();
  FillState(*workers_[1].opt, 30.0f);
  ASSERT_TRUE(workers_[1].Save(30, cfg_, ctx_).ok());
  ASSERT_EQ(LocalSteps(ck_ + "/shards/r1"), (std::vector<int64_t>{10, 20, 30}));
  EXPECT_GT(workers_[1].ckpt->ssd()->used_bytes(), committed_bytes);
  ASSERT_TRUE(std::filesystem::exists(ck_ + "/prepared/1/30/r1"));
  // A report of generation 2 that is there already stays.
  PlantReport(ck_, 2, 40, "r9");
  // The re-form: the old generation's flag is set; the worker continues as rank 0.
  *workers_[1].abandoned = true;
  auto generation2 = std::make_shared<std::atomic<bool>>(false);
  Status s = workers_[1].ckpt->Continue(2, /*committer=*/true, generation2, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(workers_[1].ckpt->committer());
  EXPECT_EQ(StepsIn(ck_), (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(workers_[1].ckpt->Steps(), (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(LocalSteps(ck_ + "/shards/r1"), (std::vector<int64_t>{10, 20}))
      << "the part of step 30 that never committed is still in the shard";
  EXPECT_EQ(workers_[1].ckpt->ssd()->used_bytes(), committed_bytes)
      << "the extents of step 30's part are still in use";
  EXPECT_FALSE(std::filesystem::exists(ck_ + "/prepared/1"));
  EXPECT_TRUE(std::filesystem::exists(ck_ + "/prepared/2/40/r9"));
  // Generation 2 is this worker alone, holding the whole model (rebuilt, as a re-form does).
  ShardWorker& w = workers_[1];
  auto whole = ModelOf(cfg_, ctx_, 0, -1);
  ASSERT_TRUE(whole.ok()) << whole.status();
  w.model = *std::move(whole);
  w.opt = std::make_unique<model::AdamW>(w.model->Parameters(), model::AdamWOptions{});
  w.share = CheckpointShare{};
  FillState(*w.opt, 40.0f);
  std::vector<std::vector<float>> saved;
  for (const Tensor* x : StateTensors(*w.opt)) saved.emplace_back(x->f32(), x->f32() + x->numel());
  s = w.Save(40, cfg_, ctx_);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(StepsIn(ck_), (std::vector<int64_t>{10, 20, 40}));
  workers_.clear();
  std::vector<std::string> report;
  EXPECT_TRUE(CheckpointManager::Verify(ck_, -1, &report).ok()) << absl::StrJoin(report, "\n");
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<model::AdamW> opt;
  ASSERT_EQ(ResumeWhole(cfg_, ctx_, ck_, &model, &opt), 40);
  const std::vector<const Tensor*> resumed = StateTensors(*opt);
  ASSERT_EQ(resumed.size(), saved.size());
  for (size_t k = 0; k < saved.size(); ++k) {
    ASSERT_EQ(std::vector<float>(resumed[k]->f32(), resumed[k]->f32() + resumed[k]->numel()),
              saved[k])
        << "tensor " << k / 3 << " (kind " << k % 3 << ") is not the state saved at step 40";
  }
}

// TIERED: the worker's store shares its shard's SSD tier, and its live expert tensors sit in
// extents no checkpoint lists once the part of step 30 they were adopted from is dropped (and in
// extents they were spilled to since). The committer waits for a third worker that died; both
// continue into generation 2 and save again: every live tensor still reads back as it was
// written (its extent was not reused), and the resume gives the state saved.
TEST_F(CheckpointContinueTest, TieredLiveTensorsKeepTheirExtentsAcrossGenerations) {
  Start("TIERED", /*tiered_worker=*/true);
  if (HasFatalFailure()) return;
  scheduler::TieredExpertScheduler& sched = *workers_[1].tiered;
  storage::TieredExpertStore& store = sched.store();
  const storage::TensorKind kinds[] = {storage::TensorKind::kWeights, storage::TensorKind::kAdamM,
                                       storage::TensorKind::kAdamV};
  // The worker's expert tensors by (MoE layer, local expert, kind), as last written.
  std::map<std::tuple<int, int, int>, std::vector<float>> live;
  // Writes the round's pattern into every `every`-th tensor through the host tier, which holds
  // fewer than all of them: the others are spilled to the SSD tier.
  auto write_experts = [&](float round, int every) {
    int n = 0;
    for (int li = 0; li < sched.moe_layers(); ++li) {
      for (int e = 0; e < sched.num_experts(li); ++e) {
        for (int k = 0; k < 3; ++k) {
          if (n++ % every != 0) continue;
          const storage::TensorKey key = sched.Key(li, e, kinds[k]);
          auto data = store.AcquireHost(key);
          ASSERT_TRUE(data.ok()) << data.status();
          std::vector<float>& v = live[{li, e, k}];
          v.resize(sched.expert_floats());
          for (size_t i = 0; i < v.size(); ++i) {
            v[i] = Pattern(key.ToString(), k, round, static_cast<int64_t>(i));
          }
          std::copy(v.begin(), v.end(), *data);
          store.ReleaseHost(key, /*modified=*/true);
        }
      }
    }
  };
  // Reads every tensor back, twice round (the host tier cannot hold them all, so most come from
  // the SSD tier), and compares it with what was written.
  auto check_experts = [&](const std::string& when) {
    std::vector<float> got(sched.expert_floats());
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& [at, want] : live) {
        const auto [li, e, k] = at;
        Status s = sched.ReadExpert(li, e, kinds[k], got.data());
        ASSERT_TRUE(s.ok()) << when << ": " << s;
        ASSERT_EQ(got, want) << when << ": expert tensor " << sched.Key(li, e, kinds[k]).ToString()
                             << " does not read back as written (its extent was reused)";
      }
    }
  };
  auto save_both = [&](int64_t step) {
    for (ShardWorker& w : workers_) FillState(*w.opt, static_cast<float>(step));
    write_experts(static_cast<float>(step), 1);
    if (!HasFatalFailure()) SaveBoth(step);
  };
  save_both(10);
  if (HasFatalFailure()) return;
  save_both(20);
  if (HasFatalFailure()) return;
  ASSERT_EQ(StepsIn(ck_), (std::vector<int64_t>{10, 20}));
  // Step 30: the worker prepares its part (the tensors it copied adopt the versions it wrote);
  // the committer waits for a third worker, r2, that died.
  write_experts(30.0f, 1);
  if (HasFatalFailure()) return;
  FillState(*workers_[1].opt, 30.0f);
  ASSERT_TRUE(workers_[1].Save(30, cfg_, ctx_).ok());
  ASSERT_EQ(LocalSteps(ck_ + "/shards/r1"), (std::vector<int64_t>{10, 20, 30}));
  workers_[0].share.shards = {"r0", "r1", "r2"};
  FillState(*workers_[0].opt, 30.0f);
  ASSERT_TRUE(workers_[0].Save(30, cfg_, ctx_, /*wait=*/false).ok());
  // Training went on: some tensors changed and were spilled to extents no checkpoint lists.
  write_experts(31.0f, 2);
  if (HasFatalFailure()) return;
  check_experts("before the re-form");
  if (HasFatalFailure()) return;
  // The re-form: rank 0 continues first (its commit waiting for r2 ends), then the worker, which
  // must name the scheduler holding its store.
  Status s = workers_[1].ckpt->Continue(2, false, nullptr, nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  for (int k = 0; k < 2; ++k) {
    s = workers_[k].ckpt->Continue(2, k == 0, std::make_shared<std::atomic<bool>>(false),
                                   workers_[k].tiered.get());
    ASSERT_TRUE(s.ok()) << "r" << k << ": " << s;
  }
  EXPECT_EQ(StepsIn(ck_), (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(LocalSteps(ck_ + "/shards/r1"), (std::vector<int64_t>{10, 20}))
      << "the part of step 30 that never committed is still in the shard";
  check_experts("after the re-form");
  if (HasFatalFailure()) return;
  // Generation 2 saves: the tensors written since are copied into new extents.
  workers_[0].share.shards = {"r0", "r1"};
  FillState(*workers_[0].opt, 40.0f);
  FillState(*workers_[1].opt, 40.0f);
  write_experts(40.0f, 3);
  if (HasFatalFailure()) return;
  SaveBoth(40);
  if (HasFatalFailure()) return;
  EXPECT_EQ(StepsIn(ck_), (std::vector<int64_t>{10, 20, 40}));
  check_experts("after generation 2 saved");
  if (HasFatalFailure()) return;
  const int first = static_cast<int>(sched.first_expert());
  std::vector<int> blocks;
  for (int li = 0; li < sched.moe_layers(); ++li) blocks.push_back(sched.block_of(li));
  const std::map<std::tuple<int, int, int>, std::vector<float>> at_40 = live;
  workers_.clear();  // the managers wait for their writers; the store goes with the scheduler
  std::vector<std::string> report;
  EXPECT_TRUE(CheckpointManager::Verify(ck_, -1, &report).ok()) << absl::StrJoin(report, "\n");
  std::unique_ptr<model::MoeTransformer> model;
  std::unique_ptr<model::AdamW> opt;
  ASSERT_EQ(ResumeWhole(cfg_, ctx_, ck_, &model, &opt), 40);
  // The committer's experts and every dense tensor hold round 40's pattern; the worker's experts
  // what its store held at step 40.
  std::map<const model::Parameter*, size_t> index;
  for (size_t p = 0; p < opt->params().size(); ++p) index[opt->params()[p]] = p;
  std::set<const model::Parameter*> in_store;
  for (const auto& ref : model->moe_layers()) {
    const int li =
        static_cast<int>(std::find(blocks.begin(), blocks.end(), ref.block) - blocks.begin());
    ASSERT_LT(li, static_cast<int>(blocks.size()));
    for (int e = first; e < first + 4; ++e) {
      std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
      const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
      for (int k = 0; k < 3; ++k) {
        const std::vector<float>& want = at_40.at({li, e - first, k});
        for (size_t i = 0; i < ps.size(); ++i) {
          in_store.insert(ps[i]);
          const size_t p = index.at(ps[i]);
          const Tensor& got = k == 0   ? ps[i]->value
                              : k == 1 ? opt->first_moment(p)
                                       : opt->second_moment(p);
          const float* seg = want.data() + layout.segments[i].offset;
          ASSERT_EQ(std::vector<float>(got.f32(), got.f32() + got.numel()),
                    std::vector<float>(seg, seg + got.numel()))
              << ps[i]->name << " (kind " << k << ") is not what the store held at step 40";
        }
      }
    }
  }
  for (size_t p = 0; p < opt->params().size(); ++p) {
    if (in_store.count(opt->params()[p])) continue;
    const Tensor* got[] = {&opt->params()[p]->value, &opt->first_moment(p), &opt->second_moment(p)};
    for (int k = 0; k < 3; ++k) {
      for (int64_t i = 0; i < got[k]->numel(); ++i) {
        ASSERT_EQ(got[k]->f32()[i], Pattern(opt->params()[p]->name, k, 40.0f, i))
            << opt->params()[p]->name << " (kind " << k << ") is not the state saved at step 40";
      }
    }
  }
}

// The committer's role moves with Continue: given up, DIR/LOCK is free for another committer;
// taken again only once that one let go; reports of older generations go, this one's stay.
TEST_F(CheckpointContinueTest, GivingUpTheCommitterRoleReleasesTheFolderLock) {
  const std::string& ck = ck_;
  auto open = [&](const std::string& shard, bool committer) {
    CheckpointOptions co;
    co.dir = ck;
    co.shard = shard;
    co.committer = committer;
    co.generation = 1;
    return CheckpointManager::Open(co, /*must_exist=*/false);
  };
  auto r0 = open("r0", true);
  ASSERT_TRUE(r0.ok()) << r0.status();
  auto other = open("r1", true);
  ASSERT_TRUE(absl::IsUnavailable(other.status())) << other.status();
  Status s = (*r0)->Continue(2, /*committer=*/false, nullptr, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE((*r0)->committer());
  other = open("r1", true);
  ASSERT_TRUE(other.ok()) << "the folder lock was not given up: " << other.status();
  // Taking it back waits for the other committer to let go.
  PlantReport(ck, 2, 50, "r1");
  PlantReport(ck, 3, 60, "r1");
  s = (*r0)->Continue(3, /*committer=*/true, nullptr, nullptr);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_FALSE((*r0)->committer());
  EXPECT_TRUE(std::filesystem::exists(ck + "/prepared/2/50/r1"));
  other->reset();
  s = (*r0)->Continue(3, /*committer=*/true, nullptr, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE((*r0)->committer());
  EXPECT_FALSE(std::filesystem::exists(ck + "/prepared/2"));
  EXPECT_TRUE(std::filesystem::exists(ck + "/prepared/3/60/r1"));
  other = open("r1", true);
  EXPECT_TRUE(absl::IsUnavailable(other.status())) << other.status();
}

}  // namespace
}  // namespace strata::train
