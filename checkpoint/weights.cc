// Read-only access to a checkpoint's model, for evaluation and inference: which model it holds,
// and its weights read into a model built from that (CheckpointManager::ReadModelConfig,
// ReadWeights).
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/manager_internal.h"
#include "google/protobuf/text_format.h"

namespace strata::checkpoint {

StatusOr<CheckpointManager::FolderEntry> CheckpointManager::ReadEntry(const std::string& dir,
                                                                      int64_t step) {
  ASSIGN_OR_RETURN(std::vector<FolderEntry> entries, ReadFolder(dir));
  if (entries.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "no checkpoints in '%s' (a checkpoint folder is the one given to --checkpoint-dir or "
        "checkpoint.dir; `strata ckpt ls DIR` lists one)",
        dir));
  }
  const FolderEntry* e = &entries.back();
  if (step >= 0) {
    e = nullptr;
    std::vector<std::string> steps;
    for (const FolderEntry& f : entries) {
      steps.push_back(absl::StrCat(f.step));
      if (f.step == step) e = &f;
    }
    if (e == nullptr) {
      return absl::NotFoundError(absl::StrFormat("no checkpoint of step %d in '%s'; it holds %s",
                                                 step, dir, absl::StrJoin(steps, ", ")));
    }
  }
  for (const FolderEntry::Part& part : e->parts) {
    if (!part.local.ok()) {
      return Status(part.local.status().code(),
                    absl::StrFormat("checkpoint %d in '%s' cannot be read: %s; `strata ckpt ls "
                                    "%s` lists the others, and --step N takes one of them",
                                    e->step, dir, part.local.status().message(), dir));
    }
  }
  return *e;
}

StatusOr<CheckpointManager::ModelOfCheckpoint> CheckpointManager::ReadModelConfig(
    const std::string& dir, int64_t step) {
  ASSIGN_OR_RETURN(FolderEntry e, ReadEntry(dir, step));
  const CheckpointManifest& first = *e.parts.front().local;
  ModelOfCheckpoint out;
  out.step = e.step;
  out.seed = e.set ? e.set->seed() : first.seed();
  out.workers = e.set ? e.set->workers() : std::max(1, first.workers());
  const std::string& text = e.set ? e.set->model_config() : first.model_config();
  if (!google::protobuf::TextFormat::ParseFromString(text, &out.model)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "checkpoint %d in '%s': its manifest's model config does not parse as this strata's "
        "ModelConfig (was it written by another version of strata?):\n%s",
        e.step, dir, text));
  }
  if (CheckpointManager::ConfigHash(out.model) !=
      (e.set ? e.set->config_hash() : first.config_hash())) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint %d in '%s': its manifest's model config does not match the hash the manifest "
        "records for it; the manifest is damaged",
        e.step, dir));
  }
  return out;
}

Status CheckpointManager::ReadWeights(const std::string& dir, int64_t step, uint64_t seed,
                                      model::MoeTransformer& model, const ExpertSink& expert_sink) {
  for (const auto& ref : model.moe_layers()) {
    if (ref.layer->num_local_experts() != ref.layer->num_experts()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ReadWeights needs a model holding every expert in memory; block %d holds %d of %d",
          ref.block, ref.layer->num_local_experts(), ref.layer->num_experts()));
    }
  }
  ASSIGN_OR_RETURN(FolderEntry e, ReadEntry(dir, step));
  const uint64_t hash = e.set ? e.set->config_hash() : e.parts.front().local->config_hash();
  if (ConfigHash(model.config()) != hash) {
    const std::string text = e.set ? e.set->model_config() : e.parts.front().local->model_config();
    return absl::FailedPreconditionError(
        absl::StrFormat("checkpoint %d in '%s' holds another model than the one built: %s", e.step,
                        dir, ConfigDiff(text, ModelText(model.config()))));
  }
  // Where every weight tensor lies: the part (shard) and its stored version. Each expert and
  // dense parameter is written by exactly one shard of a set.
  struct Where {
    size_t part = 0;
    TensorRef ref;
  };
  std::map<std::string, Where> dense;
  std::map<std::pair<int32_t, int32_t>, Where> experts;  // (block, expert)
  for (size_t i = 0; i < e.parts.size(); ++i) {
    for (const TensorRef& r : e.parts[i].local->tensors()) {
      if (r.kind() != static_cast<int32_t>(storage::TensorKind::kWeights)) continue;
      if (r.expert() >= 0) {
        experts[{r.layer(), r.expert()}] = Where{i, r};
      } else {
        dense[r.name()] = Where{i, r};
      }
    }
  }
  std::vector<std::unique_ptr<storage::SsdTier>> ssds(e.parts.size());
  // Reads `w`'s tensor (`floats` of them) into `dst`, checking its size and CRC.
  auto read = [&](const Where& w, float* dst, int64_t floats) -> Status {
    const std::string& shard = e.parts[w.part].shard;
    const std::string what = Describe(w.ref, e.step, shard);
    const uint64_t bytes = static_cast<uint64_t>(floats) * sizeof(float);
    if (w.ref.extent().bytes() != bytes) {
      return absl::DataLossError(absl::StrFormat("%s has %d bytes where the model needs %d", what,
                                                 w.ref.extent().bytes(), bytes));
    }
    if (!ssds[w.part]) {
      ASSIGN_OR_RETURN(ssds[w.part], OpenSsd(CheckpointOptions(), ShardDir(dir, shard)));
    }
    AlignedBuffer buf(bytes);
    RETURN_IF_ERROR(ssds[w.part]->Read(FromRecord(w.ref.extent()), buf.data, what));
    std::memcpy(dst, buf.data, bytes);
    return absl::OkStatus();
  };
  for (model::Parameter* p : model.DenseParameters()) {
    auto it = dense.find(p->name);
    if (it == dense.end()) {
      return absl::DataLossError(
          absl::StrFormat("checkpoint %d in '%s' holds no weights of %s", e.step, dir, p->name));
    }
    std::vector<float> host(static_cast<size_t>(p->shape.numel()));
    if (it->second.ref.generated()) {
      model::InitialValues(*p, seed, host.data());
    } else {
      RETURN_IF_ERROR(read(it->second, host.data(), p->shape.numel()));
    }
    p->value.CopyFromHost(host.data());
  }
  const std::vector<model::MoeTransformer::MoeLayerRef>& layers = model.moe_layers();
  for (size_t li = 0; li < layers.size(); ++li) {
    const auto& ref = layers[li];
    for (int64_t x = 0; x < ref.layer->num_experts(); ++x) {
      auto it = experts.find({ref.block, static_cast<int32_t>(x)});
      if (it == experts.end()) {
        return absl::DataLossError(
            absl::StrFormat("checkpoint %d in '%s' holds no weights of expert %d of block %d",
                            e.step, dir, x, ref.block));
      }
      std::vector<model::Parameter*> ps = ref.layer->expert(x).Parameters();
      const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
      std::vector<float> blob(static_cast<size_t>(layout.floats), 0.0f);
      if (!ps.front()->value.defined()) {  // unbound: the residency's
        CHECK(expert_sink) << "ReadWeights: a model with unbound experts needs an expert sink";
        if (it->second.ref.generated()) continue;
        RETURN_IF_ERROR(read(it->second, blob.data(), layout.floats));
        RETURN_IF_ERROR(expert_sink(static_cast<int>(li), static_cast<int>(x), blob.data()));
        continue;
      }
      if (it->second.ref.generated()) {
        for (size_t i = 0; i < ps.size(); ++i) {
          model::InitialValues(*ps[i], seed, blob.data() + layout.segments[i].offset);
        }
      } else {
        RETURN_IF_ERROR(read(it->second, blob.data(), layout.floats));
      }
      for (size_t i = 0; i < ps.size(); ++i) {
        ps[i]->value.CopyFromHost(blob.data() + layout.segments[i].offset);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::checkpoint
