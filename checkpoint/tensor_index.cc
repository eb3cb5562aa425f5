#include "checkpoint/tensor_index.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace strata::checkpoint {
namespace {

void AppendBe32(std::string* s, int32_t v) {
  const uint32_t u = static_cast<uint32_t>(v) ^ 0x80000000u;
  for (int i = 3; i >= 0; --i) s->push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
void AppendBe64(std::string* s, uint64_t u) {
  for (int i = 7; i >= 0; --i) s->push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}

std::string CheckpointKey(int64_t step) {
  std::string k = "c/";
  AppendBe64(&k, static_cast<uint64_t>(step) ^ 0x8000000000000000ull);
  return k;
}

Status FromRocks(const rocksdb::Status& s, const std::string& what, const std::string& dir) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsCorruption()) {
    return absl::DataLossError(
        absl::StrFormat("the checkpoint index in '%s' is damaged (%s: %s); %s", dir, what,
                        s.ToString(), kDamagedIndexRemedy));
  }
  if (s.IsIOError() && s.ToString().find("No space") != std::string::npos) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s in the checkpoint index '%s': %s; free disk space", what, dir, s.ToString()));
  }
  return absl::InternalError(
      absl::StrFormat("%s in the checkpoint index '%s': %s", what, dir, s.ToString()));
}

}  // namespace

std::string TensorIndex::TensorKey(const TensorRef& ref) {
  std::string k = "t/";
  AppendBe32(&k, ref.layer());
  AppendBe32(&k, ref.expert());
  k.push_back(static_cast<char>(ref.kind()));
  AppendBe64(&k, ref.version());
  return k;
}

namespace {

Status MissingIndex(const std::string& dir, const char* consequence) {
  return absl::NotFoundError(absl::StrFormat(
      "no checkpoint index in '%s' (its RocksDB files are missing): %s", dir, consequence));
}

rocksdb::Options IndexOptions() {
  rocksdb::Options options;
  options.paranoid_checks = true;
  // Every write is synced, so a crash can at most tear the record being appended at the WAL's
  // end; RocksDB's default (kPointInTimeRecovery) would also stop replaying silently at damage in
  // the middle and drop every later commit. This mode accepts only the torn tail and refuses any
  // other damage. (A cut that happens to fall between records looks like a torn tail; the
  // checkpoint ledger catches the list it rolls back.)
  options.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  options.max_open_files = 64;
  options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  options.keep_log_file_num = 2;
  return options;
}

// An open that failed with a corruption: names the damaged part. If the index opens when damaged
// WAL records are skipped, the rest of it is whole and the damage is in the write-ahead log.
Status OpenError(const rocksdb::Status& s, const std::string& dir) {
  if (!s.IsCorruption()) return FromRocks(s, "opening", dir);
  rocksdb::Options salvage = IndexOptions();
  salvage.wal_recovery_mode = rocksdb::WALRecoveryMode::kSkipAnyCorruptedRecords;
  rocksdb::DB* db = nullptr;
  if (!rocksdb::DB::OpenForReadOnly(salvage, dir, &db).ok()) return FromRocks(s, "opening", dir);
  delete db;
  std::vector<std::string> wals;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    if (f.path().extension() == ".log") wals.push_back(f.path().string());
  }
  std::sort(wals.begin(), wals.end());
  return absl::DataLossError(absl::StrFormat(
      "the checkpoint index in '%s' is damaged: its write-ahead log (%s) is corrupt before its "
      "end (a killed process cannot cause that; disk damage or a power loss in the middle of a "
      "write can), so the checkpoints committed after the damage are lost "
      "(RocksDB: %s); %s",
      dir, absl::StrJoin(wals, ", "), s.ToString(), kDamagedIndexRemedy));
}

}  // namespace

bool TensorIndex::Exists(const std::string& dir) {
  return std::filesystem::exists(dir + "/CURRENT");
}

StatusOr<std::unique_ptr<TensorIndex>> TensorIndex::Open(const std::string& dir, bool create) {
  if (!create && !Exists(dir)) {
    return MissingIndex(dir, "this folder holds no checkpoints to resume from");
  }
  rocksdb::Options options = IndexOptions();
  options.create_if_missing = create;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &db);
  if (!s.ok()) return OpenError(s, dir);
  std::unique_ptr<TensorIndex> index(new TensorIndex);
  index->dir_ = dir;
  index->db_.reset(db);
  return index;
}

StatusOr<std::unique_ptr<TensorIndex>> TensorIndex::OpenReadOnly(const std::string& dir) {
  if (!Exists(dir)) {
    return MissingIndex(dir, "this folder holds no checkpoints");
  }
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::OpenForReadOnly(IndexOptions(), dir, &db);
  if (!s.ok()) return OpenError(s, dir);
  std::unique_ptr<TensorIndex> index(new TensorIndex);
  index->dir_ = dir;
  index->db_.reset(db);
  return index;
}

TensorIndex::~TensorIndex() = default;

Status TensorIndex::CommitCheckpoint(const CheckpointManifest& manifest,
                                     const std::vector<TensorRef>& new_versions) {
  rocksdb::WriteBatch batch;
  for (const TensorRef& r : new_versions) {
    batch.Put(TensorKey(r), r.extent().SerializeAsString());
  }
  batch.Put(CheckpointKey(manifest.step()), manifest.SerializeAsString());
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return FromRocks(db_->Write(wo, &batch), "committing a checkpoint", dir_);
}

Status TensorIndex::RemoveCheckpoint(int64_t step, const std::vector<TensorRef>& unreferenced) {
  rocksdb::WriteBatch batch;
  batch.Delete(CheckpointKey(step));
  for (const TensorRef& r : unreferenced) batch.Delete(TensorKey(r));
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return FromRocks(db_->Write(wo, &batch), "removing a checkpoint", dir_);
}

Status TensorIndex::RemoveVersions(const std::vector<TensorRef>& refs) {
  rocksdb::WriteBatch batch;
  for (const TensorRef& r : refs) batch.Delete(TensorKey(r));
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return FromRocks(db_->Write(wo, &batch), "removing stale entries", dir_);
}

StatusOr<std::vector<CheckpointManifest>> TensorIndex::Checkpoints() const {
  std::vector<CheckpointManifest> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("c/"); it->Valid() && it->key().starts_with("c/"); it->Next()) {
    CheckpointManifest m;
    if (!m.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
      return absl::DataLossError(absl::StrFormat(
          "a checkpoint manifest in the index '%s' cannot be parsed; the index is damaged", dir_));
    }
    out.push_back(std::move(m));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "listing checkpoints", dir_));
  return out;
}

StatusOr<std::vector<TensorRef>> TensorIndex::TensorVersions() const {
  std::vector<TensorRef> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("t/"); it->Valid() && it->key().starts_with("t/"); it->Next()) {
    const rocksdb::Slice k = it->key();
    if (k.size() != 2 + 4 + 4 + 1 + 8) {
      return absl::DataLossError(absl::StrFormat("malformed key in the index '%s'", dir_));
    }
    auto be32 = [&](size_t at) {
      uint32_t u = 0;
      for (int i = 0; i < 4; ++i) u = (u << 8) | static_cast<uint8_t>(k[at + i]);
      return static_cast<int32_t>(u ^ 0x80000000u);
    };
    uint64_t version = 0;
    for (int i = 0; i < 8; ++i) version = (version << 8) | static_cast<uint8_t>(k[11 + i]);
    TensorRef r;
    r.set_layer(be32(2));
    r.set_expert(be32(6));
    r.set_kind(static_cast<uint8_t>(k[10]));
    r.set_version(version);
    if (!r.mutable_extent()->ParseFromArray(it->value().data(),
                                            static_cast<int>(it->value().size()))) {
      return absl::DataLossError(absl::StrFormat("malformed entry in the index '%s'", dir_));
    }
    out.push_back(std::move(r));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "listing tensor versions", dir_));
  return out;
}

}  // namespace strata::checkpoint
