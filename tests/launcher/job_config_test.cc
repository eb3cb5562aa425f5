// The job's config as the coordinator owns it: which fields are the job's and which the machine's,
// and the differences a joiner is refused for, named field by field.
#include "launcher/job_config.h"

#include <gtest/gtest.h>

#include "proto/config_io.h"

namespace strata::launcher {
namespace {

config::JobConfig Parse(const std::string& text) {
  auto c = config::ParseJobConfig(text, "test", "");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : config::JobConfig();
}

const char kJob[] =
    "model { seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2 moe { num_experts: 8 } }\n"
    "data { path: \"/data/text.txt\" }\n"
    "train { steps: 100 global_batch: 12 lr: 0.004 threads: 1 }\n"
    "checkpoint { every: 10 dir: \"/ckpt\" }\n";

TEST(JobConfigTest, TheMachinesFieldsMayDifferAndADefaultWrittenOutEqualsNone) {
  const config::JobConfig job = Parse(kJob);
  config::JobConfig mine = job;
  mine.mutable_train()->set_threads(16);
  mine.mutable_train()->set_device("cuda:1");
  mine.mutable_data()->set_path("/mnt/elsewhere/text.txt");
  EXPECT_TRUE(JobDifferences(job, mine).empty());
  // `weight_decay: 0.1` is the default: writing it out changes nothing.
  std::string text = kJob;
  text.replace(text.find("lr: 0.004"), 9, "lr: 0.004 weight_decay: 0.1");
  const config::JobConfig explicit_default = Parse(text);
  ASSERT_TRUE(explicit_default.train().has_weight_decay());
  EXPECT_TRUE(JobDifferences(job, explicit_default).empty());
}

TEST(JobConfigTest, EveryDifferingJobFieldIsNamedWithBothValues) {
  const config::JobConfig job = Parse(kJob);
  config::JobConfig mine = job;
  mine.mutable_train()->set_lr(0.04f);
  mine.mutable_model()->set_d_model(64);
  mine.mutable_checkpoint()->clear_dir();
  mine.mutable_train()->set_threads(3);  // the machine's: not named
  const std::vector<std::string> diff = JobDifferences(job, mine);
  ASSERT_EQ(diff.size(), 3u) << ::testing::PrintToString(diff);
  std::string all;
  for (const auto& d : diff) all += d + "\n";
  EXPECT_NE(all.find("model.d_model: 32 (job) vs 64 (this worker)"), std::string::npos) << all;
  EXPECT_NE(all.find("train.lr: 0.004 (job) vs 0.04 (this worker)"), std::string::npos) << all;
  EXPECT_NE(all.find("checkpoint.dir: \"/ckpt\" (job) vs \"\" (this worker)"), std::string::npos)
      << all;
  EXPECT_EQ(all.find("threads"), std::string::npos) << all;
}

TEST(JobConfigTest, RepeatedFieldsAreComparedElementByElement) {
  const config::JobConfig job =
      Parse(std::string(kJob) + "parallel { expert_parallel: 2 experts_per_worker: [5, 3] }\n");
  config::JobConfig mine = job;
  mine.mutable_parallel()->set_experts_per_worker(1, 4);
  mine.mutable_parallel()->set_experts_per_worker(0, 4);
  const std::vector<std::string> diff = JobDifferences(job, mine);
  ASSERT_EQ(diff.size(), 2u) << ::testing::PrintToString(diff);
  EXPECT_EQ(diff[0], "parallel.experts_per_worker[0]: 5 (job) vs 4 (this worker)");
  EXPECT_EQ(diff[1], "parallel.experts_per_worker[1]: 3 (job) vs 4 (this worker)");
}

TEST(JobConfigTest, TheCoordinatorsCheckRefusesAnotherModelAndAMissingConfig) {
  const config::JobConfig job = Parse(kJob);
  const std::string job_text = config::ToText(job);
  config::JobConfig mine = job;
  mine.mutable_train()->set_threads(7);
  EXPECT_TRUE(CheckJoinerConfig(job_text, "w1", config::ToText(JobPart(mine))).ok());
  mine.mutable_model()->set_d_model(48);
  Status s = CheckJoinerConfig(job_text, "w1", config::ToText(JobPart(mine)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("worker 'w1'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("model.d_model: 32 (job) vs 48 (this worker)"), std::string::npos)
      << s;
  EXPECT_EQ(CheckJoinerConfig(job_text, "w2", "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckJoinerConfig(job_text, "w3", "model { d_model: ").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::launcher
