#include "proto/config_io.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string_view>
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
    std::string type, name;
    if (UnknownField(message, &type, &name)) {
      const Descriptor* d =
          google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(type);
      msg = absl::StrFormat("unknown field '%s' in %s", name, type);
      if (d != nullptr) {
        std::vector<std::string> names;
        std::string best;
        size_t best_d = 1000;
        for (int i = 0; i < d->field_count(); ++i) {
          names.push_back(d->field(i)->name());
          size_t dist = EditDistance(name, d->field(i)->name());
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
  // protobuf's 'Message type "T" has no field named "N"': T and N. (A hand-written scan, not
  // std::regex, whose recursion overflows the stack on a very long name.)
  static bool UnknownField(const std::string& message, std::string* type, std::string* name) {
    static constexpr std::string_view kType = "Message type \"", kName = "\" has no field named \"";
    const size_t t = message.find(kType);
    if (t == std::string::npos) return false;
    const size_t n = message.find(kName, t + kType.size());
    if (n == std::string::npos) return false;
    const size_t end = message.find('"', n + kName.size());
    if (end == std::string::npos) return false;
    *type = message.substr(t + kType.size(), n - t - kType.size());
    *name = message.substr(n + kName.size(), end - n - kName.size());
    return !type->empty() && !name->empty();
  }

  // The field being assigned where the error is: the last "name:" before the column.
  std::string FieldAt(int line, int column) const {
    if (line < 0 || line >= static_cast<int>(lines_.size())) return "";
    const std::string_view prefix =
        std::string_view(lines_[line]).substr(0, static_cast<size_t>(std::max(0, column)));
    auto word = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
    // Scan back from each ':' over blanks to a word.
    for (size_t i = prefix.size(); i-- > 0;) {
      if (prefix[i] != ':') continue;
      size_t end = i;
      while (end > 0 && (prefix[end - 1] == ' ' || prefix[end - 1] == '\t')) --end;
      size_t begin = end;
      while (begin > 0 && word(prefix[begin - 1])) --begin;
      if (begin < end) return std::string(prefix.substr(begin, end - begin));
    }
    return "";
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
        // A repeated field is located by its first value (protobuf aborts on index -1 there).
        auto loc = f->is_repeated() ? t->GetLocation(f, 0) : t->GetLocation(f, -1);
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

// Largest accepted sizes (documented in config.proto). They keep every derived size — d_ff =
// 4 * d_model, tokens per step times top_k (int32 row indices of the MoE dispatch), parameter
// counts — far from overflow; whether a config within them fits the machine (and its TIERED budgets
// the model's dense state) is the memory estimate's call (runtime/model/memory_estimate.h).
constexpr int64_t kMaxDModel = 65536;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHidden = 1 << 20;
constexpr int64_t kMaxGlobalBatch = 1 << 20;
constexpr int64_t kMaxTokensPerStep = 1 << 28;
constexpr int64_t kMaxSteps = 1'000'000'000;
constexpr int64_t kMaxEvalBatches = 10000;
constexpr uint64_t kMaxIoBlockBytes = 64 << 20;
constexpr uint64_t kMaxSsdFileBytes = uint64_t{1} << 40;
constexpr uint64_t kMaxBucketBytes = uint64_t{1} << 32;
constexpr uint32_t kMaxTimeoutMs = 86'400'000;

bool InRange(int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; }

void ValidateModel(const JobConfig& c, Validator& v) {
  const ModelConfig& m = c.model();
  v.Require(m.vocab_size() >= 2 && m.vocab_size() <= 65536, {"model", "vocab_size"},
            absl::StrCat("vocab_size = ", m.vocab_size(), " must be in [2, 65536]"));
  v.Require(m.seq_len() >= 1 && m.seq_len() <= 65536, {"model", "seq_len"},
            absl::StrCat("seq_len = ", m.seq_len(), " must be in [1, 65536]"));
  const bool d_model_ok = InRange(m.d_model(), 1, kMaxDModel);
  v.Require(d_model_ok, {"model", "d_model"},
            absl::StrCat("d_model = ", m.d_model(), " must be in [1, ", kMaxDModel, "]"));
  v.Require(InRange(m.n_layers(), 1, kMaxLayers), {"model", "n_layers"},
            absl::StrCat("n_layers = ", m.n_layers(), " must be in [1, ", kMaxLayers, "]"));
  v.Require(m.n_heads() >= 1 && m.d_model() % std::max(1, m.n_heads()) == 0, {"model", "n_heads"},
            absl::StrCat("n_heads = ", m.n_heads(),
                         " must be positive and divide d_model = ", m.d_model()));
  v.Require(Finite(m.norm_eps()) && m.norm_eps() > 0, {"model", "norm_eps"},
            "norm_eps must be a positive number");
  // d_ff left at 0 with an out-of-range d_model stays 0 (see Normalize): d_model is the error.
  v.Require(
      InRange(m.d_ff(), 1, kMaxHidden) || (m.d_ff() == 0 && !d_model_ok), {"model", "d_ff"},
      absl::StrCat("d_ff = ", m.d_ff(), " must be in [1, ", kMaxHidden, "] (0 means 4 * d_model)"));
  v.Require(InRange(m.moe_every(), 0, kMaxLayers), {"model", "moe_every"},
            absl::StrCat("moe_every = ", m.moe_every(), " must be 0 (no MoE) or in [1, ",
                         kMaxLayers, "]"));
  v.Require(Finite(m.init_std()) && m.init_std() > 0, {"model", "init_std"},
            "init_std must be a positive number");

  if (any_moe_layer(m)) {
    const MoeConfig& e = m.moe();
    const GateConfig& g = e.gate();
    v.Require(e.num_experts() >= 1 && e.num_experts() <= 4096, {"model", "moe", "num_experts"},
              absl::StrCat("num_experts = ", e.num_experts(), " must be in [1, 4096]"));
    v.Require(e.top_k() >= 1 && e.top_k() <= 8, {"model", "moe", "top_k"},
              absl::StrCat("top_k = ", e.top_k(), " must be in [1, 8]"));
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
    v.Require(InRange(e.d_expert(), 1, kMaxHidden) || (e.d_expert() == 0 && m.d_ff() == 0),
              {"model", "moe", "d_expert"},
              absl::StrCat("d_expert = ", e.d_expert(), " must be in [1, ", kMaxHidden,
                           "] (0 means d_ff)"));
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
    if (g.type() == GateConfig::EXPERT_CHOICE) {
      // Balanced by construction: the balancing options have nothing to act on.
      v.Require(g.score_function() == GateConfig::SOFTMAX && g.bias_update_rate() == 0 &&
                    g.sequence_aux_loss_coef() == 0 && g.num_groups() <= 1 &&
                    g.routed_scaling() == 1,
                {"model", "moe", "gate", "type"},
                "the EXPERT_CHOICE gate takes softmax scores and balances by construction: remove "
                "score_function, routed_scaling, bias_update_rate, sequence_aux_loss_coef and "
                "num_groups, or use gate type TOP_K");
    }
    if (g.score_function() == GateConfig::SIGMOID) {
      v.Require(g.type() == GateConfig::TOP_K, {"model", "moe", "gate", "score_function"},
                "score_function SIGMOID goes with gate type TOP_K (SWITCH, GSHARD and "
                "NOISY_TOP_K are softmax gates); set type: TOP_K or remove score_function");
    }
    v.Require(Finite(g.routed_scaling()) && g.routed_scaling() > 0 && g.routed_scaling() <= 100,
              {"model", "moe", "gate", "routed_scaling"}, "routed_scaling must be in (0, 100]");
    v.Require(
        Finite(g.bias_update_rate()) && g.bias_update_rate() >= 0 && g.bias_update_rate() <= 1,
        {"model", "moe", "gate", "bias_update_rate"},
        "bias_update_rate must be in [0, 1] (0 turns loss-free balancing off; 0.001 is "
        "DeepSeek-V3's)");
    v.Require(Finite(g.sequence_aux_loss_coef()) && g.sequence_aux_loss_coef() >= 0,
              {"model", "moe", "gate", "sequence_aux_loss_coef"},
              "sequence_aux_loss_coef must be >= 0");
    if (g.num_groups() > 1) {
      v.Require(g.type() == GateConfig::TOP_K, {"model", "moe", "gate", "num_groups"},
                "group-limited routing (num_groups > 1) goes with gate type TOP_K");
      v.Require(g.num_groups() <= 64, {"model", "moe", "gate", "num_groups"},
                absl::StrCat("num_groups = ", g.num_groups(), " must be at most 64"));
      v.Require(g.num_groups() <= e.num_experts() && e.num_experts() % g.num_groups() == 0,
                {"model", "moe", "gate", "num_groups"},
                absl::StrCat("num_groups = ", g.num_groups(),
                             " must divide num_experts = ", e.num_experts(), " into equal groups"));
      v.Require(g.topk_groups() >= 1 && g.topk_groups() <= g.num_groups(),
                {"model", "moe", "gate", "topk_groups"},
                absl::StrCat("topk_groups = ", g.topk_groups(),
                             " must be in [1, num_groups = ", g.num_groups(), "]"));
      if (g.num_groups() <= e.num_experts() && e.num_experts() % g.num_groups() == 0) {
        const int64_t per_group = e.num_experts() / g.num_groups();
        v.Require(
            e.top_k() <= g.topk_groups() * per_group, {"model", "moe", "gate", "topk_groups"},
            absl::StrCat("top_k = ", e.top_k(), " experts cannot be chosen from ", g.topk_groups(),
                         " group(s) of ", per_group, " experts; raise topk_groups"));
      }
    } else {
      v.Require(g.num_groups() >= 0, {"model", "moe", "gate", "num_groups"},
                "num_groups must be >= 0 (0 or 1: no group-limited routing)");
    }
    v.Require(e.num_shared_experts() >= 0 && e.num_shared_experts() <= 64,
              {"model", "moe", "num_shared_experts"},
              absl::StrCat("num_shared_experts = ", e.num_shared_experts(), " must be in [0, 64]"));
    v.Require(InRange(e.shared_d_expert(), 1, kMaxHidden) || e.num_shared_experts() == 0,
              {"model", "moe", "shared_d_expert"},
              absl::StrCat("shared_d_expert = ", e.shared_d_expert(), " must be in [1, ",
                           kMaxHidden, "] (0 means d_expert)"));
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
  v.Require(InRange(t.steps(), 1, kMaxSteps), {"train", "steps"},
            absl::StrCat("steps = ", t.steps(), " must be in [1, ", kMaxSteps, "]"));
  v.Require(
      InRange(t.global_batch(), 1, kMaxGlobalBatch), {"train", "global_batch"},
      absl::StrCat("global_batch = ", t.global_batch(), " must be in [1, ", kMaxGlobalBatch, "]"));
  const int64_t tokens = int64_t{t.global_batch()} * m.seq_len();
  v.Require(
      tokens <= kMaxTokensPerStep || t.global_batch() > kMaxGlobalBatch, {"train", "global_batch"},
      absl::StrCat("global_batch * model.seq_len = ", tokens, " tokens per step is more than ",
                   kMaxTokensPerStep, "; lower global_batch or model.seq_len"));
  v.Require(Finite(t.lr()) && t.lr() > 0, {"train", "lr"}, "lr must be a positive number");
  v.Require(InRange(t.warmup_steps(), 0, kMaxSteps), {"train", "warmup_steps"},
            absl::StrCat("warmup_steps = ", t.warmup_steps(), " must be in [0, ", kMaxSteps, "]"));
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
  v.Require(InRange(t.eval_every(), 0, kMaxSteps), {"train", "eval_every"},
            absl::StrCat("eval_every = ", t.eval_every(), " must be in [0, ", kMaxSteps, "]"));
  v.Require(InRange(t.eval_batches(), 1, kMaxEvalBatches), {"train", "eval_batches"},
            absl::StrCat("eval_batches = ", t.eval_batches(), " must be in [1, ", kMaxEvalBatches,
                         "] (each evaluation runs this many global batches)"));
  v.Require(InRange(t.log_every(), 1, kMaxSteps), {"train", "log_every"},
            absl::StrCat("log_every = ", t.log_every(), " must be in [1, ", kMaxSteps, "]"));
  v.Require(t.threads() >= 0 && t.threads() <= 1024, {"train", "threads"},
            "threads must be in [0, 1024] (0 uses every core)");
  const std::string& dev = t.device();
  const bool cuda_n =
      absl::StartsWith(dev, "cuda:") && dev.size() > 5 && dev.size() <= 8 &&
      std::all_of(dev.begin() + 5, dev.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  const bool gpu = dev == "cuda" || cuda_n;
  v.Require(dev == "cpu" || gpu, {"train", "device"},
            absl::StrCat("unknown device '", dev, "'; use \"cpu\", \"cuda\" or \"cuda:N\""));

  const StorageConfig& s = c.storage();
  const bool tiered = s.mode() == StorageConfig::TIERED;
  v.Require(!tiered || any_moe_layer(m), {"storage", "mode"},
            "TIERED keeps expert state in the tiered store, but the model has no MoE layer; "
            "set model.moe_every or use IN_MEMORY");
  v.Require(s.io_queue_depth() >= 1 && s.io_queue_depth() <= 4096, {"storage", "io_queue_depth"},
            "io_queue_depth must be in [1, 4096]");
  v.Require(s.ssd_threads() >= 1 && s.ssd_threads() <= 64, {"storage", "ssd_threads"},
            "ssd_threads must be in [1, 64]");
  v.Require(s.backward_prefetch() >= -1, {"storage", "backward_prefetch"},
            absl::StrCat("backward_prefetch = ", s.backward_prefetch(),
                         " must be -1 (as many experts as the host budget leaves room for), 0 "
                         "(off) or a number of experts"));
  v.Require(s.io_block_bytes() >= 4096 && s.io_block_bytes() <= kMaxIoBlockBytes &&
                s.io_block_bytes() % 4096 == 0,
            {"storage", "io_block_bytes"},
            absl::StrCat("io_block_bytes = ", s.io_block_bytes(),
                         " must be a multiple of 4096 (the O_DIRECT alignment) in [4096, ",
                         kMaxIoBlockBytes, "]"));
  v.Require(s.ssd_file_bytes() >= (1 << 20) && s.ssd_file_bytes() <= kMaxSsdFileBytes,
            {"storage", "ssd_file_bytes"},
            absl::StrCat("ssd_file_bytes = ", s.ssd_file_bytes(), " must be in [1048576, ",
                         kMaxSsdFileBytes, "]"));
  v.Require(s.lfu_decay_interval() <= kMaxSteps, {"storage", "lfu_decay_interval"},
            absl::StrCat("lfu_decay_interval must be at most ", kMaxSteps));
  v.Require(s.history_prefetch() <= 4096, {"storage", "history_prefetch"},
            "history_prefetch must be in [0, 4096] (experts of the next layer)");
  v.Require(s.optimizer_prefetch() <= 4096, {"storage", "optimizer_prefetch"},
            "optimizer_prefetch must be in [0, 4096] (experts ahead)");
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
  v.Require(par.bucket_bytes() >= 4 && par.bucket_bytes() <= kMaxBucketBytes,
            {"parallel", "bucket_bytes"},
            absl::StrCat("bucket_bytes = ", par.bucket_bytes(), " must be in [4 (one float), ",
                         kMaxBucketBytes, "]"));
  v.Require(par.timeout_ms() >= 100 && par.timeout_ms() <= kMaxTimeoutMs,
            {"parallel", "timeout_ms"},
            absl::StrCat("timeout_ms must be in [100, ", kMaxTimeoutMs, "] (one day)"));
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
  v.Require(el.replica_every() >= 1 && el.replica_every() <= 1'000'000,
            {"elastic", "replica_every"},
            "replica_every must be in [1, 1000000] (steps between refreshes of the buddy copies)");
  v.Require(el.heartbeat_timeout_ms() <= 600'000, {"elastic", "heartbeat_timeout_ms"},
            "heartbeat_timeout_ms must be at most 600000 (ten minutes)");
  v.Require(
      el.restart_grace_ms() >= el.heartbeat_timeout_ms() && el.restart_grace_ms() <= 3'600'000,
      {"elastic", "restart_grace_ms"},
      "restart_grace_ms must be in [heartbeat_timeout_ms, 3600000]: a restarted "
      "coordinator gives its members at least one heartbeat timeout to reconnect");
  v.Require(static_cast<uint64_t>(el.coordinator_patience_ms()) >
                    static_cast<uint64_t>(el.restart_grace_ms()) + el.heartbeat_timeout_ms() &&
                el.coordinator_patience_ms() <= 86'400'000,
            {"elastic", "coordinator_patience_ms"},
            "coordinator_patience_ms must exceed restart_grace_ms + heartbeat_timeout_ms (so "
            "workers outwait a coordinator restart) and be at most 86400000 (a day)");
  if (par.experts_per_worker_size() > 0) {
    v.Require(par.experts_per_worker_size() <= 4096, {"parallel", "experts_per_worker"},
              absl::StrCat("experts_per_worker has ", par.experts_per_worker_size(),
                           " entries; at most 4096 (one per worker of a group)"));
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
  v.Require(c.checkpoint().every() <= kMaxSteps, {"checkpoint", "every"},
            absl::StrCat("every must be in [0, ", kMaxSteps, "] (0 writes no checkpoint)"));
  v.Require(c.checkpoint().keep() <= 1000, {"checkpoint", "keep"},
            "keep must be in [0, 1000] (0 and 1 both keep the newest checkpoint only)");
  v.Require(c.checkpoint().every() == 0 || !c.checkpoint().dir().empty(), {"checkpoint", "dir"},
            "checkpoint.every needs a folder: set checkpoint.dir or pass --checkpoint-dir");
}

// Binary input (a checkpoint, a token file, a compressed file passed as --config) gets one clear
// error instead of a screenful of tokenizer errors quoting raw bytes.
Status CheckIsText(const std::string& text, const std::string& source) {
  int line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t len = 1;
    bool ok = true;
    if (c == '\n') {
      ++line;
      line_start = i + 1;
    } else if (c < 0x20) {
      ok = c == '\t' || c == '\r' || c == '\f' || c == '\v';
    } else if (c == 0x7f) {
      ok = false;
    } else if (c >= 0x80) {  // UTF-8 is fine in comments and strings; other bytes are not text
      len = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
      ok = len >= 2 && i + len <= text.size();
      for (size_t j = 1; ok && j < len; ++j) {
        ok = (static_cast<unsigned char>(text[i + j]) & 0xc0) == 0x80;
      }
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "invalid config %s:\n  %s:%d:%d: byte 0x%02x is not text: a job config is a "
          "text-format .textproto (see examples/moe_lm/config.textproto); check that --config "
          "names the config and not a data or checkpoint file",
          source, source, line, static_cast<int>(i - line_start) + 1, c));
    }
    i += len;
  }
  return absl::OkStatus();
}

}  // namespace

void Normalize(JobConfig* c) {
  ModelConfig* m = c->mutable_model();
  // In 64 bits: 4 * d_model of an out-of-range d_model must not wrap into a "valid" width. Such
  // a d_ff stays 0 and validation names d_model.
  const int64_t d_ff = 4 * int64_t{m->d_model()};
  if (m->d_ff() == 0 && d_ff > 0 && d_ff <= std::numeric_limits<int32_t>::max()) {
    m->set_d_ff(static_cast<int32_t>(d_ff));
  }
  MoeConfig* e = m->mutable_moe();
  if (e->d_expert() == 0) e->set_d_expert(m->d_ff());
  if (e->shared_d_expert() == 0) e->set_shared_d_expert(e->d_expert());
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
  RETURN_IF_ERROR(CheckIsText(text, source));
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

// A config is a small text file; anything this large was named by mistake.
constexpr uintmax_t kMaxConfigBytes = 16 << 20;

StatusOr<JobConfig> LoadJobConfig(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path,
                                            "': ", ec ? ec.message() : "no such file",
                                            "; pass an existing .textproto with --config"));
  }
  if (fs::is_directory(st)) {
    std::string hint;
    if (fs::is_regular_file(fs::path(path) / "config.textproto", ec)) {
      hint = absl::StrCat(" (did you mean ", (fs::path(path) / "config.textproto").string(), "?)");
    }
    return absl::InvalidArgumentError(absl::StrCat("config file '", path,
                                                   "' is a directory; --config takes a "
                                                   ".textproto file",
                                                   hint));
  }
  // Only regular files: a FIFO or a device (/dev/zero) would block or never end.
  if (!fs::is_regular_file(st)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config file '", path, "' is not a regular file; --config takes a .textproto file"));
  }
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat("config file '", path, "' has ", size,
                                                   " bytes; a job config is a text file of at "
                                                   "most ",
                                                   kMaxConfigBytes, " bytes: check the path"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path,
                                            "': ", std::strerror(errno),
                                            "; pass an existing .textproto with --config"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat("cannot read config file '", path,
                                            "': ", std::strerror(errno),
                                            "; check the file and the disk it is on"));
  }
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = fs::path(".");
  return ParseJobConfig(ss.str(), path, dir.string());
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

int64_t CopiesLagSteps(const JobConfig& config) {
  const bool tiered_copies =
      config.storage().mode() == StorageConfig::TIERED && config.elastic().replicas() > 0 &&
      config.parallel().expert_parallel() == 0 && config.parallel().experts_per_worker_size() == 0;
  return tiered_copies ? std::max(1, config.elastic().replica_every()) : 0;
}

}  // namespace strata::config
