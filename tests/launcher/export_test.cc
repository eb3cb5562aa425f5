// `strata ckpt export --format safetensors`, checked by an independent reader: a Python script
// (tests/checkpoint/safetensors_forward.py, the standard library and numpy, no strata code)
// parses the file, checks its layout, and recomputes the forward pass of the exported model in
// float64 from the JSON config beside it; its logits match strata's own forward pass over the
// same tokens within 1e-4 (strata computes in float32: a few ulp per op through two blocks leave
// the logits within about 1e-5 of exact arithmetic; a routing choice that flipped on a near tie
// would miss by far more).
//
// Two models: the tiny job trained by two TIERED expert-parallel workers (a sharded checkpoint,
// exported from its folder alone), and one trained in one process with RMSNorm, SwiGLU, untied
// embeddings, shared experts, sigmoid scores with loss-free balancing (a selection bias training
// moved) and expert groups. Then bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"
#include "train/evaluate.h"

namespace strata {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

// Debian's interpreter (scripts/install-deps.sh installs python3-numpy for it); another python3
// on the PATH may lack numpy.
std::string Python() {
  return std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
}

// Exports the newest checkpoint of dir/ckpt, runs the reader on 3 sequences of the text, and
// compares its logits with strata's.
void ExpectTheReaderRecomputesStratasLogits(const TempDir& dir) {
  auto exported = RunCommand(absl::StrCat(kStrata, " ckpt export ", dir.File("ckpt"),
                                          " --format safetensors -o ", dir.File("m.safetensors")));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find("config in " + dir.File("m.json")), std::string::npos)
      << exported.output;

  auto m = train::LoadCheckpointModel(dir.File("ckpt"), -1, 3, 1, "cpu");
  ASSERT_TRUE(m.ok()) << m.status();
  const config::ModelConfig& cfg = (*m)->model->config();
  const int64_t B = 3, T = cfg.seq_len(), V = cfg.vocab_size();
  const std::string text = ReadFile(dir.File("text.txt"));
  std::vector<int32_t> tokens, targets(static_cast<size_t>(B * T), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      tokens.push_back(static_cast<unsigned char>(text[1000 * (b + 1) + t]));
    }
  }
  (*m)->model->Forward((*m)->ctx, tokens.data(), targets.data(), B, model::GateCall{false, 0});
  std::vector<float> want(static_cast<size_t>(B * T * V));
  (*m)->model->logits().CopyToHost(want.data());

  WriteFile(dir.File("tokens.i32"),
            std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4));
  auto reader = RunCommand(absl::StrCat(
      Python(), " ", strata::testing::SourceDir(), "/tests/checkpoint/safetensors_forward.py ",
      dir.File("m.safetensors"), " ", dir.File("m.json"), " ", dir.File("tokens.i32"), " ", B, " ",
      dir.File("logits.f32")));
  ASSERT_EQ(reader.exit_code, 0) << reader.output;
  const std::string got_bytes = ReadFile(dir.File("logits.f32"));
  ASSERT_EQ(got_bytes.size(), want.size() * sizeof(float));
  const float* got = reinterpret_cast<const float*>(got_bytes.data());
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double{got[i]} - want[i]));
    ASSERT_NEAR(got[i], want[i], 1e-4) << "row " << i / V << " token " << i % V;
  }
  std::printf("  the reader's logits: worst |difference| %.2g over %zu\n", worst, want.size());
}

TEST(ExportTest, ATwoWorkerTieredCheckpointExportsWhatAnIndependentReaderRecomputes) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  const config::JobConfig cfg = strata::testing::TieredShardedJob("text.txt", 4, 4);
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  ASSERT_EQ(
      strata::testing::RunWorkers(dir.path(), 2, "--config job.textproto --quiet --store store"),
      "");
  ExpectTheReaderRecomputesStratasLogits(dir);
}

TEST(ExportTest, RmsNormSwigluSharedExpertsAndASigmoidRouterWithBiasAndGroups) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"), "train { steps: 12 global_batch: 4 eval_every: 0 threads: 2 }\n");
  config::ModelConfig* m = cfg.mutable_model();
  m->set_norm(config::ModelConfig::RMS_NORM);
  m->set_activation(config::ModelConfig::SWIGLU);
  m->set_tie_embeddings(false);
  m->mutable_moe()->set_num_experts(8);
  m->mutable_moe()->set_num_shared_experts(1);
  m->mutable_moe()->set_shared_d_expert(16);
  config::GateConfig* g = m->mutable_moe()->mutable_gate();
  g->set_score_function(config::GateConfig::SIGMOID);
  g->set_bias_update_rate(0.05f);
  g->set_num_groups(4);
  g->set_topk_groups(2);
  g->set_routed_scaling(1.5f);
  cfg.mutable_checkpoint()->set_every(12);
  cfg.mutable_checkpoint()->set_dir(dir.File("ckpt"));
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  auto train =
      RunCommand(absl::StrCat(kStrata, " train --quiet --config ", dir.File("job.textproto")));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  ExpectTheReaderRecomputesStratasLogits(dir);
  // The selection bias training moved is in the file under its name.
  EXPECT_NE(ReadFile(dir.File("m.safetensors")).find("mlp.gate.e_score_correction_bias"),
            std::string::npos);
}

TEST(ExportTest, BadInputIsAClearErrorAndLeavesNoFile) {
  TempDir dir;
  std::filesystem::create_directories(dir.File("empty"));
  struct Case {
    std::string args;
    int code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"export " + dir.File("none") + " --format safetensors -o " + dir.File("a.safetensors"), 1,
       "checkpoint folder '" + dir.File("none") + "' does not exist"},
      {"export " + dir.File("empty") + " --format safetensors -o " + dir.File("a.safetensors"), 1,
       "no checkpoints in"},
      {"export " + dir.File("none") + " --format onnx -o x", 2, "--format safetensors is the one"},
      {"export " + dir.File("none") + " --format safetensors", 2, "-o FILE is required"},
      {"export " + dir.File("none") + " --format safetensors -o x --steps 3", 2,
       "cannot understand '--steps'"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(absl::StrCat(kStrata, " ckpt ", c.args));
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("a.safetensors")));
}

TEST(SafetensorsNameTest, StrataNamesMapToTheCommonMoeLayout) {
  using checkpoint::SafetensorsName;
  EXPECT_EQ(SafetensorsName("wte", false), "model.embed_tokens.weight");
  EXPECT_EQ(SafetensorsName("blocks.3.attn.qkv.weight", false),
            "model.layers.3.self_attn.qkv_proj.weight");
  EXPECT_EQ(SafetensorsName("blocks.0.moe.experts.12.w1", false),
            "model.layers.0.mlp.experts.12.up_proj.weight");
  EXPECT_EQ(SafetensorsName("blocks.0.moe.experts.12.w1", true),
            "model.layers.0.mlp.experts.12.gate_up_proj.weight");
  EXPECT_EQ(SafetensorsName("blocks.1.moe.shared.b2", false),
            "model.layers.1.mlp.shared_experts.down_proj.bias");
  EXPECT_EQ(SafetensorsName("blocks.2.ffn.w2", false), "model.layers.2.mlp.down_proj.weight");
  EXPECT_EQ(SafetensorsName("blocks.1.moe.gate.router_bias", false),
            "model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(SafetensorsName("blocks.1.moe.custom.thing", false),
            "strata.blocks.1.moe.custom.thing");
  EXPECT_EQ(checkpoint::ExportConfigPath("out/model.safetensors"), "out/model.json");
  EXPECT_EQ(checkpoint::ExportConfigPath("model.bin"), "model.bin.json");
}

}  // namespace
}  // namespace strata
