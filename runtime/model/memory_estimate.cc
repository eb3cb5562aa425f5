#include "runtime/model/memory_estimate.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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

uint64_t RoundUp(uint64_t bytes, uint64_t unit) { return Mul(Add(bytes, unit - 1) / unit, unit); }

// Bytes of the files that `n` tensors of `tensor` bytes (a multiple of the granule) take when
// packed first-fit into files of at most `file` bytes grown kDiskGrowBytes at a time
// (ExtentAllocator): floor(file / tensor) a file, each file as large as its last growth.
uint64_t PackedBytes(uint64_t n, uint64_t tensor, uint64_t file) {
  if (n == 0 || tensor == 0) return 0;
  const uint64_t per_file = std::max<uint64_t>(1, file / tensor);
  auto size = [&](uint64_t k) {
    return std::max(Mul(k, tensor), std::min(file, RoundUp(Mul(k, tensor), kDiskGrowBytes)));
  };
  const uint64_t rest = n % per_file;
  return Add(Mul(n / per_file, size(per_file)), rest > 0 ? size(rest) : 0);
}

// Bytes of the dense state's tensors in one checkpoint: values and both Adam moments, each tensor
// counted with a whole granule of padding (an upper bound; the model's dense tensors, as
// runtime/model builds them: wte, wpe, the final norm, the output head, every block's norms,
// attention weights and biases, every MoE block's router and shared experts (one FFN) and every
// dense block's FFN).
uint64_t DenseCheckpointBytes(const ModelConfig& m, uint64_t dense_parameters) {
  const bool ln = m.norm() == ModelConfig::LAYER_NORM;
  const uint64_t L = U(m.n_layers());
  const uint64_t moe_layers = m.moe_every() > 0 ? L / U(m.moe_every()) : 0;
  uint64_t tensors = 3 + (ln ? 1 : 0) + (m.tie_embeddings() ? 0 : 1);
  tensors = Add(tensors, Mul(L, ln ? 8 : 6));
  tensors = Add(tensors, Mul(moe_layers, m.moe().gate().type() == GateConfig::NOISY_TOP_K ? 2 : 1));
  if (m.moe().gate().bias_update_rate() > 0) tensors = Add(tensors, moe_layers);  // router_bias
  if (m.moe().num_shared_experts() > 0) {
    tensors = Add(tensors, Mul(moe_layers, m.moe().expert_bias() ? 4 : 2));
  }
  tensors = Add(tensors, Mul(Sub(L, moe_layers), 4));
  return Mul(3, Add(Mul(4, dense_parameters), Mul(tensors, kDiskGranuleBytes)));
}

std::string TempBase() {
  const char* base = std::getenv("TMPDIR");
  return base != nullptr && *base ? base : "/tmp";
}

// The nearest existing ancestor of `path` ("." for "").
std::filesystem::path Existing(const std::string& path) {
  std::filesystem::path p(path.empty() ? std::string(".") : path);
  std::error_code ec;
  while (!std::filesystem::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) {
    p = p.parent_path();
  }
  if (!std::filesystem::exists(p, ec)) p = ".";  // a relative path with no existing part
  return p;
}

// Bytes allocated to the SSD tier's data files (data-*.bin) in `path` and up to two folders below
// it (a checkpoint folder's shards/<name>/); 0 when there are none. Other
// files are not looked at, so a tier folder inside a large tree costs no long walk.
uint64_t DataFileBytesUnder(const std::string& path) {
  std::error_code ec;
  uint64_t total = 0;
  for (auto it = std::filesystem::recursive_directory_iterator(path, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it.depth() >= 2) it.disable_recursion_pending();
    const std::string name = it->path().filename().string();
    // Not this job's to reuse: other workers' tiers (rank-<r>/, which a worker on this machine
    // does not know apart from its own here, so none counts) and private folders of other
    // processes (strata-ssd-*, strata-copies-*: live, or swept rather than reused).
    if ((name.rfind("rank-", 0) == 0 || name.rfind("strata-", 0) == 0) && it->is_directory(ec)) {
      it.disable_recursion_pending();
      continue;
    }
    struct stat st;
    if (name.rfind("data-", 0) == 0 && name.size() > 4 &&
        name.compare(name.size() - 4, 4, ".bin") == 0 && it->is_regular_file(ec) &&
        ::stat(it->path().c_str(), &st) == 0) {
      total = Add(total, Mul(U(st.st_blocks), 512));
    }
  }
  return total;
}

}  // namespace

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
  // The shared experts of an MoE block run as one FFN of their total width (0: none).
  const uint64_t dshared =
      Mul(U(moe.num_shared_experts()), moe.shared_d_expert() > 0 ? U(moe.shared_d_expert()) : dexp);
  // Block l has an MoE FFN when (l + 1) % moe_every == 0 (IsMoeLayer).
  const uint64_t moe_layers = m.moe_every() > 0 ? L / U(m.moe_every()) : 0;
  const uint64_t dense_layers = Sub(L, moe_layers);
  dense = Add(dense, Mul(L, block));
  dense = Add(dense, Mul(moe_layers, Mul(noisy ? 2 : 1, E, C)));  // router (and noise router)
  if (moe.gate().bias_update_rate() > 0) dense = Add(dense, Mul(moe_layers, E));  // router_bias
  if (dshared > 0) {  // shared experts: dense, on every worker, never in the tiered store
    dense = Add(dense, Mul(moe_layers, FfnParameters(m, dshared, moe.expert_bias())));
  }
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
  // Expert choice routes through E slots per token (kernels see k = E).
  const uint64_t slots = moe.gate().type() == GateConfig::EXPERT_CHOICE ? E : k;
  uint64_t gate = Add(Mul(3, N, E), Add(N, Mul(2, N, slots)));
  if (noisy) gate = Add(gate, Mul(2, N, E));
  // The sequence-wise loss's gradient rows (one per sequence, at most one per token).
  if (moe.gate().sequence_aux_loss_coef() > 0) gate = Add(gate, Mul(N, E));
  if (switch_gate) gate = Add(gate, Mul(2, N, C));
  uint64_t R = Mul(N, k);  // dispatched rows
  if (moe.gate().type() == GateConfig::EXPERT_CHOICE) {
    // E experts x their capacity (a capacity factor of 0 reads 1), and the batch's scores in
    // double.
    double cf = std::max(moe.gate().capacity_factor_train(), moe.gate().capacity_factor_eval());
    if (cf <= 0) cf = 1;
    const uint64_t cap = std::min<uint64_t>(
        N, static_cast<uint64_t>(std::ceil(cf * static_cast<double>(N) * static_cast<double>(k) /
                                           static_cast<double>(E))));
    R = Mul(E, std::max<uint64_t>(1, cap));
    gate = Add(gate, Mul(2, N, E));
  }
  uint64_t dispatch = Add(Add(Mul(N, slots), R), Mul(3, R, C));
  dispatch = Add(dispatch, std::max<uint64_t>(1, Mul(R, Add(InWidth(m, dexp), dexp))));
  dispatch = Add(dispatch, Mul(N, slots));
  // Shared experts: their output and saved pre-activation and activation of every row.
  const uint64_t shared = dshared > 0 ? Mul(N, Add(C, Add(InWidth(m, dshared), dshared))) : 0;
  act = Add(act, Mul(moe_layers, Add(Add(gate, dispatch), shared)));
  // The trainer's input and target ids of a batch.
  act = Add(act, Mul(2, N));
  // bf16 GEMMs (train.precision BF16, AUTO on a GPU): one GEMM's rounded operands at a time in
  // per-thread scratch, its rows of input and of output gradient (and a tiered expert's weight,
  // rounded as it is used), 2 bytes each; the largest GEMM sizes it.
  const bool on_gpu = config.train().device() != "cpu";
  if (Bf16Gemms(config.train().precision(), on_gpu)) {
    uint64_t most = std::max(Mul(N, Add(V, C)), Mul(N, Mul(4, C)));  // the head; qkv
    if (dense_layers > 0) most = std::max(most, Mul(N, Add(InWidth(m, dff), C)));
    if (moe_layers > 0) most = std::max(most, Mul(R, Add(InWidth(m, dexp), C)));
    if (dshared > 0) most = std::max(most, Mul(N, Add(InWidth(m, dshared), C)));
    if (config.storage().mode() == StorageConfig::TIERED && moe_layers > 0) {
      most = Add(most, Mul(InWidth(m, dexp), C));
    }
    act = Add(act, (most + 1) / 2);  // counted in floats
  }

  MemoryEstimate e;
  e.dense_parameters = ToInt64(dense);
  e.expert_parameters = ToInt64(experts);
  e.on_gpu = on_gpu;
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
    if (e.on_gpu) e.host_bytes = host_tier;
  } else {
    const uint64_t all = Add(dense, experts);
    e.parameter_bytes = e.gradient_bytes = Mul(4, all);
    e.optimizer_bytes = Mul(8, all);
  }
  if (Bf16Gemms(config.train().precision(), e.on_gpu)) {
    e.compute_copy_bytes = e.parameter_bytes / 2;
  }
  e.total_bytes = Add(Add(Add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes),
                      Add(Add(e.activation_bytes, e.store_bytes), e.compute_copy_bytes));
  if (!e.on_gpu) e.host_bytes = e.total_bytes;
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
    const uint64_t host_tier = st.host_budget_bytes() > 0 ? st.host_budget_bytes() : held_state;
    e.store_bytes = Add(device_tier, host_tier);
    if (e.on_gpu) e.host_bytes = host_tier;
  } else {
    e.parameter_bytes = e.gradient_bytes = Mul(4, Add(dense, held));
    e.optimizer_bytes = Mul(8, Add(dense, held));
    if (e.compute_copy_bytes > 0) e.compute_copy_bytes = e.parameter_bytes / 2;
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
  e.total_bytes = Add(
      Add(Add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes),
      Add(Add(e.activation_bytes, e.store_bytes), Add(e.elastic_copy_bytes, e.compute_copy_bytes)));
  if (e.on_gpu) {
    // Page-locked staging: the buckets hold every gradient the model binds (the dense ones, and
    // the experts' in memory; a TIERED worker's are in its store), and the exchange four buffers
    // of a layer's routed rows (sent, returned; received, answered) of d_model floats.
    const bool tiered = config.storage().mode() == StorageConfig::TIERED;
    const uint64_t reduced = Add(dense, tiered ? 0 : held);
    const uint64_t rows = Mul(Mul(U(share.train().global_batch()), U(config.model().seq_len())),
                              U(config.model().moe().top_k()));
    const uint64_t exchange = E > 0 && G > 1 ? Mul(Mul(16, rows), U(config.model().d_model())) : 0;
    e.staging_bytes = Add(Mul(4, reduced), exchange);
    e.total_bytes = Add(e.total_bytes, e.staging_bytes);
    e.host_bytes = Add(Add(e.host_bytes, e.elastic_copy_bytes), e.staging_bytes);
  } else {
    e.host_bytes = e.total_bytes;
  }
  return e;
}

std::string FormatMemoryEstimate(const MemoryEstimate& e) {
  std::string out = absl::StrFormat(
      "parameters %s (%s dense, %s in experts)\n"
      "memory: %s in all%s = parameters %s + gradients %s + AdamW moments %s + activations %s",
      Count(e.parameters()), Count(e.dense_parameters), Count(e.expert_parameters),
      FormatBytes(e.total_bytes), e.on_gpu ? " for a model on the GPU" : "",
      FormatBytes(e.parameter_bytes), FormatBytes(e.gradient_bytes), FormatBytes(e.optimizer_bytes),
      FormatBytes(e.activation_bytes));
  if (e.compute_copy_bytes > 0) {
    absl::StrAppend(&out, " + bf16 weight copies ", FormatBytes(e.compute_copy_bytes));
  }
  if (e.elastic_copy_bytes > 0) {
    absl::StrAppend(&out, " + elastic copies ", FormatBytes(e.elastic_copy_bytes));
  }
  if (e.staging_bytes > 0) {
    absl::StrAppend(&out, " + page-locked staging ", FormatBytes(e.staging_bytes));
  }
  if (e.expert_state_bytes > 0 || e.store_bytes > 0) {
    absl::StrAppend(&out, " + tiered store ", FormatBytes(e.store_bytes),
                    "\nexpert state (weights, gradients, AdamW moments) on the SSD tier: ",
                    FormatBytes(e.expert_state_bytes));
  }
  if (e.on_gpu) absl::StrAppend(&out, "\nof which in host memory: ", FormatBytes(e.host_bytes));
  return out + "\n";
}

DiskEstimate EstimateDisk(const JobConfig& config, int workers, bool elastic) {
  DiskEstimate d;
  const StorageConfig& st = config.storage();
  if (st.mode() != StorageConfig::TIERED) return d;
  const MoeConfig& moe = config.model().moe();
  const MemoryEstimate m = EstimateMemory(config);
  const uint64_t E = U(moe.num_experts());
  const uint64_t L = U(config.model().n_layers());
  const uint64_t moe_layers =
      config.model().moe_every() > 0 ? L / U(config.model().moe_every()) : 0;
  // One of W workers: its expert-parallel group's share, ceil(E / G) of every MoE layer.
  const uint64_t W = U(std::max(1, workers));
  const int64_t ep = config.parallel().expert_parallel();
  const uint64_t G = W == 1 ? 1 : ep > 0 ? std::min(U(ep), W) : W;
  const uint64_t held = Mul(moe_layers, (E + G - 1) / G);
  d.experts = ToInt64(held);
  d.expert_tensor_bytes =
      RoundUp(Mul(4, FfnParameters(config.model(), U(moe.d_expert()), moe.expert_bias())),
              kDiskGranuleBytes);
  const uint64_t file = st.ssd_file_bytes();
  d.expert_bytes = PackedBytes(Mul(4, held), d.expert_tensor_bytes, file);
  const CheckpointConfig& ck = config.checkpoint();
  if (!ck.dir().empty()) {
    d.ssd_dir = ck.dir();
  } else if (!st.ssd_dir().empty()) {
    d.ssd_dir = st.ssd_dir();
  } else {
    d.ssd_dir = TempBase();
    d.temporary = true;
  }
  uint64_t ssd = d.expert_bytes;
  if (!ck.dir().empty() && ck.every() > 0) {
    const uint64_t versions = Add(std::max<uint64_t>(1, ck.keep()), 1);
    ssd = Add(
        PackedBytes(Add(Mul(4, held), Mul(Mul(3, versions), held)), d.expert_tensor_bytes, file),
        Mul(versions, DenseCheckpointBytes(config.model(), U(m.dense_parameters))));
    d.checkpoint_bytes = Sub(ssd, d.expert_bytes);
  }
  d.ssd_bytes = ssd;
  d.in_flight_bytes = RoundUp(Mul(U(st.ssd_threads()) + 2, d.expert_tensor_bytes), kDiskGrowBytes);
  if (st.ssd_capacity_bytes() > 0 && ssd > st.ssd_capacity_bytes()) {
    d.ssd_bytes = st.ssd_capacity_bytes();
    d.capped = true;
  }
  // An elastic TIERED worker's shelf: two versions of its own experts and of `replicas` others',
  // 3 pieces (weights, m, v) per expert, in the shelf's 1 GiB files.
  const uint64_t replicas = std::min<uint64_t>(U(config.elastic().replicas()), W - 1);
  if (elastic && CopiesLagSteps(config) > 0 && replicas > 0) {
    d.copies_dir = st.ssd_dir().empty() ? TempBase() : st.ssd_dir();
    d.copy_bytes =
        PackedBytes(Mul(Mul(6, Add(1, replicas)), held), d.expert_tensor_bytes, uint64_t{1} << 30);
  }
  return d;
}

std::string FormatDiskEstimate(const DiskEstimate& d) {
  if (d.ssd_bytes == 0 && d.copy_bytes == 0) return "";
  std::string out = absl::StrFormat(
      "disk: %s in %s%s = expert state %s (%d experts x 4 tensors of %s: weights, gradient, Adam "
      "m and v)",
      FormatBytes(Add(d.ssd_bytes, d.copy_bytes)), d.ssd_dir,
      d.temporary ? " (a temporary folder in it)" : "", FormatBytes(d.expert_bytes), d.experts,
      FormatBytes(d.expert_tensor_bytes));
  if (d.checkpoint_bytes > 0) {
    absl::StrAppend(&out, " + checkpoints ", FormatBytes(d.checkpoint_bytes));
  }
  if (d.capped) {
    absl::StrAppend(&out, ", bounded by storage.ssd_capacity_bytes to ", FormatBytes(d.ssd_bytes));
  }
  if (d.copy_bytes > 0) {
    absl::StrAppend(&out, " + elastic copies ", FormatBytes(d.copy_bytes), " in ", d.copies_dir);
  }
  if (d.in_flight_bytes > 0 && !d.capped) {
    absl::StrAppend(&out, "; and ", FormatBytes(d.in_flight_bytes),
                    " more while writes are in flight (storage.ssd_threads + 2 expert tensors)");
  }
  return out + "\n";
}

uint64_t AvailableDiskBytes(const std::string& path) {
  struct statvfs vfs;
  if (::statvfs(Existing(path).c_str(), &vfs) != 0) return 0;
  return Mul(U(vfs.f_bavail), U(vfs.f_frsize));
}

Status CheckDisk(const JobConfig& config, const DiskEstimate& d, uint64_t available_bytes,
                 const std::string& source, std::optional<uint64_t> copies_available_bytes) {
  const bool shared = !copies_available_bytes.has_value();
  // A tier capped by storage.ssd_capacity_bytes never takes more than the cap.
  const uint64_t files = d.capped ? d.ssd_bytes : Add(d.ssd_bytes, d.in_flight_bytes);
  const uint64_t need = shared ? Add(files, d.copy_bytes) : files;
  const bool ssd_short = available_bytes > 0 && need > available_bytes;
  const bool copies_short =
      !shared && *copies_available_bytes > 0 && d.copy_bytes > *copies_available_bytes;
  if (!ssd_short && !copies_short) return absl::OkStatus();
  std::string figures = FormatDiskEstimate(d);
  if (!figures.empty()) figures.pop_back();
  const std::string folder = ssd_short ? d.ssd_dir : d.copies_dir;
  const uint64_t needed = ssd_short ? need : d.copy_bytes;
  const uint64_t have = ssd_short ? available_bytes : *copies_available_bytes;
  std::string drives =
      "the expert state grows with model.moe.num_experts, model.moe.d_expert, model.d_model and "
      "the MoE layers (model.n_layers / model.moe_every)";
  if (d.checkpoint_bytes > 0) {
    absl::StrAppend(&drives, "; checkpoints with checkpoint.keep");
  }
  if (d.copy_bytes > 0) absl::StrAppend(&drives, "; the elastic copies with elastic.replicas");
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s: the job needs %s of disk in %s but only %s is free there (%s short):\n  %s\n  Free "
      "space there, point %s at a folder on a larger disk, or make the model smaller: %s",
      source, FormatBytes(needed), folder, FormatBytes(have), FormatBytes(Sub(needed, have)),
      figures,
      ssd_short && !config.checkpoint().dir().empty() ? "checkpoint.dir (--checkpoint-dir)"
                                                      : "storage.ssd_dir",
      drives));
}

Status CheckDiskHere(const JobConfig& config, const DiskEstimate& d, const std::string& source) {
  if (d.ssd_bytes == 0 && d.copy_bytes == 0) return absl::OkStatus();
  uint64_t available = AvailableDiskBytes(d.ssd_dir);
  // Files already in the tier's folder (a resumed job's) are reused, not added to.
  if (!d.temporary && available > 0) available = Add(available, DataFileBytesUnder(d.ssd_dir));
  std::optional<uint64_t> copies;
  if (d.copy_bytes > 0) {
    struct stat a, b;
    const bool same = ::stat(Existing(d.ssd_dir).c_str(), &a) == 0 &&
                      ::stat(Existing(d.copies_dir).c_str(), &b) == 0 && a.st_dev == b.st_dev;
    if (!same) copies = AvailableDiskBytes(d.copies_dir);
  }
  return CheckDisk(config, d, available, source, copies);
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
  const uint64_t need = Mul(U(std::max(1, processes)), Add(e.host_bytes, kProcessOverheadBytes));
  if (available_bytes == 0 || need <= available_bytes) return absl::OkStatus();
  // Name the largest part and the fields that size it.
  std::string advice;
  const uint64_t model = Add(Add(e.parameter_bytes, e.gradient_bytes), e.optimizer_bytes);
  if (e.on_gpu) {
    // What the host holds for a model on a GPU, and the setting that sizes each part.
    std::vector<std::string> parts;
    const uint64_t host_tier = Sub(Sub(e.host_bytes, e.elastic_copy_bytes), e.staging_bytes);
    if (host_tier > 0) {
      parts.push_back("the tiered store's host tier (set or lower storage.host_budget_bytes)");
    }
    if (e.elastic_copy_bytes > 0) {
      parts.push_back(st.mode() == StorageConfig::TIERED ? "the elastic copies of the dense state"
                      : config.elastic().replicas() > 0
                          ? "the elastic copies (lower elastic.replicas)"
                          : "the elastic copy of the worker's own state");
    }
    if (e.staging_bytes > 0) {
      parts.push_back(
          "the page-locked buffers of its exchanges (4 bytes a gradient, and the expert "
          "exchange's rows: lower train.global_batch)");
    }
    advice =
        parts.empty()
            ? "with the model on a GPU, host memory holds only the process itself: this "
              "machine has less free memory than a strata process needs"
            : absl::StrCat("with the model on a GPU, host memory holds ",
                           absl::StrJoin(parts, ", "), "; or start fewer workers on this machine");
  } else if (e.activation_bytes >= model && e.activation_bytes >= e.store_bytes) {
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
      FormatBytes(e.host_bytes), FormatBytes(kProcessOverheadBytes), FormatBytes(available_bytes),
      figures, advice));
}

}  // namespace strata::config
