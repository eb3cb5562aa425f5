#include "train/checkpoint.h"

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
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/common/clock.h"
#include "core/common/fault_point.h"
#include "core/common/logging.h"
#include "core/common/trace.h"
#include "google/protobuf/text_format.h"
#include "storage/crc32c.h"
#include "storage/env.h"
#include "train/ledger_text.h"

namespace strata::train {
namespace {

using storage::CheckpointManifest;
using storage::StoredExtent;
using storage::TensorRef;

// A 4 KiB-aligned buffer with room for a rounded-up extent.
struct AlignedBuffer {
  explicit AlignedBuffer(uint64_t bytes)
      : size((bytes + 4095) / 4096 * 4096),
        data(static_cast<char*>(std::aligned_alloc(4096, std::max<uint64_t>(size, 4096)))) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint64_t size;
  char* data;
};

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

std::string Describe(const TensorRef& r, int64_t step) {
  if (r.expert() < 0) {
    return absl::StrFormat("checkpoint %d: %s (%s) v%d", step, r.name(),
                           storage::KindName(static_cast<storage::TensorKind>(r.kind())),
                           r.version());
  }
  return absl::StrFormat(
      "checkpoint %d: %s v%d", step,
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

StatusOr<std::unique_ptr<storage::SsdTier>> OpenSsd(const CheckpointOptions& o) {
  ASSIGN_OR_RETURN(std::unique_ptr<storage::BlockIo> io, storage::MakeUringIo(o.io));
  if (o.wrap_io) io = o.wrap_io(std::move(io));
  storage::SsdOptions so;
  so.dir = o.dir;
  so.file_bytes = o.file_bytes;
  so.capacity_bytes = o.capacity_bytes;
  return storage::SsdTier::Open(so, std::move(io));
}

std::string LedgerPath(const std::string& dir) { return dir + "/LEDGER"; }

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
        LedgerPath(dir), storage::kDamagedIndexRemedy));
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
          LedgerPath(dir), dir, Steps(sequenced), storage::kDamagedIndexRemedy));
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
        dir, LedgerPath(dir), absl::StrJoin(what, "; "), storage::kDamagedIndexRemedy));
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
    std::unique_ptr<AlignedBuffer> buffer;
    uint64_t bytes = 0;
    bool tiered = false;  // an expert tensor of the tiered store (adopt the version after)
    uint64_t generation = 0;
    StoredExtent stored;
  };
  std::vector<Copy> copies;
  std::vector<TensorRef> refs;  // stored already (a store reference was taken) or generated
  Tracer* tracer = nullptr;
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
  // One process at a time: training, or `strata ckpt rm`.
  const std::string lock_path = dir + "/LOCK";
  m->lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (m->lock_fd_ < 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("cannot open '%s': %s", lock_path, std::strerror(errno)));
  }
  if (::flock(m->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {0};
    ssize_t n = ::pread(m->lock_fd_, pid, sizeof(pid) - 1, 0);
    if (n > 0) pid[n] = 0;
    ::close(m->lock_fd_);
    m->lock_fd_ = -1;
    return absl::UnavailableError(absl::StrFormat(
        "checkpoint folder '%s' is in use by another strata process (pid %s); wait for it to "
        "finish or use another folder",
        dir, absl::StripAsciiWhitespace(pid)));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(m->lock_fd_, 0) != 0 || ::pwrite(m->lock_fd_, pid.data(), pid.size(), 0) < 0) {
    STRATA_LOG(WARNING) << "could not record the pid in " << lock_path;
  }
  if (options.start_over) {
    if (must_exist) {
      return absl::InvalidArgumentError(
          "--start-over moves the checkpoint folder's contents aside, --resume continues from "
          "them: pass one of them");
    }
    RETURN_IF_ERROR(MoveAside(dir));
  }
  if (!storage::TensorIndex::Exists(dir + "/index")) RETURN_IF_ERROR(CheckNoIndexIsNoLoss(dir));
  // Resuming opens the index read-only: nothing in the folder changes until the checkpoint has
  // passed every check (Resume reopens it for writing).
  if (must_exist) {
    ASSIGN_OR_RETURN(m->index_, storage::TensorIndex::OpenReadOnly(dir + "/index"));
  } else {
    ASSIGN_OR_RETURN(m->index_, storage::TensorIndex::Open(dir + "/index", true));
  }
  ASSIGN_OR_RETURN(m->ssd_, OpenSsd(options));
  ASSIGN_OR_RETURN(std::vector<CheckpointManifest> indexed, m->index_->Checkpoints());
  ASSIGN_OR_RETURN(std::optional<std::string> ledger, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(CheckedList list, CheckList(dir, ledger, ledger, std::move(indexed)));
  m->manifests_ = std::move(list.live);
  m->removing_ = std::move(list.removing);
  m->last_sequence_ = list.last_sequence;
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
  return m;
}

Status CheckpointManager::ReopenWritable() {
  index_.reset();
  ASSIGN_OR_RETURN(index_, storage::TensorIndex::Open(options_.dir + "/index", false));
  return Tidy();
}

Status CheckpointManager::Tidy() {
  for (const CheckpointManifest& cm : removing_) {
    std::vector<TensorRef> unreferenced;
    for (const TensorRef& r : cm.tensors()) {
      if (r.has_extent() && !listed_.count(KeyOf(r))) unreferenced.push_back(r);
    }
    STRATA_LOG(INFO) << "finishing the removal of checkpoint " << cm.step() << " from "
                     << options_.dir;
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
  Status s = StoreLedger(options_.dir, ledger);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrFormat("updating the checkpoint ledger of '%s': %s",
                                                  options_.dir, s.message()));
  }
  return absl::OkStatus();
}

CheckpointManager::~CheckpointManager() {
  if (writer_.joinable()) writer_.join();
  if (lock_fd_ >= 0) {
    ::flock(lock_fd_, LOCK_UN);
    ::close(lock_fd_);
  }
}

Status CheckpointManager::VerifyManifest(const CheckpointManifest& m) const {
  for (const TensorRef& r : m.tensors()) {
    if (!r.has_extent()) continue;
    RETURN_IF_ERROR(ssd_->Verify(FromRecord(r.extent()), Describe(r, m.step())));
  }
  return absl::OkStatus();
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
  if (it == manifests_.end()) {
    return absl::NotFoundError(
        absl::StrFormat("no checkpoint of step %d in '%s'", step, options_.dir));
  }
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
  for (const CheckpointManifest& m : manifests_) {
    if (m.config_hash() != hash) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint %d in '%s' was written for a different model (%s); resume it with the "
          "model it was trained with, or start a new run in another folder. Nothing was changed",
          m.step(), options_.dir, ConfigDiff(m.model_config(), ModelText(config.model()))));
    }
  }
  return absl::OkStatus();
}

StatusOr<int64_t> CheckpointManager::Resume(const config::JobConfig& config,
                                            model::MoeTransformer& model, model::AdamW& optimizer,
                                            scheduler::TieredExpertScheduler* tiered,
                                            ops::Context& ctx) {
  (void)ctx;
  if (manifests_.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "checkpoint folder '%s' holds no checkpoint to resume from; drop --resume to start "
        "afresh",
        options_.dir));
  }
  RETURN_IF_ERROR(CheckCompatible(config));
  // Newest first; nothing is changed until one passes every check.
  int chosen = -1;
  std::vector<int64_t> invalid;
  Status first_error;
  for (int i = static_cast<int>(manifests_.size()) - 1; i >= 0; --i) {
    const CheckpointManifest& m = manifests_[i];
    Status s = VerifyManifest(m);
    if (s.ok()) {
      chosen = i;
      break;
    }
    STRATA_LOG(ERROR) << "checkpoint " << m.step() << " cannot be used: " << s.message();
    if (first_error.ok()) first_error = s;
    invalid.push_back(m.step());
  }
  if (chosen < 0) {
    return absl::DataLossError(
        absl::StrFormat("no checkpoint in '%s' passes its checks; the newest failed with: %s",
                        options_.dir, first_error.message()));
  }
  // Older checkpoints with extents beyond the end of their data file go too: that space was never
  // marked used, so new data would overwrite what they list.
  for (int i = 0; i < chosen; ++i) {
    for (const TensorRef& r : manifests_[i].tensors()) {
      if (!r.has_extent() || !outside_.count(KeyOf(r))) continue;
      Status s = ssd_->Verify(FromRecord(r.extent()), Describe(r, manifests_[i].step()));
      STRATA_LOG(ERROR) << "checkpoint " << manifests_[i].step()
                        << " cannot be used either: " << s.message();
      invalid.push_back(manifests_[i].step());
      break;
    }
  }
  const CheckpointManifest m = manifests_[chosen];
  if (m.seed() != config.seed()) {
    STRATA_LOG(WARNING) << "resuming with seed " << config.seed() << " but checkpoint " << m.step()
                        << " was trained with seed " << m.seed()
                        << ": data order and gate noise will not continue the original run";
  }

  // Dense parameters and their moments.
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
  auto read_into = [&](const TensorRef& r, float* dst, uint64_t bytes) -> Status {
    if (r.extent().bytes() != bytes) {
      return absl::DataLossError(absl::StrFormat("%s has %d bytes where the model needs %d",
                                                 Describe(r, m.step()), r.extent().bytes(), bytes));
    }
    AlignedBuffer buf(bytes);
    RETURN_IF_ERROR(ssd_->Read(FromRecord(r.extent()), buf.data, Describe(r, m.step())));
    std::memcpy(dst, buf.data, bytes);
    return absl::OkStatus();
  };
  for (const TensorRef& r : m.tensors()) {
    if (r.expert() >= 0) continue;
    if (r.layer() < 0 || r.layer() >= static_cast<int>(dense.size()) ||
        dense[r.layer()]->name != r.name()) {
      return absl::DataLossError(absl::StrFormat("%s does not match the model's dense parameter %d",
                                                 Describe(r, m.step()), r.layer()));
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
    const storage::TensorKey key{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())};
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
          absl::StrFormat("%s has no place in the model", Describe(r, m.step())));
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

  // Only now is anything changed. The index is reopened for writing and the invalid checkpoints
  // go, giving back the space only they used (the store holds no checkpoint versions yet); then
  // the store learns which versions the kept checkpoints use. Version numbers stay reserved past
  // every checkpoint read, removed ones included.
  std::lock_guard<std::mutex> lock(mu_);
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
  STRATA_LOG(INFO) << "resumed from checkpoint " << m.step() << " in " << options_.dir;
  return m.step();
}

Status CheckpointManager::Save(int64_t step, const config::JobConfig& config,
                               model::MoeTransformer& model, model::AdamW& optimizer,
                               scheduler::TieredExpertScheduler* tiered, ops::Context& ctx) {
  RETURN_IF_ERROR(Wait());
  // The experts' update of the last step runs behind the caller: snapshot what it wrote.
  if (tiered) RETURN_IF_ERROR(tiered->FinishExpertStep());
  TraceScope span(ctx.tracer, "checkpoint snapshot", "checkpoint", static_cast<int>(step));
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
  m.set_workers(1);
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
  // `fill` writes the tensor's bytes into the copy's buffer.
  auto add_copy = [&](TensorRef ref, uint64_t bytes, const std::function<void(void*)>& fill) {
    Pending::Copy c;
    c.ref = std::move(ref);
    c.buffer = std::make_unique<AlignedBuffer>(bytes);
    c.bytes = bytes;
    fill(c.buffer->data);
    p->copies.push_back(std::move(c));
  };
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;

  // Dense parameters with their moments: small, always copied.
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  for (size_t i = 0; i < dense.size(); ++i) {
    model::Parameter* prm = dense[i];
    const size_t oi = opt_index.at(prm);
    const uint64_t bytes = static_cast<uint64_t>(prm->shape.numel()) * sizeof(float);
    for (int kind : {0, 2, 3}) {
      TensorRef r;
      r.set_layer(static_cast<int32_t>(i));
      r.set_expert(-1);
      r.set_kind(kind);
      r.set_name(prm->name);
      r.set_version(next_version(r.layer(), -1, kind));
      const Tensor& src = kind == 0   ? prm->value
                          : kind == 2 ? optimizer.first_moment(oi)
                                      : optimizer.second_moment(oi);
      add_copy(std::move(r), bytes, [&](void* dst) { src.CopyToHost(dst); });
    }
  }

  // Experts: one blob per expert and kind.
  for (const auto& ref : model.moe_layers()) {
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
          auto buf = std::make_unique<AlignedBuffer>(bytes);
          storage::TieredExpertStore::Snapshot snap;
          RETURN_IF_ERROR(
              tiered->store().SnapshotTensor(key, reinterpret_cast<float*>(buf->data), &snap));
          if (snap.generated) {
            r.set_generated(true);
            p->refs.push_back(std::move(r));
          } else if (snap.has_stored) {
            r.set_version(snap.version);
            ToRecord(snap.stored, r.mutable_extent());
            p->refs.push_back(std::move(r));
          } else {
            r.set_version(tiered->store().NextVersion(key));
            Pending::Copy c;
            c.ref = std::move(r);
            c.buffer = std::move(buf);
            c.bytes = bytes;
            c.tiered = true;
            c.generation = snap.generation;
            p->copies.push_back(std::move(c));
          }
          continue;
        }
        std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
        const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
        const uint64_t floats = static_cast<uint64_t>(layout.floats);
        std::vector<float> blob(floats);
        for (size_t i = 0; i < ps.size(); ++i) {
          const size_t oi = opt_index.at(ps[i]);
          const Tensor& src = kind == 0   ? ps[i]->value
                              : kind == 2 ? optimizer.first_moment(oi)
                                          : optimizer.second_moment(oi);
          src.CopyToHost(blob.data() + layout.segments[i].offset);
        }
        r.set_version(next_version(ref.block, e, kind));
        const uint64_t bytes = floats * sizeof(float);
        add_copy(std::move(r), bytes, [&](void* dst) { std::memcpy(dst, blob.data(), bytes); });
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  writer_done_ = false;
  writer_status_ = absl::OkStatus();
  if (writer_.joinable()) writer_.join();
  writer_ = std::thread([this, p] { Persist(p); });
  return absl::OkStatus();
}

int64_t CheckpointManager::NewestCommitted() {
  std::lock_guard<std::mutex> lock(mu_);
  return manifests_.empty() ? 0 : manifests_.back().step();
}

void CheckpointManager::Persist(std::shared_ptr<Pending> p) {
  CheckpointManifest& m = p->manifest;
  const double started = NowSeconds();
  std::vector<storage::SsdTier::WriteItem> items;
  for (auto& c : p->copies) items.push_back({c.buffer->data, c.bytes, &c.stored});
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
  STRATA_LOG(INFO) << "checkpoint " << m.step() << " committed in " << options_.dir << " ("
                   << p->copies.size() << " tensors written)";
  // The checkpoint exists; should the ledger not learn of it, the next open still accepts it (it
  // follows the ledger's newest), but nothing may be committed or removed after it.
  Status prune = WriteLedger();
  if (!prune.ok()) {
    prune = absl::Status(
        prune.code(),
        absl::StrFormat("checkpoint of step %d was committed, but %s", m.step(), prune.message()));
  }
  while (prune.ok() && manifests_.size() > std::max<uint32_t>(1, options_.keep)) {
    prune = RemoveLocked(manifests_.front().step());
  }
  writer_status_ = prune;
  writer_done_ = true;
  // Tests and drills stop the writer for good here (hold_at_step), still holding mu_, so that a
  // kill lands after this checkpoint and before any later one however fast training runs.
  STRATA_FAULT_POINT("checkpoint.after_commit", &step);
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
  if (!storage::TensorIndex::Exists(dir + "/index")) RETURN_IF_ERROR(CheckNoIndexIsNoLoss(dir));
  // A training process may be changing the folder: the ledger is read before and after the index.
  ASSIGN_OR_RETURN(std::optional<std::string> before, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(auto index, storage::TensorIndex::OpenReadOnly(dir + "/index"));
  ASSIGN_OR_RETURN(auto indexed, index->Checkpoints());
  ASSIGN_OR_RETURN(std::optional<std::string> after, ReadLedgerText(dir));
  ASSIGN_OR_RETURN(CheckedList list, CheckList(dir, before, after, std::move(indexed)));
  return std::move(list.live);
}

StatusOr<std::vector<CheckpointInfo>> CheckpointManager::List(const std::string& dir) {
  ASSIGN_OR_RETURN(auto manifests, ReadList(dir));
  std::vector<CheckpointInfo> out;
  for (const CheckpointManifest& m : manifests) {
    CheckpointInfo i;
    i.step = m.step();
    i.created_unix_ms = m.created_unix_ms();
    i.tensors = m.tensors_size();
    for (const TensorRef& r : m.tensors()) i.stored_bytes += r.extent().length();
    i.config_hash = m.config_hash();
    i.storage_mode = m.storage_mode();
    out.push_back(i);
  }
  return out;
}

Status CheckpointManager::Verify(const std::string& dir, int64_t step,
                                 std::vector<std::string>* report) {
  ASSIGN_OR_RETURN(auto manifests, ReadList(dir));
  CheckpointOptions o;
  o.dir = dir;
  ASSIGN_OR_RETURN(std::unique_ptr<storage::SsdTier> ssd, OpenSsd(o));
  int bad = 0, checked = 0;
  for (const CheckpointManifest& m : manifests) {
    if (step >= 0 && m.step() != step) continue;
    ++checked;
    Status s;
    uint64_t bytes = 0;
    int extents = 0;
    for (const TensorRef& r : m.tensors()) {
      if (!r.has_extent()) continue;
      s = ssd->Verify(FromRecord(r.extent()), Describe(r, m.step()));
      if (!s.ok()) break;
      bytes += r.extent().bytes();
      ++extents;
    }
    if (s.ok()) {
      report->push_back(
          absl::StrFormat("checkpoint %d: ok (%d extents, %.1f MiB, every CRC-32C "
                          "matches)",
                          m.step(), extents, bytes / 1048576.0));
    } else {
      ++bad;
      report->push_back(absl::StrFormat("checkpoint %d: FAILED: %s", m.step(), s.message()));
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
  CheckpointOptions o;
  o.dir = dir;
  ASSIGN_OR_RETURN(auto m, Open(o, /*must_exist=*/true));
  std::lock_guard<std::mutex> lock(m->mu_);
  RETURN_IF_ERROR(m->ReopenWritable());
  return m->RemoveLocked(step);
}

}  // namespace strata::train
