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
// moved) and expert groups. Then bad input; then import (`strata train --init-from`): export ->
// import -> export is byte-identical, and training from the file starts where the checkpoint's
// model is (its first step's loss is the imported model's loss on that batch), IN_MEMORY and
// TIERED (the experts go into the tiered store).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "proto/config_io.h"
#include "runtime/data/dataset.h"
#include "storage/env.h"
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
  strata::testing::TrainWithACheckpoint(dir, cfg);
  if (HasFatalFailure()) return;
  ExpectTheReaderRecomputesStratasLogits(dir);
  // The selection bias training moved is in the file under its name.
  EXPECT_NE(ReadFile(dir.File("m.safetensors")).find("mlp.gate.e_score_correction_bias"),
            std::string::npos);
}

// One TIERED step with LAZY updates over 64 experts: the experts no token reached were never
// written, and the checkpoint holds them as their initialisation; the export writes their values
// from the seed.
TEST(ExportTest, ExpertsTheCheckpointHoldsAtTheirInitialisationAreExportedFromTheSeed) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"),
      "train { steps: 1 global_batch: 1 eval_every: 0 threads: 1 }\n"
      "storage { mode: TIERED io_block_bytes: 8192 expert_update: LAZY }\n");
  cfg.mutable_model()->mutable_moe()->set_num_experts(64);
  strata::testing::TrainWithACheckpoint(dir, cfg);
  if (HasFatalFailure()) return;
  ExpectTheReaderRecomputesStratasLogits(dir);
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

// The model of `ckpt`'s config (another seed: every value comes from the file) with the weights
// of a safetensors file.
std::unique_ptr<train::CheckpointModel> Imported(const std::string& ckpt, const std::string& file) {
  auto info = checkpoint::CheckpointManager::ReadModelConfig(ckpt, -1);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return nullptr;
  auto m = std::make_unique<train::CheckpointModel>();
  m->checkpoint = *info;
  m->pool = std::make_unique<ThreadPool>(2);
  m->ctx.pool = m->pool.get();
  model::ModelOptions mo;
  mo.config = info->model;
  mo.seed = 999;
  mo.max_batch = 4;
  auto model = model::MoeTransformer::Create(m->ctx, mo);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  m->model = *std::move(model);
  const Status s = checkpoint::ImportSafetensors(file, *m->model).status();
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? std::move(m) : nullptr;
}

TEST(ImportTest, ExportImportExportIsByteIdenticalAndTrainingStartsFromTheFile) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"), "train { steps: 10 global_batch: 4 eval_every: 0 threads: 2 }\n");
  strata::testing::TrainWithACheckpoint(dir, cfg);
  if (HasFatalFailure()) return;
  auto exported = RunCommand(absl::StrCat(kStrata, " ckpt export ", dir.File("ckpt"),
                                          " --format safetensors -o ", dir.File("a.safetensors")));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;

  // Export -> import -> export.
  std::unique_ptr<train::CheckpointModel> m = Imported(dir.File("ckpt"), dir.File("a.safetensors"));
  ASSERT_NE(m, nullptr);
  auto again = checkpoint::WriteSafetensors(*m->model, dir.File("b.safetensors"));
  ASSERT_TRUE(again.ok()) << again.status();
  const std::string a = ReadFile(dir.File("a.safetensors"));
  EXPECT_EQ(a.size(), again->bytes);
  EXPECT_TRUE(a == ReadFile(dir.File("b.safetensors"))) << "export -> import -> export differs";

  // The first step's loss of training from the file: the imported model's on batch 0.
  const int64_t B = 4, T = cfg.model().seq_len();
  auto data =
      data::TokenDataset::Open(cfg.data(), cfg.model().vocab_size(), T, storage::Env::Default());
  ASSERT_TRUE(data.ok()) << data.status();
  std::vector<int32_t> inputs(static_cast<size_t>(B * T)), targets(inputs.size());
  (*data)->TrainBatch(cfg.seed(), data::TokenDataset::FirstSample(0, B), B, inputs.data(),
                      targets.data());
  model::GateCall call{true, 0, 0};
  call.sequence_length = T;
  call.batch_tokens = B * T;
  const double want = m->model->Forward(m->ctx, inputs.data(), targets.data(), B, call);
  config::JobConfig fine = cfg;
  fine.clear_checkpoint();
  fine.mutable_train()->set_steps(1);
  for (const char* storage : {"", "storage { mode: TIERED io_block_bytes: 8192 }"}) {
    SCOPED_TRACE(*storage ? "TIERED" : "IN_MEMORY");
    config::JobConfig job = fine;
    if (*storage) {
      auto parsed = config::ParseJobConfig(config::ToText(fine) + storage, "fine", "");
      ASSERT_TRUE(parsed.ok()) << parsed.status();
      job = *parsed;
    }
    WriteFile(dir.File("fine.textproto"), config::ToText(job));
    std::filesystem::remove(dir.File("m.jsonl"));
    auto r = RunCommand(absl::StrCat(
        kStrata, " train --quiet --config ", dir.File("fine.textproto"), " --init-from ",
        dir.File("a.safetensors"), " --metrics-out ", dir.File("m.jsonl")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double got = strata::testing::StepLosses(dir.File("m.jsonl")).at(1);
    EXPECT_NEAR(got, want, 1e-6 * want) << "the metrics line rounds to 8 digits";
  }
  // Two workers, expert-parallel and TIERED, each reading its share of the experts from the
  // file: the job's first loss is the mean of the imported model's over each worker's half of the
  // batch (each half routed and capped at its own capacity), to rounding (a row's sums depend on
  // how many rows share the GEMM call: a few ulp through two blocks; the metrics line keeps 8
  // digits).
  {
    double halves = 0;
    for (int r = 0; r < 2; ++r) {
      model::GateCall half{true, 0, r * 2 * T};
      half.sequence_length = T;
      half.batch_tokens = B * T;
      halves += m->model->Forward(m->ctx, inputs.data() + r * 2 * T, targets.data() + r * 2 * T, 2,
                                  half) /
                2;
    }
    auto parsed = config::ParseJobConfig(
        config::ToText(fine) +
            "parallel { expert_parallel: 0 }\nstorage { mode: TIERED io_block_bytes: 8192 }\n",
        "ep", "");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    parsed->mutable_train()->set_threads(1);
    WriteFile(dir.File("ep.textproto"), config::ToText(*parsed));
    const std::string job = " --quiet --config ep.textproto --init-from a.safetensors";
    ASSERT_EQ(strata::testing::RunWorkers(
                  dir.path(), 2,
                  [&](int r) { return absl::StrCat(job, " --store rv1 --metrics-out ep", r); }),
              "");
    EXPECT_NEAR(strata::testing::StepLosses(dir.File("ep0")).at(1), halves, 1e-6 * halves);
    // One worker given the file and the other none: both stop, and say why, before a step.
    const std::string failed = strata::testing::RunWorkers(dir.path(), 2, [&](int r) {
      return absl::StrCat(r == 0 ? job : " --quiet --config ep.textproto", " --store rv2");
    });
    EXPECT_NE(failed.find("worker 0 exited with 1"), std::string::npos) << failed;
    EXPECT_NE(failed.find("worker 1 exited with 1"), std::string::npos) << failed;
    EXPECT_NE(failed.find("did not start from the same weights: this worker (rank 1) has no "
                          "--init-from"),
              std::string::npos)
        << failed;
    EXPECT_NE(failed.find("this worker (rank 0) read a.safetensors (CRC-32C"), std::string::npos)
        << failed;
    // strata launch passes the file to every worker it starts.
    auto launched = RunCommand(absl::StrCat("cd ", dir.path(), " && ", kStrata,
                                            " launch --quiet --config ep.textproto --workers 2 "
                                            "--init-from a.safetensors --metrics-out launched"));
    ASSERT_EQ(launched.exit_code, 0) << launched.output;
    EXPECT_NEAR(strata::testing::StepLosses(dir.File("launched.0")).at(1), halves, 1e-6 * halves);
  }

  auto fresh =
      RunCommand(absl::StrCat(kStrata, " train --quiet --config ", dir.File("fine.textproto"),
                              " --metrics-out ", dir.File("m.jsonl")));
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_GT(std::abs(strata::testing::StepLosses(dir.File("m.jsonl")).at(1) - want), 1e-3)
      << "without --init-from the model starts from the seed";

  // Bad files: another model's export, a truncated file, --init-from with --resume.
  config::JobConfig other = fine;
  other.mutable_model()->set_d_model(48);
  WriteFile(dir.File("other.textproto"), config::ToText(other));
  WriteFile(dir.File("cut.safetensors"), a.substr(0, a.size() / 2));
  struct Case {
    std::string flags;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"--config " + dir.File("other.textproto") + " --init-from " + dir.File("a.safetensors"),
       "the file is of another model"},
      {"--config " + dir.File("fine.textproto") + " --init-from " + dir.File("cut.safetensors"),
       "do not hold its shape within the file"},
      {"--config " + dir.File("fine.textproto") + " --init-from " + dir.File("none.safetensors"),
       "cannot open the safetensors file"},
      {"--config " + dir.File("job.textproto") + " --resume --init-from " +
           dir.File("a.safetensors"),
       "a resume takes its weights from the checkpoint"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(absl::StrCat(kStrata, " train --quiet ", c.flags));
    EXPECT_EQ(r.exit_code, 1) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
  }

  // An export that fails midway (every data file of the checkpoint damaged: a CRC mismatch while
  // the file is being written) leaves no file behind, temporary or not.
  int damaged = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir.File("ckpt"))) {
    if (!f.is_regular_file() || f.path().filename().string().rfind("data-", 0) != 0) continue;
    std::string bytes = ReadFile(f.path().string());
    if (bytes.empty()) continue;
    for (size_t i = 0; i < bytes.size(); i += 4096) bytes[i] ^= 0x5a;
    WriteFile(f.path().string(), bytes);
    ++damaged;
  }
  ASSERT_GT(damaged, 0);
  auto broken = RunCommand(absl::StrCat(kStrata, " ckpt export ", dir.File("ckpt"),
                                        " --format safetensors -o ", dir.File("c.safetensors")));
  EXPECT_EQ(broken.exit_code, 1) << broken.output;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_NE(f.path().filename().string().rfind("c.", 0), 0u) << f.path() << " was left behind";
  }
}

}  // namespace
}  // namespace strata
