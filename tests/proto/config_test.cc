// Reading JobConfig: defaults, derived defaults, relative paths, and errors that name the file,
// line and field.
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "proto/config_io.h"
#include "tests/test_util.h"

namespace strata::config {
namespace {

using strata::testing::TempDir;
using strata::testing::WriteFile;

std::string Error(const std::string& text) {
  auto c = ParseJobConfig(text, "job.textproto", "/base");
  EXPECT_FALSE(c.ok()) << "accepted:\n" << text;
  return c.ok() ? "" : std::string(c.status().message());
}

TEST(ConfigTest, MinimalConfigTakesDocumentedDefaults) {
  auto c = ParseJobConfig("data { path: \"d.txt\" }", "job.textproto", "/base");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->seed(), 1234u);
  EXPECT_EQ(c->model().d_model(), 128);
  EXPECT_EQ(c->model().d_ff(), 512);            // 4 * d_model
  EXPECT_EQ(c->model().moe().d_expert(), 512);  // d_ff
  EXPECT_EQ(c->model().moe().top_k(), 2);
  EXPECT_EQ(c->model().moe().gate().type(), GateConfig::TOP_K);
  EXPECT_EQ(c->train().steps(), 1000);
  EXPECT_EQ(c->data().path(), "/base/d.txt");  // relative to the config's folder
  EXPECT_EQ(c->storage().io_queue_depth(), 32u);
  EXPECT_EQ(c->storage().io_block_bytes(), 1u << 20);
  EXPECT_EQ(c->storage().ssd_threads(), 4u);
}

TEST(ConfigTest, StorageConcurrencyOutOfRangeNamesTheField) {
  const std::string msg = Error(
      "data { path: \"d\" }\n"
      "storage {\n"
      "  mode: TIERED\n"
      "  ssd_threads: 0\n"
      "  io_queue_depth: 5000\n"
      "}\n");
  EXPECT_NE(msg.find("job.textproto:4:3: field storage.ssd_threads"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ssd_threads must be in [1, 64]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("storage.io_queue_depth"), std::string::npos) << msg;
}

TEST(ConfigTest, TrainDeviceIsCpuOrCudaAndNamesTheField) {
  auto c = ParseJobConfig("data { path: \"d\" }", "job.textproto", "/base");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train().device(), "cpu");
  for (const char* ok : {"cpu", "cuda", "cuda:0", "cuda:12"}) {
    auto g = ParseJobConfig(absl::StrCat("data { path: \"d\" } train { device: \"", ok, "\" }"),
                            "job.textproto", "/base");
    EXPECT_TRUE(g.ok()) << ok << ": " << g.status();
  }
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:1x", "CUDA", "cuda:0 "}) {
    const std::string msg =
        Error(absl::StrCat("data { path: \"d\" }\ntrain {\n  device: \"", bad, "\"\n}\n"));
    EXPECT_NE(msg.find("job.textproto:3:3: field train.device: unknown device"), std::string::npos)
        << bad << ": " << msg;
  }
  const std::string tiered = Error(
      "data { path: \"d\" }\n"
      "train { device: \"cuda\" }\n"
      "storage { mode: TIERED }\n");
  EXPECT_NE(tiered.find("field train.device: a model on a GPU trains with storage.mode IN_MEMORY"),
            std::string::npos)
      << tiered;
}

TEST(ConfigTest, TopKFollowsGateTypeUnlessSet) {
  auto sw = ParseJobConfig("data { path: \"d\" } model { moe { gate { type: SWITCH } } }", "j", "");
  ASSERT_TRUE(sw.ok()) << sw.status();
  EXPECT_EQ(sw->model().moe().top_k(), 1);
  auto gs = ParseJobConfig("data { path: \"d\" } model { moe { gate { type: GSHARD } } }", "j", "");
  ASSERT_TRUE(gs.ok()) << gs.status();
  EXPECT_EQ(gs->model().moe().top_k(), 2);
}

TEST(ConfigTest, UnknownFieldNamesLineFieldAndSuggestion) {
  const std::string msg = Error("data { path: \"d\" }\nmodel {\n  d_modle: 64\n}\n");
  EXPECT_NE(msg.find("job.textproto:3:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown field 'd_modle'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'd_model'"), std::string::npos) << msg;
}

TEST(ConfigTest, WrongTypeNamesLineAndField) {
  const std::string msg = Error("data { path: \"d\" }\ntrain {\n  steps: \"many\"\n}\n");
  EXPECT_NE(msg.find("job.textproto:3:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("field steps"), std::string::npos) << msg;
  const std::string enum_msg = Error("data { path: \"d\" }\nmodel { norm: BATCH_NORM }\n");
  EXPECT_NE(enum_msg.find("job.textproto:2:"), std::string::npos) << enum_msg;
  EXPECT_NE(enum_msg.find("BATCH_NORM"), std::string::npos) << enum_msg;
}

TEST(ConfigTest, TopKLargerThanExpertsNamesLineFieldAndFix) {
  const std::string msg = Error(
      "data { path: \"d\" }\n"
      "model {\n"
      "  moe {\n"
      "    num_experts: 4\n"
      "    top_k: 5\n"
      "  }\n"
      "}\n");
  EXPECT_NE(msg.find("job.textproto:5:5: field model.moe.top_k"), std::string::npos) << msg;
  EXPECT_NE(msg.find("set top_k to at most 4"), std::string::npos) << msg;
}

TEST(ConfigTest, EveryProblemIsReportedAtOnce) {
  const std::string msg = Error(
      "data { path: \"d\" eval_fraction: 0.9 }\n"
      "model { d_model: 100 n_heads: 3 }\n"
      "train { lr: -1 global_batch: 0 }\n");
  for (const char* f : {"data.eval_fraction", "model.n_heads", "train.lr", "train.global_batch"}) {
    EXPECT_NE(msg.find(f), std::string::npos) << f << " not reported in:\n" << msg;
  }
  EXPECT_NE(msg.find("job.textproto:2:"), std::string::npos) << msg;
}

TEST(ConfigTest, GateSpecificRulesAndMissingPath) {
  EXPECT_NE(Error("data { path: \"d\" } model { moe { top_k: 2 gate { type: SWITCH } } }")
                .find("SWITCH gate routes each token to 1 expert"),
            std::string::npos);
  const std::string no_path = Error("train { steps: 5 }");
  EXPECT_NE(no_path.find("data.path is required"), std::string::npos) << no_path;
  EXPECT_NE(no_path.find("(default value)"), std::string::npos) << no_path;
  EXPECT_NE(Error("data { path: \"d\" } model { vocab_size: 100 }").find("BYTES needs"),
            std::string::npos);
  EXPECT_NE(Error("data { path: \"d\" } model { moe { gate { capacity_factor_train: -1 } } }")
                .find("capacity_factor_train"),
            std::string::npos);
}

TEST(ConfigTest, DenseModelIgnoresMoeSection) {
  auto c = ParseJobConfig(
      "data { path: \"d\" } model { moe_every: 0 moe { top_k: 3 num_experts: 2 } }", "j", "");
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST(ConfigTest, LoadFromFileResolvesPathsAndReportsMissingFile) {
  TempDir dir;
  WriteFile(dir.File("job.textproto"), "data { path: \"sub/data.txt\" }\n");
  auto c = LoadJobConfig(dir.File("job.textproto"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->data().path(), dir.path() + "/sub/data.txt");
  auto missing = LoadJobConfig(dir.File("nope.textproto"));
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_NE(missing.status().message().find("nope.textproto"), std::string::npos);
}

}  // namespace
}  // namespace strata::config
