// The real `strata` binary: usage errors, config errors with file/line/field, and a short run.
#include <gtest/gtest.h>

#include "absl/strings/str_split.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("text.txt"), strata::testing::SyntheticText(30000));
    WriteFile(dir_.File("ok.textproto"),
              "model { seq_len: 16 d_model: 16 n_layers: 1 n_heads: 2\n"
              "        moe { num_experts: 2 d_expert: 16 } }\n"
              "data { path: \"text.txt\" }\n"
              "train { steps: 100 global_batch: 4 eval_every: 2 eval_batches: 1 threads: 1 }\n");
  }
  TempDir dir_;
};

TEST_F(CliTest, NoArgumentsPrintsUsage) {
  auto r = RunCommand(kStrata);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("usage: strata COMMAND"), std::string::npos) << r.output;
  auto v = RunCommand(kStrata + " version");
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_NE(v.output.find("backends: cpu"), std::string::npos) << v.output;
}

TEST_F(CliTest, UsageErrorsExitTwoAndNameTheFlag) {
  auto r = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") + " --stpes 3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("unknown flag --stpes"), std::string::npos) << r.output;
  auto n = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") + " --steps many");
  EXPECT_EQ(n.exit_code, 2);
  EXPECT_NE(n.output.find("--steps 'many' must be an integer"), std::string::npos) << n.output;
  auto m = RunCommand(kStrata + " train --steps 3");
  EXPECT_EQ(m.exit_code, 2);
  EXPECT_NE(m.output.find("--config FILE is required"), std::string::npos) << m.output;
  auto u = RunCommand(kStrata + " trian");
  EXPECT_EQ(u.exit_code, 2);
  EXPECT_NE(u.output.find("unknown command 'trian'"), std::string::npos) << u.output;
}

TEST_F(CliTest, BadConfigFailsBeforeTrainingWithFileLineAndField) {
  const std::string bad = dir_.File("bad.textproto");
  WriteFile(bad,
            "data { path: \"text.txt\" }\n"
            "model {\n"
            "  moe { num_experts: 2 top_k: 3 }\n"
            "}\n");
  const std::string metrics = dir_.File("m.jsonl");
  auto r = RunCommand(kStrata + " train --config " + bad + " --metrics-out " + metrics);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(bad + ":3:24: field model.moe.top_k"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("top_k = 3 is larger than num_experts = 2"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(metrics)) << "training started despite the bad config";

  WriteFile(bad, "data { path: \"text.txt\" }\nmodel { d_model: \"wide\" }\n");
  auto t = RunCommand(kStrata + " train --config " + bad);
  EXPECT_EQ(t.exit_code, 1);
  EXPECT_NE(t.output.find(bad + ":2:"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("field d_model"), std::string::npos) << t.output;
}

TEST_F(CliTest, TrainsWritesMetricsAndReportsHeldOutLoss) {
  const std::string metrics = dir_.File("m.jsonl");
  auto r = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") +
                      " --steps 4 --threads 2 --metrics-out " + metrics);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("done: 4 steps, held-out loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 4/4"), std::string::npos) << r.output;
  std::vector<std::string> lines = absl::StrSplit(ReadFile(metrics), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 4u);
  auto c = RunCommand(kStrata + " check --config " + dir_.File("ok.textproto"));
  EXPECT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("valid"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("d_expert: 16"), std::string::npos) << c.output;
}

TEST_F(CliTest, AGpuDeviceThatIsNotThereIsAClearErrorBeforeTraining) {
  const std::string metrics = dir_.File("m.jsonl");
  auto r = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") +
                      " --device cuda:999 --metrics-out " + metrics);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model on cuda:999"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train on the CPU device"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(metrics)) << "training started on a missing GPU";
  auto u = RunCommand(kStrata + " train --config " + dir_.File("ok.textproto") + " --device gpu");
  EXPECT_EQ(u.exit_code, 2) << u.output;
  EXPECT_NE(u.output.find("--device: unknown device 'gpu'"), std::string::npos) << u.output;
}

TEST_F(CliTest, MissingDataFileSaysHowToMakeIt) {
  WriteFile(dir_.File("nodata.textproto"), "data { path: \"absent.txt\" }\n");
  auto r = RunCommand(kStrata + " train --config " + dir_.File("nodata.textproto"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("absent.txt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("prepare"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
