#include "checkpoint/manager_internal.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <utility>
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/common/clock.h"
#include "core/common/fault_point.h"
#include "core/common/logging.h"
#include "core/common/trace.h"
#include "storage/env.h"

namespace strata::checkpoint {

Status CheckpointManager::Save(int64_t step, const config::JobConfig& config,
                               model::MoeTransformer& model, model::AdamW& optimizer,
                               scheduler::TieredExpertScheduler* tiered, ops::Context& ctx,
                               const CheckpointShare& share) {
  RETURN_IF_ERROR(Wait());
  // The store holding this shard's checkpoint versions may have been handed to another scheduler
  // (a re-form): the removals below give versions back through the one that holds it now.
  {
    absl::MutexLock lock(&mu_);
    if (tiered_ != nullptr && tiered != nullptr) tiered_ = tiered;
  }
  // The writer is done with the last checkpoint's buffers: this one takes them again.
  if (!arena_) arena_ = std::make_unique<SnapshotArena>();
  arena_->Reset();
  if (!options_.committer) RETURN_IF_ERROR(ReclaimUnnamed(/*every=*/false));
  RETURN_IF_ERROR(ReplaceFrom(step));
  // The experts' update of the last step runs behind the caller: snapshot what it wrote.
  if (tiered) RETURN_IF_ERROR(tiered->FinishExpertStep());
  TraceScope span(ctx.tracer, "checkpoint save", "checkpoint", static_cast<int>(step));
  {
    absl::MutexLock lock(&mu_);
    tiered_ = tiered;
  }
  auto p = std::make_shared<Pending>();
  p->tracer = ctx.tracer;
  DescribeCheckpoint(*p, step, config, model, optimizer, tiered != nullptr, share);
  SnapshotDense(*p, model, optimizer, share);
  if (share.experts) RETURN_IF_ERROR(SnapshotExperts(*p, model, optimizer, tiered));
  StartWriter(std::move(p));
  return absl::OkStatus();
}

void CheckpointManager::DescribeCheckpoint(Pending& p, int64_t step,
                                           const config::JobConfig& config,
                                           model::MoeTransformer& model, model::AdamW& optimizer,
                                           bool tiered, const CheckpointShare& share) {
  CheckpointManifest& m = p.manifest;
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
  CheckpointSet& set = p.set;
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
    if (shard != shard_name_) p.other_shards.push_back(shard);
  }
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
    if (!share.dense || share.dense->count(name) > 0) entry->add_dense(name);
  }
  p.layout = CheckpointSetLayoutOf(config.model(), dense_names);
  {
    absl::MutexLock lock(&mu_);
    m.set_sequence(++last_sequence_);
    if (!manifests_.empty()) {
      m.set_previous_step(manifests_.back().step());
      m.set_previous_sequence(manifests_.back().sequence());
    }
  }
}

// `fill` writes the tensor's bytes into the copy's buffer: now when `sources` include a tensor
// off the host (a device copy is ordered on the caller's stream), else on the writer thread
// while the next step's forward and backward run (they only read these tensors).
void CheckpointManager::AddCopy(Pending& p, TensorRef ref, uint64_t bytes,
                                const std::vector<Tensor>& sources,
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
  p.copies.push_back(std::move(c));
}

void CheckpointManager::SnapshotDense(Pending& p, model::MoeTransformer& model,
                                      model::AdamW& optimizer, const CheckpointShare& share) {
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
  // Dense parameters with their moments: small, always copied.
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  for (size_t i = 0; i < dense.size(); ++i) {
    model::Parameter* prm = dense[i];
    if (share.dense && share.dense->count(prm->name) == 0) continue;
    const size_t oi = opt_index.at(prm);
    const uint64_t bytes = static_cast<uint64_t>(prm->shape.numel()) * sizeof(float);
    for (int kind : {0, 2, 3}) {
      TensorRef r;
      r.set_layer(static_cast<int32_t>(i));
      r.set_expert(-1);
      r.set_kind(kind);
      r.set_name(prm->name);
      r.set_version(++next_version_[{r.layer(), -1, kind}]);
      const Tensor src = kind == 0   ? prm->value
                         : kind == 2 ? optimizer.first_moment(oi)
                                     : optimizer.second_moment(oi);
      AddCopy(p, std::move(r), bytes, {src}, [src](void* dst) { src.CopyToHost(dst); });
    }
  }
}

Status CheckpointManager::SnapshotExperts(Pending& p, model::MoeTransformer& model,
                                          model::AdamW& optimizer,
                                          scheduler::TieredExpertScheduler* tiered) {
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
  for (const auto& ref : model.moe_layers()) {
    const int first = static_cast<int>(ref.layer->first_local_expert());
    for (int e = first; e < first + ref.layer->num_local_experts(); ++e) {
      for (int kind : {0, 2, 3}) {
        TensorRef r;
        r.set_layer(ref.block);
        r.set_expert(e);
        r.set_kind(kind);
        if (tiered != nullptr) {
          RETURN_IF_ERROR(SnapshotTieredExpert(p, std::move(r), *tiered));
          continue;
        }
        std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
        const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
        const uint64_t bytes = static_cast<uint64_t>(layout.floats) * sizeof(float);
        r.set_version(++next_version_[{ref.block, e, kind}]);
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
        AddCopy(p, std::move(r), bytes, srcs, [srcs, offsets](void* dst) {
          for (size_t i = 0; i < srcs.size(); ++i) {
            srcs[i].CopyToHost(static_cast<float*>(dst) + offsets[i]);
          }
        });
      }
    }
  }
  return absl::OkStatus();
}

Status CheckpointManager::SnapshotTieredExpert(Pending& p, TensorRef r,
                                               scheduler::TieredExpertScheduler& tiered) {
  const storage::TensorKey key{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())};
  const uint64_t bytes = tiered.store().tensor_bytes();
  char* buf = arena_->Take(bytes);
  storage::TieredExpertStore::Snapshot snap;
  RETURN_IF_ERROR(tiered.store().SnapshotTensor(key, reinterpret_cast<float*>(buf), &snap));
  if (snap.generated) {
    r.set_generated(true);
    p.refs.push_back(std::move(r));
    arena_->ReturnLast();
  } else if (snap.has_stored) {
    r.set_version(snap.version);
    ToRecord(snap.stored, r.mutable_extent());
    p.refs.push_back(std::move(r));
    arena_->ReturnLast();
  } else {
    r.set_version(tiered.store().NextVersion(key));
    Pending::Copy c;
    c.ref = std::move(r);
    c.buffer = buf;
    c.bytes = bytes;
    c.tiered = true;
    c.generation = snap.generation;
    p.copies.push_back(std::move(c));
  }
  return absl::OkStatus();
}

void CheckpointManager::StartWriter(std::shared_ptr<Pending> p) {
  const bool deferred = std::any_of(p->copies.begin(), p->copies.end(),
                                    [](const Pending::Copy& c) { return c.fill != nullptr; });
  {
    absl::MutexLock lock(&snapshot_mu_);
    snapshot_done_ = !deferred;
  }
  absl::MutexLock lock(&mu_);
  writer_done_ = false;
  writer_status_ = absl::OkStatus();
  if (writer_.joinable()) writer_.join();
  writer_ = std::thread([this, p = std::move(p)] { Persist(p); });
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
  absl::MutexLock lock(&snapshot_mu_);
  if (snapshot_done_) return;
  TraceScope span(tracer, "checkpoint fence", "checkpoint");
  while (!snapshot_done_) snapshot_cv_.Wait(&snapshot_mu_);
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
  absl::MutexLock lock(&snapshot_mu_);
  snapshot_done_ = true;
  snapshot_cv_.SignalAll();
}

int64_t CheckpointManager::NewestCommitted() {
  absl::MutexLock lock(&mu_);
  const std::vector<int64_t> steps = StepsLocked();
  return steps.empty() ? 0 : steps.back();
}

void CheckpointManager::Persist(std::shared_ptr<Pending> p) {
  TakeSnapshot(*p);
  const double started = NowSeconds();
  std::vector<TensorRef> new_versions;
  bool written = false;
  Status s = CommitLocal(*p, &new_versions, &written);
  // The shard is prepared; the global manifest makes the checkpoint exist. A process stopped here
  // leaves a local checkpoint that no set names, reclaimed when the shard is next opened.
  if (s.ok()) s = CommitGlobal(*p, new_versions);
  if (p->tracer != nullptr) {
    p->tracer->SpanOn("checkpoint writer",
                      absl::StrFormat("checkpoint persist %d", p->manifest.step()), "checkpoint",
                      started, NowSeconds());
  }
  if (!s.ok()) {
    PersistFailed(*p, s, written);
    return;
  }
  PersistCommitted(*p);
}

Status CheckpointManager::CommitLocal(Pending& p, std::vector<TensorRef>* new_versions,
                                      bool* written) {
  CheckpointManifest& m = p.manifest;
  std::vector<storage::SsdTier::WriteItem> items;
  for (auto& c : p.copies) items.push_back({c.buffer, c.bytes, &c.stored});
  // Extents, then fdatasync (also of working state spilled earlier, which this checkpoint may
  // list), then the index.
  Status s = ssd_->WriteMany(items);
  *written = s.ok();
  if (s.ok()) s = ssd_->Sync();
  if (s.ok()) {
    STRATA_LOG(INFO) << "checkpoint " << m.step() << ": " << p.copies.size()
                     << " tensors written and synced; committing";
  }
  // Tests and drills hold a checkpoint here (sleep_ms), so that a kill lands between its extents
  // and its commit. The step travels as an int64_t.
  [[maybe_unused]] int64_t step = m.step();
  if (s.ok()) STRATA_FAULT_POINT("checkpoint.before_commit", &step);
  for (auto& c : p.copies) {
    ToRecord(c.stored, c.ref.mutable_extent());
    *m.add_tensors() = c.ref;
    new_versions->push_back(c.ref);
  }
  {
    absl::MutexLock lock(&mu_);
    for (const TensorRef& r : p.refs) {
      *m.add_tensors() = r;
      if (r.has_extent() && !listed_.count(KeyOf(r))) new_versions->push_back(r);
    }
  }
  if (s.ok()) s = index_->CommitCheckpoint(m, *new_versions);
  return s;
}

Status CheckpointManager::CommitGlobal(Pending& p, const std::vector<TensorRef>& new_versions) {
  CheckpointManifest& m = p.manifest;
  [[maybe_unused]] int64_t step = m.step();
  Status s;
  STRATA_FAULT_POINT("checkpoint.before_set_commit", &step);
  storage::ShardEntry* entry = p.set.mutable_shards(0);
  entry->set_local_sequence(m.sequence());
  entry->set_local_manifest_crc32c(ManifestCrc(m));
  if (!options_.committer) {
    s = ReportPrepared(p);
  } else {
    s = CollectPrepared(p);
    if (s.ok()) {
      StatusOr<CheckpointSet> committed = CommitCheckpointSet(options_.dir, p.layout, p.set);
      if (committed.ok()) {
        p.set = *std::move(committed);
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
      absl::MutexLock lock(&mu_);
      removing_.push_back(m);
    }
  }
  return s;
}

scheduler::TieredExpertScheduler* CheckpointManager::Tiered() {
  absl::MutexLock lock(&mu_);
  return tiered_;
}

void CheckpointManager::PersistFailed(Pending& p, const Status& s, bool written) {
  const CheckpointManifest& m = p.manifest;
  // Nothing was committed: give back what this checkpoint held.
  if (written) {
    for (auto& c : p.copies) ssd_->Free(c.stored.extent);
  }
  if (scheduler::TieredExpertScheduler* tiered = Tiered()) {
    for (const TensorRef& r : p.refs) {
      if (!r.has_extent()) continue;
      tiered->store().UnrefVersion(
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
      told = env->WriteFileAtomic(folder + "/" + shard_name_ + ".failed", std::string(s.message()));
    }
    if (!told.ok()) STRATA_LOG(WARNING) << "could not tell the committer: " << told.message();
  }
  absl::MutexLock lock(&mu_);
  writer_status_ = absl::Status(
      s.code(), absl::StrFormat("checkpoint of step %d in '%s' failed: %s; the previous "
                                "checkpoints are intact",
                                m.step(), options_.dir, s.message()));
  writer_done_ = true;
}

void CheckpointManager::PersistCommitted(Pending& p) {
  const CheckpointManifest& m = p.manifest;
  [[maybe_unused]] int64_t step = m.step();
  // Committed. Copied expert tensors: the checkpoint holds a reference, and the tensor adopts the
  // version as its SSD copy if it has not changed since the snapshot.
  if (scheduler::TieredExpertScheduler* tiered = Tiered()) {
    for (auto& c : p.copies) {
      if (!c.tiered) continue;
      const storage::TensorKey key{c.ref.layer(), c.ref.expert(),
                                   static_cast<storage::TensorKind>(c.ref.kind())};
      tiered->store().RefVersion(key, c.ref.version(), c.stored);
      tiered->store().AdoptVersion(key, c.generation, c.ref.version(), c.stored);
    }
  }
  absl::MutexLock lock(&mu_);
  for (const TensorRef& r : m.tensors()) {
    if (r.has_extent()) listed_[KeyOf(r)]++;
  }
  manifests_.push_back(m);
  if (!options_.committer) {
    // Prepared and reported: the committer makes it exist once every shard has reported.
    STRATA_LOG(INFO) << "checkpoint " << m.step() << ": shard " << shard_name_ << " prepared in "
                     << options_.dir << " (" << p.copies.size() << " tensors written)";
    writer_status_ = WriteLedger();
    writer_done_ = true;
    return;
  }
  sets_.push_back(p.set);
  STRATA_LOG(INFO) << "checkpoint " << m.step() << " committed in " << options_.dir << " ("
                   << p.copies.size() << " tensors written"
                   << (p.other_shards.empty() ? ""
                                              : absl::StrFormat(", %d shards", p.set.shards_size()))
                   << ")";
  // The checkpoint exists; should the ledger not learn of it, the next open still accepts it (it
  // follows the ledger's newest), but nothing may be committed or removed after it.
  Status prune = WriteLedger();
  if (!prune.ok()) {
    prune = absl::Status(
        prune.code(),
        absl::StrFormat("checkpoint of step %d was committed, but %s", m.step(), prune.message()));
  }
  for (std::vector<int64_t> steps = StepsLocked();
       prune.ok() && steps.size() > std::max<uint32_t>(1, options_.keep); steps = StepsLocked()) {
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
  absl::MutexLock lock(&mu_);
  return writer_status_;
}

Status CheckpointManager::PollError() {
  absl::MutexLock lock(&mu_);
  return writer_done_ ? writer_status_ : absl::OkStatus();
}

}  // namespace strata::checkpoint
