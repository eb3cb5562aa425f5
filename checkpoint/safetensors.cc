#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "checkpoint/manager.h"
#include "checkpoint/manager_internal.h"
#include "core/common/json.h"
#include "core/common/thread_pool.h"
#include "proto/config_io.h"
#include "runtime/model/gate.h"
#include "runtime/model/transformer.h"
#include "storage/env.h"

namespace strata::checkpoint {

std::string ExportConfigPath(const std::string& out_path) {
  constexpr absl::string_view kExt = ".safetensors";
  if (absl::EndsWith(out_path, kExt)) {
    return out_path.substr(0, out_path.size() - kExt.size()) + ".json";
  }
  return out_path + ".json";
}

std::string SafetensorsName(const std::string& name, bool swiglu) {
  static const std::map<std::string, std::string> kTop = {{"wte", "model.embed_tokens.weight"},
                                                          {"wpe", "model.embed_positions.weight"},
                                                          {"lnf.weight", "model.norm.weight"},
                                                          {"lnf.bias", "model.norm.bias"},
                                                          {"lm_head", "lm_head.weight"}};
  if (auto it = kTop.find(name); it != kTop.end()) return it->second;
  const std::vector<std::string> parts = absl::StrSplit(name, '.');
  int layer = 0;
  if (parts.size() < 3 || parts[0] != "blocks" || !absl::SimpleAtoi(parts[1], &layer)) {
    return "strata." + name;
  }
  const std::string prefix = absl::StrCat("model.layers.", layer, ".");
  const std::string rest = name.substr(parts[0].size() + parts[1].size() + 2);
  static const std::map<std::string, std::string> kBlock = {
      {"ln1.weight", "input_layernorm.weight"},
      {"ln1.bias", "input_layernorm.bias"},
      {"ln2.weight", "post_attention_layernorm.weight"},
      {"ln2.bias", "post_attention_layernorm.bias"},
      {"attn.qkv.weight", "self_attn.qkv_proj.weight"},
      {"attn.qkv.bias", "self_attn.qkv_proj.bias"},
      {"attn.proj.weight", "self_attn.o_proj.weight"},
      {"attn.proj.bias", "self_attn.o_proj.bias"},
      {"moe.gate.router", "mlp.gate.weight"},
      {"moe.gate.router_bias", "mlp.gate.e_score_correction_bias"},
      {"moe.gate.noise_router", "mlp.gate.noise.weight"}};
  if (auto it = kBlock.find(rest); it != kBlock.end()) return prefix + it->second;
  // An FFN's four tensors under its folder in the file.
  const std::string up = swiglu ? "gate_up_proj" : "up_proj";
  const std::map<std::string, std::string> ffn = {{"w1", up + ".weight"},
                                                  {"b1", up + ".bias"},
                                                  {"w2", "down_proj.weight"},
                                                  {"b2", "down_proj.bias"}};
  const std::string& last = parts.back();
  auto tensor = ffn.find(last);
  if (tensor == ffn.end()) return "strata." + name;
  if (parts.size() == 4 && parts[2] == "ffn") return prefix + "mlp." + tensor->second;
  if (parts.size() == 5 && parts[2] == "moe" && parts[3] == "shared") {
    return prefix + "mlp.shared_experts." + tensor->second;
  }
  int expert = 0;
  if (parts.size() == 6 && parts[2] == "moe" && parts[3] == "experts" &&
      absl::SimpleAtoi(parts[4], &expert)) {
    return absl::StrCat(prefix, "mlp.experts.", expert, ".", tensor->second);
  }
  return "strata." + name;
}

namespace {

const char* ActivationName(config::ModelConfig::Activation a) {
  switch (a) {
    case config::ModelConfig::RELU:
      return "relu";
    case config::ModelConfig::SWIGLU:
      return "swiglu";
    case config::ModelConfig::GELU:
      break;
  }
  return "gelu_tanh";
}

const char* GateTypeName(config::GateConfig::Type t) {
  switch (t) {
    case config::GateConfig::SWITCH:
      return "switch";
    case config::GateConfig::GSHARD:
      return "gshard";
    case config::GateConfig::NOISY_TOP_K:
      return "noisy_top_k";
    case config::GateConfig::EXPERT_CHOICE:
      return "expert_choice";
    case config::GateConfig::TOP_K:
      break;
  }
  return "top_k";
}

// The architecture a reader needs, with the router as it runs at inference.
std::string ConfigJson(const CheckpointManager::ModelOfCheckpoint& ckpt,
                       model::MoeTransformer& model) {
  const config::ModelConfig& m = ckpt.model;
  JsonWriter j;
  j.BeginObject()
      .Field("format", "strata-moe")
      .Field("format_version", 1)
      .Field("step", ckpt.step)
      .Field("vocab_size", m.vocab_size())
      .Field("seq_len", m.seq_len())
      .Field("d_model", m.d_model())
      .Field("n_layers", m.n_layers())
      .Field("n_heads", m.n_heads())
      .Field("d_ff", m.d_ff())
      .Field("norm", m.norm() == config::ModelConfig::RMS_NORM ? "rms_norm" : "layer_norm")
      .Field("norm_eps", static_cast<double>(m.norm_eps()))
      .Field("activation", ActivationName(m.activation()))
      .Field("tie_embeddings", m.tie_embeddings());
  std::vector<int64_t> moe_blocks;
  for (const auto& ref : model.moe_layers()) moe_blocks.push_back(ref.block);
  j.Key("moe_layers").IntArray(moe_blocks);
  if (!model.moe_layers().empty()) {
    const config::MoeConfig& moe = m.moe();
    model::Gate& gate = model.moe_layers()[0].layer->gate();
    j.Key("moe")
        .BeginObject()
        .Field("num_experts", moe.num_experts())
        .Field("d_expert", moe.d_expert())
        .Field("expert_bias", moe.expert_bias())
        .Field("shared_experts_width",
               static_cast<int64_t>(moe.num_shared_experts()) * moe.shared_d_expert());
    j.Key("router").BeginObject().Field("type", GateTypeName(moe.gate().type()));
    j.Field("k", gate.k());
    if (auto* sg = dynamic_cast<model::SoftmaxGate*>(&gate)) {
      const ops::MoeRouterSpec spec = sg->Spec();
      j.Field("score", spec.sigmoid ? "sigmoid" : "softmax")
          .Field("renormalize", spec.renormalize)
          .Field("scaling", static_cast<double>(spec.scaling))
          .Field("num_groups", spec.num_groups)
          .Field("topk_groups", spec.topk_groups)
          .Field("selection_bias", sg->selection_bias() != nullptr);
    }
    j.EndObject().EndObject();
  }
  j.Field("strata_model_config", ModelText(m));
  j.EndObject();
  return j.str() + "\n";
}

// pwrite of all `n` bytes at `offset`.
Status WriteAt(int fd, const void* data, uint64_t n, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      return absl::InternalError(
          absl::StrFormat("writing '%s' failed: %s", path, std::strerror(errno)));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<ExportReport> ExportSafetensors(const std::string& dir, int64_t step,
                                         const std::string& out_path) {
  ASSIGN_OR_RETURN(const CheckpointManager::ModelOfCheckpoint ckpt,
                   CheckpointManager::ReadModelConfig(dir, step));
  ThreadPool pool(1);
  ops::Context ctx;
  ctx.pool = &pool;
  model::ModelOptions mo;
  mo.config = ckpt.model;
  mo.seed = ckpt.seed;
  mo.unbound_experts = true;  // the experts stream from the shards to the file
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeTransformer> model,
                   model::MoeTransformer::Create(ctx, mo));
  const bool swiglu = ckpt.model.activation() == config::ModelConfig::SWIGLU;

  // The header: every parameter's place in the data, in Parameters() order.
  std::map<const model::Parameter*, uint64_t> offset;
  JsonWriter h;
  h.BeginObject().Key("__metadata__").BeginObject();
  h.Field("format", "pt").Field("producer", "strata").EndObject();
  uint64_t data_bytes = 0;
  for (const model::Parameter* p : model->Parameters()) {
    const uint64_t bytes = static_cast<uint64_t>(p->shape.numel()) * sizeof(float);
    offset[p] = data_bytes;
    std::vector<int64_t> shape;
    for (int i = 0; i < p->shape.rank(); ++i) shape.push_back(p->shape[i]);
    h.Key(SafetensorsName(p->name, swiglu)).BeginObject().Field("dtype", "F32");
    h.Key("shape").IntArray(shape);
    h.Key("data_offsets")
        .IntArray({static_cast<int64_t>(data_bytes), static_cast<int64_t>(data_bytes + bytes)});
    h.EndObject();
    data_bytes += bytes;
  }
  h.EndObject();
  std::string header = h.str();
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t data_start = 8 + header.size();

  const std::string tmp = absl::StrCat(out_path, ".tmp-", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "cannot create '%s' next to the export: %s; is the folder there and writable?", tmp,
        std::strerror(errno)));
  }
  auto fail = [&](const Status& s) {
    close(fd);
    unlink(tmp.c_str());
    return s;
  };
  uint8_t size_le[8];
  for (int i = 0; i < 8; ++i) size_le[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  if (Status s = WriteAt(fd, size_le, 8, 0, tmp); !s.ok()) return fail(s);
  if (Status s = WriteAt(fd, header.data(), header.size(), 8, tmp); !s.ok()) return fail(s);

  // Experts as they stream from the shards; then the ones the checkpoint holds at their
  // initialisation, generated from the seed; then the dense weights ReadWeights left in the model.
  const auto& layers = model->moe_layers();
  std::vector<std::vector<bool>> written(layers.size());
  for (size_t li = 0; li < layers.size(); ++li)
    written[li].assign(layers[li].layer->num_experts(), false);
  auto write_expert = [&](int li, int e, const float* blob) -> Status {
    std::vector<model::Parameter*> ps = layers[li].layer->expert(e).Parameters();
    const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
    for (size_t i = 0; i < ps.size(); ++i) {
      RETURN_IF_ERROR(WriteAt(fd, blob + layout.segments[i].offset,
                              static_cast<uint64_t>(ps[i]->shape.numel()) * sizeof(float),
                              data_start + offset.at(ps[i]), tmp));
    }
    written[li][e] = true;
    return absl::OkStatus();
  };
  if (Status s = CheckpointManager::ReadWeights(dir, ckpt.step, ckpt.seed, *model, write_expert);
      !s.ok()) {
    return fail(s);
  }
  for (size_t li = 0; li < layers.size(); ++li) {
    for (int64_t e = 0; e < layers[li].layer->num_experts(); ++e) {
      if (written[li][e]) continue;
      std::vector<model::Parameter*> ps = layers[li].layer->expert(e).Parameters();
      const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
      std::vector<float> blob(static_cast<size_t>(layout.floats));
      for (size_t i = 0; i < ps.size(); ++i) {
        model::InitialValues(*ps[i], ckpt.seed, blob.data() + layout.segments[i].offset);
      }
      if (Status s = write_expert(static_cast<int>(li), static_cast<int>(e), blob.data());
          !s.ok()) {
        return fail(s);
      }
    }
  }
  std::vector<float> host;
  for (const model::Parameter* p : model->DenseParameters()) {
    host.resize(static_cast<size_t>(p->shape.numel()));
    p->value.CopyToHost(host.data());
    if (Status s =
            WriteAt(fd, host.data(), host.size() * sizeof(float), data_start + offset.at(p), tmp);
        !s.ok()) {
      return fail(s);
    }
  }
  if (fsync(fd) != 0) {
    return fail(absl::InternalError(
        absl::StrFormat("syncing '%s': %s (is the disk full?)", tmp, std::strerror(errno))));
  }
  close(fd);
  ExportReport r;
  r.step = ckpt.step;
  r.workers = ckpt.workers;
  r.tensors = static_cast<int64_t>(offset.size());
  r.bytes = data_start + data_bytes;
  r.config_path = ExportConfigPath(out_path);
  if (Status s = storage::Env::Default()->WriteFileAtomic(r.config_path, ConfigJson(ckpt, *model));
      !s.ok()) {
    unlink(tmp.c_str());
    return s;
  }
  if (rename(tmp.c_str(), out_path.c_str()) != 0) {
    const Status s = absl::InternalError(
        absl::StrFormat("renaming '%s' to '%s': %s", tmp, out_path, std::strerror(errno)));
    unlink(tmp.c_str());
    return s;
  }
  return r;
}

}  // namespace strata::checkpoint
