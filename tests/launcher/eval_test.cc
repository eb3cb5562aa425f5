// `strata eval` and the read-only checkpoint reader under it, with real processes and real
// checkpoint folders:
// - the held-out tail of a job's data, evaluated from the job's last checkpoint with the job's
//   batch, gives the trainer's own evaluation of that step (to the 8 digits its metrics print; the
//   same forward passes over the same batches, so the sums are the same);
// - the weights read from a checkpoint that two TIERED expert-parallel workers wrote (two shards,
//   each holding half of the experts) are bitwise the parameters the workers exported when they
//   finished;
// - bad input (no checkpoint, a missing step, a short file, bad flags) is a clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "checkpoint/manager.h"
#include "core/common/thread_pool.h"
#include "proto/config_io.h"
#include "runtime/data/dataset.h"
#include "runtime/model/transformer.h"
#include "storage/env.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"

namespace strata {
namespace {

using strata::testing::DoubleField;
using strata::testing::IntField;
using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

// The line of `step` in a metrics file.
std::string MetricsLine(const std::string& path, int64_t step) {
  for (const auto& piece : absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty())) {
    const std::string line(piece);
    if (IntField(line, "step") == step) return line;
  }
  return "";
}

// Trains `cfg` with `strata train` in `dir`, a checkpoint at its last step into dir/ckpt and the
// metrics into dir/m.jsonl.
void TrainToCheckpoint(const TempDir& dir, config::JobConfig cfg) {
  cfg.mutable_checkpoint()->set_every(cfg.train().steps());
  cfg.mutable_checkpoint()->set_dir(dir.File("ckpt"));
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  auto train =
      RunCommand(absl::StrCat(kStrata, " train --quiet --config ", dir.File("job.textproto"),
                              " --metrics-out ", dir.File("m.jsonl")));
  ASSERT_EQ(train.exit_code, 0) << train.output;
}

TEST(EvalTest, TheHeldOutTailFromTheLastCheckpointGivesTheTrainersEvaluation) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  constexpr int kBatch = 2, kSteps = 6;
  config::JobConfig cfg = strata::testing::TinyMoeJob(dir.File("text.txt"), "");
  auto data = data::TokenDataset::Open(cfg.data(), cfg.model().vocab_size(), cfg.model().seq_len(),
                                       storage::Env::Default());
  ASSERT_TRUE(data.ok()) << data.status();
  const int64_t windows = (*data)->eval_windows();
  ASSERT_EQ(windows % kBatch, 0) << "the evaluation must cover the held-out windows once";
  cfg.mutable_train()->set_steps(kSteps);
  cfg.mutable_train()->set_global_batch(kBatch);
  cfg.mutable_train()->set_eval_every(kSteps);
  cfg.mutable_train()->set_eval_batches(static_cast<int>(windows / kBatch));
  cfg.mutable_train()->set_threads(2);
  TrainToCheckpoint(dir, cfg);
  if (HasFailure()) return;
  const std::string line = MetricsLine(dir.File("m.jsonl"), kSteps);
  const double want = DoubleField(line, "eval_loss");
  ASSERT_TRUE(std::isfinite(want)) << line;

  // The held-out tail, as a file of its own.
  const std::string text = ReadFile(dir.File("text.txt"));
  WriteFile(dir.File("tail.txt"), text.substr(static_cast<size_t>((*data)->train_tokens())));
  auto eval =
      RunCommand(absl::StrCat(kStrata, " eval --json --checkpoint ", dir.File("ckpt"), " --data ",
                              dir.File("tail.txt"), " --batch ", kBatch, " --threads 2"));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  const std::string json = eval.output.substr(eval.output.rfind("{\""));
  EXPECT_EQ(IntField(json, "step"), kSteps) << json;
  EXPECT_EQ(IntField(json, "windows"), windows) << json;
  EXPECT_EQ(IntField(json, "tokens"), windows * cfg.model().seq_len()) << json;
  const double got = DoubleField(json, "loss");
  // The metrics print 8 significant digits.
  EXPECT_NEAR(got, want, 1e-7 * want) << json << "\n" << line;
  // Both printed with every digit of a double.
  EXPECT_NEAR(DoubleField(json, "bits_per_byte"), got / std::log(2.0), 1e-14) << json;

  // A batch that does not divide the windows ends in a short one; --max-windows stops early.
  auto part =
      RunCommand(absl::StrCat(kStrata, " eval --json --checkpoint ", dir.File("ckpt"), " --data ",
                              dir.File("tail.txt"), " --batch 2 --max-windows 5 --step ", kSteps));
  ASSERT_EQ(part.exit_code, 0) << part.output;
  const std::string pj = part.output.substr(part.output.rfind("{\""));
  EXPECT_EQ(IntField(pj, "windows"), 5) << pj;
  EXPECT_TRUE(std::isfinite(DoubleField(pj, "loss"))) << pj;

  // The human-readable form, with its progress lines on stderr.
  auto human = RunCommand(absl::StrCat(kStrata, " eval --checkpoint ", dir.File("ckpt"), " --data ",
                                       dir.File("tail.txt"), " --batch ", kBatch));
  ASSERT_EQ(human.exit_code, 0) << human.output;
  EXPECT_NE(human.output.find(absl::StrCat("eval: ", windows, " of ", windows, " windows")),
            std::string::npos)
      << human.output;
  EXPECT_NE(human.output.find(absl::StrCat("checkpoint ", kSteps, " of ", dir.File("ckpt"))),
            std::string::npos)
      << human.output;
  EXPECT_NE(human.output.find("bits per byte"), std::string::npos) << human.output;
}

TEST(EvalTest, WeightsOfATwoWorkerTieredCheckpointAreWhatTheWorkersExported) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  const config::JobConfig cfg = strata::testing::TieredShardedJob("text.txt", 4, 4);
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  ASSERT_EQ(
      strata::testing::RunWorkers(
          dir.path(), 2, "--config job.textproto --quiet --store store --export-params exported"),
      "");

  auto ckpt = checkpoint::CheckpointManager::ReadModelConfig(dir.File("ckpt"), -1);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->step, 4);
  EXPECT_EQ(ckpt->workers, 2);
  EXPECT_EQ(ckpt->seed, cfg.seed());
  ThreadPool pool(1);
  ops::Context ctx;
  ctx.pool = &pool;
  model::ModelOptions mo;
  mo.config = ckpt->model;
  mo.seed = ckpt->seed;
  auto model = model::MoeTransformer::Create(ctx, mo);
  ASSERT_TRUE(model.ok()) << model.status();
  // Every value starts from the seed's initialisation, which training moved away from.
  ASSERT_TRUE(
      checkpoint::CheckpointManager::ReadWeights(dir.File("ckpt"), ckpt->step, ckpt->seed, **model)
          .ok());
  int compared = 0;
  for (const model::Parameter* p : (*model)->Parameters()) {
    const std::string exported = ReadFile(dir.File("exported/" + p->name + ".f32"));
    ASSERT_EQ(exported.size(), static_cast<size_t>(p->shape.numel()) * sizeof(float)) << p->name;
    const std::string read(reinterpret_cast<const char*>(p->value.f32()),
                           static_cast<size_t>(p->shape.numel()) * sizeof(float));
    EXPECT_EQ(read, exported) << p->name;
    ++compared;
  }
  EXPECT_GT(compared, 8);
  // Both shards were needed: each holds half of the experts.
  auto list = checkpoint::CheckpointManager::List(dir.File("ckpt"));
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_FALSE(list->empty());
  EXPECT_EQ(list->back().shards.size(), 2u);

  // A model of another shape is refused, naming the difference.
  mo.config.set_d_model(48);
  auto other = model::MoeTransformer::Create(ctx, mo);
  ASSERT_TRUE(other.ok()) << other.status();
  const Status s =
      checkpoint::CheckpointManager::ReadWeights(dir.File("ckpt"), ckpt->step, ckpt->seed, **other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("d_model"), std::string::npos) << s;
}

// A model of 16-bit tokens (vocab_size 64): its own kind of file evaluates, a bytes file (the
// default format) is refused before a byte could index past the embedding table.
TEST(EvalTest, SixteenBitTokensEvaluateAndABytesFileIsRefusedForTheirModel) {
  TempDir dir;
  std::string tokens;
  for (int i = 0; i < 8000; ++i) {
    const int t = (i * 7 + i / 13) % 64;
    tokens.push_back(static_cast<char>(t));
    tokens.push_back('\0');
  }
  WriteFile(dir.File("tokens.bin"), tokens);
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("tokens.bin"), "train { steps: 2 global_batch: 2 eval_every: 0 threads: 1 }\n");
  cfg.mutable_model()->set_vocab_size(64);
  cfg.mutable_data()->set_format(config::DataConfig::UINT16);
  TrainToCheckpoint(dir, cfg);
  if (HasFailure()) return;
  auto ok = RunCommand(absl::StrCat(kStrata, " eval --json --checkpoint ", dir.File("ckpt"),
                                    " --data ", dir.File("tokens.bin"), " --format uint16"));
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  const std::string json = ok.output.substr(ok.output.rfind("{\""));
  EXPECT_EQ(IntField(json, "windows"), (8000 - 1) / 32) << json;
  EXPECT_TRUE(std::isfinite(DoubleField(json, "loss"))) << json;
  EXPECT_EQ(json.find("bits_per_byte"), std::string::npos) << "not a bytes file: " << json;
  auto bytes = RunCommand(absl::StrCat(kStrata, " eval --checkpoint ", dir.File("ckpt"), " --data ",
                                       dir.File("tokens.bin")));
  EXPECT_EQ(bytes.exit_code, 1) << bytes.output;
  EXPECT_NE(bytes.output.find("has a vocabulary of 64 tokens, fewer than a byte's 256 values"),
            std::string::npos)
      << bytes.output;
  EXPECT_NE(bytes.output.find("--format uint16"), std::string::npos) << bytes.output;
}

TEST(EvalTest, BadInputIsAClearError) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(20000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"), "train { steps: 2 global_batch: 2 eval_every: 0 threads: 1 }\n");
  TrainToCheckpoint(dir, cfg);
  if (HasFailure()) return;
  WriteFile(dir.File("short.txt"), "too short");
  std::filesystem::create_directories(dir.File("empty"));
  struct Case {
    std::string flags;
    int code;
    std::string says;
  };
  const std::string ckpt = dir.File("ckpt"), text = dir.File("text.txt");
  const std::vector<Case> cases = {
      {"--data " + text, 2, "--checkpoint is required"},
      {"--checkpoint " + ckpt, 2, "--data is required"},
      {"--checkpoint " + ckpt + " --data " + text + " --batch 0", 2, "--batch"},
      {"--checkpoint " + ckpt + " --data " + text + " --format utf8", 2,
       "--format utf8: the formats are bytes and uint16"},
      {"--checkpoint " + dir.File("nowhere") + " --data " + text, 1, "does not exist"},
      {"--checkpoint " + dir.File("empty") + " --data " + text, 1, "no checkpoints in"},
      {"--checkpoint " + ckpt + " --step 7 --data " + text, 1,
       "no checkpoint of step 7 in '" + ckpt + "'; it holds 2"},
      {"--checkpoint " + ckpt + " --data " + dir.File("short.txt"), 1,
       "too few for one window of seq_len + 1 = 33 tokens"},
      {"--checkpoint " + ckpt + " --data " + dir.File("missing.txt"), 1,
       "the data file '" + dir.File("missing.txt") + "' does not exist"},
      {"--checkpoint " + ckpt + " --step 0 --data " + text, 2, "--step"},
      {"--checkpoint " + ckpt + " --data " + text + " --format uint16", 1, ">= model.vocab_size"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(absl::StrCat(kStrata, " eval ", c.flags));
    EXPECT_EQ(r.exit_code, c.code) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.flags << "\n" << r.output;
  }
}

}  // namespace
}  // namespace strata
