// Reading JobConfig: defaults, derived defaults, relative paths, and errors that name the file,
// line and field.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

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
  // The tiered store trains a model on a GPU too (its device tier is then HBM).
  auto tiered =
      ParseJobConfig("data { path: \"d\" } train { device: \"cuda\" } storage { mode: TIERED }",
                     "job.textproto", "/base");
  EXPECT_TRUE(tiered.ok()) << tiered.status();
}

// train.precision: AUTO by default, which is bf16 GEMMs on a GPU and fp32 on the CPU; an unknown
// value names the field.
TEST(ConfigTest, PrecisionIsAutoByDefaultAndBf16OnlyWhereAsked) {
  auto c = ParseJobConfig("data { path: \"d\" }", "job.textproto", "/base");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train().precision(), TrainConfig::AUTO);
  EXPECT_FALSE(Bf16Gemms(TrainConfig::AUTO, /*on_gpu=*/false));
  EXPECT_TRUE(Bf16Gemms(TrainConfig::AUTO, /*on_gpu=*/true));
  EXPECT_FALSE(Bf16Gemms(TrainConfig::FP32, true));
  EXPECT_FALSE(Bf16Gemms(TrainConfig::FP32, false));
  EXPECT_TRUE(Bf16Gemms(TrainConfig::BF16, true));
  EXPECT_TRUE(Bf16Gemms(TrainConfig::BF16, false));
  auto b = ParseJobConfig("data { path: \"d\" } train { precision: BF16 }", "job.textproto", "/b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->train().precision(), TrainConfig::BF16);
  const std::string msg = Error("data { path: \"d\" }\ntrain {\n  precision: FP16\n}\n");
  EXPECT_NE(msg.find("Unknown enumeration value of \"FP16\" for field \"precision\""),
            std::string::npos)
      << msg;
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

TEST(ConfigTest, RouterOptionsAreCheckedWithTheFieldAndTheFix) {
  auto error = [](const std::string& moe) {
    return Error("data { path: \"d\" } model { moe { " + moe + " } }");
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"top_k: 1 gate { type: SWITCH score_function: SIGMOID }",
       "score_function SIGMOID goes with gate type TOP_K"},
      {"gate { routed_scaling: 0 }", "routed_scaling must be in (0, 100]"},
      {"gate { bias_update_rate: -0.5 }", "bias_update_rate must be in [0, 1]"},
      {"gate { sequence_aux_loss_coef: -1 }", "sequence_aux_loss_coef must be >= 0"},
      {"num_experts: 8 gate { num_groups: 3 }", "num_groups = 3 must divide num_experts = 8"},
      {"num_experts: 128 gate { num_groups: 128 }", "num_groups = 128 must be at most 64"},
      {"num_experts: 8 gate { num_groups: 4 topk_groups: 5 }",
       "topk_groups = 5 must be in [1, num_groups = 4]"},
      {"num_experts: 16 top_k: 8 gate { num_groups: 8 topk_groups: 2 }",
       "top_k = 8 experts cannot be chosen from 2 group(s) of 2 experts; raise topk_groups"},
      {"top_k: 2 gate { type: NOISY_TOP_K num_groups: 2 }",
       "group-limited routing (num_groups > 1) goes with gate type TOP_K"},
      {"num_experts: 16 top_k: 9", "top_k = 9 must be in [1, 8]"},
      {"num_shared_experts: 65", "num_shared_experts = 65 must be in [0, 64]"},
      {"gate { type: EXPERT_CHOICE bias_update_rate: 0.001 }",
       "the EXPERT_CHOICE gate takes softmax scores and balances by construction"},
      {"num_shared_experts: 1 shared_d_expert: -4", "shared_d_expert = -4 must be in [1, "},
  };
  for (const auto& [moe, want] : cases) {
    const std::string msg = error(moe);
    EXPECT_NE(msg.find(want), std::string::npos) << moe << "\n" << msg;
    EXPECT_NE(msg.find("field model.moe."), std::string::npos) << moe << "\n" << msg;
  }
  // DeepSeek-V3's router on 64 fine-grained experts with a shared one is valid, and the shared
  // width defaults to d_expert.
  auto ok = ParseJobConfig(
      "data { path: \"d\" } model { moe { num_experts: 64 top_k: 8 d_expert: 32 "
      "num_shared_experts: 1 gate { score_function: SIGMOID bias_update_rate: 0.001 "
      "num_groups: 8 topk_groups: 4 routed_scaling: 2.5 sequence_aux_loss_coef: 0.0001 } } }",
      "j", "");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->model().moe().shared_d_expert(), 32);
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

TEST(ConfigTest, BadExpertsPerWorkerIsALocatedErrorNotAnAbort) {
  // protobuf aborts when a repeated field is located with index -1.
  const std::string msg = Error(
      "data { path: \"d\" }\n"
      "parallel {\n"
      "  experts_per_worker: 3\n"
      "  experts_per_worker: -1\n"
      "}\n");
  EXPECT_NE(msg.find("job.textproto:3:3: field parallel.experts_per_worker: experts_per_worker "
                     "must be non-negative and sum to moe.num_experts = 8 (it sums to 2)"),
            std::string::npos)
      << msg;
}

TEST(ConfigTest, SizesHaveUpperBoundsAndNeverWrap) {
  // 4 * 2147483644 wraps to -16 in 32 bits; the error must name d_model, not a derived d_ff.
  const std::string wrap =
      Error("data { path: \"d\" }\nmodel { d_model: 2147483644 n_heads: 1 }\n");
  EXPECT_NE(wrap.find("job.textproto:2:9: field model.d_model: d_model = 2147483644 must be in "
                      "[1, 65536]"),
            std::string::npos)
      << wrap;
  EXPECT_EQ(wrap.find("d_ff"), std::string::npos) << wrap;
  EXPECT_EQ(wrap.find("d_expert"), std::string::npos) << wrap;
  struct Case {
    const char* text;
    const char* field;
  };
  for (const Case& c : {
           Case{"model { d_model: 1000000 n_heads: 1 }", "field model.d_model: d_model = 1000000"},
           Case{"model { n_layers: 100000000 }", "field model.n_layers: n_layers = 100000000"},
           Case{"model { d_ff: 2000000000 }", "field model.d_ff: d_ff = 2000000000"},
           Case{"model { moe { d_expert: 2000000000 } }", "field model.moe.d_expert"},
           Case{"model { moe_every: 2147483647 }", "field model.moe_every"},
           Case{"train { global_batch: 2000000000 }", "field train.global_batch"},
           Case{"train { global_batch: 65536 } model { seq_len: 65536 }",
                "tokens per step is more than 268435456"},
           Case{"train { eval_batches: 1000000000 }",
                "field train.eval_batches: eval_batches = 1000000000 must be in [1, 10000]"},
           Case{"train { steps: -5 }", "field train.steps: steps = -5"},
           Case{"storage { io_block_bytes: 18446744073709547520 }", "field storage.io_block_bytes"},
           Case{"parallel { bucket_bytes: 18446744073709551615 }", "field parallel.bucket_bytes"},
           Case{"parallel { timeout_ms: 4294967295 }", "field parallel.timeout_ms"},
       }) {
    const std::string msg = Error(absl::StrCat("data { path: \"d\" }\n", c.text, "\n"));
    EXPECT_NE(msg.find(absl::StrCat("job.textproto:2:")), std::string::npos) << c.text << msg;
    EXPECT_NE(msg.find(c.field), std::string::npos) << c.text << "\n" << msg;
  }
}

TEST(ConfigTest, ConfigPathThatIsNotATextFileIsAClearError) {
  TempDir dir;
  // A folder: not "data.path is required" from parsing an empty read.
  auto folder = LoadJobConfig(dir.path());
  ASSERT_FALSE(folder.ok());
  EXPECT_NE(folder.status().message().find("'" + dir.path() + "' is a directory"),
            std::string::npos)
      << folder.status();
  EXPECT_EQ(folder.status().message().find("data.path"), std::string::npos) << folder.status();
  WriteFile(dir.File("config.textproto"), "data { path: \"d\" }\n");
  auto hinted = LoadJobConfig(dir.path());
  ASSERT_FALSE(hinted.ok());
  EXPECT_NE(hinted.status().message().find("did you mean " + dir.File("config.textproto")),
            std::string::npos)
      << hinted.status();
  // Through a regular file (ENOTDIR), and a device that never ends.
  WriteFile(dir.File("plain"), "x");
  auto through = LoadJobConfig(dir.File("plain/job.textproto"));
  ASSERT_FALSE(through.ok());
  EXPECT_TRUE(absl::IsNotFound(through.status())) << through.status();
  EXPECT_NE(through.status().message().find("cannot read config file"), std::string::npos);
  auto device = LoadJobConfig("/dev/zero");
  ASSERT_FALSE(device.ok());
  EXPECT_NE(device.status().message().find("'/dev/zero' is not a regular file"), std::string::npos)
      << device.status();
  // Unreadable by permission (root reads it anyway, so only checked as another user).
  WriteFile(dir.File("secret.textproto"), "data { path: \"d\" }\n");
  std::filesystem::permissions(dir.File("secret.textproto"), std::filesystem::perms::none);
  if (geteuid() != 0) {
    auto secret = LoadJobConfig(dir.File("secret.textproto"));
    ASSERT_FALSE(secret.ok());
    EXPECT_NE(secret.status().message().find("Permission denied"), std::string::npos)
        << secret.status();
  }
  // Binary content: one error with the place of the first non-text byte.
  WriteFile(dir.File("bin.textproto"), std::string("data {\n  \x93\x00\x01\xff garbage", 20));
  auto binary = LoadJobConfig(dir.File("bin.textproto"));
  ASSERT_FALSE(binary.ok());
  EXPECT_NE(
      binary.status().message().find(dir.File("bin.textproto") + ":2:3: byte 0x93 is not text"),
      std::string::npos)
      << binary.status();
  // UTF-8 in comments and strings is text.
  auto utf8 = ParseJobConfig("# d\xc3\xa9j\xc3\xa0 vu\ndata { path: \"caf\xc3\xa9\" }\n", "j", "");
  EXPECT_TRUE(utf8.ok()) << utf8.status();
}

}  // namespace
}  // namespace strata::config
