// The memory estimate: parameter counts against models built from the same config, the byte
// figures against hand-computed ones, and the refusals of what cannot fit.
#include "proto/memory_estimate.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace strata::config
