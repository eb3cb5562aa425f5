#include "storage/copy_shelf.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/logging.h"

namespace strata::storage {

namespace {
constexpr char kFolderPrefix[] = "strata-copies-";
}  // namespace

StatusOr<std::unique_ptr<CopyShelf>> CopyShelf::Create(const Options& options) {
  if (options.piece_bytes == 0 || options.piece_bytes % sizeof(float) != 0 || options.pieces < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a copy shelf needs pieces of a positive number of floats (got %d bytes, %d pieces)",
        options.piece_bytes, options.pieces));
  }
  if (options.parent_dir.empty()) {
    return absl::InvalidArgumentError("a copy shelf needs a parent folder");
  }
  std::unique_ptr<CopyShelf> s(new CopyShelf(options));
  ASSIGN_OR_RETURN(s->folder_,
                   PrivateFolder::Create(options.parent_dir, kFolderPrefix, "the buddy copies"));
  ASSIGN_OR_RETURN(std::unique_ptr<BlockIo> io, MakeUringIo(options.io));
  if (options.wrap_io) io = options.wrap_io(std::move(io));
  SsdOptions so;
  so.dir = s->folder_->path();
  ASSIGN_OR_RETURN(s->tier_, SsdTier::Open(so, std::move(io)));
  RETURN_IF_ERROR(s->Reserve(options.piece_bytes));
  return s;
}

CopyShelf::~CopyShelf() {
  tier_.reset();  // closes its files before the folder goes
}

std::string CopyShelf::What(int64_t version, int64_t item, int piece) const {
  return absl::StrFormat("copy of item %d piece %d v%d in %s", item, piece, version, dir());
}

Status CopyShelf::Reserve(uint64_t bytes) {
  if (bounce_.size() >= bytes) return absl::OkStatus();
  ASSIGN_OR_RETURN(bounce_, IoBuffer::Allocate(bytes));
  return absl::OkStatus();
}

Status CopyShelf::Write(int64_t version, int64_t item, int first, int count, const float* data) {
  if (first < 0 || count < 1 || first + count > options_.pieces) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pieces [%d, %d) of item %d are outside its blob of %d pieces", first,
                        first + count, item, options_.pieces));
  }
  // Each piece at its own 4 KiB-aligned place in the bounce buffer, all written together.
  const uint64_t stride = (options_.piece_bytes + kSsdGranule - 1) / kSsdGranule * kSsdGranule;
  RETURN_IF_ERROR(Reserve(stride * count));
  std::vector<StoredExtent> stored(count);
  std::vector<SsdTier::WriteItem> writes;
  for (int k = 0; k < count; ++k) {
    char* at = bounce_.data() + stride * k;
    std::memcpy(at, reinterpret_cast<const char*>(data) + options_.piece_bytes * k,
                options_.piece_bytes);
    writes.push_back({at, options_.piece_bytes, &stored[k]});
  }
  RETURN_IF_ERROR(tier_->WriteMany(writes));
  Blob& b = items_[item][version];
  if (b.pieces.empty()) {
    b.pieces.resize(options_.pieces);
    b.written.assign(options_.pieces, false);
    b.missing = options_.pieces;
  }
  for (int k = 0; k < count; ++k) {
    const int piece = first + k;
    if (b.written[piece]) {
      tier_->Free(b.pieces[piece].extent);
    } else {
      b.written[piece] = true;
      --b.missing;
    }
    b.pieces[piece] = stored[k];
  }
  return absl::OkStatus();
}

Status CopyShelf::Read(int64_t version, int64_t item, int first, int count, float* out) {
  auto it = items_.find(item);
  Blob* b = nullptr;
  if (it != items_.end()) {
    auto v = it->second.find(version);
    if (v != it->second.end()) b = &v->second;
  }
  for (int piece = first; piece < first + count; ++piece) {
    if (b == nullptr || piece < 0 || piece >= options_.pieces || !b->written[piece]) {
      return absl::NotFoundError(absl::StrCat(What(version, item, piece), " was never written"));
    }
  }
  const uint64_t stride = (options_.piece_bytes + kSsdGranule - 1) / kSsdGranule * kSsdGranule;
  RETURN_IF_ERROR(Reserve(stride * count));
  std::vector<std::string> what;
  for (int k = 0; k < count; ++k) what.push_back(What(version, item, first + k));
  std::vector<SsdTier::ReadItem> reads;
  for (int k = 0; k < count; ++k) {
    reads.push_back({&b->pieces[first + k], bounce_.data() + stride * k, &what[k]});
  }
  if (Status s = tier_->ReadMany(reads); !s.ok()) {
    // A copy that cannot be read is lost like its worker: it is dropped, and the other copies, or
    // a checkpoint, are what the job goes on from.
    if (absl::IsDataLoss(s)) {
      auto v = it->second.find(version);
      it->second.erase(DropPieces(v));
      if (it->second.empty()) items_.erase(it);
    }
    return Status(s.code(), absl::StrCat("reading a buddy copy: ", s.message()));
  }
  for (int k = 0; k < count; ++k) {
    std::memcpy(reinterpret_cast<char*>(out) + options_.piece_bytes * k,
                bounce_.data() + stride * k, options_.piece_bytes);
  }
  return absl::OkStatus();
}

std::vector<int64_t> CopyShelf::Versions(int64_t item) const {
  std::vector<int64_t> out;
  auto it = items_.find(item);
  if (it == items_.end()) return out;
  for (auto v = it->second.rbegin(); v != it->second.rend(); ++v) {
    if (v->second.missing == 0) out.push_back(v->first);
  }
  return out;
}

std::map<int64_t, CopyShelf::Blob>::iterator CopyShelf::DropPieces(
    std::map<int64_t, Blob>::iterator it) {
  for (int p = 0; p < options_.pieces; ++p) {
    if (it->second.written[p]) tier_->Free(it->second.pieces[p].extent);
  }
  return it;
}

void CopyShelf::KeepNewest(int64_t item, int keep) {
  auto it = items_.find(item);
  if (it == items_.end()) return;
  auto& versions = it->second;
  int kept = 0;
  for (auto v = versions.end(); v != versions.begin();) {
    --v;
    if (v->second.missing == 0 && kept < keep) {
      ++kept;
      continue;
    }
    v = versions.erase(DropPieces(v));
  }
  if (versions.empty()) items_.erase(it);
}

void CopyShelf::KeepOnly(int64_t item, int64_t version) {
  auto it = items_.find(item);
  if (it == items_.end()) return;
  auto& versions = it->second;
  for (auto v = versions.begin(); v != versions.end();) {
    v = v->first == version ? std::next(v) : versions.erase(DropPieces(v));
  }
  if (versions.empty()) items_.erase(it);
}

void CopyShelf::DropNewerThan(int64_t item, int64_t version) {
  auto it = items_.find(item);
  if (it == items_.end()) return;
  auto& versions = it->second;
  for (auto v = versions.upper_bound(version); v != versions.end();) {
    v = versions.erase(DropPieces(v));
  }
  if (versions.empty()) items_.erase(it);
}

void CopyShelf::Clear() {
  for (auto& [item, versions] : items_) {
    for (auto v = versions.begin(); v != versions.end(); ++v) DropPieces(v);
  }
  items_.clear();
}

}  // namespace strata::storage
