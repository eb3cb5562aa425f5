#include "checkpoint/manager.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/ledger_text.h"
#include "core/common/clock.h"
#include "core/common/fault_point.h"
#include "core/common/logging.h"
#include "core/common/trace.h"
#include "google/protobuf/text_format.h"
#include "storage/crc32c.h"
#include "storage/env.h"

namespace strata::checkpoint {
namespace {

using storage::CheckpointManifest;
using storage::StoredExtent;
using storage::TensorRef;

// A 4 KiB-aligned buffer with room for a rounded-up extent.
struct AlignedBuffer {
  static uint64_t Rounded(uint64_t bytes) {
    return std::max<uint64_t>((bytes + 4095) / 4096 * 4096, 4096);
  }
  explicit AlignedBuffer(uint64_t bytes)
      : size(Rounded(bytes)), data(static_cast<char*>(std::aligned_alloc(4096, size))) {}
  // Adopts `memory` (from aligned_alloc, `rounded` bytes).
  AlignedBuffer(uint64_t rounded, char* memory) : size(rounded), data(memory) {}
  char* Release() { return std::exchange(data, nullptr); }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint64_t size;
  char* data;
};

}  // namespace

// Snapshot memory: chunks carved into 4 KiB-aligned buffers in the order Save asks for them. Kept
// from one checkpoint to the next, which asks for the same sizes in the same order and so finds
// its pages touched already: a fresh buffer's first-touch faults were most of a snapshot's time
// (Reserve touches them before the first checkpoint). Huge pages (MADV_HUGEPAGE) were measured
// slower to fault in on the 2-core VM (2.6 s against 0.58 s per GiB) and are not asked for.
// Reset by Save once the writer is done with the last checkpoint's buffers.
struct CheckpointManager::SnapshotArena {
  static constexpr uint64_t kAlign = 4096;
  static constexpr uint64_t kChunk = 64ull << 20;
  struct Chunk {
    char* base;
    uint64_t size;
  };
  std::vector<Chunk> chunks;
  size_t chunk = 0;  // where the next buffer is carved from
  uint64_t offset = 0;
  size_t last_chunk = 0;  // where the last one was (ReturnLast)
  uint64_t last_offset = 0;

  ~SnapshotArena() {
    for (const Chunk& c : chunks) std::free(c.base);
  }
  void Reset() { chunk = 0, offset = 0; }
  char* Take(uint64_t bytes) {
    const uint64_t rounded = AlignedBuffer::Rounded(bytes);
    while (chunk < chunks.size() && offset + rounded > chunks[chunk].size) ++chunk, offset = 0;
    if (chunk == chunks.size()) {
      const uint64_t size = std::max(kChunk, (rounded + kAlign - 1) / kAlign * kAlign);
      char* base = static_cast<char*>(std::aligned_alloc(kAlign, size));
      CHECK(base != nullptr) << "cannot allocate " << size
                             << " bytes of checkpoint snapshot memory";
      chunks.push_back({base, size});
      offset = 0;
    }
    last_chunk = chunk, last_offset = offset;
    char* out = chunks[chunk].base + offset;
    offset += rounded;
    return out;
  }
  // Gives back the buffer Take returned last (unused).
  void ReturnLast() { chunk = last_chunk, offset = last_offset; }
};

namespace {

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

// "checkpoint 10" or "checkpoint 10, shard p0" (a folder written before sharding is shard ".").
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

// The lines where two model configs differ, for an error message.
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

// The SSD tier of the shard folder `dir`.
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

// A folder written before sharding has its one shard's index, data files or ledger directly in
// it: it is the shard ".".
bool IsFolderShard(const std::string& dir) {
  return TensorIndex::Exists(dir + "/index") || !storage::SsdTier::DataFiles(dir).empty() ||
         storage::Env::Default()->FileExists(LedgerPath(dir));
}

// DIR/prepared/<generation>/<step>/<shard>: a worker's report that its shard is prepared for a
// checkpoint (its ShardEntry, serialized), for the committer to collect.
std::string PreparedRoot(const std::string& dir) { return dir + "/prepared"; }
std::string PreparedDir(const std::string& dir, int64_t generation, int64_t step) {
  return absl::StrCat(dir, "/prepared/", generation, "/", step);
}

std::string ShardDir(const std::string& dir, const std::string& shard) {
  return shard == "." ? dir : absl::StrCat(dir, "/shards/", shard);
}

// Takes the lock file `path` of `folder` for this process (writing its pid), or says who has it.
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

// The shard entry named `shard` in `set`, or null.
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

// Whether the local manifest `m` of `shard` is the one `set` names (same sequence and bytes);
// otherwise why not.
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

// DIR/LEDGER's bytes; nullopt when there is none.
StatusOr<std::optional<std::string>> ReadLedgerText(const std::string& dir) {
  storage::Env* env = storage::Env::Default();
  if (!env->FileExists(LedgerPath(dir))) return std::optional<std::string>();
  ASSIGN_OR_RETURN(std::string text, env->ReadFile(LedgerPath(dir)));
  return std::optional<std::string>(std::move(text));
}

// DIR/LEDGER holds the ledger in text form, then a line with the CRC-32C of that text.
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

std::string Steps(const std::vector<int64_t>& steps) { return absl::StrJoin(steps, ", "); }

struct CheckedList {
  std::vector<CheckpointManifest> live;      // the folder's checkpoints, by increasing step
  std::vector<CheckpointManifest> removing;  // in the index, but being removed
  uint64_t last_sequence = 0;
};

// The index's checkpoints checked against the ledger: `before` and `after` are the ledger file's
// bytes read before and after the index (the same when the folder is locked). A process training
// into the folder may change both in between; between two ledger updates the index changes by at
// most one commit or one recorded removal, so an index entry is accepted if either ledger accounts
// for it, and missing only if both list it.
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

// A folder without an index is empty for checkpoints only if it holds no data files and its
// ledger (if any) lists nothing: otherwise the index was lost, and training would overwrite
// checkpoints that a copy of the index could still read.
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

// `--start-over`: everything in the folder but its lock moves to a new sibling folder.
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

}  // namespace

// A checkpoint between its snapshot and its commit.
struct CheckpointManager::Pending {
  CheckpointManifest manifest;
  struct Copy {
    TensorRef ref;
    char* buffer = nullptr;  // from the manager's snapshot arena
    uint64_t bytes = 0;
    bool tiered = false;  // an expert tensor of the tiered store (adopt the version after)
    uint64_t generation = 0;
    StoredExtent stored;
    // Fills the buffer on the writer thread, before anything is written (the snapshot that
    // overlaps the next step; see Save). Null: filled by Save already.
    std::function<void(void*)> fill;
  };
  std::vector<Copy> copies;
  std::vector<TensorRef> refs;  // stored already (a store reference was taken) or generated
  Tracer* tracer = nullptr;
  // The global manifest to commit once the local one is durable (its shard entry's sequence and
  // CRC filled in then), and what a whole set of this model holds.
  CheckpointSet set;
  CheckpointSetLayout layout;
  std::vector<std::string> other_shards;  // the committer's: shards whose reports it waits for
};

uint64_t CheckpointManager::ConfigHash(const config::ModelConfig& model) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : ModelText(model)) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

StatusOr<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(
    const CheckpointOptions& options, bool must_exist) {
  std::unique_ptr<CheckpointManager> m(new CheckpointManager);
  m->options_ = options;
  const std::string& dir = options.dir;
  if (must_exist && !std::filesystem::is_directory(dir)) {
    return absl::NotFoundError(
        absl::StrFormat("checkpoint folder '%s' does not exist: nothing to resume from", dir));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot create checkpoint folder '%s': %s", dir, ec.message()));
  }
  // One committer at a time: a training job's (one process, or rank 0), or `strata ckpt rm`.
  if (options.committer) {
    ASSIGN_OR_RETURN(m->lock_fd_, LockFolder(dir + "/LOCK", dir));
  }
  if (options.start_over && options.committer) {
    if (must_exist) {
      return absl::InvalidArgumentError(
          "--start-over moves the checkpoint folder's contents aside, --resume continues from "
          "them: pass one of them");
    }
    RETURN_IF_ERROR(MoveAside(dir));
  }
  // The committed sets first: a folder whose global manifests are damaged is not trained into.
  ASSIGN_OR_RETURN(m->sets_, ListCheckpointSets(dir));
  // A folder written before sharding is written on in place by one process; workers write their
  // own shards beside it.
  if (IsFolderShard(dir) && options.committer && options.shard == "p0") {
    m->shard_name_ = ".";
    m->shard_dir_ = dir;
  } else {
    RETURN_IF_ERROR(ValidateShardName(options.shard));
    if (options.shard == ".") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the shard '.' is the folder '%s' itself, kept for folders written before sharding; "
          "write a shard named p0, r<rank> or w<id>",
          dir));
    }
    m->shard_name_ = options.shard;
    m->shard_dir_ = ShardDir(dir, options.shard);
    std::filesystem::create_directories(m->shard_dir_, ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrFormat("cannot create checkpoint shard '%s': %s", m->shard_dir_, ec.message()));
    }
    ASSIGN_OR_RETURN(m->shard_lock_fd_, LockFolder(m->shard_dir_ + "/LOCK", m->shard_dir_));
  }
  // Reports of checkpoints no longer in flight (a job stopped while saving): a new job's committer
  // opens before any worker saves. They are not checkpoints: a resume clears them too.
  if (options.committer) {
    std::filesystem::remove_all(PreparedRoot(dir), ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrFormat(
          "cannot clear '%s' of old prepared reports: %s", PreparedRoot(dir), ec.message()));
    }
  }
  // Workers beside a folder written before sharding read its checkpoints as one-shard sets of the
  // shard "." (never written, pruned or removed by them).
  if (m->shard_name_ != "." && IsFolderShard(dir)) {
    ASSIGN_OR_RETURN(std::vector<CheckpointManifest> old, ReadList(dir));
    for (const CheckpointManifest& cm : old) {
      if (cm.sharded()) continue;
      CheckpointSet cs;
      cs.set_step(cm.step());
      cs.set_config_hash(cm.config_hash());
      cs.set_model_config(cm.model_config());
      cs.set_seed(cm.seed());
      cs.set_optimizer_steps(cm.optimizer_steps());
      cs.set_storage_mode(cm.storage_mode());
      storage::ShardEntry* e = cs.add_shards();
      e->set_name(".");
      e->set_local_sequence(cm.sequence());
      e->set_local_manifest_crc32c(ManifestCrc(cm));
      std::map<int32_t, std::pair<int32_t, int32_t>> ranges;  // block -> first, last
      std::set<std::string> dense;
      for (const TensorRef& r : cm.tensors()) {
        if (r.expert() < 0) {
          dense.insert(r.name());
          continue;
        }
        auto [it, fresh] = ranges.try_emplace(r.layer(), r.expert(), r.expert());
        it->second.first = std::min(it->second.first, r.expert());
        it->second.second = std::max(it->second.second, r.expert());
      }
      for (const auto& [block, range] : ranges) {
        storage::ExpertRange* er = e->add_experts();
        er->set_layer(block);
        er->set_first(range.first);
        er->set_count(range.second - range.first + 1);
      }
      for (const std::string& d : dense) e->add_dense(d);
      m->folder_sets_.push_back(std::move(cs));
    }
  }
  const std::string& shard = m->shard_dir_;
  const bool has_index = TensorIndex::Exists(shard + "/index");
  if (!has_index) RETURN_IF_ERROR(CheckNoIndexIsNoLoss(shard));
  // Resuming opens the index read-only: nothing in the folder changes until the checkpoint has
  // passed every check (Resume reopens it for writing). A shard that is gone while sets name it
  // starts empty: those sets fail their checks, and older ones may still resume.
  if (must_exist && (has_index || m->sets_.empty())) {
    ASSIGN_OR_RETURN(m->index_, TensorIndex::OpenReadOnly(shard + "/index"));
  } else {
    ASSIGN_OR_RETURN(m->index_, TensorIndex::Open(shard + "/index", true));
  }
  ASSIGN_OR_RETURN(m->ssd_, OpenSsd(options, shard));
  ASSIGN_OR_RETURN(std::vector<CheckpointManifest> indexed, m->index_->Checkpoints());
  ASSIGN_OR_RETURN(std::optional<std::string> ledger, ReadLedgerText(shard));
  ASSIGN_OR_RETURN(CheckedList list, CheckList(shard, ledger, ledger, std::move(indexed)));
  m->removing_ = std::move(list.removing);
  m->last_sequence_ = list.last_sequence;
  // A local checkpoint of a set exists only if the set committed naming it; one no committed set
  // names was prepared by a process stopped before the commit (or its set was removed), and goes.
  for (CheckpointManifest& cm : list.live) {
    const CheckpointSet* set = nullptr;
    for (const CheckpointSet& cs : m->sets_) {
      if (cs.step() == cm.step()) set = &cs;
    }
    const storage::ShardEntry* e = set ? FindShard(*set, m->shard_name_) : nullptr;
    if (!cm.sharded() || (e != nullptr && e->local_sequence() == cm.sequence())) {
      m->manifests_.push_back(std::move(cm));
      continue;
    }
    STRATA_LOG(INFO) << "shard " << m->shard_name_ << " of " << dir
                     << ": the local checkpoint of step " << cm.step()
                     << " was prepared but never committed; its space is reclaimed";
    m->removing_.push_back(std::move(cm));
  }
  for (const CheckpointManifest& cm : m->manifests_) {
    for (const TensorRef& r : cm.tensors()) {
      if (r.has_extent()) m->listed_[KeyOf(r)]++;
    }
  }
  // Space that no checkpoint refers to (an interrupted checkpoint, spilled working state) is free.
  // An extent beyond the end of its data file is damage to the checkpoints that list it (Verify
  // and Resume name them), not to the folder.
  ASSIGN_OR_RETURN(std::vector<TensorRef> versions, m->index_->TensorVersions());
  for (const TensorRef& r : versions) {
    auto& next = m->next_version_[{r.layer(), r.expert(), r.kind()}];
    next = std::max(next, r.version());
    if (!m->listed_.count(KeyOf(r))) continue;
    if (!m->ssd_->InFiles(FromRecord(r.extent()).extent)) {
      m->outside_.insert(KeyOf(r));
      continue;
    }
    Status s = m->ssd_->MarkUsed(FromRecord(r.extent()).extent);
    if (!s.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "the checkpoint index in '%s' does not match its data files (%s); nothing was changed",
          dir, s.message()));
    }
  }
  if (!must_exist) RETURN_IF_ERROR(m->Tidy());
  if (options.committer) m->ReclaimIdleShards();
  return m;
}

void CheckpointManager::ReclaimIdleShards() {
  // Shards no process writes now (a job that shrank, a worker job resumed by one process) let go
  // of the local checkpoints no committed set names. The committer opens before any other worker
  // of its job, so a shard in use here is another process's (a worker declared lost but still
  // running): left to it.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.dir + "/shards", ec)) {
    const std::string name = entry.path().filename().string();
    if (name == shard_name_ || name == "." || !ValidateShardName(name).ok()) continue;
    CheckpointOptions o = options_;
    o.shard = name;
    o.committer = false;
    o.start_over = false;
    StatusOr<std::unique_ptr<CheckpointManager>> idle = Open(o, /*must_exist=*/false);
    if (!idle.ok() && !absl::IsUnavailable(idle.status())) {
      STRATA_LOG(WARNING) << "shard " << name << " of " << options_.dir
                          << " was not tidied: " << idle.status().message();
    }
  }
}

Status CheckpointManager::ReopenWritable() {
  index_.reset();
  ASSIGN_OR_RETURN(index_, TensorIndex::Open(shard_dir_ + "/index", false));
  return Tidy();
}

Status CheckpointManager::Tidy() {
  for (const CheckpointManifest& cm : removing_) {
    std::vector<TensorRef> unreferenced;
    for (const TensorRef& r : cm.tensors()) {
      if (r.has_extent() && !listed_.count(KeyOf(r))) unreferenced.push_back(r);
    }
    STRATA_LOG(INFO) << "finishing the removal of the local checkpoint " << cm.step() << " from "
                     << shard_dir_;
    RETURN_IF_ERROR(index_->RemoveCheckpoint(cm.step(), unreferenced));
  }
  removing_.clear();
  return WriteLedger();
}

Status CheckpointManager::WriteLedger(const CheckpointManifest* removing) {
  storage::CheckpointLedger ledger;
  ledger.set_format(1);
  ledger.set_last_sequence(last_sequence_);
  for (const CheckpointManifest& cm : manifests_) {
    storage::LedgerEntry* e = &cm == removing ? ledger.add_removing() : ledger.add_live();
    e->set_step(cm.step());
    e->set_sequence(cm.sequence());
  }
  for (const CheckpointManifest& cm : removing_) {
    storage::LedgerEntry* e = ledger.add_removing();
    e->set_step(cm.step());
    e->set_sequence(cm.sequence());
  }
  Status s = StoreLedger(shard_dir_, ledger);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrFormat("updating the checkpoint ledger of '%s': %s",
                                                  shard_dir_, s.message()));
  }
  return absl::OkStatus();
}

CheckpointManager::~CheckpointManager() {
  cancel_ = true;
  if (writer_.joinable()) writer_.join();
  index_.reset();
  Unlock(shard_lock_fd_);
  Unlock(lock_fd_);
}

std::vector<int64_t> CheckpointManager::Steps() const {
  std::set<int64_t> steps;
  for (const CheckpointSet& cs : sets_) steps.insert(cs.step());
  for (const CheckpointSet& cs : folder_sets_) steps.insert(cs.step());
  for (const CheckpointManifest& cm : manifests_) steps.insert(cm.step());
  return {steps.begin(), steps.end()};
}

Status CheckpointManager::VerifyManifest(const CheckpointManifest& m) const {
  for (const TensorRef& r : m.tensors()) {
    if (!r.has_extent()) continue;
    RETURN_IF_ERROR(ssd_->Verify(FromRecord(r.extent()), Describe(r, m.step(), shard_name_)));
  }
  return absl::OkStatus();
}

Status CheckpointManager::CheckCheckpoint(int64_t step, const CheckpointManifest** local) const {
  *local = nullptr;
  for (const CheckpointManifest& cm : manifests_) {
    if (cm.step() == step) *local = &cm;
  }
  // Resume calls this only for a checkpoint wholly in this shard (or of a folder written before
  // sharding); any other is read through a SetReader.
  for (const CheckpointSet& cs : sets_) {
    if (cs.step() != step) continue;
    if (*local == nullptr) {
      return absl::DataLossError(absl::StrFormat(
          "%s: the shard has no local checkpoint of that step (the global manifest names "
          "sequence %d in '%s'): the shard was deleted or rewritten",
          Where(step, shard_name_), FindShard(cs, shard_name_)->local_sequence(), shard_dir_));
    }
    RETURN_IF_ERROR(MatchesSet(**local, cs, shard_name_));
  }
  if (*local == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("no checkpoint of step %d in '%s'", step, options_.dir));
  }
  return VerifyManifest(**local);
}

void CheckpointManager::ReleaseVersion(const TensorRef& r) {
  const StoredExtent s = FromRecord(r.extent());
  if (outside_.count(KeyOf(r))) {  // never marked used: nothing to give back
    if (!listed_.count(KeyOf(r))) outside_.erase(KeyOf(r));
    return;
  }
  if (tiered_ != nullptr && r.expert() >= 0) {
    tiered_->store().UnrefVersion(
        storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())},
        r.version());
    return;
  }
  if (!listed_.count(KeyOf(r))) ssd_->Free(s.extent);
}

Status CheckpointManager::RemoveLocked(int64_t step) {
  auto it = std::find_if(manifests_.begin(), manifests_.end(),
                         [&](const CheckpointManifest& m) { return m.step() == step; });
  auto set = std::find_if(sets_.begin(), sets_.end(),
                          [&](const CheckpointSet& cs) { return cs.step() == step; });
  auto folder_set = std::find_if(folder_sets_.begin(), folder_sets_.end(),
                                 [&](const CheckpointSet& cs) { return cs.step() == step; });
  if (folder_set != folder_sets_.end()) {
    folder_sets_.erase(folder_set);  // not this process's to remove: only no longer counted
    if (it == manifests_.end() && set == sets_.end()) return absl::OkStatus();
  }
  if (it == manifests_.end() && set == sets_.end()) {
    return absl::NotFoundError(
        absl::StrFormat("no checkpoint of step %d in '%s'", step, options_.dir));
  }
  // The global manifest goes first: from then on the checkpoint does not exist, and a process
  // stopped before the local one goes leaves a local checkpoint no set names, which the next open
  // reclaims.
  if (set != sets_.end() && options_.committer) {
    RETURN_IF_ERROR(RemoveCheckpointSet(options_.dir, step));
    sets_.erase(set);
  }
  if (it == manifests_.end()) return absl::OkStatus();  // the shard had lost it
  return RemoveLocalLocked(it);
}

Status CheckpointManager::RemoveLocalLocked(std::vector<CheckpointManifest>::iterator it) {
  const int64_t step = it->step();
  // The ledger records the removal first: a process killed before the index forgets the
  // checkpoint leaves one that the next open neither lists nor takes for a resurrected one.
  RETURN_IF_ERROR(WriteLedger(&*it));
  std::vector<TensorRef> unreferenced;
  std::vector<TensorRef> stored;
  for (const TensorRef& r : it->tensors()) {
    if (!r.has_extent()) continue;
    stored.push_back(r);
    if (--listed_[KeyOf(r)] == 0) {
      listed_.erase(KeyOf(r));
      unreferenced.push_back(r);
    }
  }
  Status s = index_->RemoveCheckpoint(step, unreferenced);
  if (!s.ok()) {
    for (const TensorRef& r : stored) listed_[KeyOf(r)]++;
    WriteLedger().IgnoreError();  // it is still there: best effort, Tidy finishes it otherwise
    return s;
  }
  for (const TensorRef& r : stored) ReleaseVersion(r);
  manifests_.erase(it);
  return WriteLedger();
}

Status CheckpointManager::CheckCompatible(const config::JobConfig& config) const {
  const uint64_t hash = ConfigHash(config.model());
  auto check = [&](const auto& m) -> Status {
    if (m.config_hash() == hash) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %d in '%s' was written for a different model (%s); resume it with the "
        "model it was trained with, or start a new run in another folder. Nothing was changed",
        m.step(), options_.dir, ConfigDiff(m.model_config(), ModelText(config.model()))));
  };
  for (const CheckpointSet& cs : sets_) RETURN_IF_ERROR(check(cs));
  for (const CheckpointSet& cs : folder_sets_) RETURN_IF_ERROR(check(cs));
  for (const CheckpointManifest& m : manifests_) RETURN_IF_ERROR(check(m));
  return absl::OkStatus();
}

// Reads the parts of a committed set from the shards that hold them: each shard is opened
// read-only when first needed, its local manifest checked against the set.
struct CheckpointManager::SetReader {
  SetReader(const CheckpointOptions& o, CheckpointSet s) : options(o), set(std::move(s)) {}
  struct Shard {
    Status status;
    CheckpointManifest local;
    std::unique_ptr<storage::SsdTier> ssd;
    std::map<std::tuple<int32_t, int32_t, int32_t>, TensorRef> experts;  // layer, expert, kind
    std::map<std::pair<std::string, int32_t>, TensorRef> dense;          // name, kind
  };
  // The shard named `name`, opened (or why it cannot be read).
  Shard& Open(const std::string& name) {
    auto [it, fresh] = shards.try_emplace(name);
    Shard& sh = it->second;
    if (!fresh) return sh;
    const std::string sdir = ShardDir(options.dir, name);
    if (!std::filesystem::is_directory(sdir)) {
      sh.status = absl::NotFoundError(
          absl::StrFormat("%s: the shard's folder '%s' is missing", Where(set.step(), name), sdir));
      return sh;
    }
    StatusOr<std::vector<CheckpointManifest>> list = ReadList(sdir);
    if (!list.ok()) {
      sh.status = Status(list.status().code(),
                         absl::StrCat(Where(set.step(), name), ": ", list.status().message()));
      return sh;
    }
    sh.status = absl::NotFoundError(absl::StrFormat(
        "%s: the shard has no local checkpoint of that step: the shard was deleted or rewritten",
        Where(set.step(), name)));
    for (CheckpointManifest& m : *list) {
      if (m.step() != set.step()) continue;
      sh.status = MatchesSet(m, set, name);
      sh.local = std::move(m);
    }
    if (!sh.status.ok()) return sh;
    StatusOr<std::unique_ptr<storage::SsdTier>> ssd = OpenSsd(options, sdir);
    if (!ssd.ok()) {
      sh.status = ssd.status();
      return sh;
    }
    sh.ssd = *std::move(ssd);
    for (const TensorRef& r : sh.local.tensors()) {
      if (r.expert() >= 0) {
        sh.experts[{r.layer(), r.expert(), r.kind()}] = r;
      } else {
        sh.dense[{r.name(), r.kind()}] = r;
      }
    }
    return sh;
  }
  // The shard holding expert `e` of block `layer` / the dense parameter `name`, and its entry.
  StatusOr<std::pair<Shard*, std::string>> HolderOfExpert(int32_t layer, int64_t e) {
    for (const storage::ShardEntry& se : set.shards()) {
      for (const storage::ExpertRange& r : se.experts()) {
        if (r.layer() == layer && e >= r.first() && e < r.first() + r.count()) {
          return std::make_pair(&Open(se.name()), se.name());
        }
      }
    }
    return absl::DataLossError(absl::StrFormat(
        "checkpoint %d: no shard holds expert %d of block %d", set.step(), e, layer));
  }
  StatusOr<std::pair<Shard*, std::string>> HolderOfDense(const std::string& name) {
    for (const storage::ShardEntry& se : set.shards()) {
      for (const std::string& d : se.dense()) {
        if (d == name) return std::make_pair(&Open(se.name()), se.name());
      }
    }
    return absl::DataLossError(
        absl::StrFormat("checkpoint %d: no shard holds the dense parameter %s", set.step(), name));
  }
  // The stored version of one tensor the set places in `holder`.
  StatusOr<const TensorRef*> Find(const std::pair<Shard*, std::string>& holder, int32_t layer,
                                  int64_t e, const std::string& name, int32_t kind) {
    Shard& sh = *holder.first;
    RETURN_IF_ERROR(sh.status);
    const TensorRef* r = nullptr;
    if (e >= 0) {
      auto it = sh.experts.find({layer, static_cast<int32_t>(e), kind});
      if (it != sh.experts.end()) r = &it->second;
    } else {
      auto it = sh.dense.find({name, kind});
      if (it != sh.dense.end()) r = &it->second;
    }
    if (r == nullptr) {
      return absl::DataLossError(absl::StrFormat(
          "%s: the global manifest places %s (%s) there, but the shard's local checkpoint does "
          "not hold it",
          Where(set.step(), holder.second),
          e >= 0 ? absl::StrFormat("expert %d of block %d", e, layer) : name,
          storage::KindName(static_cast<storage::TensorKind>(kind))));
    }
    return r;
  }
  // The shard holding one tensor of the model (expert e >= 0 of block `layer`, or the dense
  // parameter `name`) and its stored version there.
  struct Located {
    std::pair<Shard*, std::string> holder;
    const TensorRef* ref = nullptr;
  };
  StatusOr<Located> Locate(int32_t layer, int64_t e, const std::string& name, int32_t kind) {
    StatusOr<std::pair<Shard*, std::string>> holder =
        e >= 0 ? HolderOfExpert(layer, e) : HolderOfDense(name);
    RETURN_IF_ERROR(holder.status());
    ASSIGN_OR_RETURN(const TensorRef* r, Find(*holder, layer, e, name, kind));
    return Located{*holder, r};
  }
  // Reads a stored tensor's `bytes` into `dst`, checking its CRC.
  Status Read(const std::pair<Shard*, std::string>& holder, const TensorRef& r, void* dst,
              uint64_t bytes) {
    const std::string what = Describe(r, set.step(), holder.second);
    if (r.extent().bytes() != bytes) {
      return absl::DataLossError(absl::StrFormat("%s has %d bytes where the model needs %d", what,
                                                 r.extent().bytes(), bytes));
    }
    AlignedBuffer buf(bytes);
    RETURN_IF_ERROR(holder.first->ssd->Read(FromRecord(r.extent()), buf.data, what));
    std::memcpy(dst, buf.data, bytes);
    return absl::OkStatus();
  }

  CheckpointOptions options;
  CheckpointSet set;
  std::map<std::string, Shard> shards;
};

namespace {

// Calls `f(layer, expert, name, kind)` for every tensor `model` holds: its dense parameters by
// name (expert -1), and its own experts of every MoE block, each with its three kinds.
template <typename F>
Status ForEachHeldTensor(const model::MoeTransformer& model, F&& f) {
  for (const model::Parameter* p : model.DenseParameters()) {
    for (int32_t kind : {0, 2, 3}) RETURN_IF_ERROR(f(-1, -1, p->name, kind));
  }
  for (const auto& ref : model.moe_layers()) {
    const int64_t first = ref.layer->first_local_expert();
    for (int64_t e = first; e < first + ref.layer->num_local_experts(); ++e) {
      for (int32_t kind : {0, 2, 3}) RETURN_IF_ERROR(f(ref.block, e, std::string(), kind));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Status CheckpointManager::CheckSetParts(SetReader& reader,
                                        const model::MoeTransformer& model) const {
  return ForEachHeldTensor(
      model, [&](int32_t layer, int64_t e, const std::string& name, int32_t kind) -> Status {
        ASSIGN_OR_RETURN(SetReader::Located at, reader.Locate(layer, e, name, kind));
        if (!at.ref->has_extent()) return absl::OkStatus();  // generated: nothing stored
        return at.holder.first->ssd->Verify(FromRecord(at.ref->extent()),
                                            Describe(*at.ref, reader.set.step(), at.holder.second));
      });
}

Status CheckpointManager::ReadSetParts(SetReader& reader, const config::JobConfig& config,
                                       model::MoeTransformer& model, model::AdamW& optimizer,
                                       scheduler::TieredExpertScheduler* tiered) {
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
  std::map<std::string, model::Parameter*> dense;
  for (model::Parameter* p : model.DenseParameters()) dense[p->name] = p;
  auto target = [&](model::Parameter* p, int32_t kind) -> const Tensor& {
    const size_t oi = opt_index.at(p);
    return kind == 0   ? p->value
           : kind == 2 ? optimizer.first_moment(oi)
                       : optimizer.second_moment(oi);
  };
  return ForEachHeldTensor(
      model, [&](int32_t layer, int64_t e, const std::string& name, int32_t kind) -> Status {
        ASSIGN_OR_RETURN(SetReader::Located at, reader.Locate(layer, e, name, kind));
        const auto* holder = &at.holder;
        const TensorRef* r = at.ref;
        if (e < 0) {
          model::Parameter* p = dense.at(name);
          std::vector<float> host(static_cast<size_t>(p->shape.numel()));
          RETURN_IF_ERROR(reader.Read(*holder, *r, host.data(), host.size() * sizeof(float)));
          target(p, kind).CopyFromHost(host.data());
          return absl::OkStatus();
        }
        const storage::TensorKey key{layer, static_cast<int32_t>(e),
                                     static_cast<storage::TensorKind>(kind)};
        if (tiered != nullptr) {
          if (r->generated()) return absl::OkStatus();
          if (holder->second == shard_name_) {
            // This process's own shard is its store's SSD tier: the store takes the extent as
            // it is, the version the checkpoint lists.
            tiered->store().SetStored(key, r->version(), FromRecord(r->extent()));
            return absl::OkStatus();
          }
          // Another shard's: copied into this process's SSD tier under a version of its own
          // (the versions its own checkpoints list are reserved already).
          const uint64_t bytes = tiered->store().tensor_bytes();
          AlignedBuffer buf(bytes);
          RETURN_IF_ERROR(reader.Read(*holder, *r, buf.data, bytes));
          StoredExtent stored;
          std::vector<storage::SsdTier::WriteItem> items{{buf.data, bytes, &stored}};
          RETURN_IF_ERROR(ssd_->WriteMany(items));
          tiered->store().SetStored(key, tiered->store().NextVersion(key), stored);
          return absl::OkStatus();
        }
        model::MoeLayer* moe = nullptr;
        for (const auto& ref : model.moe_layers()) {
          if (ref.block == layer) moe = ref.layer;
        }
        std::vector<model::Parameter*> ps = moe->expert(e).Parameters();
        const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
        std::vector<float> blob(static_cast<size_t>(layout.floats), 0.0f);
        if (r->generated()) {
          if (kind == 0) {
            for (size_t i = 0; i < ps.size(); ++i) {
              model::InitialValues(*ps[i], config.seed(), blob.data() + layout.segments[i].offset);
            }
          }
        } else {
          RETURN_IF_ERROR(reader.Read(*holder, *r, blob.data(), blob.size() * sizeof(float)));
        }
        for (size_t i = 0; i < ps.size(); ++i) {
          target(ps[i], kind).CopyFromHost(blob.data() + layout.segments[i].offset);
        }
        return absl::OkStatus();
      });
}

StatusOr<int64_t> CheckpointManager::Resume(const config::JobConfig& config,
                                            model::MoeTransformer& model, model::AdamW& optimizer,
                                            scheduler::TieredExpertScheduler* tiered,
                                            ops::Context& ctx, const ResumeAgreement& agree) {
  (void)ctx;
  FinishSnapshot();  // what is read in below must not be copied out at the same time
  const std::vector<int64_t> steps = Steps();
  if (steps.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "checkpoint folder '%s' holds no checkpoint to resume from; drop --resume to start "
        "afresh",
        options_.dir));
  }
  RETURN_IF_ERROR(CheckCompatible(config));
  bool holds_every_expert = true;
  for (const auto& ref : model.moe_layers()) {
    holds_every_expert &= ref.layer->num_local_experts() == ref.layer->num_experts();
  }
  // Newest first; nothing is changed until one passes every check. A checkpoint wholly in this
  // shard is read from it (a TIERED store takes its extents as they are); any other is read from
  // the shards that hold what this model needs.
  const CheckpointManifest* chosen = nullptr;
  std::unique_ptr<SetReader> reader;
  int64_t chosen_step = -1;
  std::vector<int64_t> invalid;
  Status first_error;
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    const CheckpointSet* set = nullptr;
    for (const CheckpointSet& cs : folder_sets_) {
      if (cs.step() == *step) set = &cs;
    }
    for (const CheckpointSet& cs : sets_) {
      if (cs.step() == *step) set = &cs;
    }
    Status s;
    // A checkpoint wholly in this shard is read from it as it stands only by a model that holds
    // all of it (a worker's shard may hold a checkpoint of a job it trained alone).
    if (set == nullptr ||
        (set->shards_size() == 1 && set->shards(0).name() == shard_name_ && holds_every_expert)) {
      s = CheckCheckpoint(*step, &chosen);
    } else {
      reader = std::make_unique<SetReader>(options_, *set);
      s = CheckSetParts(*reader, model);
    }
    bool ok = s.ok();
    if (agree) {
      ASSIGN_OR_RETURN(ok, agree(ok));
    }
    if (ok) {
      chosen_step = *step;
      break;
    }
    chosen = nullptr;
    reader.reset();
    if (s.ok()) {
      s = absl::DataLossError(absl::StrFormat(
          "another worker could not read its part of it (its log says which; `strata ckpt verify "
          "%s %d` checks every part)",
          options_.dir, *step));
    }
    STRATA_LOG(ERROR) << "checkpoint " << *step << " cannot be used: " << s.message();
    if (first_error.ok()) first_error = s;
    invalid.push_back(*step);
  }
  if (chosen_step < 0) {
    return absl::DataLossError(
        absl::StrFormat("no checkpoint in '%s' passes its checks; the newest failed with: %s",
                        options_.dir, first_error.message()));
  }
  // Older checkpoints with extents beyond the end of their data file go too: that space was never
  // marked used, so new data would overwrite what they list.
  for (const CheckpointManifest& older : manifests_) {
    if (older.step() >= chosen_step) break;
    for (const TensorRef& r : older.tensors()) {
      if (!r.has_extent() || !outside_.count(KeyOf(r))) continue;
      Status s = ssd_->Verify(FromRecord(r.extent()), Describe(r, older.step(), shard_name_));
      STRATA_LOG(ERROR) << "checkpoint " << older.step()
                        << " cannot be used either: " << s.message();
      invalid.push_back(older.step());
      break;
    }
  }
  // Version numbers stay reserved past every checkpoint of this shard, removed ones included (the
  // store holds no checkpoint versions yet; an expert read from another shard takes a new one).
  if (tiered != nullptr) {
    for (const CheckpointManifest& cm : manifests_) {
      for (const TensorRef& r : cm.tensors()) {
        if (r.expert() < 0) continue;
        tiered->store().ReserveVersions(
            storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())},
            r.version());
      }
    }
  }
  if (reader) {
    const CheckpointSet& set = reader->set;
    if (set.seed() != config.seed()) {
      STRATA_LOG(WARNING) << "resuming with seed " << config.seed() << " but checkpoint "
                          << set.step() << " was trained with seed " << set.seed()
                          << ": data order and gate noise will not continue the original run";
    }
    RETURN_IF_ERROR(ReadSetParts(*reader, config, model, optimizer, tiered));
    optimizer.set_steps(set.optimizer_steps());
  } else {
    const CheckpointManifest m = *chosen;
    if (m.seed() != config.seed()) {
      STRATA_LOG(WARNING) << "resuming with seed " << config.seed() << " but checkpoint "
                          << m.step() << " was trained with seed " << m.seed()
                          << ": data order and gate noise will not continue the original run";
    }

    // Dense parameters and their moments.
    const std::vector<model::Parameter*>& dense = model.DenseParameters();
    std::map<const model::Parameter*, size_t> opt_index;
    for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
    auto read_into = [&](const TensorRef& r, float* dst, uint64_t bytes) -> Status {
      if (r.extent().bytes() != bytes) {
        return absl::DataLossError(absl::StrFormat("%s has %d bytes where the model needs %d",
                                                   Describe(r, m.step(), shard_name_),
                                                   r.extent().bytes(), bytes));
      }
      AlignedBuffer buf(bytes);
      RETURN_IF_ERROR(
          ssd_->Read(FromRecord(r.extent()), buf.data, Describe(r, m.step(), shard_name_)));
      std::memcpy(dst, buf.data, bytes);
      return absl::OkStatus();
    };
    for (const TensorRef& r : m.tensors()) {
      if (r.expert() >= 0) continue;
      if (r.layer() < 0 || r.layer() >= static_cast<int>(dense.size()) ||
          dense[r.layer()]->name != r.name()) {
        return absl::DataLossError(
            absl::StrFormat("%s does not match the model's dense parameter %d",
                            Describe(r, m.step(), shard_name_), r.layer()));
      }
      model::Parameter* p = dense[r.layer()];
      const uint64_t bytes = static_cast<uint64_t>(p->shape.numel()) * sizeof(float);
      const size_t oi = opt_index.at(p);
      const Tensor& dst = r.kind() == 0   ? p->value
                          : r.kind() == 2 ? optimizer.first_moment(oi)
                                          : optimizer.second_moment(oi);
      if (dst.device().is_cpu()) {
        RETURN_IF_ERROR(read_into(r, dst.f32(), bytes));
      } else {  // a model on a GPU: through host memory
        std::vector<float> host(static_cast<size_t>(p->shape.numel()));
        RETURN_IF_ERROR(read_into(r, host.data(), bytes));
        dst.CopyFromHost(host.data());
      }
    }
    // Experts.
    for (const TensorRef& r : m.tensors()) {
      if (r.expert() < 0) continue;
      const storage::TensorKey key{r.layer(), r.expert(),
                                   static_cast<storage::TensorKind>(r.kind())};
      if (tiered != nullptr) {
        if (!r.generated()) tiered->store().SetStored(key, r.version(), FromRecord(r.extent()));
        continue;
      }
      // In memory: scatter the blob into the expert's parameters or their moments.
      model::MoeLayer* layer = nullptr;
      for (const auto& ref : model.moe_layers()) {
        if (ref.block == r.layer()) layer = ref.layer;
      }
      if (layer == nullptr || r.expert() < layer->first_local_expert() ||
          r.expert() >= layer->first_local_expert() + layer->num_local_experts()) {
        return absl::DataLossError(
            absl::StrFormat("%s has no place in the model", Describe(r, m.step(), shard_name_)));
      }
      // The blob has the tiered store's layout (model::ExpertLayout), whichever mode wrote it.
      std::vector<model::Parameter*> ps = layer->expert(r.expert()).Parameters();
      const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
      const uint64_t floats = static_cast<uint64_t>(layout.floats);
      std::vector<float> blob(floats, 0.0f);
      if (r.generated()) {
        if (r.kind() == 0) {
          for (size_t i = 0; i < ps.size(); ++i) {
            model::InitialValues(*ps[i], config.seed(), blob.data() + layout.segments[i].offset);
          }
        }
      } else {
        RETURN_IF_ERROR(read_into(r, blob.data(), floats * sizeof(float)));
      }
      for (size_t i = 0; i < ps.size(); ++i) {
        const size_t oi = opt_index.at(ps[i]);
        const Tensor& dst = r.kind() == 0   ? ps[i]->value
                            : r.kind() == 2 ? optimizer.first_moment(oi)
                                            : optimizer.second_moment(oi);
        dst.CopyFromHost(blob.data() + layout.segments[i].offset);
      }
    }
    optimizer.set_steps(m.optimizer_steps());
  }

  // Only now is anything changed. The index is reopened for writing and the invalid checkpoints
  // go, giving back the space only they used (the store holds no checkpoint versions yet); then
  // the store learns which versions the kept checkpoints use. Version numbers stay reserved past
  // every checkpoint read, removed ones included.
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(ReopenWritable());
  for (int64_t step : invalid) {
    STRATA_LOG(WARNING) << "removing checkpoint " << step << " (it failed its checks)";
    RETURN_IF_ERROR(RemoveLocked(step));
  }
  tiered_ = tiered;
  if (tiered != nullptr) {
    for (const CheckpointManifest& cm : manifests_) {
      for (const TensorRef& r : cm.tensors()) {
        if (r.expert() < 0 || !r.has_extent()) continue;
        tiered->store().RefVersion(
            storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())},
            r.version(), FromRecord(r.extent()));
      }
    }
  }
  STRATA_LOG(INFO) << "resumed from checkpoint " << chosen_step << " in " << options_.dir;
  return chosen_step;
}

void CheckpointManager::RebindStore(scheduler::TieredExpertScheduler* tiered) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tiered_ != nullptr) tiered_ = tiered;
}

void CheckpointManager::AdoptStore(scheduler::TieredExpertScheduler* tiered) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const CheckpointManifest& cm : manifests_) {
    for (const TensorRef& r : cm.tensors()) {
      if (r.expert() < 0) continue;
      const storage::TensorKey key{r.layer(), r.expert(),
                                   static_cast<storage::TensorKind>(r.kind())};
      tiered->store().ReserveVersions(key, r.version());
      // An extent outside the data files was never marked used: nothing to hold or give back.
      if (r.has_extent() && !outside_.count(KeyOf(r))) {
        tiered->store().RefVersion(key, r.version(), FromRecord(r.extent()));
      }
    }
  }
  tiered_ = tiered;
}

Status CheckpointManager::Save(int64_t step, const config::JobConfig& config,
                               model::MoeTransformer& model, model::AdamW& optimizer,
                               scheduler::TieredExpertScheduler* tiered, ops::Context& ctx,
                               const CheckpointShare& share) {
  RETURN_IF_ERROR(Wait());
  // The store holding this shard's checkpoint versions may have been handed to another scheduler
  // (a re-form): the removals below give versions back through the one that holds it now.
  if (tiered_ != nullptr && tiered != nullptr) tiered_ = tiered;
  // The writer is done with the last checkpoint's buffers: this one takes them again.
  if (!arena_) arena_ = std::make_unique<SnapshotArena>();
  arena_->Reset();
  if (!options_.committer) RETURN_IF_ERROR(ReclaimUnnamed(/*every=*/false));
  RETURN_IF_ERROR(ReplaceFrom(step));
  // The experts' update of the last step runs behind the caller: snapshot what it wrote.
  if (tiered) RETURN_IF_ERROR(tiered->FinishExpertStep());
  TraceScope span(ctx.tracer, "checkpoint save", "checkpoint", static_cast<int>(step));
  tiered_ = tiered;
  auto p = std::make_shared<Pending>();
  p->tracer = ctx.tracer;
  CheckpointManifest& m = p->manifest;
  m.set_step(step);
  m.set_created_unix_ms(NowMs());
  m.set_config_hash(ConfigHash(config.model()));
  m.set_model_config(ModelText(config.model()));
  m.set_seed(config.seed());
  m.set_optimizer_steps(optimizer.steps());
  m.set_storage_mode(tiered ? "TIERED" : "IN_MEMORY");
  m.set_workers(share.workers);
  m.set_sharded(true);
  // The global manifest: the same header, and where each part lies (one shard: this one).
  CheckpointSet& set = p->set;
  set.set_step(step);
  set.set_config_hash(m.config_hash());
  set.set_model_config(m.model_config());
  set.set_seed(m.seed());
  set.set_optimizer_steps(m.optimizer_steps());
  set.set_storage_mode(m.storage_mode());
  set.set_workers(share.workers);
  storage::ShardEntry* entry = set.add_shards();
  entry->set_name(shard_name_);
  for (const std::string& shard : share.shards) {
    if (shard != shard_name_) p->other_shards.push_back(shard);
  }
  auto writes_dense = [&](const std::string& name) {
    return !share.dense || share.dense->count(name) > 0;
  };
  for (const auto& ref : model.moe_layers()) {
    if (!share.experts || ref.layer->num_local_experts() == 0) continue;
    storage::ExpertRange* range = entry->add_experts();
    range->set_layer(ref.block);
    range->set_first(static_cast<int32_t>(ref.layer->first_local_expert()));
    range->set_count(static_cast<int32_t>(ref.layer->num_local_experts()));
  }
  std::vector<std::string> dense_names;
  for (const model::Parameter* prm : model.DenseParameters()) dense_names.push_back(prm->name);
  for (const std::string& name : dense_names) {
    if (writes_dense(name)) entry->add_dense(name);
  }
  p->layout = CheckpointSetLayoutOf(config.model(), dense_names);
  {
    std::lock_guard<std::mutex> lock(mu_);
    m.set_sequence(++last_sequence_);
    if (!manifests_.empty()) {
      m.set_previous_step(manifests_.back().step());
      m.set_previous_sequence(manifests_.back().sequence());
    }
  }

  auto next_version = [&](int32_t layer, int32_t expert, int32_t kind) {
    return ++next_version_[{layer, expert, kind}];
  };
  // `fill` writes the tensor's bytes into the copy's buffer: now when `sources` include a tensor
  // off the host (a device copy is ordered on the caller's stream), else on the writer thread
  // while the next step's forward and backward run (they only read these tensors).
  auto add_copy = [&](TensorRef ref, uint64_t bytes, const std::vector<Tensor>& sources,
                      std::function<void(void*)> fill) {
    Pending::Copy c;
    c.ref = std::move(ref);
    c.buffer = arena_->Take(bytes);
    c.bytes = bytes;
    const bool on_host = std::all_of(sources.begin(), sources.end(),
                                     [](const Tensor& t) { return t.device().is_cpu(); });
    if (on_host) {
      c.fill = std::move(fill);
    } else {
      fill(c.buffer);
    }
    p->copies.push_back(std::move(c));
  };
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;

  // Dense parameters with their moments: small, always copied.
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  for (size_t i = 0; i < dense.size(); ++i) {
    model::Parameter* prm = dense[i];
    if (!writes_dense(prm->name)) continue;
    const size_t oi = opt_index.at(prm);
    const uint64_t bytes = static_cast<uint64_t>(prm->shape.numel()) * sizeof(float);
    for (int kind : {0, 2, 3}) {
      TensorRef r;
      r.set_layer(static_cast<int32_t>(i));
      r.set_expert(-1);
      r.set_kind(kind);
      r.set_name(prm->name);
      r.set_version(next_version(r.layer(), -1, kind));
      const Tensor src = kind == 0   ? prm->value
                         : kind == 2 ? optimizer.first_moment(oi)
                                     : optimizer.second_moment(oi);
      add_copy(std::move(r), bytes, {src}, [src](void* dst) { src.CopyToHost(dst); });
    }
  }

  // Experts: one blob per expert and kind.
  for (const auto& ref : model.moe_layers()) {
    if (!share.experts) break;
    const int first = static_cast<int>(ref.layer->first_local_expert());
    for (int e = first; e < first + ref.layer->num_local_experts(); ++e) {
      for (int kind : {0, 2, 3}) {
        TensorRef r;
        r.set_layer(ref.block);
        r.set_expert(e);
        r.set_kind(kind);
        if (tiered != nullptr) {
          const storage::TensorKey key{ref.block, e, static_cast<storage::TensorKind>(kind)};
          const uint64_t bytes = tiered->store().tensor_bytes();
          char* buf = arena_->Take(bytes);
          storage::TieredExpertStore::Snapshot snap;
          RETURN_IF_ERROR(
              tiered->store().SnapshotTensor(key, reinterpret_cast<float*>(buf), &snap));
          if (snap.generated) {
            r.set_generated(true);
            p->refs.push_back(std::move(r));
            arena_->ReturnLast();
          } else if (snap.has_stored) {
            r.set_version(snap.version);
            ToRecord(snap.stored, r.mutable_extent());
            p->refs.push_back(std::move(r));
            arena_->ReturnLast();
          } else {
            r.set_version(tiered->store().NextVersion(key));
            Pending::Copy c;
            c.ref = std::move(r);
            c.buffer = buf;
            c.bytes = bytes;
            c.tiered = true;
            c.generation = snap.generation;
            p->copies.push_back(std::move(c));
          }
          continue;
        }
        std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
        const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
        const uint64_t bytes = static_cast<uint64_t>(layout.floats) * sizeof(float);
        r.set_version(next_version(ref.block, e, kind));
        // Straight into the snapshot buffer, segment by segment.
        std::vector<Tensor> srcs;
        std::vector<int64_t> offsets;
        for (size_t i = 0; i < ps.size(); ++i) {
          const size_t oi = opt_index.at(ps[i]);
          srcs.push_back(kind == 0   ? ps[i]->value
                         : kind == 2 ? optimizer.first_moment(oi)
                                     : optimizer.second_moment(oi));
          offsets.push_back(static_cast<int64_t>(layout.segments[i].offset));
        }
        add_copy(std::move(r), bytes, srcs, [srcs, offsets](void* dst) {
          for (size_t i = 0; i < srcs.size(); ++i) {
            srcs[i].CopyToHost(static_cast<float*>(dst) + offsets[i]);
          }
        });
      }
    }
  }
  const bool deferred = std::any_of(p->copies.begin(), p->copies.end(),
                                    [](const Pending::Copy& c) { return c.fill != nullptr; });
  {
    std::lock_guard<std::mutex> lock(snapshot_mu_);
    snapshot_done_ = !deferred;
  }
  std::lock_guard<std::mutex> lock(mu_);
  writer_done_ = false;
  writer_status_ = absl::OkStatus();
  if (writer_.joinable()) writer_.join();
  writer_ = std::thread([this, p] { Persist(p); });
  return absl::OkStatus();
}

void CheckpointManager::Reserve(const model::MoeTransformer& model, const CheckpointShare& share,
                                bool tiered) {
  if (writer_.joinable()) return;  // a checkpoint was saved already: its buffers are there
  // The host copies a checkpoint of this share takes (Save's order does not matter for the
  // total): the dense share, and IN_MEMORY experts; a TIERED store's copies are bounded by its
  // budgets and mostly not needed (clean tensors are referenced).
  std::vector<uint64_t> sizes;
  for (const model::Parameter* prm : model.DenseParameters()) {
    if (share.dense && !share.dense->count(prm->name)) continue;
    const bool on_host = prm->value.device().is_cpu();
    for (int k = 0; k < 3 && on_host; ++k) sizes.push_back(prm->value.bytes());
  }
  for (const auto& ref : model.moe_layers()) {
    if (tiered || !share.experts) break;
    const int first = static_cast<int>(ref.layer->first_local_expert());
    for (int e = first; e < first + ref.layer->num_local_experts(); ++e) {
      const model::ExpertLayout layout = model::ExpertLayout::Of(ref.layer->expert(e).Parameters());
      for (int k = 0; k < 3; ++k) sizes.push_back(static_cast<uint64_t>(layout.floats) * 4);
    }
  }
  if (!arena_) arena_ = std::make_unique<SnapshotArena>();
  // The writer touches them while training starts; the first Save waits for it (Wait).
  writer_ = std::thread([this, sizes = std::move(sizes)] {
    arena_->Reset();
    for (uint64_t bytes : sizes) std::memset(arena_->Take(bytes), 0, bytes);
    arena_->Reset();
  });
}

void CheckpointManager::FinishSnapshot(Tracer* tracer) {
  std::unique_lock<std::mutex> lock(snapshot_mu_);
  if (snapshot_done_) return;
  TraceScope span(tracer, "checkpoint fence", "checkpoint");
  snapshot_cv_.wait(lock, [this] { return snapshot_done_; });
}

void CheckpointManager::TakeSnapshot(Pending& p) {
  const double started = NowSeconds();
  for (Pending::Copy& c : p.copies) {
    if (c.fill == nullptr) continue;
    c.fill(c.buffer);
    c.fill = nullptr;  // drops its tensors: the model's buffers are the trainer's again
  }
  if (p.tracer != nullptr) {
    p.tracer->SpanOn("checkpoint writer",
                     absl::StrFormat("checkpoint snapshot %d", p.manifest.step()), "checkpoint",
                     started, NowSeconds());
  }
  std::lock_guard<std::mutex> lock(snapshot_mu_);
  snapshot_done_ = true;
  snapshot_cv_.notify_all();
}

Status CheckpointManager::ReplaceFrom(int64_t step) {
  std::vector<int64_t> later;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const int64_t s : Steps()) {
      if (s >= step) later.push_back(s);
    }
  }
  if (later.empty()) return absl::OkStatus();
  if (!options_.committer) {
    // The global manifest goes first, and only the committer removes it: a part that a committed
    // set still names stays until the committer (saving the same step) has removed that set.
    const auto deadline = std::chrono::steady_clock::now() + options_.commit_timeout;
    for (;;) {
      ASSIGN_OR_RETURN(std::vector<CheckpointSet> sets, ListCheckpointSets(options_.dir));
      std::vector<int64_t> named;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const CheckpointSet& cs : sets) {
          const storage::ShardEntry* e = FindShard(cs, shard_name_);
          if (cs.step() < step || e == nullptr) continue;
          for (const CheckpointManifest& cm : manifests_) {
            if (cm.step() == cs.step() && cm.sequence() == e->local_sequence()) {
              named.push_back(cs.step());
            }
          }
        }
        sets_ = std::move(sets);
      }
      if (named.empty()) break;
      if (cancel_ || (options_.abandoned && options_.abandoned->load())) {
        return absl::AbortedError(absl::StrFormat(
            "checkpoint %d in '%s' is to be saved again, but the job stopped while its committed "
            "set was still to be removed",
            named.front(), options_.dir));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "checkpoint%s %s in '%s' must be saved again, and the committer (rank 0) did not "
            "remove the committed set%s within %d ms, so shard %s keeps its part%s (see rank 0's "
            "log)",
            named.size() == 1 ? "" : "s", absl::StrJoin(named, ", "), options_.dir,
            named.size() == 1 ? "" : "s", options_.commit_timeout.count(), shard_name_,
            named.size() == 1 ? "" : "s"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  for (auto it = later.rbegin(); it != later.rend(); ++it) {
    STRATA_LOG(WARNING) << absl::StrFormat(
        "checkpoint %d in '%s' (shard %s) is removed: training went back to step %d, and saves "
        "its checkpoints again from there",
        *it, options_.dir, shard_name_, step);
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(RemoveLocked(*it));
  }
  return absl::OkStatus();
}

int64_t CheckpointManager::NewestCommitted() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<int64_t> steps = Steps();
  return steps.empty() ? 0 : steps.back();
}

void CheckpointManager::Persist(std::shared_ptr<Pending> p) {
  TakeSnapshot(*p);
  CheckpointManifest& m = p->manifest;
  const double started = NowSeconds();
  std::vector<storage::SsdTier::WriteItem> items;
  for (auto& c : p->copies) items.push_back({c.buffer, c.bytes, &c.stored});
  // Extents, then fdatasync (also of working state spilled earlier, which this checkpoint may
  // list), then the index.
  Status s = ssd_->WriteMany(items);
  const bool written = s.ok();
  if (s.ok()) s = ssd_->Sync();
  if (s.ok()) {
    STRATA_LOG(INFO) << "checkpoint " << m.step() << ": " << p->copies.size()
                     << " tensors written and synced; committing";
  }
  // Tests and drills hold a checkpoint here (sleep_ms), so that a kill lands between its extents
  // and its commit. The step travels as an int64_t.
  [[maybe_unused]] int64_t step = m.step();
  if (s.ok()) STRATA_FAULT_POINT("checkpoint.before_commit", &step);
  std::vector<TensorRef> new_versions;
  for (auto& c : p->copies) {
    ToRecord(c.stored, c.ref.mutable_extent());
    *m.add_tensors() = c.ref;
    new_versions.push_back(c.ref);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const TensorRef& r : p->refs) {
      *m.add_tensors() = r;
      if (r.has_extent() && !listed_.count(KeyOf(r))) new_versions.push_back(r);
    }
  }
  if (s.ok()) s = index_->CommitCheckpoint(m, new_versions);
  // The shard is prepared; the global manifest makes the checkpoint exist. A process stopped here
  // leaves a local checkpoint that no set names, reclaimed when the shard is next opened.
  if (s.ok()) {
    STRATA_FAULT_POINT("checkpoint.before_set_commit", &step);
    storage::ShardEntry* entry = p->set.mutable_shards(0);
    entry->set_local_sequence(m.sequence());
    entry->set_local_manifest_crc32c(ManifestCrc(m));
    if (!options_.committer) {
      s = ReportPrepared(*p);
    } else {
      s = CollectPrepared(*p);
      if (s.ok()) {
        StatusOr<CheckpointSet> committed = CommitCheckpointSet(options_.dir, p->layout, p->set);
        if (committed.ok()) {
          p->set = *std::move(committed);
        } else {
          s = committed.status();
        }
      }
      // The reports are in the set now (or of a checkpoint that failed).
      std::error_code ec;
      std::filesystem::remove_all(PreparedDir(options_.dir, options_.generation, m.step()), ec);
    }
    if (!s.ok()) {
      Status undo = index_->RemoveCheckpoint(m.step(), new_versions);
      if (!undo.ok()) {
        // Recorded as being removed in every later ledger, so that the next open finishes it
        // rather than taking it for a removed checkpoint come back.
        STRATA_LOG(WARNING) << "the local checkpoint " << m.step() << " in " << shard_dir_
                            << " stays until the shard is next opened: " << undo.message();
        removing_.push_back(m);
      }
    }
  }
  if (p->tracer != nullptr) {
    p->tracer->SpanOn("checkpoint writer", absl::StrFormat("checkpoint persist %d", m.step()),
                      "checkpoint", started, NowSeconds());
  }
  if (!s.ok()) {
    // Nothing was committed: give back what this checkpoint held.
    if (written) {
      for (auto& c : p->copies) ssd_->Free(c.stored.extent);
    }
    if (tiered_ != nullptr) {
      for (const TensorRef& r : p->refs) {
        if (!r.has_extent()) continue;
        tiered_->store().UnrefVersion(
            storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())},
            r.version());
      }
    }
    STRATA_LOG(ERROR) << "checkpoint " << m.step() << " failed: " << s.message();
    if (!options_.committer) {
      // The committer stops waiting for this shard at once, and says why.
      storage::Env* env = storage::Env::Default();
      const std::string folder = PreparedDir(options_.dir, options_.generation, m.step());
      Status told = env->CreateDirs(folder);
      if (told.ok()) {
        told =
            env->WriteFileAtomic(folder + "/" + shard_name_ + ".failed", std::string(s.message()));
      }
      if (!told.ok()) STRATA_LOG(WARNING) << "could not tell the committer: " << told.message();
    }
    std::lock_guard<std::mutex> lock(mu_);
    writer_status_ = absl::Status(
        s.code(), absl::StrFormat("checkpoint of step %d in '%s' failed: %s; the previous "
                                  "checkpoints are intact",
                                  m.step(), options_.dir, s.message()));
    writer_done_ = true;
    return;
  }
  // Committed. Copied expert tensors: the checkpoint holds a reference, and the tensor adopts the
  // version as its SSD copy if it has not changed since the snapshot.
  if (tiered_ != nullptr) {
    for (auto& c : p->copies) {
      if (!c.tiered) continue;
      const storage::TensorKey key{c.ref.layer(), c.ref.expert(),
                                   static_cast<storage::TensorKind>(c.ref.kind())};
      tiered_->store().RefVersion(key, c.ref.version(), c.stored);
      tiered_->store().AdoptVersion(key, c.generation, c.ref.version(), c.stored);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const TensorRef& r : m.tensors()) {
    if (r.has_extent()) listed_[KeyOf(r)]++;
  }
  manifests_.push_back(m);
  if (!options_.committer) {
    // Prepared and reported: the committer makes it exist once every shard has reported.
    STRATA_LOG(INFO) << "checkpoint " << m.step() << ": shard " << shard_name_ << " prepared in "
                     << options_.dir << " (" << p->copies.size() << " tensors written)";
    writer_status_ = WriteLedger();
    writer_done_ = true;
    return;
  }
  sets_.push_back(p->set);
  STRATA_LOG(INFO) << "checkpoint " << m.step() << " committed in " << options_.dir << " ("
                   << p->copies.size() << " tensors written"
                   << (p->other_shards.empty()
                           ? ""
                           : absl::StrFormat(", %d shards", p->set.shards_size()))
                   << ")";
  // The checkpoint exists; should the ledger not learn of it, the next open still accepts it (it
  // follows the ledger's newest), but nothing may be committed or removed after it.
  Status prune = WriteLedger();
  if (!prune.ok()) {
    prune = absl::Status(
        prune.code(),
        absl::StrFormat("checkpoint of step %d was committed, but %s", m.step(), prune.message()));
  }
  for (std::vector<int64_t> steps = Steps();
       prune.ok() && steps.size() > std::max<uint32_t>(1, options_.keep); steps = Steps()) {
    prune = RemoveLocked(steps.front());
  }
  writer_status_ = prune;
  writer_done_ = true;
  // Tests and drills stop the writer for good here (hold_at_step), still holding mu_, so that a
  // kill lands after this checkpoint and before any later one however fast training runs.
  STRATA_FAULT_POINT("checkpoint.after_commit", &step);
}

Status CheckpointManager::ReportPrepared(const Pending& p) {
  storage::Env* env = storage::Env::Default();
  const std::string folder = PreparedDir(options_.dir, options_.generation, p.manifest.step());
  RETURN_IF_ERROR(env->CreateDirs(folder));
  return env->WriteFileAtomic(folder + "/" + shard_name_, p.set.shards(0).SerializeAsString());
}

Status CheckpointManager::CollectPrepared(Pending& p) {
  storage::Env* env = storage::Env::Default();
  const std::string folder = PreparedDir(options_.dir, options_.generation, p.manifest.step());
  const auto deadline = std::chrono::steady_clock::now() + options_.commit_timeout;
  std::vector<std::string> waiting = p.other_shards;
  while (!waiting.empty()) {
    std::vector<std::string> still;
    for (const std::string& shard : waiting) {
      const std::string path = folder + "/" + shard;
      if (env->FileExists(path + ".failed")) {
        StatusOr<std::string> why = env->ReadFile(path + ".failed");
        return absl::AbortedError(
            absl::StrFormat("shard %s could not write its part: %s", shard,
                            why.ok() ? *why : std::string("(its report cannot be read)")));
      }
      if (!env->FileExists(path)) {
        still.push_back(shard);
        continue;
      }
      ASSIGN_OR_RETURN(std::string bytes, env->ReadFile(path));
      storage::ShardEntry entry;
      if (!entry.ParseFromString(bytes) || entry.name() != shard) {
        return absl::DataLossError(absl::StrFormat(
            "the prepared report '%s' is damaged (it does not parse as shard %s's entry)", path,
            shard));
      }
      *p.set.add_shards() = std::move(entry);
    }
    waiting = std::move(still);
    if (waiting.empty()) break;
    if (cancel_ || (options_.abandoned && options_.abandoned->load())) {
      return absl::AbortedError("the checkpoint was abandoned while waiting for the other shards");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "shard%s %s did not report prepared within %d ms in '%s' (a worker stopped, or cannot "
          "write its shard or that folder; see its log)",
          waiting.size() == 1 ? "" : "s", absl::StrJoin(waiting, ", "),
          options_.commit_timeout.count(), folder));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return absl::OkStatus();
}

Status CheckpointManager::ReclaimUnnamed(bool every) {
  ASSIGN_OR_RETURN(std::vector<CheckpointSet> sets, ListCheckpointSets(options_.dir));
  std::lock_guard<std::mutex> lock(mu_);
  sets_ = std::move(sets);
  if (sets_.empty() && !every) return absl::OkStatus();
  const int64_t below = every ? std::numeric_limits<int64_t>::max() : sets_.back().step();
  std::vector<int64_t> unnamed;
  for (const CheckpointManifest& cm : manifests_) {
    if (!cm.sharded() || cm.step() >= below) continue;
    const storage::ShardEntry* e = nullptr;
    for (const CheckpointSet& cs : sets_) {
      if (cs.step() == cm.step()) e = FindShard(cs, shard_name_);
    }
    if (e == nullptr || e->local_sequence() != cm.sequence()) unnamed.push_back(cm.step());
  }
  // Only the local part: a set of that step naming another sequence is not this shard's to drop.
  for (int64_t step : unnamed) {
    auto it = std::find_if(manifests_.begin(), manifests_.end(),
                           [&](const CheckpointManifest& m) { return m.step() == step; });
    STRATA_LOG(INFO) << "shard " << shard_name_ << " of " << options_.dir
                     << ": no committed set names its local checkpoint of step " << step
                     << "; its space is reclaimed";
    RETURN_IF_ERROR(RemoveLocalLocked(it));
  }
  return absl::OkStatus();
}

Status CheckpointManager::Continue(int64_t generation, bool committer,
                                   std::shared_ptr<std::atomic<bool>> abandoned,
                                   scheduler::TieredExpertScheduler* tiered) {
  if (shard_name_ == ".") {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the checkpoint folder '%s' was written before sharding, and its one shard is the folder "
        "itself, held with the committer's lock: a new generation cannot keep it; close this "
        "checkpoint manager and open the folder again",
        options_.dir));
  }
  // The previous generation's checkpoint in flight ends here, so that no writer work crosses
  // generations: a committer waiting for reports gives up (the workers may be gone), a persist's
  // own writes finish. Its failure is the old generation's: the new one saves again.
  cancel_ = true;
  Status in_flight = Wait();
  cancel_ = false;
  if (!in_flight.ok()) {
    STRATA_LOG(WARNING) << "generation " << generation << " continues without the checkpoint "
                        << "the previous generation left in flight: " << in_flight.message();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    writer_status_ = absl::OkStatus();
    writer_done_ = true;
  }
  // A store that holds this shard's checkpoint versions is reached through its scheduler of now:
  // a re-form may have handed it to another one.
  if (tiered_ != nullptr) {
    if (tiered == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shard %s of '%s' continues without the TIERED scheduler whose store holds its "
          "checkpoints' versions; pass the scheduler that holds that store now",
          shard_name_, options_.dir));
    }
    tiered_ = tiered;
  }
  if (committer && lock_fd_ < 0) {
    ASSIGN_OR_RETURN(lock_fd_, LockFolder(options_.dir + "/LOCK", options_.dir));
  } else if (!committer && lock_fd_ >= 0) {
    Unlock(std::exchange(lock_fd_, -1));
  }
  options_.committer = committer;
  options_.generation = generation;
  options_.abandoned = std::move(abandoned);
  // The reports of older generations are of checkpoints that can no longer commit; this
  // generation's workers may already be reporting theirs.
  if (committer) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(PreparedRoot(options_.dir), ec)) {
      int64_t g = 0;
      if (!absl::SimpleAtoi(entry.path().filename().string(), &g) || g >= generation) continue;
      std::error_code removed;
      std::filesystem::remove_all(entry.path(), removed);
      if (removed) {
        return absl::PermissionDeniedError(
            absl::StrFormat("cannot clear '%s' of generation %d's prepared reports: %s",
                            entry.path().string(), g, removed.message()));
      }
    }
  }
  // The old committer committed (or not) just before it stopped: what this shard prepared for a
  // set that never committed goes, releasing only what no checkpoint and no live tensor uses.
  return ReclaimUnnamed(/*every=*/true);
}

std::vector<std::set<std::string>> DealDenseParameters(const model::MoeTransformer& model,
                                                       int shards) {
  std::vector<std::set<std::string>> out(static_cast<size_t>(std::max(1, shards)));
  std::vector<const model::Parameter*> dense(model.DenseParameters().begin(),
                                             model.DenseParameters().end());
  std::stable_sort(dense.begin(), dense.end(), [](const auto* a, const auto* b) {
    return a->shape.numel() > b->shape.numel();
  });
  std::vector<int64_t> bytes(out.size(), 0);
  for (const model::Parameter* p : dense) {
    const size_t w =
        static_cast<size_t>(std::min_element(bytes.begin(), bytes.end()) - bytes.begin());
    out[w].insert(p->name);
    bytes[w] += p->shape.numel();
  }
  return out;
}

Status CheckpointManager::Wait() {
  if (writer_.joinable()) writer_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return writer_status_;
}

Status CheckpointManager::PollError() {
  std::lock_guard<std::mutex> lock(mu_);
  return writer_done_ ? writer_status_ : absl::OkStatus();
}

StatusOr<std::vector<CheckpointManifest>> CheckpointManager::ReadList(const std::string& dir) {
  if (!TensorIndex::Exists(dir + "/index")) RETURN_IF_ERROR(CheckNoIndexIsNoLoss(dir));
  // A training process may be changing the folder: the ledger is read before and after the index.
  ASSIGN_OR_RETURN(std::optional<std::string> before, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(auto index, TensorIndex::OpenReadOnly(dir + "/index"));
  ASSIGN_OR_RETURN(auto indexed, index->Checkpoints());
  ASSIGN_OR_RETURN(std::optional<std::string> after, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(CheckedList list, CheckList(dir, before, after, std::move(indexed)));
  return std::move(list.live);
}

// One checkpoint of a folder as `strata ckpt` sees it: a committed set, or a checkpoint of a folder
// written before sharding; and for each shard, its local manifest or why it cannot be read.
struct CheckpointManager::FolderEntry {
  int64_t step = 0;
  std::optional<CheckpointSet> set;
  struct Part {
    std::string shard;
    StatusOr<CheckpointManifest> local = absl::UnknownError("not read");
  };
  std::vector<Part> parts;
};

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
    for (const FolderEntry::Part& part : e.parts) {
      i.shards.push_back(part.shard);
      if (!part.local.ok()) {
        if (i.problem.empty()) i.problem = std::string(part.local.status().message());
        continue;
      }
      const CheckpointManifest& m = *part.local;
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

Status CheckpointManager::Remove(const std::string& dir, int64_t step) {
  StatusOr<std::vector<CheckpointSet>> sets = ListCheckpointSets(dir);
  if (!sets.ok()) {
    // Damaged global manifests keep the folder from opening; removing the named step is the way
    // out, and needs no shard: a local checkpoint its set named is reclaimed at the next open.
    ASSIGN_OR_RETURN(const int fd, LockFolder(dir + "/LOCK", dir));
    Status s = RemoveCheckpointSet(dir, step);
    Unlock(fd);
    return s;
  }
  auto set = std::find_if(sets->begin(), sets->end(),
                          [&](const CheckpointSet& cs) { return cs.step() == step; });
  if (set == sets->end() && !IsFolderShard(dir)) {
    std::vector<int64_t> steps;
    for (const CheckpointSet& cs : *sets) steps.push_back(cs.step());
    return absl::NotFoundError(absl::StrFormat(
        "no checkpoint of step %d in '%s'; it holds %s", step, dir,
        steps.empty() ? std::string("none") : "steps " + absl::StrJoin(steps, ", ")));
  }
  if (set == sets->end() || (set->shards_size() == 1 && set->shards(0).name() == ".")) {
    // A checkpoint of a folder written before sharding (or written on in place): one process's.
    CheckpointOptions o;
    o.dir = dir;
    ASSIGN_OR_RETURN(auto m, Open(o, /*must_exist=*/true));
    std::lock_guard<std::mutex> lock(m->mu_);
    RETURN_IF_ERROR(m->ReopenWritable());
    return m->RemoveLocked(step);
  }
  // The global manifest goes under the committer's lock (refused while a job trains here); then
  // each shard still there opens as its writer would, which lets go of the local checkpoint no
  // set names any more.
  ASSIGN_OR_RETURN(const int fd, LockFolder(dir + "/LOCK", dir));
  Status s = RemoveCheckpointSet(dir, step);
  for (const storage::ShardEntry& e : set->shards()) {
    if (!s.ok()) break;
    if (!std::filesystem::is_directory(ShardDir(dir, e.name()))) continue;
    CheckpointOptions o;
    o.dir = dir;
    o.shard = e.name();
    o.committer = false;
    StatusOr<std::unique_ptr<CheckpointManager>> shard = Open(o, /*must_exist=*/false);
    if (!shard.ok()) {
      STRATA_LOG(WARNING) << "checkpoint " << step << " is removed; shard " << e.name()
                          << " lets its part go when it is next opened: " << shard.status();
    }
  }
  Unlock(fd);
  return s;
}

}  // namespace strata::checkpoint
