// The examples run: the custom-expert program trains with its own expert and its gradient check
// passes; the shipped configs are valid.
#include <gtest/gtest.h>

#include "proto/config_io.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

TEST(ExamplesTest, CustomExpertTrains) {
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(120000));
  auto r = RunCommand(std::string(STRATA_BIN_DIR) + "/custom_expert_example --data " +
                      dir.File("text.txt") + " --steps 40");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("gradient check of ScaledLinearExpert"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trained 40 steps with ScaledLinearExpert"), std::string::npos)
      << r.output;
}

TEST(ExamplesTest, ShippedConfigsAreValid) {
  for (const char* f :
       {"examples/moe_lm/config.textproto", "examples/custom_expert/config.textproto",
        "examples/larger_than_memory/config.textproto"}) {
    auto c = config::LoadJobConfig(std::string(STRATA_SOURCE_DIR) + "/" + f);
    EXPECT_TRUE(c.ok()) << f << ": " << c.status();
  }
}

}  // namespace
}  // namespace strata
