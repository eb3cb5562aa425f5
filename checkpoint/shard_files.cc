#include "checkpoint/manager_internal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <utility>
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/ledger_text.h"
#include "core/common/logging.h"
#include "google/protobuf/text_format.h"
#include "storage/crc32c.h"
#include "storage/env.h"

namespace strata::checkpoint {

namespace {

std::string Steps(const std::vector<int64_t>& steps) { return absl::StrJoin(steps, ", "); }

}  // namespace

StoredExtent FromRecord(const storage::ExtentRecord& r) {
  StoredExtent s;
  s.extent.file = r.file();
  s.extent.offset = r.offset();
  s.extent.length = r.length();
  s.bytes = r.bytes();
  s.crc = r.crc32c();
  return s;
}

void ToRecord(const StoredExtent& s, storage::ExtentRecord* r) {
  r->set_file(s.extent.file);
  r->set_offset(s.extent.offset);
  r->set_length(s.extent.length);
  r->set_bytes(s.bytes);
  r->set_crc32c(s.crc);
}

std::string Where(int64_t step, const std::string& shard) {
  if (shard.empty() || shard == ".") return absl::StrFormat("checkpoint %d", step);
  return absl::StrFormat("checkpoint %d, shard %s", step, shard);
}

std::string Describe(const TensorRef& r, int64_t step, const std::string& shard) {
  if (r.expert() < 0) {
    return absl::StrFormat("%s: %s (%s) v%d", Where(step, shard), r.name(),
                           storage::KindName(static_cast<storage::TensorKind>(r.kind())),
                           r.version());
  }
  return absl::StrFormat(
      "%s: %s v%d", Where(step, shard),
      storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())}
          .ToString(),
      r.version());
}

std::string ModelText(const config::ModelConfig& m) {
  std::string s;
  google::protobuf::TextFormat::PrintToString(m, &s);
  return s;
}

std::string ConfigDiff(const std::string& checkpoint, const std::string& current) {
  std::vector<std::string> a = absl::StrSplit(checkpoint, '\n', absl::SkipEmpty());
  std::vector<std::string> b = absl::StrSplit(current, '\n', absl::SkipEmpty());
  std::vector<std::string> diff;
  for (const auto& line : a) {
    if (std::find(b.begin(), b.end(), line) == b.end()) diff.push_back("checkpoint has " + line);
  }
  for (const auto& line : b) {
    if (std::find(a.begin(), a.end(), line) == a.end()) diff.push_back("config has " + line);
  }
  return absl::StrJoin(diff, "; ");
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

StatusOr<std::unique_ptr<storage::SsdTier>> OpenSsd(const CheckpointOptions& o,
                                                    const std::string& dir) {
  ASSIGN_OR_RETURN(std::unique_ptr<storage::BlockIo> io, storage::MakeUringIo(o.io));
  if (o.wrap_io) io = o.wrap_io(std::move(io));
  storage::SsdOptions so;
  so.dir = dir;
  so.file_bytes = o.file_bytes;
  so.capacity_bytes = o.capacity_bytes;
  return storage::SsdTier::Open(so, std::move(io));
}

std::string LedgerPath(const std::string& dir) { return dir + "/LEDGER"; }

bool IsFolderShard(const std::string& dir) {
  return TensorIndex::Exists(dir + "/index") || !storage::SsdTier::DataFiles(dir).empty() ||
         storage::Env::Default()->FileExists(LedgerPath(dir));
}

std::string PreparedRoot(const std::string& dir) { return dir + "/prepared"; }

std::string PreparedDir(const std::string& dir, int64_t generation, int64_t step) {
  return absl::StrCat(dir, "/prepared/", generation, "/", step);
}

std::string ShardDir(const std::string& dir, const std::string& shard) {
  return shard == "." ? dir : absl::StrCat(dir, "/shards/", shard);
}

StatusOr<int> LockFolder(const std::string& path, const std::string& folder) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot open '%s': %s", path, std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {0};
    ssize_t n = ::pread(fd, pid, sizeof(pid) - 1, 0);
    if (n > 0) pid[n] = 0;
    ::close(fd);
    return absl::UnavailableError(absl::StrFormat(
        "checkpoint folder '%s' is in use by another strata process (pid %s); wait for it to "
        "finish or use another folder",
        folder, absl::StripAsciiWhitespace(pid)));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    STRATA_LOG(WARNING) << "could not record the pid in " << path;
  }
  return fd;
}

void Unlock(int fd) {
  if (fd < 0) return;
  ::flock(fd, LOCK_UN);
  ::close(fd);
}

const storage::ShardEntry* FindShard(const storage::CheckpointSet& set, const std::string& shard) {
  for (const storage::ShardEntry& e : set.shards()) {
    if (e.name() == shard) return &e;
  }
  return nullptr;
}

uint32_t ManifestCrc(const CheckpointManifest& m) {
  const std::string bytes = m.SerializeAsString();
  return storage::Crc32c(bytes.data(), bytes.size());
}

Status MatchesSet(const CheckpointManifest& m, const storage::CheckpointSet& set,
                  const std::string& shard) {
  const storage::ShardEntry* e = FindShard(set, shard);
  if (e == nullptr) {
    return absl::DataLossError(absl::StrFormat("%s: the global manifest does not name this shard",
                                               Where(set.step(), shard)));
  }
  if (m.sequence() != e->local_sequence()) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the shard's local checkpoint has sequence %d, the global manifest names %d: the "
        "shard was rewritten after the checkpoint committed",
        Where(set.step(), shard), m.sequence(), e->local_sequence()));
  }
  const uint32_t crc = ManifestCrc(m);
  if (crc != e->local_manifest_crc32c()) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the shard's local manifest has CRC-32C %08x, the global manifest recorded %08x: it "
        "changed after the checkpoint committed",
        Where(set.step(), shard), crc, e->local_manifest_crc32c()));
  }
  return absl::OkStatus();
}

StatusOr<std::optional<std::string>> ReadLedgerText(const std::string& dir) {
  storage::Env* env = storage::Env::Default();
  if (!env->FileExists(LedgerPath(dir))) return std::optional<std::string>();
  ASSIGN_OR_RETURN(std::string text, env->ReadFile(LedgerPath(dir)));
  return std::optional<std::string>(std::move(text));
}

StatusOr<storage::CheckpointLedger> ParseLedger(const std::string& dir, const std::string& text) {
  std::optional<storage::CheckpointLedger> ledger = ParseLedgerText(text);
  if (!ledger) {
    return absl::DataLossError(absl::StrFormat(
        "the checkpoint ledger '%s' is damaged (its checksum or its contents are wrong), so "
        "the checkpoint list cannot be checked; %s",
        LedgerPath(dir), kDamagedIndexRemedy));
  }
  return *std::move(ledger);
}

Status StoreLedger(const std::string& dir, const storage::CheckpointLedger& ledger) {
  return storage::Env::Default()->WriteFileAtomic(LedgerPath(dir), LedgerText(ledger));
}

StatusOr<CheckedList> CheckList(const std::string& dir, const std::optional<std::string>& before,
                                const std::optional<std::string>& after,
                                std::vector<CheckpointManifest> indexed) {
  ASSIGN_OR_RETURN(LedgerReads reads, ParseLedgerReads(before, after, [&](const std::string& text) {
                     return ParseLedger(dir, text);
                   }));
  std::optional<storage::CheckpointLedger> old_ledger = std::move(reads.before);
  std::optional<storage::CheckpointLedger> ledger = std::move(reads.after);
  CheckedList out;
  for (const CheckpointManifest& m : indexed) {
    out.last_sequence = std::max(out.last_sequence, m.sequence());
  }
  if (!ledger) {
    // A folder written before the ledger: nothing to check against, and nothing to check with.
    std::vector<int64_t> sequenced;
    for (const CheckpointManifest& m : indexed) {
      if (m.has_sequence()) sequenced.push_back(m.step());
    }
    if (!sequenced.empty()) {
      return absl::DataLossError(absl::StrFormat(
          "the checkpoint ledger '%s' is missing, but the index in '%s/index' holds checkpoints "
          "written with one (%s), so the checkpoint list cannot be checked; %s",
          LedgerPath(dir), dir, Steps(sequenced), kDamagedIndexRemedy));
    }
    out.live = std::move(indexed);
    return out;
  }
  out.last_sequence = std::max(out.last_sequence, ledger->last_sequence());
  using Key = std::pair<int64_t, uint64_t>;
  std::set<Key> old_live, live, removing, in_index;
  for (const auto& e : old_ledger->live()) old_live.insert({e.step(), e.sequence()});
  for (const auto& e : ledger->live()) live.insert({e.step(), e.sequence()});
  for (const auto* l : {&*old_ledger, &*ledger}) {
    for (const auto& e : l->removing()) removing.insert({e.step(), e.sequence()});
  }
  std::vector<CheckpointManifest> newer;  // committed after the ledger was last written
  std::vector<int64_t> back, missing, unrecorded;
  for (CheckpointManifest& m : indexed) {
    const Key k{m.step(), m.sequence()};
    in_index.insert(k);
    if (removing.count(k) || (m.sequence() > old_ledger->last_sequence() &&
                              m.sequence() <= ledger->last_sequence() && !live.count(k))) {
      out.removing.push_back(std::move(m));  // being removed, or committed and removed meanwhile
    } else if (old_live.count(k) || live.count(k)) {
      out.live.push_back(std::move(m));
    } else if (m.sequence() > ledger->last_sequence()) {
      newer.push_back(std::move(m));
    } else {
      back.push_back(m.step());
    }
  }
  for (const auto& e : old_ledger->live()) {
    const Key k{e.step(), e.sequence()};
    if (live.count(k) && !in_index.count(k)) missing.push_back(e.step());
  }
  // A crash between a commit and the ledger's update leaves the commit out of the ledger. Such a
  // checkpoint is accepted when it follows the ledger's newest one.
  std::sort(newer.begin(), newer.end(),
            [](const auto& a, const auto& b) { return a.sequence() < b.sequence(); });
  bool has_previous = ledger->live_size() > 0;
  uint64_t previous = has_previous ? ledger->live(ledger->live_size() - 1).sequence() : 0;
  for (CheckpointManifest& m : newer) {
    const bool follows = has_previous
                             ? m.has_previous_sequence() && m.previous_sequence() == previous
                             : !m.has_previous_sequence();
    if (!follows) {
      unrecorded.push_back(m.step());
      continue;
    }
    has_previous = true;
    previous = m.sequence();
    out.live.push_back(std::move(m));
  }
  if (!missing.empty() || !back.empty() || !unrecorded.empty()) {
    std::vector<std::string> what;
    if (!missing.empty()) what.push_back("checkpoints missing from the index: " + Steps(missing));
    if (!back.empty()) what.push_back("removed checkpoints back in the index: " + Steps(back));
    if (!unrecorded.empty()) {
      what.push_back("checkpoints the ledger never recorded: " + Steps(unrecorded));
    }
    return absl::DataLossError(absl::StrFormat(
        "the checkpoint index in '%s/index' does not match the checkpoint ledger '%s' (%s): the "
        "index lost or regained entries, as a damaged or cut RocksDB write-ahead log does, and "
        "cannot be trusted; %s",
        dir, LedgerPath(dir), absl::StrJoin(what, "; "), kDamagedIndexRemedy));
  }
  std::sort(out.live.begin(), out.live.end(),
            [](const auto& a, const auto& b) { return a.step() < b.step(); });
  return out;
}

Status CheckNoIndexIsNoLoss(const std::string& dir) {
  uint64_t bytes = 0;
  const std::vector<std::string> files = storage::SsdTier::DataFiles(dir);
  for (const std::string& f : files) {
    std::error_code ec;
    const uintmax_t n = std::filesystem::file_size(f, ec);
    if (!ec) bytes += n;
  }
  int listed = 0;
  StatusOr<std::optional<std::string>> text = ReadLedgerText(dir);
  bool ledger_ok = text.ok();
  if (ledger_ok && *text) {
    StatusOr<storage::CheckpointLedger> ledger = ParseLedger(dir, **text);
    ledger_ok = ledger.ok();
    if (ledger_ok) listed = ledger->live_size();
  }
  if (bytes == 0 && listed == 0 && ledger_ok) return absl::OkStatus();
  std::string held = absl::StrFormat("%d data file%s (%.1f MiB)", files.size(),
                                     files.size() == 1 ? "" : "s", bytes / 1048576.0);
  if (listed > 0) {
    absl::StrAppend(&held, absl::StrFormat(" and a ledger of %d checkpoints", listed));
  }
  if (!ledger_ok) absl::StrAppend(&held, " and a checkpoint ledger that cannot be read");
  return absl::FailedPreconditionError(absl::StrFormat(
      "no checkpoint index in '%s/index', but the folder holds %s: without the index those "
      "checkpoints cannot be read, and training into the folder would overwrite them. Restore "
      "the index from a copy of the folder, or pass --start-over to move the folder's contents "
      "aside (to '%s.old-<time>') and train afresh",
      dir, held, dir));
}

Status MoveAside(const std::string& dir) {
  std::vector<std::filesystem::path> entries;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    if (f.path().filename() != "LOCK") entries.push_back(f.path());
  }
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot list checkpoint folder '%s': %s", dir, ec.message()));
  }
  if (entries.empty()) return absl::OkStatus();
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &tm);
  std::string base = std::filesystem::path(dir).lexically_normal().string();
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  std::string aside = absl::StrCat(base, ".old-", stamp);
  for (int n = 2; std::filesystem::exists(aside); ++n) {
    aside = absl::StrCat(base, ".old-", stamp, "-", n);
  }
  std::filesystem::create_directory(aside, ec);
  for (const auto& e : entries) {
    if (ec) break;
    std::filesystem::rename(e, aside / e.filename(), ec);
  }
  if (ec) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--start-over: cannot move the contents of '%s' to '%s' (%s); move or delete them "
        "yourself",
        dir, aside, ec.message()));
  }
  for (const std::string& d : {dir, aside}) {
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
      (void)::fsync(fd);
      ::close(fd);
    }
  }
  STRATA_LOG(WARNING) << "--start-over: moved what '" << dir << "' held (" << entries.size()
                      << " entries) to " << aside << "; delete it once it is not needed";
  return absl::OkStatus();
}

}  // namespace strata::checkpoint
