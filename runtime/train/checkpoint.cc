#include "runtime/train/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/text_format.h"
#include "runtime/common/clock.h"
#include "runtime/common/logging.h"
#include "runtime/common/trace.h"

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
  // Resuming opens the index read-only: nothing in the folder changes until the checkpoint has
  // passed every check (Resume reopens it for writing).
  if (must_exist) {
    ASSIGN_OR_RETURN(m->index_, storage::TensorIndex::OpenReadOnly(dir + "/index"));
  } else {
    ASSIGN_OR_RETURN(m->index_, storage::TensorIndex::Open(dir + "/index", true));
  }
  ASSIGN_OR_RETURN(m->ssd_, OpenSsd(options));
  ASSIGN_OR_RETURN(m->manifests_, m->index_->Checkpoints());
  for (const CheckpointManifest& cm : m->manifests_) {
    for (const TensorRef& r : cm.tensors()) {
      if (r.has_extent()) m->listed_[KeyOf(r)]++;
    }
  }
  // Space that no checkpoint refers to (an interrupted checkpoint, spilled working state) is free.
  ASSIGN_OR_RETURN(std::vector<TensorRef> versions, m->index_->TensorVersions());
  for (const TensorRef& r : versions) {
    auto& next = m->next_version_[{r.layer(), r.expert(), r.kind()}];
    next = std::max(next, r.version());
    if (!m->listed_.count(KeyOf(r))) continue;
    Status s = m->ssd_->MarkUsed(FromRecord(r.extent()).extent);
    if (!s.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "the checkpoint index in '%s' does not match its data files (%s); nothing was changed",
          dir, s.message()));
    }
  }
  return m;
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
    return s;
  }
  for (const TensorRef& r : stored) ReleaseVersion(r);
  manifests_.erase(it);
  return absl::OkStatus();
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
    std::vector<model::Parameter*> ps = layer->expert(r.expert()).Parameters();
    uint64_t floats = 0;
    for (auto* p : ps) floats += static_cast<uint64_t>(p->shape.numel());
    std::vector<float> blob(floats, 0.0f);
    if (r.generated()) {
      if (r.kind() == 0) {
        uint64_t off = 0;
        for (auto* p : ps) {
          model::InitialValues(*p, config.seed(), blob.data() + off);
          off += static_cast<uint64_t>(p->shape.numel());
        }
      }
    } else {
      RETURN_IF_ERROR(read_into(r, blob.data(), floats * sizeof(float)));
    }
    uint64_t off = 0;
    for (auto* p : ps) {
      const size_t oi = opt_index.at(p);
      const Tensor& dst = r.kind() == 0   ? p->value
                          : r.kind() == 2 ? optimizer.first_moment(oi)
                                          : optimizer.second_moment(oi);
      dst.CopyFromHost(blob.data() + off);
      off += static_cast<uint64_t>(p->shape.numel());
    }
  }
  optimizer.set_steps(m.optimizer_steps());

  // Only now is anything changed. The store learns which versions the checkpoints use (all of
  // them, so that removing the invalid ones below gives back exactly what they held), then the
  // index is reopened for writing and invalid newer checkpoints go.
  std::lock_guard<std::mutex> lock(mu_);
  tiered_ = tiered;
  if (tiered != nullptr) {
    for (const CheckpointManifest& cm : manifests_) {
      for (const TensorRef& r : cm.tensors()) {
        if (r.expert() < 0) continue;
        const storage::TensorKey key{r.layer(), r.expert(),
                                     static_cast<storage::TensorKind>(r.kind())};
        tiered->store().ReserveVersions(key, r.version());
        if (r.has_extent()) tiered->store().RefVersion(key, r.version(), FromRecord(r.extent()));
      }
    }
  }
  index_.reset();
  ASSIGN_OR_RETURN(index_, storage::TensorIndex::Open(options_.dir + "/index", false));
  for (int64_t step : invalid) {
    STRATA_LOG(WARNING) << "removing checkpoint " << step << " (it failed its checks)";
    RETURN_IF_ERROR(RemoveLocked(step));
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
        uint64_t floats = 0;
        for (auto* prm : ps) floats += static_cast<uint64_t>(prm->shape.numel());
        std::vector<float> blob(floats);
        uint64_t off = 0;
        for (auto* prm : ps) {
          const size_t oi = opt_index.at(prm);
          const Tensor& src = kind == 0   ? prm->value
                              : kind == 2 ? optimizer.first_moment(oi)
                                          : optimizer.second_moment(oi);
          src.CopyToHost(blob.data() + off);
          off += static_cast<uint64_t>(prm->shape.numel());
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
  if (s.ok() && options_.commit_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.commit_delay_ms));
  }
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
  Status prune;
  while (prune.ok() && manifests_.size() > std::max<uint32_t>(1, options_.keep)) {
    prune = RemoveLocked(manifests_.front().step());
  }
  writer_status_ = prune;
  writer_done_ = true;
  if (options_.hold_after_step > 0 && m.step() == options_.hold_after_step) {
    STRATA_LOG(WARNING) << "checkpoint " << m.step()
                        << ": holding here (fault injection) until the process is killed";
    for (;;) pause();
  }
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

StatusOr<std::vector<CheckpointInfo>> CheckpointManager::List(const std::string& dir) {
  ASSIGN_OR_RETURN(auto index, storage::TensorIndex::OpenReadOnly(dir + "/index"));
  ASSIGN_OR_RETURN(auto manifests, index->Checkpoints());
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
  ASSIGN_OR_RETURN(auto index, storage::TensorIndex::OpenReadOnly(dir + "/index"));
  ASSIGN_OR_RETURN(auto manifests, index->Checkpoints());
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
  m->index_.reset();
  ASSIGN_OR_RETURN(m->index_, storage::TensorIndex::Open(dir + "/index", false));
  return m->RemoveLocked(step);
}

}  // namespace strata::train
