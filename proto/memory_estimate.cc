#include "proto/memory_estimate.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "proto/config_io.h"

namespace strata::config {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// Saturating arithmetic: an estimate of an absurd config is "too much", never a wrapped small
// number.
uint64_t U(int64_t v) { return v < 0 ? 0 : static_cast<uint64_t>(v); }
uint64_t Mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kMax : r;
}
uint64_t Mul(uint64_t a, uint64_t b, uint64_t c) { return Mul(Mul(a, b), c); }
uint64_t Add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? kMax : r;
}
uint64_t Sub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }
int64_t ToInt64(uint64_t v) {
  return static_cast<int64_t>(std::min<uint64_t>(v, std::numeric_limits<int64_t>::max()));
}

// Width of an FFN's first matrix for hidden width h (SwiGLU's is 2x: gate and up together).
uint64_t InWidth(const ModelConfig& m, uint64_t h) {
  return m.activation() == ModelConfig::SWIGLU ? Mul(2, h) : h;
}

// Parameters of a two-layer FFN C -> h -> C (model::FfnExpert).
uint64_t FfnParameters(const ModelConfig& m, uint64_t h, bool bias) {
  const uint64_t C = U(m.d_model()), in = InWidth(m, h);
  uint64_t n = Add(Mul(in, C), Mul(C, h));
  if (bias) n = Add(n, Add(in, C));
  return n;
}

std::string Count(int64_t n) {
  if (n >= 1'000'000'000) return absl::StrFormat("%.2f G", n / 1e9);
  if (n >= 1'000'000) return absl::StrFormat("%.2f M", n / 1e6);
  if (n >= 1'000) return absl::StrFormat("%.1f k", n / 1e3);
  return absl::StrCat(n);
}

// First number of the line of `path` that starts with `key` (e.g. "MemAvailable:"), times
// `unit`; 0 when absent.
uint64_t ReadNumber(const std::string& path, const std::string& key, uint64_t unit) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, key)) continue;
    rest = absl::StripAsciiWhitespace(rest);
    const size_t space = rest.find(' ');
    uint64_t v = 0;
    if (absl::SimpleAtoi(rest.substr(0, space), &v)) return Mul(v, unit);
  }
  return 0;
}

}  // namespace

std::string FormatBytes(uint64_t b) {
  if (b == kMax) return "more than 16 EiB";
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.1f %s", v, kUnits[u]);
}

int64_t MemoryEstimate::parameters() const {
  return ToInt64(Add(U(dense_parameters), U(expert_parameters)));
}

MemoryEstimate EstimateMemory(const JobConfig& config) {
  const ModelConfig& m = config.model();
  const MoeConfig& moe = m.moe();
  const bool ln = m.norm() == ModelConfig::LAYER_NORM;
  const uint64_t V = U(m.vocab_size()), T = U(m.seq_len()), C = U(m.d_model()), L = U(m.n_layers()),
                 NH = U(m.n_heads()), E = U(moe.num_experts()), k = U(moe.top_k()),
                 B = U(config.train().global_batch());
  const uint64_t N = Mul(B, T);  // tokens of a batch

  // Parameters, as runtime/model builds them.
  uint64_t dense = Add(Mul(V, C), Mul(T, C));               // wte, wpe
  dense = Add(dense, ln ? Mul(2, C) : C);                   // final norm
  if (!m.tie_embeddings()) dense = Add(dense, Mul(V, C));   // lm_head
  const uint64_t block = Add(Add(Mul(4, C, C), Mul(4, C)),  // qkv and proj, with biases
                             ln ? Mul(4, C) : Mul(2, C));   // ln1, ln2
  const bool noisy = moe.gate().type() == GateConfig::NOISY_TOP_K;
  const bool switch_gate = moe.gate().type() == GateConfig::SWITCH;
  const uint64_t dff = U(m.d_ff()), dexp = U(moe.d_expert());
  // Block l has an MoE FFN when (l + 1) % moe_every == 0 (IsMoeLayer).
  const uint64_t moe_layers = m.moe_every() > 0 ? L / U(m.moe_every()) : 0;
  const uint64_t dense_layers = Sub(L, moe_layers);
  dense = Add(dense, Mul(L, block));
  dense = Add(dense, Mul(moe_layers, Mul(noisy ? 2 : 1, E, C)));  // router (and noise router)
  dense = Add(dense, Mul(dense_layers, FfnParameters(m, dff, true)));
  const uint64_t experts = Mul(moe_layers, Mul(E, FfnParameters(m, dexp, moe.expert_bias())));

  // Activations, as runtime/model allocates them for max_batch = global_batch sequences.
  // The model: token ids and targets, L + 1 residuals, final norm, logits, backward scratch.
  uint64_t act = Add(Mul(2, N), Mul(Add(L, 1), N, C));
  act = Add(act, Add(Mul(N, C), Mul(2, N)));  // lnf out, mean, rstd
  act = Add(act, Mul(N, V));                  // logits
  act = Add(act, Mul(6, N, C));               // dres, dln, datt, dqkv (3C)
  // Every block: ln1/ln2 out, mean, rstd; qkv (3C); attention matrix; attention out; x_mid;
  // ffn out.
  const uint64_t per_block = Add(Add(Mul(8, N, C), Mul(4, N)), Mul(Mul(B, NH), Mul(T, T)));
  act = Add(act, Mul(L, per_block));
  // Dense FFN blocks: the saved pre-activation and activation of every row.
  act = Add(act, Mul(dense_layers, Mul(N, Add(InWidth(m, dff), dff))));
  // MoE blocks: the gate (logits, probabilities, their gradient, logsumexp, k experts and
  // weights per token, noise or jitter buffers) and the dispatch (k rows per token: slot and
  // token ids, permuted input, output and input gradient, the experts' saved activations, and
  // the combine weights' gradient).
  uint64_t gate = Add(Mul(3, N, E), Add(N, Mul(2, N, k)));
  if (noisy) gate = Add(gate, Mul(2, N, E));
  if (switch_gate) gate = Add(gate, Mul(2, N, C));
  const uint64_t R = Mul(N, k);
  uint64_t dispatch = Add(Mul(2, R), Mul(3, R, C));
  dispatch = Add(dispatch, std::max<uint64_t>(1, Mul(R, Add(InWidth(m, dexp), dexp))));
  dispatch = Add(dispatch, Mul(N, k));
  act = Add(act, Mul(moe_layers, Add(gate, dispatch)));
  // The trainer's input and target ids of a batch.
  act = Add(act, Mul(2, N));

  MemoryEstimate e;
  e.dense_parameters = ToInt64(dense);
  e.expert_parameters = ToInt64(experts);
  e.on_gpu = config.train().device() != "cpu";
  e.activation_bytes = Mul(4, act);
  const StorageConfig& st = config.storage();
  if (st.mode() == StorageConfig::TIERED) {
    // The model holds the dense parameters only; the store holds the experts' four tensors.
    e.parameter_bytes = e.gradient_bytes = Mul(4, dense);
    e.optimizer_bytes = Mul(8, dense);
    e.dense_state_bytes = Mul(16, dense);
    e.expert_state_bytes = Mul(16, experts);
    // The device tier's budget covers the dense state too; what is left of it is expert slots.
    const uint64_t device_tier = st.device_budget_bytes() > 0
                                     ? Sub(st.device_budget_bytes(), e.dense_state_bytes)
                                     : e.expert_state_bytes;
    const uint64_t host_tier =
        st.host_budget_bytes() > 0 ? st.host_budget_bytes() : e.expert_state_bytes;
    e.store_bytes = Add(device_tier, host_tier);
  } else {
    const uint64_t all = Add(dense, experts);
    e.parameter_bytes = e.gradient_bytes = Mul(4, all);
    e.optimizer_bytes = Mul(8, all);
  }
  e.total_bytes = Add(Add(Add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes),
                      Add(e.activation_bytes, e.store_bytes));
  return e;
}

MemoryEstimate EstimateWorkerMemory(const JobConfig& config, int workers, bool elastic) {
  if (workers <= 1) return EstimateMemory(config);
  const uint64_t W = U(workers);
  // The activations of the worker's share of the batch.
  JobConfig share = config;
  const uint64_t B = U(config.train().global_batch());
  share.mutable_train()->set_global_batch(
      static_cast<int32_t>(std::max<uint64_t>(1, (B + W - 1) / W)));
  MemoryEstimate e = EstimateMemory(share);
  // The experts of its expert-parallel group's share: ceil(E / G) of every MoE layer.
  const uint64_t E = U(config.model().moe().num_experts());
  const int64_t ep = config.parallel().expert_parallel();
  const uint64_t G = ep > 0 ? std::min(U(ep), W) : W;
  const uint64_t per_expert = E > 0 ? U(e.expert_parameters) / E : 0;
  const uint64_t held = Mul(per_expert, E > 0 ? (E + G - 1) / G : 0);
  const uint64_t dense = U(e.dense_parameters);
  if (config.storage().mode() == StorageConfig::TIERED) {
    const uint64_t held_state = Mul(16, held);
    const StorageConfig& st = config.storage();
    const uint64_t device_tier = st.device_budget_bytes() > 0
                                     ? Sub(st.device_budget_bytes(), e.dense_state_bytes)
                                     : held_state;
    e.store_bytes =
        Add(device_tier, st.host_budget_bytes() > 0 ? st.host_budget_bytes() : held_state);
  } else {
    e.parameter_bytes = e.gradient_bytes = Mul(4, Add(dense, held));
    e.optimizer_bytes = Mul(8, Add(dense, held));
  }
  // An elastic IN_MEMORY job with one expert-parallel group keeps copies a later generation goes
  // on from (values and both moments, 12 bytes a parameter): its own state from before the
  // update, the experts of elastic.replicas other workers after their latest two updates, and
  // during a re-form the state handed over. Other layouts go back to a checkpoint, which every
  // worker reads into its own model and store.
  if (elastic && config.storage().mode() == StorageConfig::IN_MEMORY && ep == 0 &&
      config.parallel().experts_per_worker_size() == 0) {
    const uint64_t replicas =
        std::min<uint64_t>(U(std::max(0, config.elastic().replicas())), W - 1);
    e.elastic_copy_bytes = Add(Mul(24, Add(dense, held)), Mul(Mul(24, replicas), held));
  }
  // A TIERED one keeps its expert copies on its SSD: in memory, the dense state of the latest two
  // refreshes and, during a re-form, the dense state handed over.
  if (elastic && CopiesLagSteps(config) > 0) e.elastic_copy_bytes = Mul(36, dense);
  e.total_bytes = Add(Add(Add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes),
                      Add(Add(e.activation_bytes, e.store_bytes), e.elastic_copy_bytes));
  return e;
}

std::string FormatMemoryEstimate(const MemoryEstimate& e) {
  std::string out = absl::StrFormat(
      "parameters %s (%s dense, %s in experts)\n"
      "memory: %s in all%s = parameters %s + gradients %s + AdamW moments %s + activations %s",
      Count(e.parameters()), Count(e.dense_parameters), Count(e.expert_parameters),
      FormatBytes(e.total_bytes), e.on_gpu ? " on the GPU" : "", FormatBytes(e.parameter_bytes),
      FormatBytes(e.gradient_bytes), FormatBytes(e.optimizer_bytes),
      FormatBytes(e.activation_bytes));
  if (e.elastic_copy_bytes > 0) {
    absl::StrAppend(&out, " + elastic copies ", FormatBytes(e.elastic_copy_bytes));
  }
  if (e.expert_state_bytes > 0 || e.store_bytes > 0) {
    absl::StrAppend(&out, " + tiered store ", FormatBytes(e.store_bytes),
                    "\nexpert state (weights, gradients, AdamW moments) on the SSD tier: ",
                    FormatBytes(e.expert_state_bytes));
  }
  return out + "\n";
}

uint64_t AvailableHostMemory() {
  uint64_t avail = ReadNumber("/proc/meminfo", "MemAvailable:", 1024);
  if (avail == 0) {
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) avail = Mul(U(pages), U(page));
  }
  // A container's limit (cgroup v2): what is left under memory.max.
  std::ifstream max_file("/sys/fs/cgroup/memory.max");
  std::string max_text;
  uint64_t limit = 0;
  if (max_file >> max_text && absl::SimpleAtoi(max_text, &limit) && limit > 0) {
    // File pages the kernel can drop (inactive page cache) are not in the way.
    const uint64_t used = Sub(ReadNumber("/sys/fs/cgroup/memory.current", "", 1),
                              ReadNumber("/sys/fs/cgroup/memory.stat", "inactive_file", 1));
    const uint64_t left = Sub(limit, used);
    avail = avail == 0 ? left : std::min(avail, left);
  }
  return avail;
}

Status CheckMemory(const JobConfig& config, const MemoryEstimate& e, uint64_t available_bytes,
                   const std::string& source, int processes) {
  const StorageConfig& st = config.storage();
  if (st.mode() == StorageConfig::TIERED && st.device_budget_bytes() > 0 &&
      st.device_budget_bytes() <= e.dense_state_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "invalid config %s:\n  %s: field storage.device_budget_bytes: %d bytes cannot hold the "
        "dense parameters with their gradients and Adam state (%d bytes) and any expert; raise it "
        "above %d or make the dense part of the model smaller",
        source, source, st.device_budget_bytes(), e.dense_state_bytes, e.dense_state_bytes));
  }
  const uint64_t need = Mul(U(std::max(1, processes)), Add(e.total_bytes, kProcessOverheadBytes));
  if (available_bytes == 0 || e.on_gpu || need <= available_bytes) {
    return absl::OkStatus();
  }
  // Name the largest part and the fields that size it.
  std::string advice;
  const uint64_t model = Add(Add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes);
  if (e.activation_bytes >= model && e.activation_bytes >= e.store_bytes) {
    advice =
        "activations are the largest part: lower train.global_batch or model.seq_len (the "
        "attention matrices grow with seq_len squared)";
  } else if (e.store_bytes >= model) {
    advice =
        "the tiered store is the largest part: set or lower storage.host_budget_bytes and "
        "storage.device_budget_bytes so expert state stays on the SSD tier";
  } else if (st.mode() != StorageConfig::TIERED && e.expert_parameters > e.dense_parameters) {
    advice =
        "the experts are the largest part: use storage.mode TIERED with budgets (expert state "
        "then lives on SSD), or lower model.moe.num_experts or model.moe.d_expert";
  } else {
    advice =
        "the parameters are the largest part: lower model.d_model, model.n_layers, model.d_ff "
        "or model.vocab_size";
  }
  std::string figures = FormatMemoryEstimate(e);
  absl::StrReplaceAll({{"\n", "\n  "}}, &figures);
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s: the job needs %s of memory (%s%s for the model and %s for the process) but this "
      "machine has %s available (MemAvailable and the cgroup limit):\n  %s%s",
      source, FormatBytes(need),
      processes > 1 ? absl::StrFormat("%d processes, each ", processes) : std::string(),
      FormatBytes(e.total_bytes), FormatBytes(kProcessOverheadBytes), FormatBytes(available_bytes),
      figures, advice));
}

}  // namespace strata::config
