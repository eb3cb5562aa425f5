// The memory and disk estimates: parameter counts against models built from the same config, the
// byte figures against hand-computed ones, and the refusals of what cannot fit.
#include "runtime/model/memory_estimate.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/common/thread_pool.h"
#include "proto/config_io.h"
#include "runtime/model/transformer.h"

namespace strata::config {
namespace {

JobConfig Parse(const std::string& text) {
  auto c = ParseJobConfig(absl::StrCat("data { path: \"d\" format: UINT16 }\n", text),
                          "job.textproto", "");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : JobConfig();
}

// V 16, T 4, C 8, 2 blocks (block 0 dense with d_ff 32, block 1 MoE with 4 experts of width 16,
// top-2), batch 3: small enough to count by hand below.
const char* kSmall =
    "model { vocab_size: 16 seq_len: 4 d_model: 8 n_layers: 2 n_heads: 2 moe_every: 2\n"
    "        moe { num_experts: 4 top_k: 2 d_expert: 16 } }\n"
    "train { global_batch: 3 }\n";

TEST(MemoryEstimateTest, ParameterCountsEqualTheModelBuiltFromTheConfig) {
  ThreadPool pool(1);
  ops::Context ctx{&pool};
  const std::vector<std::string> models = {
      kSmall,
      "model { seq_len: 8 d_model: 16 n_layers: 3 n_heads: 4 }",  // MoE everywhere, defaults
      "model { seq_len: 8 d_model: 16 n_layers: 3 n_heads: 2 norm: RMS_NORM activation: SWIGLU\n"
      "        tie_embeddings: false moe_every: 2 d_ff: 24\n"
      "        moe { num_experts: 3 top_k: 1 d_expert: 12 expert_bias: false\n"
      "              gate { type: NOISY_TOP_K } } }",
      "model { seq_len: 8 d_model: 16 n_layers: 2 n_heads: 1 activation: RELU\n"
      "        moe { num_experts: 5 gate { type: SWITCH } } }",
      "model { seq_len: 8 d_model: 16 n_layers: 2 n_heads: 4 moe_every: 0 }",  // dense
      // Shared experts: one FFN of their total width per MoE block, dense parameters.
      "model { seq_len: 8 d_model: 16 n_layers: 2 n_heads: 2 activation: SWIGLU\n"
      "        moe { num_experts: 4 d_expert: 12 num_shared_experts: 2 expert_bias: false } }",
      "model { seq_len: 8 d_model: 16 n_layers: 3 n_heads: 2 moe_every: 3\n"
      "        moe { num_experts: 3 num_shared_experts: 1 shared_d_expert: 20 } }",
      // Loss-free balancing: a router_bias of E per MoE block, a dense parameter.
      "model { seq_len: 8 d_model: 16 n_layers: 2 n_heads: 2\n"
      "        moe { num_experts: 6 top_k: 4 gate { score_function: SIGMOID\n"
      "              bias_update_rate: 0.001 num_groups: 3 topk_groups: 2 } } }",
      "model { seq_len: 8 d_model: 16 n_layers: 2 n_heads: 2\n"
      "        moe { num_experts: 4 gate { type: EXPERT_CHOICE } } }",
  };
  for (const std::string& text : models) {
    const JobConfig cfg = Parse(text);
    const MemoryEstimate e = EstimateMemory(cfg);
    model::ModelOptions o;
    o.config = cfg.model();
    o.max_batch = 2;
    auto m = model::MoeTransformer::Create(ctx, o);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(e.parameters(), model::CountScalars((*m)->Parameters())) << text;
    EXPECT_EQ(e.dense_parameters, model::CountScalars((*m)->DenseParameters())) << text;
    EXPECT_EQ(e.parameter_bytes, 4u * static_cast<uint64_t>(e.parameters())) << text;
  }
}

TEST(MemoryEstimateTest, FiguresOfASmallConfigMatchAHandCount) {
  const MemoryEstimate e = EstimateMemory(Parse(kSmall));
  // Dense: wte 16*8 + wpe 4*8 + final norm 2*8 = 176; per block qkv 3*8*8 + 24, proj 8*8 + 8,
  // two norms 2*16 = 320, twice = 640; block 0's FFN 32*8 + 32 + 8*32 + 8 = 552; block 1's router
  // 4*8 = 32. Experts: 4 * (16*8 + 16 + 8*16 + 8) = 1120.
  EXPECT_EQ(e.dense_parameters, 176 + 640 + 552 + 32);
  EXPECT_EQ(e.expert_parameters, 1120);
  EXPECT_EQ(e.parameter_bytes, 2520u * 4);
  EXPECT_EQ(e.gradient_bytes, 2520u * 4);
  EXPECT_EQ(e.optimizer_bytes, 2520u * 8);
  // Activations, N = 3 * 4 = 12 tokens, in floats:
  //   model: ids 2N = 24, 3 residuals 3*N*8 = 288, final norm N*8 + 2N = 120, logits N*16 = 192,
  //          backward scratch 6*N*8 = 576                                               = 1200
  //   blocks: 2 * (8*N*8 + 4N + attention 3*2*4*4) = 2 * (768 + 48 + 96)               = 1824
  //   block 0's FFN saved rows: N * (32 + 32)                                           =  768
  //   block 1: gate 3*N*4 + N + 2*N*2 = 204; dispatch of 24 rows: ids 48, 3*24*8 = 576,
  //            saved 24 * (16 + 16) = 768, combine gradient 24                          = 1620
  //   trainer's ids 2N                                                                  =   24
  EXPECT_EQ(e.activation_bytes, (1200u + 1824 + 768 + 1620 + 24) * 4);
  EXPECT_EQ(e.store_bytes, 0u);
  EXPECT_EQ(e.total_bytes, 2520u * 16 + 5436 * 4);

  // TIERED: the model keeps the dense state (1400 * 16 = 22400 bytes); the experts' four tensors
  // (1120 * 16 = 17920 bytes) go to the store, whose unlimited tiers may each hold all of them.
  const JobConfig tiered_cfg = Parse(absl::StrCat(kSmall, "storage { mode: TIERED }"));
  const MemoryEstimate t = EstimateMemory(tiered_cfg);
  EXPECT_EQ(t.dense_state_bytes, 22400u);
  EXPECT_EQ(t.expert_state_bytes, 17920u);
  EXPECT_EQ(t.store_bytes, 2u * 17920);
  EXPECT_EQ(t.total_bytes, 22400u + 5436 * 4 + 2 * 17920);
  // With budgets the tiers hold what the budgets say (the device budget includes the dense state).
  const MemoryEstimate b = EstimateMemory(Parse(absl::StrCat(
      kSmall, "storage { mode: TIERED device_budget_bytes: 30000 host_budget_bytes: 10000 }")));
  EXPECT_EQ(b.store_bytes, (30000u - 22400) + 10000);
  EXPECT_EQ(b.total_bytes, 22400u + 5436 * 4 + 17600);
  const std::string text = FormatMemoryEstimate(b);
  EXPECT_NE(text.find("parameters 2.5 k (1.4 k dense, 1.1 k in experts)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("tiered store 17.2 KiB"), std::string::npos) << text;
}

TEST(MemoryEstimateTest, SharedExpertsCountAsDenseStateAndActivations) {
  // kSmall with 2 shared experts of width 8: one FFN of width 16 in block 1,
  // 16*8 + 16 + 8*16 + 8 = 280 dense parameters; the routed experts are unchanged.
  const std::string shared =
      "model { vocab_size: 16 seq_len: 4 d_model: 8 n_layers: 2 n_heads: 2 moe_every: 2\n"
      "        moe { num_experts: 4 top_k: 2 d_expert: 16 num_shared_experts: 2\n"
      "              shared_d_expert: 8 } }\n"
      "train { global_batch: 3 }\n";
  const MemoryEstimate e = EstimateMemory(Parse(shared));
  EXPECT_EQ(e.dense_parameters, 1400 + 280);
  EXPECT_EQ(e.expert_parameters, 1120);
  EXPECT_EQ(e.optimizer_bytes, 2800u * 8);
  // Activations: kSmall's 5436 floats and, for the 12 tokens, the shared output (8) and the
  // saved pre-activation and activation (16 + 16).
  EXPECT_EQ(e.activation_bytes, (5436u + 12 * (8 + 16 + 16)) * 4);
  // TIERED: the shared experts stay in the model's dense state, with their Adam moments; the
  // store holds only the routed experts.
  const MemoryEstimate t = EstimateMemory(Parse(absl::StrCat(shared, "storage { mode: TIERED }")));
  EXPECT_EQ(t.dense_state_bytes, 1680u * 16);
  EXPECT_EQ(t.expert_state_bytes, 1120u * 16);
  // A checkpoint's dense state: values and both moments of the 1680 parameters, a granule for
  // each of 29 tensors (kSmall's 25: wte, wpe, final norm's 2, 8 per block, block 1's router,
  // block 0's FFN 4; and the shared FFN's 4), 3 versions (keep 2). Tiny expert tensors: the
  // expert files take 64 MiB with or without the checkpoints' versions.
  const DiskEstimate d = EstimateDisk(Parse(absl::StrCat(
      shared, "storage { mode: TIERED }\ncheckpoint { dir: \"/ck\" every: 10 keep: 2 }")));
  EXPECT_EQ(d.checkpoint_bytes, 3u * 3 * (4 * 1680 + 29 * 4096));
}

TEST(MemoryEstimateTest, RefusesWhatDoesNotFitWithTheFigures) {
  const JobConfig cfg = Parse(kSmall);
  const MemoryEstimate e = EstimateMemory(cfg);
  const uint64_t need = e.total_bytes + kProcessOverheadBytes;
  EXPECT_TRUE(CheckMemory(cfg, e, need, "job.textproto").ok());
  EXPECT_TRUE(CheckMemory(cfg, e, 0, "job.textproto").ok()) << "0: not known, not checked";
  const Status s = CheckMemory(cfg, e, need - 1, "job.textproto");
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  const std::string msg(s.message());
  EXPECT_NE(msg.find("job.textproto: the job needs 256.1 MiB of memory (60.6 KiB for the model "
                     "and 256.0 MiB for the process) but this machine has 256.1 MiB available"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("AdamW moments 19.7 KiB"), std::string::npos) << msg;

  // A device budget below the dense state (1400 parameters * 16 bytes) is refused up front.
  const JobConfig tiny =
      Parse(absl::StrCat(kSmall, "storage { mode: TIERED device_budget_bytes: 22400 }"));
  const Status b = CheckMemory(tiny, EstimateMemory(tiny), 0, "job.textproto");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.message().find("field storage.device_budget_bytes: 22400 bytes cannot hold the "
                             "dense parameters with their gradients and Adam state (22400 bytes)"),
            std::string::npos)
      << b;
}

// The configs that `strata check` called valid and that then aborted `strata train` with "out of
// host memory allocating 12000000000000 bytes": now refused before anything is allocated, on any
// machine (each needs terabytes), with the largest part named.
TEST(MemoryEstimateTest, ConfigsTooLargeForAnyMachineAreRefusedByValidation) {
  struct Case {
    const char* text;
    const char* advice;
  };
  for (const Case& c : {
           Case{"model { d_model: 65536 n_layers: 64 n_heads: 1 moe_every: 0 }",
                "lower model.d_model"},
           Case{"model { d_model: 65536 n_heads: 1 moe { d_expert: 65536 } }",
                "use storage.mode TIERED"},
           Case{"model { seq_len: 65536 }", "lower train.global_batch or model.seq_len"},
           Case{"model { d_model: 4096 n_layers: 1024 n_heads: 1 }", "storage.mode TIERED"},
       }) {
    const JobConfig cfg = Parse(c.text);
    const MemoryEstimate e = EstimateMemory(cfg);
    EXPECT_GT(e.total_bytes, uint64_t{1} << 40) << c.text;
    EXPECT_TRUE(ValidateJobConfig(cfg, "big.textproto").ok()) << "the machine check is separate";
    const Status s = CheckMemory(cfg, e, AvailableHostMemory(), "big.textproto");
    ASSERT_TRUE(absl::IsResourceExhausted(s)) << c.text << ": " << s;
    EXPECT_NE(s.message().find("big.textproto: the job needs"), std::string::npos) << s;
    EXPECT_NE(s.message().find(c.advice), std::string::npos) << s;
  }
}

TEST(MemoryEstimateTest, AWorkerHoldsItsShareOfTheExpertsAndTheBatch) {
  // kSmall on 2 workers: each holds 2 of the 4 experts and 2 of the 3 sequences (ceil).
  const JobConfig cfg = Parse(kSmall);
  const MemoryEstimate full = EstimateMemory(cfg);
  const MemoryEstimate w = EstimateWorkerMemory(cfg, 2, /*elastic=*/false);
  const uint64_t dense = static_cast<uint64_t>(full.dense_parameters);
  const uint64_t half_experts = static_cast<uint64_t>(full.expert_parameters) / 2;
  EXPECT_EQ(w.expert_parameters, full.expert_parameters) << "the model's count is unchanged";
  EXPECT_EQ(w.parameter_bytes, 4 * (dense + half_experts));
  EXPECT_EQ(w.gradient_bytes, 4 * (dense + half_experts));
  EXPECT_EQ(w.optimizer_bytes, 8 * (dense + half_experts));
  JobConfig two_sequences = cfg;
  two_sequences.mutable_train()->set_global_batch(2);
  EXPECT_EQ(w.activation_bytes, EstimateMemory(two_sequences).activation_bytes);
  EXPECT_EQ(w.elastic_copy_bytes, 0u) << "a --store worker keeps no copies";
  EXPECT_EQ(w.total_bytes,
            w.parameter_bytes + w.gradient_bytes + w.optimizer_bytes + w.activation_bytes);
  EXPECT_LT(w.total_bytes, full.total_bytes);
  // An elastic worker keeps, in values and both moments (12 bytes a parameter), its state from
  // before the update and the state handed over in a re-form (2 x its share), and its buddy's
  // experts after its latest two updates (replicas 1 of the other worker: 2 x half the experts).
  const MemoryEstimate c = EstimateWorkerMemory(cfg, 2);
  EXPECT_EQ(c.elastic_copy_bytes, 12 * (2 * (dense + half_experts) + 2 * half_experts));
  EXPECT_EQ(c.total_bytes, w.total_bytes + c.elastic_copy_bytes);
  // A TIERED worker keeps its expert copies on its SSD; in memory, the dense state of its latest
  // two copies and the one handed over (3 x 12 bytes a dense parameter).
  EXPECT_EQ(EstimateWorkerMemory(Parse(absl::StrCat(kSmall, "storage { mode: TIERED }\n")), 2)
                .elastic_copy_bytes,
            36 * dense);
  // Layouts that go back to a checkpoint instead keep none.
  for (const char* other : {"storage { mode: TIERED }\nelastic { replicas: 0 }\n",
                            "parallel { expert_parallel: 1 }\n", "elastic { replicas: 0 }\n"}) {
    const MemoryEstimate o = EstimateWorkerMemory(Parse(absl::StrCat(kSmall, other)), 2);
    if (std::string(other).find("replicas") != std::string::npos &&
        std::string(other).find("TIERED") == std::string::npos) {
      EXPECT_EQ(o.elastic_copy_bytes, 24 * (dense + half_experts)) << "no buddy copies";
    } else {
      EXPECT_EQ(o.elastic_copy_bytes, 0u) << other;
    }
  }
  // Expert-parallel groups of 1: every worker holds every expert.
  const MemoryEstimate g1 =
      EstimateWorkerMemory(Parse(absl::StrCat(kSmall, "parallel { expert_parallel: 1 }\n")), 2);
  EXPECT_EQ(g1.parameter_bytes, 4 * (dense + 2 * half_experts));
  // Two processes of a share need twice the share (and the process overhead twice).
  const uint64_t two = 2 * (w.total_bytes + kProcessOverheadBytes);
  EXPECT_TRUE(CheckMemory(cfg, w, two, "job.textproto", 2).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(CheckMemory(cfg, w, two - 1, "job.textproto", 2)));
}

// With the model on a GPU only what stays in host memory is compared with the host's: nothing
// of one in-memory process, the host tier of a TIERED one, and a worker's elastic copies and
// page-locked staging. Each figure worked out by hand for kSmall (V 16, T 4, C 8, batch 3).
TEST(MemoryEstimateTest, OnAGpuTheHostHoldsTheHostTierTheElasticCopiesAndTheStaging) {
  const auto on_gpu = [](JobConfig cfg) {
    cfg.mutable_train()->set_device("cuda");
    return cfg;
  };
  const JobConfig in_memory = on_gpu(Parse(kSmall));
  const MemoryEstimate m = EstimateMemory(in_memory);
  EXPECT_TRUE(m.on_gpu);
  EXPECT_EQ(m.host_bytes, 0u);
  EXPECT_EQ(m.staging_bytes, 0u) << "one process exchanges nothing";
  // The same model, and (train.precision AUTO: bf16 GEMMs on a GPU) a bf16 copy of each weight
  // and the scratch of the largest bf16 GEMM's operands: the experts' 3 x 4 x 2 = 24 rows of
  // 16 + 8 (pre-activation and input; the head's 12 x (16 + 8) and qkv's 12 x 32 and the dense
  // FFN's 12 x (32 + 8) are smaller), 2 bytes each.
  EXPECT_EQ(m.compute_copy_bytes, 2 * static_cast<uint64_t>(m.parameters()));
  EXPECT_EQ(m.activation_bytes, EstimateMemory(Parse(kSmall)).activation_bytes + 2 * 24 * 24);
  EXPECT_EQ(m.total_bytes,
            EstimateMemory(Parse(kSmall)).total_bytes + m.compute_copy_bytes + 2 * 24 * 24);
  EXPECT_EQ(EstimateMemory(Parse(kSmall)).compute_copy_bytes, 0u) << "fp32 on the CPU";
  JobConfig fp32 = in_memory;
  fp32.mutable_train()->set_precision(TrainConfig::FP32);
  EXPECT_EQ(EstimateMemory(fp32).compute_copy_bytes, 0u);
  EXPECT_EQ(EstimateMemory(fp32).total_bytes, EstimateMemory(Parse(kSmall)).total_bytes);
  // bf16 asked for on the CPU: the copies are host memory.
  JobConfig bf16 = Parse(kSmall);
  bf16.mutable_train()->set_precision(TrainConfig::BF16);
  const MemoryEstimate cpu16 = EstimateMemory(bf16);
  EXPECT_EQ(cpu16.compute_copy_bytes, m.compute_copy_bytes);
  EXPECT_EQ(cpu16.host_bytes, cpu16.total_bytes);
  EXPECT_EQ(EstimateMemory(Parse(kSmall)).host_bytes, EstimateMemory(Parse(kSmall)).total_bytes);
  // Only the process's own overhead is left to fit; a byte less is refused, saying so.
  EXPECT_TRUE(CheckMemory(in_memory, m, kProcessOverheadBytes, "job.textproto").ok());
  const Status s = CheckMemory(in_memory, m, kProcessOverheadBytes - 1, "job.textproto");
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("host memory holds only the process itself"), std::string::npos) << s;

  const JobConfig tiered =
      on_gpu(Parse(absl::StrCat(kSmall, "storage { mode: TIERED host_budget_bytes: 50000 }\n")));
  EXPECT_EQ(EstimateMemory(tiered).host_bytes, 50000u);

  // An elastic worker of 2, all experts split over both (one group of 2): its copies as the CPU
  // figures them, the buckets of its gradients (4 bytes each: the dense ones and its 2 of the 4
  // experts), and the exchange's four buffers of a layer's rows (2 of the 3 sequences x 4 tokens
  // x top-2 = 16 rows of 8 floats).
  const MemoryEstimate w = EstimateWorkerMemory(in_memory, 2);
  const uint64_t dense = static_cast<uint64_t>(w.dense_parameters);
  const uint64_t half_experts = static_cast<uint64_t>(w.expert_parameters) / 2;
  EXPECT_EQ(w.elastic_copy_bytes, EstimateWorkerMemory(Parse(kSmall), 2).elastic_copy_bytes);
  EXPECT_EQ(w.staging_bytes, 4 * (dense + half_experts) + 4 * (16 * 8 * 4));
  EXPECT_EQ(w.host_bytes, w.elastic_copy_bytes + w.staging_bytes);
  EXPECT_EQ(w.compute_copy_bytes, 2 * (dense + half_experts));
  // Its bf16 scratch: its 2 sequences' 16 expert rows of 16 + 8.
  EXPECT_EQ(w.total_bytes, EstimateWorkerMemory(Parse(kSmall), 2).total_bytes + w.staging_bytes +
                               w.compute_copy_bytes + 2 * 16 * 24);
  const Status ws = CheckMemory(in_memory, w, w.host_bytes + kProcessOverheadBytes - 1, "j");
  ASSERT_TRUE(absl::IsResourceExhausted(ws)) << ws;
  EXPECT_NE(ws.message().find("the elastic copies (lower elastic.replicas), the page-locked "
                              "buffers of its exchanges"),
            std::string::npos)
      << ws;
  // Two data-parallel replicas (groups of 1): every gradient is in the bucket, no exchange.
  const MemoryEstimate dp = EstimateWorkerMemory(
      on_gpu(Parse(absl::StrCat(kSmall, "parallel { expert_parallel: 1 }\n"))), 2, false);
  EXPECT_EQ(dp.staging_bytes, 4 * static_cast<uint64_t>(dp.parameters()));
  EXPECT_EQ(dp.host_bytes, dp.staging_bytes);
  // A TIERED one: its host tier, its dense copies (36 bytes a dense parameter), its staging (its
  // experts' gradients are in its store, not in a bucket).
  const MemoryEstimate t = EstimateWorkerMemory(tiered, 2);
  EXPECT_EQ(t.staging_bytes, 4 * dense + 4 * (16 * 8 * 4));
  EXPECT_EQ(t.host_bytes, 50000u + 36 * dense + t.staging_bytes);
  const Status ts = CheckMemory(tiered, t, kProcessOverheadBytes, "j");
  ASSERT_TRUE(absl::IsResourceExhausted(ts)) << ts;
  EXPECT_NE(ts.message().find("the tiered store's host tier (set or lower "
                              "storage.host_budget_bytes), the elastic copies of the dense state"),
            std::string::npos)
      << ts;
}

TEST(MemoryEstimateTest, SaturatesInsteadOfWrapping) {
  // Field validation refuses these; the estimate itself must still not wrap to a small number.
  JobConfig cfg = Parse(kSmall);
  cfg.mutable_model()->set_d_model(std::numeric_limits<int32_t>::max());
  cfg.mutable_model()->set_n_layers(std::numeric_limits<int32_t>::max());
  cfg.mutable_model()->set_seq_len(std::numeric_limits<int32_t>::max());
  cfg.mutable_train()->set_global_batch(std::numeric_limits<int32_t>::max());
  const MemoryEstimate e = EstimateMemory(cfg);
  EXPECT_EQ(e.total_bytes, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(e.parameters(), std::numeric_limits<int64_t>::max());
  EXPECT_FALSE(CheckMemory(cfg, e, uint64_t{1} << 40, "x").ok());
}

TEST(MemoryEstimateTest, AvailableHostMemoryIsReadFromThisMachine) {
  const uint64_t avail = AvailableHostMemory();
  EXPECT_GT(avail, uint64_t{16} << 20) << "a test machine has more than 16 MiB free";
  EXPECT_LT(avail, uint64_t{1} << 50);
}

// The larger-than-RAM example's expert shape on 2 MoE layers of 4 experts: one expert tensor is
// 2 x 1024 x 4096 weights + 4096 + 1024 biases = 8,393,728 floats = 33,574,912 bytes, exactly
// 8197 granules of 4 KiB. A 1 GiB data file holds 31 of them (1,040,822,272 bytes) and grows in
// 64 MiB steps, so it ends at 1 GiB.
const char* kWide =
    "model { vocab_size: 256 seq_len: 32 d_model: 1024 n_layers: 2 n_heads: 8 moe_every: 1\n"
    "        moe { num_experts: 4 top_k: 1 d_expert: 4096 } }\n"
    "train { global_batch: 1 }\n";
constexpr uint64_t kTensor = 33'574'912;
constexpr uint64_t kGiB = uint64_t{1} << 30, kMiB = uint64_t{1} << 20;

TEST(DiskEstimateTest, FiguresMatchAHandCount) {
  EXPECT_EQ(EstimateDisk(Parse(kWide)).ssd_bytes, 0u) << "IN_MEMORY writes nothing";

  // 8 experts x 4 tensors = 32: one full file (31 tensors, 1 GiB) and one with 1 tensor, grown to
  // 64 MiB.
  const DiskEstimate d =
      EstimateDisk(Parse(absl::StrCat(kWide, "storage { mode: TIERED ssd_dir: \"/big/ssd\" }")));
  EXPECT_EQ(d.ssd_dir, "/big/ssd");
  EXPECT_FALSE(d.temporary);
  EXPECT_EQ(d.expert_tensor_bytes, kTensor);
  EXPECT_EQ(d.experts, 8);
  EXPECT_EQ(d.expert_bytes, kGiB + 64 * kMiB);
  EXPECT_EQ(d.checkpoint_bytes, 0u);
  EXPECT_EQ(d.ssd_bytes, kGiB + 64 * kMiB);
  EXPECT_EQ(d.copy_bytes, 0u);
  const std::string text = FormatDiskEstimate(d);
  EXPECT_NE(text.find("disk: 1.1 GiB in /big/ssd = expert state 1.1 GiB (8 experts x 4 tensors of "
                      "32.0 MiB"),
            std::string::npos)
      << text;

  // No folder: the temporary one under $TMPDIR.
  setenv("TMPDIR", "/scratch", 1);
  const DiskEstimate t = EstimateDisk(Parse(absl::StrCat(kWide, "storage { mode: TIERED }")));
  unsetenv("TMPDIR");
  EXPECT_EQ(t.ssd_dir, "/scratch");
  EXPECT_TRUE(t.temporary);

  // Checkpoints (keep 2: 3 versions while the newest commits) in the checkpoint folder, where the
  // SSD tier then lives: 32 + 3 x 3 x 8 = 104 expert tensors = 3 full files and 11 tensors
  // (369,324,032 bytes, grown to 6 x 64 MiB), and 3 versions of the dense state: values and both
  // moments, with a granule for each of its 22 tensors (wte, wpe, final norm's 2, 8 per block,
  // 2 routers).
  const JobConfig ck = Parse(absl::StrCat(kWide,
                                          "storage { mode: TIERED ssd_dir: \"/big/ssd\" }\n"
                                          "checkpoint { dir: \"/ck\" every: 10 keep: 2 }"));
  const uint64_t dense = static_cast<uint64_t>(EstimateMemory(ck).dense_parameters);
  EXPECT_EQ(dense,
            256u * 1024 + 32 * 1024 + 2 * 1024 + 2 * (4 * 1024 * 1024 + 8 * 1024) + 2 * 4 * 1024);
  const DiskEstimate c = EstimateDisk(ck);
  EXPECT_EQ(c.ssd_dir, "/ck");
  EXPECT_EQ(c.expert_bytes, kGiB + 64 * kMiB);
  const uint64_t with_checkpoints = 3 * kGiB + 6 * 64 * kMiB + 3 * 3 * (4 * dense + 22 * 4096);
  EXPECT_EQ(c.ssd_bytes, with_checkpoints);
  EXPECT_EQ(c.checkpoint_bytes, with_checkpoints - (kGiB + 64 * kMiB));
  // A folder without checkpoints written pins nothing more.
  EXPECT_EQ(EstimateDisk(Parse(absl::StrCat(kWide,
                                            "storage { mode: TIERED }\n"
                                            "checkpoint { dir: \"/ck\" every: 0 }")))
                .ssd_bytes,
            kGiB + 64 * kMiB);
  // storage.ssd_capacity_bytes bounds the SSD tier.
  JobConfig capped = ck;
  capped.mutable_storage()->set_ssd_capacity_bytes(2 * kGiB);
  const DiskEstimate cap = EstimateDisk(capped);
  EXPECT_EQ(cap.ssd_bytes, 2 * kGiB);
  EXPECT_TRUE(cap.capped);

  // One of 2 elastic workers holds 2 experts of each layer (4: 16 tensors, 537,198,592 bytes, grown
  // to 9 x 64 MiB) and keeps on its shelf, under storage.ssd_dir, two versions of its own experts
  // and of its buddy's, 3 tensors each: 2 x 2 x 4 x 3 = 48 = one full 1 GiB file and 17 tensors
  // (570,773,504 bytes, grown to 9 x 64 MiB).
  const DiskEstimate w =
      EstimateDisk(Parse(absl::StrCat(kWide, "storage { mode: TIERED ssd_dir: \"/big/ssd\" }")), 2);
  EXPECT_EQ(w.experts, 4);
  EXPECT_EQ(w.ssd_bytes, 9 * 64 * kMiB);
  EXPECT_EQ(w.copies_dir, "/big/ssd");
  EXPECT_EQ(w.copy_bytes, kGiB + 9 * 64 * kMiB);
  EXPECT_EQ(EstimateDisk(Parse(absl::StrCat(kWide, "storage { mode: TIERED ssd_dir: \"/b\" }")), 2,
                         /*elastic=*/false)
                .copy_bytes,
            0u)
      << "a --store worker keeps no copies";
}

TEST(DiskEstimateTest, RefusesWhatDoesNotFitNamingTheFolderAndTheFix) {
  const JobConfig cfg =
      Parse(absl::StrCat(kWide, "storage { mode: TIERED ssd_dir: \"/big/ssd\" }"));
  const DiskEstimate d = EstimateDisk(cfg);
  // The state's files and, on top, 6 tensors of 32 MiB in flight (a 64 MiB growth step: 256 MiB).
  EXPECT_EQ(d.in_flight_bytes, 256 * kMiB);
  const uint64_t need = kGiB + 64 * kMiB + 256 * kMiB;
  EXPECT_TRUE(CheckDisk(cfg, d, need, "job.textproto").ok());
  EXPECT_FALSE(CheckDisk(cfg, d, need - 1, "job.textproto").ok());
  EXPECT_TRUE(CheckDisk(cfg, d, 0, "job.textproto").ok()) << "0: not known, not checked";
  const Status s = CheckDisk(cfg, d, 512 * kMiB, "job.textproto");
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  const std::string msg(s.message());
  for (const char* part :
       {"job.textproto: the job needs 1.3 GiB of disk in /big/ssd but only 512.0 MiB is free "
        "there (832.0 MiB short)",
        "and 256.0 MiB more while writes are in flight",
        "expert state 1.1 GiB (8 experts x 4 tensors", "model.moe.num_experts",
        "point storage.ssd_dir at a folder on a larger disk"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << "\n" << msg;
  }
  // With checkpoints the tier is in the checkpoint folder, and keep is named.
  const JobConfig ck = Parse(absl::StrCat(
      kWide, "storage { mode: TIERED }\ncheckpoint { dir: \"/ck\" every: 10 keep: 2 }"));
  const Status c = CheckDisk(ck, EstimateDisk(ck), kGiB, "job.textproto");
  ASSERT_TRUE(absl::IsResourceExhausted(c)) << c;
  EXPECT_NE(c.message().find("checkpoint.keep"), std::string::npos) << c;
  EXPECT_NE(c.message().find("point checkpoint.dir (--checkpoint-dir) at"), std::string::npos) << c;

  // An elastic worker's copies on the tier's file system count against the same free space; on
  // another, against that one's.
  const DiskEstimate w = EstimateDisk(cfg, 2);
  // Writes in flight: 4 ssd threads + 2 tensors, in 64 MiB steps of file growth.
  EXPECT_EQ(w.in_flight_bytes,
            (6 * w.expert_tensor_bytes + 64 * kMiB - 1) / (64 * kMiB) * 64 * kMiB);
  const uint64_t files = w.ssd_bytes + w.in_flight_bytes;
  EXPECT_TRUE(CheckDisk(cfg, w, files + w.copy_bytes, "job.textproto").ok());
  EXPECT_FALSE(CheckDisk(cfg, w, files + w.copy_bytes - 1, "job.textproto").ok());
  EXPECT_TRUE(CheckDisk(cfg, w, files, "job.textproto", w.copy_bytes).ok());
  EXPECT_FALSE(CheckDisk(cfg, w, files - 1, "job.textproto", w.copy_bytes).ok());
  const Status o = CheckDisk(cfg, w, files, "job.textproto", w.copy_bytes - 1);
  ASSERT_TRUE(absl::IsResourceExhausted(o)) << o;
  EXPECT_NE(o.message().find("elastic.replicas"), std::string::npos) << o;
}

TEST(DiskEstimateTest, AvailableDiskBytesIsOfTheNearestExistingFolder) {
  struct statvfs vfs;
  ASSERT_EQ(statvfs("/", &vfs), 0);
  const uint64_t root = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  // Other processes write meanwhile: the two reads agree within 256 MiB.
  const uint64_t missing = AvailableDiskBytes("/no-such-folder/below/it");
  EXPECT_GT(missing, 0u);
  EXPECT_LT(std::max(missing, root) - std::min(missing, root), 256 * kMiB);
  EXPECT_GT(AvailableDiskBytes("no-such-relative-folder"), 0u);
}

TEST(DiskEstimateTest, ARealFolderOnASmallFileSystemIsRefused) {
  // /dev/shm is a tmpfs of at most half the machine's memory; 4096 experts of 32 MiB (512 GiB
  // with their four tensors) do not fit there on any machine this runs on.
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) != 0) GTEST_SKIP() << "no /dev/shm here";
  const JobConfig cfg = Parse(
      "model { vocab_size: 256 seq_len: 32 d_model: 1024 n_layers: 4 n_heads: 8\n"
      "        moe { num_experts: 1024 top_k: 1 d_expert: 4096 } }\n"
      "storage { mode: TIERED ssd_dir: \"/dev/shm/strata-disk-test/ssd\" }");
  const DiskEstimate d = EstimateDisk(cfg);
  ASSERT_GT(d.ssd_bytes, uint64_t{vfs.f_bavail} * vfs.f_frsize);
  const Status s = CheckDiskHere(cfg, d, "big.textproto");
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("of disk in /dev/shm/strata-disk-test/ssd but only"),
            std::string::npos)
      << s;
  // The same need on a folder with room for it passes.
  EXPECT_TRUE(CheckDiskHere(cfg,
                            EstimateDisk(Parse(absl::StrCat(kWide, "storage { mode: TIERED }"))),
                            "small.textproto")
                  .ok());
}

// A resumed job's data files are room its tier reuses: with them counted the job fits, and the
// same bytes in a file that is no data file do not count. On /dev/shm, where nothing else writes,
// so the free space holds still between the reads.
TEST(DiskEstimateTest, DataFilesAlreadyInTheFolderCountAsRoom) {
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) != 0) GTEST_SKIP() << "no /dev/shm here";
  const std::string dir = absl::StrCat("/dev/shm/strata-disk-test-", getpid());
  std::filesystem::create_directories(dir + "/shards/p0");
  const std::string data = dir + "/shards/p0/data-00000.bin", other = dir + "/shards/p0/x.bin";
  const int fd = open(data.c_str(), O_CREAT | O_WRONLY, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(posix_fallocate(fd, 0, 64 * kMiB), 0);
  close(fd);
  // A need bounded (by ssd_capacity_bytes) at 32 MiB over what is free.
  JobConfig cfg = Parse(absl::StrCat(kWide, "storage { mode: TIERED ssd_dir: \"", dir, "\" }"));
  cfg.mutable_model()->mutable_moe()->set_num_experts(1024);
  cfg.mutable_storage()->set_ssd_capacity_bytes(AvailableDiskBytes(dir) + 32 * kMiB);
  EXPECT_TRUE(CheckDiskHere(cfg, EstimateDisk(cfg), "job.textproto").ok());
  std::filesystem::rename(data, other);
  const Status s = CheckDiskHere(cfg, EstimateDisk(cfg), "job.textproto");
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
}

}  // namespace
}  // namespace strata::config
