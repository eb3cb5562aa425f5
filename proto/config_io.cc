#include "proto/config_io.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace strata::config {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::TextFormat;

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Makes protobuf's parse errors say which field and what to do.
class ErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  ErrorCollector(std::string source, const std::string& text)
      : source_(std::move(source)), lines_(absl::StrSplit(text, '\n')) {}

  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    std::string msg = message;
    static const std::regex kUnknown(R"re(Message type "([\w.]+)" has no field named "(\w+)")re");
    std::smatch m;
    if (std::regex_search(message, m, kUnknown)) {
      const Descriptor* d =
          google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(m[1].str());
      msg = absl::StrFormat("unknown field '%s' in %s", m[2].str(), m[1].str());
      if (d != nullptr) {
        std::vector<std::string> names;
        std::string best;
        size_t best_d = 1000;
        for (int i = 0; i < d->field_count(); ++i) {
          names.push_back(d->field(i)->name());
          size_t dist = EditDistance(m[2].str(), d->field(i)->name());
          if (dist < best_d) best_d = dist, best = d->field(i)->name();
        }
        if (best_d <= 3) absl::StrAppend(&msg, "; did you mean '", best, "'?");
        absl::StrAppend(&msg, " (fields of ", d->name(), ": ", absl::StrJoin(names, ", "), ")");
      }
    } else {
      std::string field = FieldAt(line, column);
      if (!field.empty()) msg = absl::StrCat("field ", field, ": ", message);
      absl::StrAppend(&msg, "; see proto/config.proto for each field's type and default");
    }
    errors_.push_back(absl::StrFormat("%s:%d:%d: %s", source_, line + 1, column + 1, msg));
  }

  const std::vector<std::string>& errors() const { return errors_; }

 private:
  // The field being assigned where the error is: the last "name:" before the column.
  std::string FieldAt(int line, int column) const {
    if (line < 0 || line >= static_cast<int>(lines_.size())) return "";
    std::string prefix = lines_[line].substr(0, std::max(0, column));
    static const std::regex kField(R"re((\w+)\s*:)re");
    std::string field;
    for (std::sregex_iterator it(prefix.begin(), prefix.end(), kField), end; it != end; ++it) {
      field = (*it)[1].str();
    }
    return field;
  }

  std::string source_;
  std::vector<std::string> lines_;
  std::vector<std::string> errors_;
};

// Validation with source locations. A field is named by its path from JobConfig, e.g.
// {"model", "moe", "top_k"}; the location comes from the parse tree when the field was written in
// the file, and "(default)" is said otherwise.
class Validator {
 public:
  Validator(const JobConfig& config, std::string source, const TextFormat::ParseInfoTree* tree)
      : config_(config), source_(std::move(source)), tree_(tree) {}

  void Require(bool ok, const std::vector<std::string>& path, const std::string& what) {
    if (ok) return;
    errors_.push_back(absl::StrCat(Where(path), "field ", absl::StrJoin(path, "."), ": ", what));
  }

  Status Result() const {
    if (errors_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("invalid config ", source_, ":\n  ", absl::StrJoin(errors_, "\n  ")));
  }

 private:
  std::string Where(const std::vector<std::string>& path) const {
    if (tree_ == nullptr) return absl::StrCat(source_, ": ");
    const Descriptor* d = JobConfig::descriptor();
    const TextFormat::ParseInfoTree* t = tree_;
    for (size_t i = 0; i < path.size(); ++i) {
      const FieldDescriptor* f = d ? d->FindFieldByName(path[i]) : nullptr;
      if (f == nullptr || t == nullptr) break;
      if (i + 1 == path.size()) {
        auto loc = t->GetLocation(f, -1);
        if (loc.line >= 0) {
          return absl::StrFormat("%s:%d:%d: ", source_, loc.line + 1, loc.column + 1);
        }
        break;
      }
      t = t->GetTreeForNested(f, -1);
      d = f->message_type();
    }
    return absl::StrCat(source_, ": (default value) ");
  }

  const JobConfig& config_;
  std::string source_;
  const TextFormat::ParseInfoTree* tree_;
  std::vector<std::string> errors_;
};

bool Finite(double v) { return std::isfinite(v); }

bool any_moe_layer(const ModelConfig& m) {
  for (int l = 0; l < m.n_layers(); ++l) {
    if (IsMoeLayer(m, l)) return true;
  }
  return false;
}

void ValidateModel(const JobConfig& c, Validator& v) {
  const ModelConfig& m = c.model();
  v.Require(m.vocab_size() >= 2 && m.vocab_size() <= 65536, {"model", "vocab_size"},
            absl::StrCat("vocab_size = ", m.vocab_size(), " must be in [2, 65536]"));
  v.Require(m.seq_len() >= 1 && m.seq_len() <= 65536, {"model", "seq_len"},
            absl::StrCat("seq_len = ", m.seq_len(), " must be in [1, 65536]"));
  v.Require(m.d_model() >= 1, {"model", "d_model"},
            absl::StrCat("d_model = ", m.d_model(), " must be positive"));
  v.Require(m.n_layers() >= 1, {"model", "n_layers"},
            absl::StrCat("n_layers = ", m.n_layers(), " must be at least 1"));
  v.Require(m.n_heads() >= 1 && m.d_model() % std::max(1, m.n_heads()) == 0, {"model", "n_heads"},
            absl::StrCat("n_heads = ", m.n_heads(),
                         " must be positive and divide d_model = ", m.d_model()));
  v.Require(Finite(m.norm_eps()) && m.norm_eps() > 0, {"model", "norm_eps"},
            "norm_eps must be a positive number");
  v.Require(m.d_ff() >= 1, {"model", "d_ff"},
            absl::StrCat("d_ff = ", m.d_ff(), " must be positive (0 means 4 * d_model)"));
  v.Require(m.moe_every() >= 0, {"model", "moe_every"},
            absl::StrCat("moe_every = ", m.moe_every(), " must be 0 (no MoE) or positive"));
  v.Require(Finite(m.init_std()) && m.init_std() > 0, {"model", "init_std"},
            "init_std must be a positive number");

  if (any_moe_layer(m)) {
    const MoeConfig& e = m.moe();
    const GateConfig& g = e.gate();
    v.Require(e.num_experts() >= 1 && e.num_experts() <= 4096, {"model", "moe", "num_experts"},
              absl::StrCat("num_experts = ", e.num_experts(), " must be in [1, 4096]"));
    v.Require(e.top_k() >= 1 && e.top_k() <= 4, {"model", "moe", "top_k"},
              absl::StrCat("top_k = ", e.top_k(), " must be in [1, 4]"));
    v.Require(e.top_k() <= e.num_experts(), {"model", "moe", "top_k"},
              absl::StrCat("top_k = ", e.top_k(), " is larger than num_experts = ", e.num_experts(),
                           "; set top_k to at most ", e.num_experts()));
    if (g.type() == GateConfig::SWITCH) {
      v.Require(e.top_k() == 1, {"model", "moe", "top_k"},
                absl::StrCat("the SWITCH gate routes each token to 1 expert but top_k = ",
                             e.top_k(), "; remove top_k or use gate type TOP_K"));
    }
    if (g.type() == GateConfig::GSHARD) {
      v.Require(e.top_k() == 2, {"model", "moe", "top_k"},
                absl::StrCat("the GSHARD gate routes each token to 2 experts but top_k = ",
                             e.top_k(), "; remove top_k or use gate type TOP_K"));
    }
    v.Require(e.d_expert() >= 1, {"model", "moe", "d_expert"},
              "d_expert must be positive (0 means d_ff)");
    v.Require(Finite(g.capacity_factor_train()) && g.capacity_factor_train() >= 0,
              {"model", "moe", "gate", "capacity_factor_train"},
              "capacity_factor_train must be >= 0 (0 means dropless)");
    v.Require(Finite(g.capacity_factor_eval()) && g.capacity_factor_eval() >= 0,
              {"model", "moe", "gate", "capacity_factor_eval"},
              "capacity_factor_eval must be >= 0 (0 means dropless)");
    v.Require(Finite(g.aux_loss_coef()) && g.aux_loss_coef() >= 0,
              {"model", "moe", "gate", "aux_loss_coef"}, "aux_loss_coef must be >= 0");
    v.Require(Finite(g.z_loss_coef()) && g.z_loss_coef() >= 0,
              {"model", "moe", "gate", "z_loss_coef"}, "z_loss_coef must be >= 0");
    v.Require(Finite(g.jitter_eps()) && g.jitter_eps() >= 0 && g.jitter_eps() < 1,
              {"model", "moe", "gate", "jitter_eps"}, "jitter_eps must be in [0, 1)");
  }
}

void ValidateDataAndTraining(const JobConfig& c, Validator& v) {
  const ModelConfig& m = c.model();
  const DataConfig& d = c.data();
  v.Require(!d.path().empty(), {"data", "path"},
            "data.path is required: the token file to train on (relative to the config file)");
  v.Require(Finite(d.eval_fraction()) && d.eval_fraction() > 0 && d.eval_fraction() <= 0.5,
            {"data", "eval_fraction"}, "eval_fraction must be in (0, 0.5]");
  if (d.format() == DataConfig::BYTES) {
    v.Require(m.vocab_size() >= 256, {"model", "vocab_size"},
              absl::StrCat("data.format BYTES needs vocab_size >= 256, got ", m.vocab_size()));
  }

  const TrainConfig& t = c.train();
  v.Require(t.steps() >= 1, {"train", "steps"}, "steps must be at least 1");
  v.Require(t.global_batch() >= 1, {"train", "global_batch"}, "global_batch must be at least 1");
  v.Require(Finite(t.lr()) && t.lr() > 0, {"train", "lr"}, "lr must be a positive number");
  v.Require(t.warmup_steps() >= 0, {"train", "warmup_steps"}, "warmup_steps must be >= 0");
  v.Require(Finite(t.min_lr_ratio()) && t.min_lr_ratio() >= 0 && t.min_lr_ratio() <= 1,
            {"train", "min_lr_ratio"}, "min_lr_ratio must be in [0, 1]");
  v.Require(Finite(t.weight_decay()) && t.weight_decay() >= 0, {"train", "weight_decay"},
            "weight_decay must be >= 0");
  v.Require(Finite(t.beta1()) && t.beta1() >= 0 && t.beta1() < 1, {"train", "beta1"},
            "beta1 must be in [0, 1)");
  v.Require(Finite(t.beta2()) && t.beta2() >= 0 && t.beta2() < 1, {"train", "beta2"},
            "beta2 must be in [0, 1)");
  v.Require(Finite(t.adam_eps()) && t.adam_eps() > 0, {"train", "adam_eps"},
            "adam_eps must be positive");
  v.Require(Finite(t.grad_clip()) && t.grad_clip() >= 0, {"train", "grad_clip"},
            "grad_clip must be >= 0 (0 turns clipping off)");
  v.Require(t.eval_every() >= 0, {"train", "eval_every"}, "eval_every must be >= 0");
  v.Require(t.eval_batches() >= 1, {"train", "eval_batches"}, "eval_batches must be at least 1");
  v.Require(t.log_every() >= 1, {"train", "log_every"}, "log_every must be at least 1");
  v.Require(t.threads() >= 0 && t.threads() <= 1024, {"train", "threads"},
            "threads must be in [0, 1024] (0 uses every core)");
  const std::string& dev = t.device();
  const bool cuda_n =
      absl::StartsWith(dev, "cuda:") && dev.size() > 5 && dev.size() <= 8 &&
      std::all_of(dev.begin() + 5, dev.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  const bool gpu = dev == "cuda" || cuda_n;
  v.Require(dev == "cpu" || gpu, {"train", "device"},
            absl::StrCat("unknown device '", dev, "'; use \"cpu\", \"cuda\" or \"cuda:N\""));
  v.Require(!gpu || c.storage().mode() != StorageConfig::TIERED, {"train", "device"},
            "a model on a GPU trains with storage.mode IN_MEMORY for now; set train.device "
            "\"cpu\" for the tiered store");

  const StorageConfig& s = c.storage();
  const bool tiered = s.mode() == StorageConfig::TIERED;
  v.Require(!tiered || any_moe_layer(m), {"storage", "mode"},
            "TIERED keeps expert state in the tiered store, but the model has no MoE layer; "
            "set model.moe_every or use IN_MEMORY");
  v.Require(s.io_queue_depth() >= 1 && s.io_queue_depth() <= 4096, {"storage", "io_queue_depth"},
            "io_queue_depth must be in [1, 4096]");
  v.Require(s.ssd_threads() >= 1 && s.ssd_threads() <= 64, {"storage", "ssd_threads"},
            "ssd_threads must be in [1, 64]");
  v.Require(s.io_block_bytes() >= 4096 && s.io_block_bytes() % 4096 == 0,
            {"storage", "io_block_bytes"},
            "io_block_bytes must be a positive multiple of 4096 (the O_DIRECT alignment)");
  v.Require(s.ssd_file_bytes() >= (1 << 20), {"storage", "ssd_file_bytes"},
            "ssd_file_bytes must be at least 1048576");
  v.Require(Finite(s.lfu_decay()) && s.lfu_decay() > 0 && s.lfu_decay() <= 1,
            {"storage", "lfu_decay"}, "lfu_decay must be in (0, 1]");
  v.Require(!(s.expert_update() == StorageConfig::LAZY && !tiered), {"storage", "expert_update"},
            "expert_update LAZY applies to the tiered store; set storage.mode: TIERED or use "
            "DENSE");
  const ParallelConfig& par = c.parallel();
  v.Require(par.expert_parallel() >= 0 && par.expert_parallel() <= 4096,
            {"parallel", "expert_parallel"},
            "expert_parallel must be in [0, 4096] (0: all workers, 1: data parallel only)");
  v.Require(par.dispatch_chunks() >= 1 && par.dispatch_chunks() <= 64,
            {"parallel", "dispatch_chunks"}, "dispatch_chunks must be in [1, 64] (1: no overlap)");
  v.Require(par.bucket_bytes() >= 4, {"parallel", "bucket_bytes"},
            "bucket_bytes must be at least 4 (one float)");
  v.Require(par.timeout_ms() >= 100, {"parallel", "timeout_ms"}, "timeout_ms must be at least 100");
  v.Require(par.local_size() >= 0 && par.local_size() <= 4096, {"parallel", "local_size"},
            "local_size must be in [0, 4096] (0: flat all-to-all)");
  const ElasticConfig& el = c.elastic();
  v.Require(el.min_workers() >= 0 && el.min_workers() <= 4096, {"elastic", "min_workers"},
            "min_workers must be in [0, 4096] (0: the workers started)");
  v.Require(el.max_workers() >= 0 && el.max_workers() <= 4096, {"elastic", "max_workers"},
            "max_workers must be in [0, 4096] (0: the workers started)");
  v.Require(el.max_workers() == 0 || el.min_workers() <= el.max_workers(),
            {"elastic", "max_workers"}, "max_workers must be at least min_workers");
  v.Require(el.heartbeat_timeout_ms() >= 100, {"elastic", "heartbeat_timeout_ms"},
            "heartbeat_timeout_ms must be at least 100");
  v.Require(el.replicas() >= 0 && el.replicas() <= 8, {"elastic", "replicas"},
            "replicas must be in [0, 8] (0: no buddy copies)");
  if (par.experts_per_worker_size() > 0) {
    int64_t sum = 0;
    bool negative = false;
    for (int32_t n : par.experts_per_worker()) {
      sum += n;
      negative |= n < 0;
    }
    v.Require(!negative && sum == m.moe().num_experts(), {"parallel", "experts_per_worker"},
              absl::StrCat("experts_per_worker must be non-negative and sum to moe.num_experts = ",
                           m.moe().num_experts(), " (it sums to ", sum, ")"));
    v.Require(par.expert_parallel() == 0 || par.experts_per_worker_size() == par.expert_parallel(),
              {"parallel", "experts_per_worker"},
              absl::StrCat("experts_per_worker has ", par.experts_per_worker_size(),
                           " entries but expert_parallel is ", par.expert_parallel(),
                           "; give one per worker of an expert-parallel group"));
  }
  v.Require(s.device_budget_bytes() == 0 || tiered, {"storage", "device_budget_bytes"},
            "budgets apply to storage.mode: TIERED");
  v.Require(s.host_budget_bytes() == 0 || tiered, {"storage", "host_budget_bytes"},
            "budgets apply to storage.mode: TIERED");
  v.Require(c.checkpoint().every() == 0 || !c.checkpoint().dir().empty(), {"checkpoint", "dir"},
            "checkpoint.every needs a folder: set checkpoint.dir or pass --checkpoint-dir");
}

}  // namespace

void Normalize(JobConfig* c) {
  ModelConfig* m = c->mutable_model();
  if (m->d_ff() == 0) m->set_d_ff(4 * m->d_model());
  MoeConfig* e = m->mutable_moe();
  if (e->d_expert() == 0) e->set_d_expert(m->d_ff());
  if (!e->has_top_k()) {
    switch (e->gate().type()) {
      case GateConfig::SWITCH:
        e->set_top_k(1);
        break;
      case GateConfig::GSHARD:
        e->set_top_k(2);
        break;
      default:
        e->set_top_k(std::min(2, std::max(1, e->num_experts())));
    }
  }
}

StatusOr<JobConfig> ParseJobConfig(const std::string& text, const std::string& source,
                                   const std::string& base_dir) {
  JobConfig config;
  TextFormat::Parser parser;
  ErrorCollector errors(source, text);
  TextFormat::ParseInfoTree tree;
  parser.RecordErrorsTo(&errors);
  parser.WriteLocationsTo(&tree);
  if (!parser.ParseFromString(text, &config)) {
    std::vector<std::string> msgs = errors.errors();
    if (msgs.empty()) msgs.push_back(absl::StrCat(source, ": could not parse the text format"));
    return absl::InvalidArgumentError(
        absl::StrCat("invalid config ", source, ":\n  ", absl::StrJoin(msgs, "\n  ")));
  }
  Normalize(&config);
  Validator v(config, source, &tree);
  ValidateModel(config, v);
  ValidateDataAndTraining(config, v);
  RETURN_IF_ERROR(v.Result());
  // Paths in the file are relative to the file's folder.
  auto resolve = [&](std::string* path) {
    if (!base_dir.empty() && !path->empty() && std::filesystem::path(*path).is_relative()) {
      *path = (std::filesystem::path(base_dir) / *path).lexically_normal().string();
    }
  };
  resolve(config.mutable_data()->mutable_path());
  if (config.storage().has_ssd_dir()) resolve(config.mutable_storage()->mutable_ssd_dir());
  if (config.checkpoint().has_dir()) resolve(config.mutable_checkpoint()->mutable_dir());
  return config;
}

StatusOr<JobConfig> LoadJobConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path,
                                            "': ", std::strerror(errno),
                                            "; pass an existing .textproto with --config"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  return ParseJobConfig(ss.str(), path, dir);
}

Status ValidateJobConfig(const JobConfig& config, const std::string& source) {
  Validator v(config, source, nullptr);
  ValidateModel(config, v);
  ValidateDataAndTraining(config, v);
  return v.Result();
}

Status ValidateModelConfig(const ModelConfig& model, const std::string& source) {
  JobConfig config;
  *config.mutable_model() = model;
  Validator v(config, source, nullptr);
  ValidateModel(config, v);
  return v.Result();
}

std::string ToText(const JobConfig& config) {
  std::string out;
  TextFormat::PrintToString(config, &out);
  return out;
}

}  // namespace strata::config
