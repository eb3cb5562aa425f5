// `strata generate` and GenerateFromCheckpoint, on a checkpoint a real `strata train` wrote:
// - decoding through the KV cache, greedy and sampled, draws what the logits of a full Forward
//   over the window give at its last position, recomputed here for every token (a prompt longer
//   than seq_len included, and three restarts of the window at seq_len / 2); top-k 1 is greedy
//   whatever the temperature and seed;
// - a seed gives the same text, another seed another, and a prompt gets the same text alone or in
//   a batch with others (a dropless gate routes every token on its own);
// - SampleToken keeps exactly the top-k / top-p tokens and draws them with their renormalised
//   probabilities (frequencies over 20,000 draws);
// - the command streams one prompt, prints a file of prompts, and refuses bad input clearly;
// - a checkpoint four TIERED expert-parallel workers wrote (four shards, one expert each) generates
//   bit for bit what the parameters those workers exported generate in this process.
#include "train/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/manager.h"
#include "core/common/rng.h"
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

class GenerateTest : public ::testing::Test {
 protected:
  // One tiny job trained for the whole suite: 30 steps, a checkpoint at the last.
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    WriteFile(dir_->File("text.txt"), strata::testing::SyntheticText(30000));
    config::JobConfig cfg = strata::testing::TinyMoeJob(
        dir_->File("text.txt"), "train { steps: 30 global_batch: 8 eval_every: 0 threads: 2 }\n");
    strata::testing::TrainWithACheckpoint(*dir_, cfg);
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string Ckpt() { return dir_->File("ckpt"); }

  static train::GenerateOptions Options(std::vector<std::string> prompts) {
    train::GenerateOptions o;
    o.checkpoint_dir = Ckpt();
    o.prompts = std::move(prompts);
    o.max_tokens = 12;
    o.threads = 2;
    return o;
  }
  static std::vector<std::string> Generate(const train::GenerateOptions& o) {
    auto g = train::GenerateFromCheckpoint(o);
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? g->completions : std::vector<std::string>{};
  }
  static TempDir* dir_;
};
TempDir* GenerateTest::dir_ = nullptr;

TEST_F(GenerateTest, DecodingSamplesWhatFullPassesOverTheWindowGiveAndTopKOneIsGreedy) {
  const std::string prompt = "The quick brown fox jumps over the lazy dog, again and";  // > 32
  auto m = train::LoadCheckpointModel(Ckpt(), -1, 1, 2, "cpu");
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t T = (*m)->checkpoint.model.seq_len(), V = (*m)->checkpoint.model.vocab_size();
  ASSERT_EQ(T, 32) << "40 tokens after a 54-byte prompt restart the window three times at 32";
  for (double temperature : {0.0, 1.0}) {
    SCOPED_TRACE(absl::StrCat("temperature ", temperature));
    train::GenerateOptions o = Options({prompt});
    o.temperature = temperature;
    o.seed = 4;
    o.max_tokens = 40;
    const std::vector<std::string> got = Generate(o);
    ASSERT_EQ(got.size(), 1u);
    ASSERT_EQ(got[0].size(), 40u);

    // The same, by a full pass over the window for every token (generate.h's window rule: the
    // prompt's last T tokens, restarting with the last T / 2 when it would pass T), the token
    // drawn by SampleToken from the prompt's stream.
    std::string text = prompt;
    size_t start = text.size() - T;
    for (int i = 0; i < 40; ++i) {
      if (text.size() - start > static_cast<size_t>(T)) start = text.size() - T / 2;
      const std::string window = text.substr(start);
      std::vector<int32_t> tokens(static_cast<size_t>(T), 0), targets(tokens.size(), 0);
      for (size_t j = 0; j < window.size(); ++j) tokens[j] = static_cast<unsigned char>(window[j]);
      model::GateCall call{false, static_cast<uint64_t>((*m)->checkpoint.step), 0};
      (*m)->model->Forward((*m)->ctx, tokens.data(), targets.data(), 1, call);
      std::vector<float> logits(static_cast<size_t>(T * V));
      (*m)->model->logits().CopyToHost(logits.data());
      const float* row = logits.data() + (window.size() - 1) * V;
      text.push_back(
          static_cast<char>(train::SampleToken(row, static_cast<int>(V), temperature, 0, 1.0,
                                               train::PromptKey(4, prompt), text.size())));
    }
    EXPECT_EQ(got[0], text.substr(prompt.size()));
    if (temperature == 0) {
      for (uint64_t seed : {1u, 99u}) {
        train::GenerateOptions k1 = o;
        k1.temperature = 1.7;
        k1.top_k = 1;
        k1.seed = seed;
        EXPECT_EQ(Generate(k1), got) << "seed " << seed;
      }
    } else {
      // Sampling, not a run of one byte: what the reference checks is the text of a distribution.
      EXPECT_GT(std::set<char>(got[0].begin(), got[0].end()).size(), 4u) << got[0];
    }
  }
}

TEST_F(GenerateTest, ASeedGivesTheSameTextAndAPromptTheSameAloneOrInABatch) {
  train::GenerateOptions o = Options({"Once upon a time", "A mixture of experts"});
  o.seed = 5;
  o.max_tokens = 20;
  const std::vector<std::string> both = Generate(o);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(Generate(o), both) << "the same seed";
  for (size_t i = 0; i < 2; ++i) {
    train::GenerateOptions alone = o;
    alone.prompts = {o.prompts[i]};
    EXPECT_EQ(Generate(alone), std::vector<std::string>{both[i]}) << o.prompts[i];
  }
  o.seed = 6;
  EXPECT_NE(Generate(o), both) << "another seed, the same 40 draws";
}

TEST(SampleTokenTest, KeepsTheTopKAndTopPTokensAndDrawsThemByTheirProbabilities) {
  // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
  const float logits[4] = {std::log(0.25f), std::log(0.5f), std::log(0.125f), std::log(0.125f)};
  struct Case {
    int64_t top_k;
    double top_p;
    std::map<int, double> want;  // token -> renormalised probability
  };
  const Case cases[] = {
      {0, 1.0, {{1, 0.5}, {0, 0.25}, {2, 0.125}, {3, 0.125}}},
      {2, 1.0, {{1, 2.0 / 3}, {0, 1.0 / 3}}},
      {0, 0.7, {{1, 2.0 / 3}, {0, 1.0 / 3}}},  // 0.5 < 0.7 <= 0.75
      {0, 0.45, {{1, 1.0}}},
      {3, 0.9, {{1, 0.5 / 0.875}, {0, 0.25 / 0.875}, {2, 0.125 / 0.875}}},
  };
  constexpr int kDraws = 20000;
  for (const Case& c : cases) {
    std::map<int, int> seen;
    for (int i = 0; i < kDraws; ++i) {
      ++seen[train::SampleToken(logits, 4, 1.0, c.top_k, c.top_p, rng::Key(42), i)];
    }
    for (const auto& [token, count] : seen) {
      EXPECT_TRUE(c.want.count(token))
          << "top_k " << c.top_k << " top_p " << c.top_p << ": drew token " << token;
    }
    // A binomial frequency's standard deviation is at most 0.0036 at 20,000 draws: 0.02 is 5.6 of
    // them.
    for (const auto& [token, p] : c.want) {
      EXPECT_NEAR(static_cast<double>(seen[token]) / kDraws, p, 0.02)
          << "top_k " << c.top_k << " top_p " << c.top_p << " token " << token;
    }
  }
  // Greedy, and a tie for the most likely broken by the lower token, greedy or top-1.
  EXPECT_EQ(train::SampleToken(logits, 4, 0.0, 0, 1.0, 0, 0), 1);
  const float tied[3] = {1.0f, 3.0f, 3.0f};
  EXPECT_EQ(train::SampleToken(tied, 3, 0.0, 0, 1.0, 0, 0), 1);
  EXPECT_EQ(train::SampleToken(tied, 3, 1.0, 1, 1.0, rng::Key(1), 7), 1);
}

TEST_F(GenerateTest, TheCommandStreamsAPromptPrintsAFileOfThemAndRefusesBadInput) {
  auto one = RunCommand(absl::StrCat(kStrata, " generate --checkpoint ", Ckpt(),
                                     " --prompt 'Once upon a time' --max-tokens 8 --seed 5"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  train::GenerateOptions o = Options({"Once upon a time"});
  o.seed = 5;
  o.max_tokens = 8;
  const std::vector<std::string> want = Generate(o);
  ASSERT_EQ(want.size(), 1u);
  EXPECT_NE(one.output.find("Once upon a time" + want[0] + "\n"), std::string::npos) << one.output;
  EXPECT_NE(one.output.find("generate: checkpoint 30, 8 tokens"), std::string::npos) << one.output;

  // CRLF lines, generated one prompt at a time (--batch 1): the same text.
  WriteFile(dir_->File("prompts.txt"), "Once upon a time\r\nA mixture of experts\r\n");
  auto file =
      RunCommand(absl::StrCat(kStrata, " generate --checkpoint ", Ckpt(), " --prompt-file ",
                              dir_->File("prompts.txt"), " --max-tokens 8 --seed 5 --batch 1"));
  ASSERT_EQ(file.exit_code, 0) << file.output;
  EXPECT_NE(file.output.find("Once upon a time" + want[0] + "\n"), std::string::npos)
      << file.output;
  EXPECT_NE(file.output.find("generate: checkpoint 30, 16 tokens"), std::string::npos)
      << file.output;

  WriteFile(dir_->File("empty.txt"), "\n\n");
  struct Case {
    std::string flags;
    int code;
    std::string says;
  };
  const std::string ck = "--checkpoint " + Ckpt();
  const std::vector<Case> cases = {
      {"--prompt x", 2, "--checkpoint is required"},
      {ck, 2, "give one of --prompt TEXT and --prompt-file FILE"},
      {ck + " --prompt x --prompt-file " + dir_->File("prompts.txt"), 2, "give one of"},
      {ck + " --prompt-file " + dir_->File("empty.txt"), 1, "holds no prompt (one per line)"},
      {ck + " --prompt-file " + dir_->File("missing.txt"), 1, "cannot read --prompt-file"},
      {ck + " --prompt ''", 1, "prompt 1 is empty"},
      {ck + " --prompt x --top-p 0", 1, "top_p must be in (0, 1], not 0"},
      {ck + " --prompt x --temperature -1", 1, "the temperature must be 0 (greedy) or more"},
      {ck + " --prompt x --temperature warm", 2, "--temperature warm is not a number"},
      {ck + " --prompt x --max-tokens 0", 2, "--max-tokens"},
      {ck + " --prompt x --step 7", 1, "no checkpoint of step 7"},
      {ck + " --prompt x --offload-device 12MB", 2, "--offload-device: '12MB' is not a size"},
      {ck + " --prompt x --offload-host -1G", 2, "--offload-host: '-1G' is not a size"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(absl::StrCat(kStrata, " generate ", c.flags));
    EXPECT_EQ(r.exit_code, c.code) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
  }
}

// Expert-choice routing lets a batch's tokens compete, so a token's route would depend on what is
// decoded beside it: refused before the weights are read.
TEST(GenerateRefusalTest, AnExpertChoiceModelIsRefusedNamingWhy) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"), "train { steps: 2 global_batch: 2 eval_every: 0 threads: 1 }\n");
  cfg.mutable_model()->mutable_moe()->mutable_gate()->set_type(config::GateConfig::EXPERT_CHOICE);
  strata::testing::TrainWithACheckpoint(dir, cfg);
  if (HasFatalFailure()) return;
  train::GenerateOptions o;
  o.checkpoint_dir = dir.File("ckpt");
  o.prompts = {"abc"};
  auto g = train::GenerateFromCheckpoint(o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
  EXPECT_NE(g.status().message().find("routes with expert choice"), std::string::npos)
      << g.status();
}

// Four `strata worker` processes train a TIERED expert-parallel job (one expert of each layer per
// worker, every expert on the workers' SSD tier) and checkpoint it as four shards; each exports
// its parameters when training ends. Generation from the sharded checkpoint (one process reading
// every shard) equals generation in this process from a model given the exported parameters,
// greedy and sampled, text for text.
TEST(GenerateShardedTest, AFourWorkerTieredCheckpointGeneratesWhatItsWorkersParametersDo) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  const config::JobConfig cfg = strata::testing::TieredShardedJob("text.txt", 6, 8);
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  constexpr int kWorkers = 4;
  ASSERT_EQ(strata::testing::RunWorkers(
                dir.path(), kWorkers,
                "--config job.textproto --quiet --store store --export-params exported"),
            "");
  auto list = checkpoint::CheckpointManager::List(dir.File("ckpt"));
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_FALSE(list->empty());
  EXPECT_EQ(list->back().shards.size(), static_cast<size_t>(kWorkers));

  // The same parameters in one process: the model built from the checkpoint's config, every
  // parameter set from what the workers exported.
  auto ckpt = checkpoint::CheckpointManager::ReadModelConfig(dir.File("ckpt"), -1);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ(ckpt->workers, kWorkers);
  train::CheckpointModel one;
  one.checkpoint = *ckpt;
  one.name = "the exported parameters";
  one.pool = std::make_unique<ThreadPool>(2);
  one.ctx.pool = one.pool.get();
  model::ModelOptions mo;
  mo.config = ckpt->model;
  mo.seed = 12345;  // not the job's: every value comes from the export
  mo.max_batch = 3;
  auto model = model::MoeTransformer::Create(one.ctx, mo);
  ASSERT_TRUE(model.ok()) << model.status();
  one.model = *std::move(model);
  for (model::Parameter* p : one.model->Parameters()) {
    const std::string exported = ReadFile(dir.File("exported/" + p->name + ".f32"));
    ASSERT_EQ(exported.size(), static_cast<size_t>(p->value.numel()) * sizeof(float)) << p->name;
    p->value.CopyFromHost(exported.data());
  }

  for (double temperature : {0.0, 0.9}) {
    train::GenerateOptions o;
    o.checkpoint_dir = dir.File("ckpt");
    o.prompts = {"Once upon a time", "The quick brown fox jumps over the lazy dog, again", "A"};
    o.max_tokens = 40;
    o.temperature = temperature;
    o.seed = 3;
    o.threads = 2;
    auto sharded = train::GenerateFromCheckpoint(o);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    auto in_one = train::Generate(one, o);
    ASSERT_TRUE(in_one.ok()) << in_one.status();
    EXPECT_EQ(sharded->completions, in_one->completions) << "temperature " << temperature;
    EXPECT_EQ(sharded->tokens, 3 * 40);
  }
}

// Offloaded inference (evaluate.h): a model of 2 MoE layers x 64 experts (8 KiB of weights each,
// 1 MiB in all) generates and evaluates with its experts in a tiered store whose device ring and
// host tier each hold an eighth of them (16 slots), the rest on the SSD tier: the text and the
// loss are bit for bit those of the model in memory (on the CPU both run each expert as one task
// with single-threaded kernels), the experts did come from the SSD, and the history prefetch
// guessed some of the routed experts before their gate ran.
TEST(GenerateOffloadTest, BudgetsEightTimesBelowTheExpertsGiveTheInMemoryTextBitForBit) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(40000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"), "train { steps: 20 global_batch: 8 eval_every: 0 threads: 2 }\n");
  config::MoeConfig* moe = cfg.mutable_model()->mutable_moe();
  moe->set_num_experts(64);
  moe->set_expert_bias(false);
  strata::testing::TrainWithACheckpoint(dir, cfg);
  if (HasFatalFailure()) return;

  train::GenerateOptions o;
  o.checkpoint_dir = dir.File("ckpt");
  o.prompts = {"Once upon a time", "The quick brown fox", "A mixture of experts", "Z"};
  o.max_tokens = 48;  // past seq_len 32: a window restart too
  o.temperature = 0.8;
  o.seed = 9;
  o.threads = 2;
  auto in_memory = train::GenerateFromCheckpoint(o);
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  EXPECT_EQ(in_memory->offload.routed, 0u);

  constexpr uint64_t kExpertBytes = 2 * 64 * 32 * 32 * 2 * sizeof(float);  // 1 MiB
  o.offload.enabled = true;
  o.offload.device_bytes = kExpertBytes / 8;
  o.offload.host_bytes = kExpertBytes / 8;
  o.offload.io_block_bytes = 8192;
  o.offload.ssd_dir = dir.File("offload");
  std::filesystem::create_directories(o.offload.ssd_dir);
  auto offloaded = train::GenerateFromCheckpoint(o);
  ASSERT_TRUE(offloaded.ok()) << offloaded.status();
  EXPECT_EQ(offloaded->completions, in_memory->completions);
  const train::OffloadReport& r = offloaded->offload;
  EXPECT_EQ(r.expert_bytes, kExpertBytes);
  EXPECT_GT(r.ssd_bytes_read, 0u) << "the experts came through the SSD tier";
  EXPECT_GT(r.routed, 0u);
  EXPECT_GT(r.guessed, 0u) << "history prefetch guessed some routed experts";
  EXPECT_LE(r.guessed, r.routed);
  std::printf("offloaded: %llu routed, %llu guessed, %.1f MiB from SSD, %.1f MiB to the ring\n",
              static_cast<unsigned long long>(r.routed), static_cast<unsigned long long>(r.guessed),
              r.ssd_bytes_read / 1048576.0, r.device_bytes_in / 1048576.0);

  // Evaluation too: the same loss to the bit.
  train::CheckpointEvalOptions e;
  e.checkpoint_dir = dir.File("ckpt");
  e.data.set_path(dir.File("text.txt"));
  e.batch = 4;
  e.max_windows = 12;
  e.threads = 2;
  auto eval_memory = train::EvaluateCheckpoint(e);
  ASSERT_TRUE(eval_memory.ok()) << eval_memory.status();
  e.offload = o.offload;
  auto eval_offloaded = train::EvaluateCheckpoint(e);
  ASSERT_TRUE(eval_offloaded.ok()) << eval_offloaded.status();
  EXPECT_EQ(eval_offloaded->loss, eval_memory->loss);

  // The command: the same text, and a line on what offloading did.
  auto cli = RunCommand(absl::StrCat(
      kStrata, " generate --checkpoint ", dir.File("ckpt"), " --prompt 'Once upon a time' ",
      "--max-tokens 48 --temperature 0.8 --seed 9 --threads 2 --offload-device 128KiB ",
      "--offload-host 128KiB --offload-dir ", o.offload.ssd_dir));
  ASSERT_EQ(cli.exit_code, 0) << cli.output;
  EXPECT_NE(cli.output.find("Once upon a time" + in_memory->completions[0] + "\n"),
            std::string::npos)
      << cli.output;
  EXPECT_NE(cli.output.find("offload: 1.0 MiB of experts through a ring of 128.0 KiB over 128.0 "
                            "KiB of host memory"),
            std::string::npos)
      << cli.output;

  // A ring too small for the compute threads is refused, naming what to raise.
  o.offload.device_bytes = 2 * 8192;
  auto small = train::GenerateFromCheckpoint(o);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("cannot offload the experts of checkpoint 20"),
            std::string::npos)
      << small.status();
  EXPECT_NE(small.status().message().find("raise the device budget"), std::string::npos)
      << small.status();
}

}  // namespace
}  // namespace strata
