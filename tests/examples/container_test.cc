// The container image (container/, scripts/container.sh, docs/container.md), built with podman
// from source (Containerfile: several minutes), or with STRATA_CONTAINER_FROM_BUILD=1 from this
// build folder (Containerfile.installed: the run-time stage, with a CUDA build's CUDA libraries
// carried along; faster for a CPU build). Inside it, `strata version` says what this build's strata
// says, and a 2-worker elastic job (coordinator, gRPC, Gloo) trains the steps the same job trains
// with this build's strata, from the same first loss. The Kubernetes and Slurm recipes of
// docs/elastic.md parse, name the image the script builds, and use only flags the image's strata
// has (container/check_recipes.py). Skips where podman is not installed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::RunCommand;
using strata::testing::StepLosses;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kBuild = std::string(STRATA_BIN_DIR) + "/..";

std::string Tail(const std::string& s) { return s.size() > 6000 ? s.substr(s.size() - 6000) : s; }

TEST(ContainerTest, TheImageTrainsLikeThisBuildAndTheRecipesUseItsFlags) {
  if (RunCommand("command -v podman").exit_code != 0) {
    GTEST_SKIP() << "podman is not installed (scripts/install-deps.sh --with-container installs "
                    "it): the container image is neither built nor checked";
  }
  const std::string src = strata::testing::SourceDir();
  const std::string strata = strata::testing::BinDir() + "/strata";
  const char* from_build = std::getenv("STRATA_CONTAINER_FROM_BUILD");
  const bool source = from_build == nullptr || std::string(from_build) != "1";
  const std::string script = src + "/scripts/container.sh";
  auto build = RunCommand(
      absl::StrCat(script, " build --tag strata:test", source ? "" : " --from-build " + kBuild));
  ASSERT_EQ(build.exit_code, 0) << Tail(build.output);
  const std::string run = script + " run --tag strata:test";

  // The first line names the version and the backends: a source build's has the CPU one only.
  auto version = RunCommand(run + " -- strata version");
  ASSERT_EQ(version.exit_code, 0) << version.output;
  const std::string here = RunCommand(strata + " version").output;
  const std::string want_version =
      source ? absl::StrCat("strata ", STRATA_PROJECT_VERSION, " (backends: cpu)\n")
             : here.substr(0, here.find('\n') + 1);
  EXPECT_NE(version.output.find(want_version), std::string::npos)
      << version.output << "\nwant: " << want_version;
  EXPECT_NE(want_version.find(absl::StrCat("strata ", STRATA_PROJECT_VERSION, " ")),
            std::string::npos)
      << want_version;

  // The same job here and in the image: a coordinator and 2 workers, 20 steps.
  TempDir dir;
  const std::string job =
      "seed: 5\n"
      "model { seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2\n"
      "        moe { num_experts: 8 top_k: 2 d_expert: 32 } }\n"
      "data { path: \"text.txt\" }\n"
      "train { steps: 20 global_batch: 12 lr: 0.004 warmup_steps: 2 eval_every: 0 "
      "eval_batches: 2 threads: 1 }\n";
  for (const char* where : {"host", "image"}) {
    std::filesystem::create_directories(dir.File(where));
    WriteFile(dir.File(std::string(where) + "/text.txt"), strata::testing::SyntheticText(20000));
    WriteFile(dir.File(std::string(where) + "/job.textproto"), job);
  }
  const std::string launch =
      "strata launch --config job.textproto --workers 2 --metrics-out m.jsonl --quiet";
  auto host = RunCommand(absl::StrCat("cd ", dir.File("host"), " && ", strata, launch.substr(6)));
  ASSERT_EQ(host.exit_code, 0) << host.output;
  auto image = RunCommand(absl::StrCat(run, " -v ", dir.File("image"), ":/work -- ", launch));
  ASSERT_EQ(image.exit_code, 0) << image.output;
  const auto want = StepLosses(dir.File("host/m.jsonl.0"));
  const auto got = StepLosses(dir.File("image/m.jsonl.0"));
  ASSERT_EQ(want.size(), 20u);
  ASSERT_EQ(got.size(), 20u) << image.output;
  // The first step's loss is the same computation on the same initial weights and batch; the two
  // programs differ only in compiler flags (this build's -march against the image's generic
  // x86-64) and possibly OpenBLAS's kernel, which reorder float sums: a few ulps of fp32 (1e-7
  // relative each) over reductions of a few hundred terms, well below 1e-5. Later steps may part
  // further through top-k routing at near-ties, so only the first is compared this closely.
  EXPECT_NEAR(got.begin()->second, want.begin()->second, 1e-5 * std::fabs(want.begin()->second));
  // And the image's job learns as this build's does: the last step's loss well below the first.
  EXPECT_LT(got.rbegin()->second, 0.9 * got.begin()->second);
  EXPECT_LT(want.rbegin()->second, 0.9 * want.begin()->second);

  ASSERT_EQ(RunCommand("/usr/bin/python3 -c 'import yaml'").exit_code, 0)
      << "the recipe check needs Debian's python3-yaml (scripts/install-deps.sh --with-container)";

  auto recipes = RunCommand(absl::StrCat("/usr/bin/python3 ", src, "/container/check_recipes.py ",
                                         src, "/docs/elastic.md --image strata:latest --strata '",
                                         run, " -- strata'"));
  EXPECT_EQ(recipes.exit_code, 0) << recipes.output;
  EXPECT_NE(recipes.output.find("checked Job strata-workers"), std::string::npos) << recipes.output;
  EXPECT_NE(recipes.output.find("checked Slurm recipe: strata worker"), std::string::npos)
      << recipes.output;
}

}  // namespace
}  // namespace strata
