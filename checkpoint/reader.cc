#include "checkpoint/manager_internal.h"

#include <optional>

#include <cstring>
#include <filesystem>
#include <utility>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/logging.h"

namespace strata::checkpoint {

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

// The checkpoint Resume takes: `step`, read from this shard's `local` manifest or, through
// `reader`, from the shards of its set; and the newer ones that failed their checks (`invalid`).
struct CheckpointManager::ResumeChoice {
  int64_t step = -1;
  std::optional<CheckpointManifest> local;  // a copy: the lists may change after the choice
  std::unique_ptr<SetReader> reader;
  std::vector<int64_t> invalid;
};

StatusOr<int64_t> CheckpointManager::Resume(const config::JobConfig& config,
                                            model::MoeTransformer& model, model::AdamW& optimizer,
                                            scheduler::TieredExpertScheduler* tiered,
                                            ops::Context& ctx, const ResumeAgreement& agree) {
  (void)ctx;
  FinishSnapshot();  // what is read in below must not be copied out at the same time
  if (Steps().empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "checkpoint folder '%s' holds no checkpoint to resume from; drop --resume to start "
        "afresh",
        options_.dir));
  }
  RETURN_IF_ERROR(CheckCompatible(config));
  ASSIGN_OR_RETURN(ResumeChoice choice, ChooseCheckpoint(model, agree));
  AddOlderOutsideFiles(choice.step, &choice.invalid);
  {
    absl::MutexLock lock(&mu_);
    // Version numbers stay reserved past every checkpoint of this shard, removed ones included
    // (the store holds no checkpoint versions yet; an expert read from another shard takes a new
    // one).
    for (const CheckpointManifest& cm : manifests_) {
      for (const TensorRef& r : cm.tensors()) {
        if (tiered == nullptr || r.expert() < 0) continue;
        tiered->store().ReserveVersions(
            storage::TensorKey{r.layer(), r.expert(), static_cast<storage::TensorKind>(r.kind())},
            r.version());
      }
    }
  }
  const uint64_t seed = choice.reader ? choice.reader->set.seed() : choice.local->seed();
  if (seed != config.seed()) {
    STRATA_LOG(WARNING) << "resuming with seed " << config.seed() << " but checkpoint "
                        << choice.step << " was trained with seed " << seed
                        << ": data order and gate noise will not continue the original run";
  }
  if (choice.reader) {
    RETURN_IF_ERROR(ReadSetParts(*choice.reader, config, model, optimizer, tiered));
    optimizer.set_steps(choice.reader->set.optimizer_steps());
  } else {
    const CheckpointManifest local = *choice.local;
    RETURN_IF_ERROR(ReadLocalDense(local, model, optimizer));
    RETURN_IF_ERROR(ReadLocalExperts(local, config, model, optimizer, tiered));
    optimizer.set_steps(local.optimizer_steps());
  }
  RETURN_IF_ERROR(KeepResumed(choice.invalid, tiered));
  STRATA_LOG(INFO) << "resumed from checkpoint " << choice.step << " in " << options_.dir;
  return choice.step;
}

StatusOr<CheckpointManager::ResumeChoice> CheckpointManager::ChooseCheckpoint(
    const model::MoeTransformer& model, const ResumeAgreement& agree) {
  const std::vector<int64_t> steps = Steps();
  bool holds_every_expert = true;
  for (const auto& ref : model.moe_layers()) {
    holds_every_expert &= ref.layer->num_local_experts() == ref.layer->num_experts();
  }
  // Newest first; nothing is changed until one passes every check. A checkpoint wholly in this
  // shard is read from it (a TIERED store takes its extents as they are); any other is read from
  // the shards that hold what this model needs.
  ResumeChoice choice;
  Status first_error;
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    Status s;
    bool read_here = false;
    {
      absl::MutexLock lock(&mu_);
      const CheckpointSet* set = nullptr;
      for (const CheckpointSet& cs : folder_sets_) {
        if (cs.step() == *step) set = &cs;
      }
      for (const CheckpointSet& cs : sets_) {
        if (cs.step() == *step) set = &cs;
      }
      // A checkpoint wholly in this shard is read from it as it stands only by a model that holds
      // all of it (a worker's shard may hold a checkpoint of a job it trained alone).
      read_here = set == nullptr || (set->shards_size() == 1 &&
                                     set->shards(0).name() == shard_name_ && holds_every_expert);
      if (read_here) {
        StatusOr<CheckpointManifest> local = LocalCheckpointLocked(*step);
        s = local.status();
        if (local.ok()) choice.local = *std::move(local);
      } else {
        choice.reader = std::make_unique<SetReader>(options_, *set);
      }
    }
    // Every extent read back, without the lock: other threads may ask for the lists meanwhile.
    if (read_here && s.ok()) s = VerifyManifest(*choice.local);
    if (!read_here) s = CheckSetParts(*choice.reader, model);
    bool ok = s.ok();
    if (agree) {
      ASSIGN_OR_RETURN(ok, agree(ok));
    }
    if (ok) {
      choice.step = *step;
      break;
    }
    choice.local.reset();
    choice.reader.reset();
    if (s.ok()) {
      s = absl::DataLossError(absl::StrFormat(
          "another worker could not read its part of it (its log says which; `strata ckpt verify "
          "%s %d` checks every part)",
          options_.dir, *step));
    }
    STRATA_LOG(ERROR) << "checkpoint " << *step << " cannot be used: " << s.message();
    if (first_error.ok()) first_error = s;
    choice.invalid.push_back(*step);
  }
  if (choice.step < 0) {
    return absl::DataLossError(
        absl::StrFormat("no checkpoint in '%s' passes its checks; the newest failed with: %s",
                        options_.dir, first_error.message()));
  }
  return choice;
}

void CheckpointManager::AddOlderOutsideFiles(int64_t step, std::vector<int64_t>* invalid) {
  // Older checkpoints with extents beyond the end of their data file go too: that space was never
  // marked used, so new data would overwrite what they list. The first such extent of each, read
  // back without the lock to say why.
  std::vector<std::pair<int64_t, TensorRef>> outside;
  {
    absl::MutexLock lock(&mu_);
    for (const CheckpointManifest& older : manifests_) {
      if (older.step() >= step) break;
      for (const TensorRef& r : older.tensors()) {
        if (!r.has_extent() || !outside_.count(KeyOf(r))) continue;
        outside.emplace_back(older.step(), r);
        break;
      }
    }
  }
  for (const auto& [older, r] : outside) {
    Status s = ssd_->Verify(FromRecord(r.extent()), Describe(r, older, shard_name_));
    STRATA_LOG(ERROR) << "checkpoint " << older << " cannot be used either: " << s.message();
    invalid->push_back(older);
  }
}

Status CheckpointManager::ReadExtent(const TensorRef& r, int64_t step, void* dst,
                                     uint64_t bytes) const {
  if (r.extent().bytes() != bytes) {
    return absl::DataLossError(absl::StrFormat("%s has %d bytes where the model needs %d",
                                               Describe(r, step, shard_name_), r.extent().bytes(),
                                               bytes));
  }
  AlignedBuffer buf(bytes);
  RETURN_IF_ERROR(ssd_->Read(FromRecord(r.extent()), buf.data, Describe(r, step, shard_name_)));
  std::memcpy(dst, buf.data, bytes);
  return absl::OkStatus();
}

Status CheckpointManager::ReadLocalDense(const CheckpointManifest& m, model::MoeTransformer& model,
                                         model::AdamW& optimizer) const {
  // Dense parameters and their moments.
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
  for (const TensorRef& r : m.tensors()) {
    if (r.expert() >= 0) continue;
    if (r.layer() < 0 || r.layer() >= static_cast<int>(dense.size()) ||
        dense[r.layer()]->name != r.name()) {
      return absl::DataLossError(absl::StrFormat("%s does not match the model's dense parameter %d",
                                                 Describe(r, m.step(), shard_name_), r.layer()));
    }
    model::Parameter* p = dense[r.layer()];
    const uint64_t bytes = static_cast<uint64_t>(p->shape.numel()) * sizeof(float);
    const size_t oi = opt_index.at(p);
    const Tensor& dst = r.kind() == 0   ? p->value
                        : r.kind() == 2 ? optimizer.first_moment(oi)
                                        : optimizer.second_moment(oi);
    if (dst.device().is_cpu()) {
      RETURN_IF_ERROR(ReadExtent(r, m.step(), dst.f32(), bytes));
    } else {  // a model on a GPU: through host memory
      std::vector<float> host(static_cast<size_t>(p->shape.numel()));
      RETURN_IF_ERROR(ReadExtent(r, m.step(), host.data(), bytes));
      dst.CopyFromHost(host.data());
    }
  }
  return absl::OkStatus();
}

Status CheckpointManager::ReadLocalExperts(const CheckpointManifest& m,
                                           const config::JobConfig& config,
                                           model::MoeTransformer& model, model::AdamW& optimizer,
                                           scheduler::TieredExpertScheduler* tiered) const {
  std::map<const model::Parameter*, size_t> opt_index;
  for (size_t i = 0; i < optimizer.params().size(); ++i) opt_index[optimizer.params()[i]] = i;
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
      RETURN_IF_ERROR(ReadExtent(r, m.step(), blob.data(), floats * sizeof(float)));
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      const size_t oi = opt_index.at(ps[i]);
      const Tensor& dst = r.kind() == 0   ? ps[i]->value
                          : r.kind() == 2 ? optimizer.first_moment(oi)
                                          : optimizer.second_moment(oi);
      dst.CopyFromHost(blob.data() + layout.segments[i].offset);
    }
  }
  return absl::OkStatus();
}

Status CheckpointManager::KeepResumed(const std::vector<int64_t>& invalid,
                                      scheduler::TieredExpertScheduler* tiered) {
  // Only now is anything changed. The index is reopened for writing and the invalid checkpoints
  // go, giving back the space only they used (the store holds no checkpoint versions yet); then
  // the store learns which versions the kept checkpoints use. Version numbers stay reserved past
  // every checkpoint read, removed ones included.
  absl::MutexLock lock(&mu_);
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
  return absl::OkStatus();
}

void CheckpointManager::RebindStore(scheduler::TieredExpertScheduler* tiered) {
  absl::MutexLock lock(&mu_);
  if (tiered_ != nullptr) tiered_ = tiered;
}

void CheckpointManager::AdoptStore(scheduler::TieredExpertScheduler* tiered) {
  absl::MutexLock lock(&mu_);
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

Status CheckpointManager::VerifyManifest(const CheckpointManifest& m) const {
  for (const TensorRef& r : m.tensors()) {
    if (!r.has_extent()) continue;
    RETURN_IF_ERROR(ssd_->Verify(FromRecord(r.extent()), Describe(r, m.step(), shard_name_)));
  }
  return absl::OkStatus();
}

StatusOr<CheckpointManifest> CheckpointManager::LocalCheckpointLocked(int64_t step) const {
  const CheckpointManifest* local = nullptr;
  for (const CheckpointManifest& cm : manifests_) {
    if (cm.step() == step) local = &cm;
  }
  // Resume calls this only for a checkpoint wholly in this shard (or of a folder written before
  // sharding); any other is read through a SetReader.
  for (const CheckpointSet& cs : sets_) {
    if (cs.step() != step) continue;
    if (local == nullptr) {
      return absl::DataLossError(absl::StrFormat(
          "%s: the shard has no local checkpoint of that step (the global manifest names "
          "sequence %d in '%s'): the shard was deleted or rewritten",
          Where(step, shard_name_), FindShard(cs, shard_name_)->local_sequence(), shard_dir_));
    }
    RETURN_IF_ERROR(MatchesSet(*local, cs, shard_name_));
  }
  if (local == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("no checkpoint of step %d in '%s'", step, options_.dir));
  }
  return *local;
}

}  // namespace strata::checkpoint
