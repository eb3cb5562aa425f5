#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/manager.h"
#include "checkpoint/manager_internal.h"
#include "core/common/json.h"
#include "core/common/thread_pool.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "proto/config_io.h"
#include "runtime/model/gate.h"
#include "runtime/model/transformer.h"
#include "storage/crc32c.h"
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
    // Above 0 a token's route depends on its batch (capacity at evaluation).
    j.Field("capacity_factor_eval", static_cast<double>(moe.gate().capacity_factor_eval()));
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

StatusOr<SafetensorsWritten> WriteSafetensors(
    model::MoeTransformer& model, const std::string& out_path,
    const std::function<Status(const CheckpointManager::ExpertSink&)>& stream_experts) {
  const bool swiglu = model.config().activation() == config::ModelConfig::SWIGLU;
  // The header: every parameter's place in the data, in Parameters() order.
  std::map<const model::Parameter*, uint64_t> offset;
  JsonWriter h;
  h.BeginObject().Key("__metadata__").BeginObject();
  h.Field("format", "pt").Field("producer", "strata").EndObject();
  uint64_t data_bytes = 0;
  for (const model::Parameter* p : model.Parameters()) {
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

  // Unbound experts as they stream in; then every parameter the model holds.
  const auto& layers = model.moe_layers();
  std::vector<std::vector<bool>> written(layers.size());
  for (size_t li = 0; li < layers.size(); ++li) {
    written[li].assign(static_cast<size_t>(layers[li].layer->num_local_experts()), false);
  }
  auto write_expert = [&](int li, int e, const float* blob) -> Status {
    model::MoeLayer& layer = *layers[li].layer;
    std::vector<model::Parameter*> ps = layer.expert(layer.first_local_expert() + e).Parameters();
    const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
    for (size_t i = 0; i < ps.size(); ++i) {
      RETURN_IF_ERROR(WriteAt(fd, blob + layout.segments[i].offset,
                              static_cast<uint64_t>(ps[i]->shape.numel()) * sizeof(float),
                              data_start + offset.at(ps[i]), tmp));
    }
    written[li][e] = true;
    return absl::OkStatus();
  };
  if (stream_experts) {
    if (Status s = stream_experts(write_expert); !s.ok()) return fail(s);
  }
  std::vector<float> host;
  for (const model::Parameter* p : model.Parameters()) {
    if (!p->value.defined()) continue;  // an unbound expert's: streamed
    host.resize(static_cast<size_t>(p->shape.numel()));
    p->value.CopyToHost(host.data());
    if (Status s =
            WriteAt(fd, host.data(), host.size() * sizeof(float), data_start + offset.at(p), tmp);
        !s.ok()) {
      return fail(s);
    }
  }
  for (size_t li = 0; li < layers.size(); ++li) {
    model::MoeLayer& layer = *layers[li].layer;
    for (size_t e = 0; e < written[li].size(); ++e) {
      const bool unbound = !layer.expert(layer.first_local_expert() + static_cast<int64_t>(e))
                                .Parameters()
                                .front()
                                ->value.defined();
      if (unbound && !written[li][e]) {
        return fail(absl::InternalError(absl::StrFormat(
            "the weights of expert %d of block %d never reached the export",
            layer.first_local_expert() + static_cast<int64_t>(e), layers[li].block)));
      }
    }
  }
  if (fsync(fd) != 0) {
    return fail(absl::InternalError(
        absl::StrFormat("syncing '%s': %s (is the disk full?)", tmp, std::strerror(errno))));
  }
  close(fd);
  if (rename(tmp.c_str(), out_path.c_str()) != 0) {
    const Status s = absl::InternalError(
        absl::StrFormat("renaming '%s' to '%s': %s", tmp, out_path, std::strerror(errno)));
    unlink(tmp.c_str());
    return s;
  }
  return SafetensorsWritten{static_cast<int64_t>(offset.size()), data_start + data_bytes};
}

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
  // ReadWeights reads the dense weights into the model and streams every expert it stores; an
  // expert the checkpoint holds at its initialisation is generated from the seed.
  auto stream = [&](const CheckpointManager::ExpertSink& sink) -> Status {
    const auto& layers = model->moe_layers();
    std::vector<std::vector<bool>> seen(layers.size());
    for (size_t li = 0; li < layers.size(); ++li) {
      seen[li].assign(static_cast<size_t>(layers[li].layer->num_experts()), false);
    }
    RETURN_IF_ERROR(CheckpointManager::ReadWeights(dir, ckpt.step, ckpt.seed, *model,
                                                   [&](int li, int e, const float* blob) {
                                                     seen[li][e] = true;
                                                     return sink(li, e, blob);
                                                   }));
    for (size_t li = 0; li < layers.size(); ++li) {
      for (int64_t e = 0; e < layers[li].layer->num_experts(); ++e) {
        if (seen[li][e]) continue;
        std::vector<model::Parameter*> ps = layers[li].layer->expert(e).Parameters();
        const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
        std::vector<float> blob(static_cast<size_t>(layout.floats));
        for (size_t i = 0; i < ps.size(); ++i) {
          model::InitialValues(*ps[i], ckpt.seed, blob.data() + layout.segments[i].offset);
        }
        RETURN_IF_ERROR(sink(static_cast<int>(li), static_cast<int>(e), blob.data()));
      }
    }
    return absl::OkStatus();
  };
  ASSIGN_OR_RETURN(const SafetensorsWritten w, WriteSafetensors(*model, out_path, stream));
  ExportReport r;
  r.step = ckpt.step;
  r.workers = ckpt.workers;
  r.tensors = w.tensors;
  r.bytes = w.bytes;
  r.config_path = ExportConfigPath(out_path);
  if (Status s = storage::Env::Default()->WriteFileAtomic(r.config_path, ConfigJson(ckpt, *model));
      !s.ok()) {
    unlink(out_path.c_str());
    return s;
  }
  return r;
}

StatusOr<uint32_t> ImportSafetensors(const std::string& path, model::MoeTransformer& model,
                                     const CheckpointManager::ExpertSink& expert_sink) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrFormat("cannot open the safetensors file '%s': %s", path, std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  const off_t size = lseek(fd, 0, SEEK_END);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("'%s' is not a safetensors file strata can read: %s", path, why));
  };
  auto read_at = [&](void* dst, uint64_t n, uint64_t at) -> Status {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = pread(fd, p, n, static_cast<off_t>(at));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        return absl::DataLossError(
            absl::StrFormat("reading '%s' at byte %d: %s", path, at,
                            r == 0 ? "the file ends" : std::strerror(errno)));
      }
      p += r;
      n -= static_cast<uint64_t>(r);
      at += static_cast<uint64_t>(r);
    }
    return absl::OkStatus();
  };
  if (size < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cannot read '%s' as a safetensors file: %s", path, std::strerror(errno)));
  }
  uint8_t size_le[8];
  if (size < 8) return bad("it is shorter than 8 bytes");
  RETURN_IF_ERROR(read_at(size_le, 8, 0));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(size_le[i]) << (8 * i);
  if (n > (100u << 20) || 8 + n > static_cast<uint64_t>(size)) {
    return bad(absl::StrFormat("its header size %d does not fit its %d bytes", n, size));
  }
  std::string header(n, '\0');
  RETURN_IF_ERROR(read_at(header.data(), n, 8));
  google::protobuf::Struct json;
  if (const auto st = google::protobuf::util::JsonStringToMessage(header, &json); !st.ok()) {
    return bad(absl::StrCat("its header is not JSON (", st.ToString(), ")"));
  }
  // A JSON number that is a whole byte count or dimension: non-negative, integral, below 2^53.
  auto whole = [](const google::protobuf::Value& v, uint64_t* out) {
    const double d = v.number_value();
    if (!(d >= 0 && d < 9007199254740992.0 && d == static_cast<double>(static_cast<int64_t>(d)))) {
      return false;
    }
    *out = static_cast<uint64_t>(d);
    return true;
  };
  const uint64_t data_start = 8 + n, data_bytes = static_cast<uint64_t>(size) - data_start;
  struct Entry {
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;
  };
  std::map<std::string, Entry> tensors;
  for (const auto& [name, v] : json.fields()) {
    if (name == "__metadata__") continue;
    const auto& f = v.struct_value().fields();
    auto field = [&](const char* key) -> const google::protobuf::Value* {
      auto it = f.find(key);
      return it == f.end() ? nullptr : &it->second;
    };
    const google::protobuf::Value* dtype = field("dtype");
    const google::protobuf::Value* shape = field("shape");
    const google::protobuf::Value* offsets = field("data_offsets");
    if (dtype == nullptr || shape == nullptr || offsets == nullptr ||
        offsets->list_value().values_size() != 2) {
      return bad(absl::StrFormat("tensor %s lacks dtype, shape or data_offsets", name));
    }
    if (dtype->string_value() != "F32") {
      return bad(absl::StrFormat("tensor %s is %s; strata reads F32 (float32) tensors", name,
                                 dtype->string_value()));
    }
    Entry e;
    uint64_t count = 1;
    for (const auto& d : shape->list_value().values()) {
      uint64_t dim = 0;
      if (!whole(d, &dim) || (dim > 0 && count > data_bytes / dim)) {
        return bad(
            absl::StrFormat("tensor %s has a shape that is not whole dimensions within the "
                            "file",
                            name));
      }
      e.shape.push_back(static_cast<int64_t>(dim));
      count *= dim;
    }
    if (!whole(offsets->list_value().values(0), &e.begin) ||
        !whole(offsets->list_value().values(1), &e.end) || e.end < e.begin || e.end > data_bytes ||
        e.end - e.begin != count * sizeof(float)) {
      return bad(
          absl::StrFormat("tensor %s's data_offsets [%d, %d) do not hold its shape within "
                          "the file's %d bytes of data",
                          name, e.begin, e.end, data_bytes));
    }
    tensors[name] = std::move(e);
  }
  // The file holds this model's tensors: as many as the whole model has (every worker's experts).
  const auto& layers = model.moe_layers();
  size_t want = model.DenseParameters().size();
  for (const auto& ref : layers) {
    const model::MoeLayer& l = *ref.layer;
    if (l.num_local_experts() > 0) {
      want += static_cast<size_t>(l.num_experts()) *
              const_cast<model::MoeLayer&>(l).expert(l.first_local_expert()).Parameters().size();
    }
  }
  const bool countable = layers.empty() || layers[0].layer->num_local_experts() > 0;
  if (countable && tensors.size() != want) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "'%s' holds %d tensors, but this model has %d: it is the export of another model", path,
        tensors.size(), want));
  }
  const bool swiglu = model.config().activation() == config::ModelConfig::SWIGLU;
  // Every tensor the model holds is checked before any is read.
  auto find = [&](const model::Parameter& p) -> StatusOr<const Entry*> {
    const std::string name = SafetensorsName(p.name, swiglu);
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("'%s' has no tensor %s (strata's %s): it is not an export of this model",
                          path, name, p.name));
    }
    std::vector<int64_t> shape;
    for (int i = 0; i < p.shape.rank(); ++i) shape.push_back(p.shape[i]);
    if (it->second.shape != shape) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "tensor %s is [%s] in '%s', but this model's %s is [%s]: the file is of another model",
          name, absl::StrJoin(it->second.shape, ", "), path, p.name, absl::StrJoin(shape, ", ")));
    }
    return &it->second;
  };
  for (const model::Parameter* p : model.Parameters()) RETURN_IF_ERROR(find(*p).status());
  auto read = [&](const model::Parameter& p, float* dst) -> Status {
    ASSIGN_OR_RETURN(const Entry* e, find(p));
    return read_at(dst, e->end - e->begin, data_start + e->begin);
  };
  // What every worker reads alike: the header (names, shapes, offsets) and the dense tensors.
  uint32_t crc = storage::Crc32c(header.data(), header.size());
  std::vector<float> host;
  for (model::Parameter* p : model.DenseParameters()) {
    host.resize(static_cast<size_t>(p->shape.numel()));
    RETURN_IF_ERROR(read(*p, host.data()));
    crc = storage::Crc32c(crc, host.data(), host.size() * sizeof(float));
    p->value.CopyFromHost(host.data());
  }
  for (size_t li = 0; li < layers.size(); ++li) {
    model::MoeLayer& layer = *layers[li].layer;
    for (int64_t e = 0; e < layer.num_local_experts(); ++e) {
      std::vector<model::Parameter*> ps = layer.expert(layer.first_local_expert() + e).Parameters();
      if (ps.front()->value.defined()) {
        for (model::Parameter* p : ps) {
          host.resize(static_cast<size_t>(p->shape.numel()));
          RETURN_IF_ERROR(read(*p, host.data()));
          p->value.CopyFromHost(host.data());
        }
        continue;
      }
      CHECK(expert_sink) << "ImportSafetensors: a model with unbound experts needs an expert sink";
      const model::ExpertLayout layout = model::ExpertLayout::Of(ps);
      host.assign(static_cast<size_t>(layout.floats), 0.0f);
      for (size_t i = 0; i < ps.size(); ++i) {
        RETURN_IF_ERROR(read(*ps[i], host.data() + layout.segments[i].offset));
      }
      RETURN_IF_ERROR(expert_sink(static_cast<int>(li), static_cast<int>(e), host.data()));
    }
  }
  return crc;
}

}  // namespace strata::checkpoint
