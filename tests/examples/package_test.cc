// The installable package (cmake/package.cmake, docs/library.md): `cmake --install` into a fresh
// prefix, then the project in examples/installed_package configured with find_package(strata),
// built against the prefix alone and run. Its losses equal those of the same source built in
// this tree (custom_expert_example: the same computation, now through
// libstrata.so; equal up to the expert's own loops, compiled with the project's flags). The
// installed headers are exactly the closure under #include of the API's entry
// points (read here from the installed files themselves), nothing internal (no backend, no
// coordinator, launcher or web), and they compile together against the prefix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

namespace fs = std::filesystem;

const std::string kBuild = std::string(STRATA_BIN_DIR) + "/..";

TEST(PackageTest, AProjectBuiltAgainstTheInstalledPackageRunsLikeTheTreesOwnBuild) {
  TempDir dir;
  const std::string prefix = dir.File("prefix");
  auto install =
      RunCommand(absl::StrCat(STRATA_CMAKE, " --install ", kBuild, " --prefix ", prefix));
  ASSERT_EQ(install.exit_code, 0) << install.output;
  const std::string libdir = prefix + "/" + STRATA_LIBDIR;
  EXPECT_TRUE(fs::exists(libdir + "/libstrata.so")) << install.output;
  EXPECT_TRUE(fs::exists(prefix + "/bin/strata"));
  auto version = RunCommand(prefix + "/bin/strata version");
  EXPECT_EQ(version.exit_code, 0) << version.output;
  EXPECT_NE(version.output.find(absl::StrCat("strata ", STRATA_PROJECT_VERSION, " ")),
            std::string::npos)
      << "the package's version\n"
      << version.output;

  // The headers: every one reached from the entry points, and no other.
  const std::string include = prefix + "/include/strata";
  std::set<std::string> installed;
  for (const auto& e : fs::recursive_directory_iterator(include)) {
    if (e.is_regular_file()) installed.insert(fs::relative(e.path(), include).string());
  }
  std::set<std::string> reached;
  std::vector<std::string> todo = {"train/trainer.h",        "runtime/model/moe_layer.h",
                                   "runtime/model/expert.h", "proto/config_io.h",
                                   "kernels/blas_kernel.h",  "train/evaluate.h"};
  const std::regex quoted(R"re(^\s*#\s*include\s*"([^"]+)")re");
  while (!todo.empty()) {
    const std::string h = todo.back();
    todo.pop_back();
    if (!reached.insert(h).second) continue;
    std::ifstream in(include + "/" + h);
    EXPECT_TRUE(in.good()) << h << " is included but not installed";
    std::smatch m;
    for (std::string line; std::getline(in, line);) {
      if (!std::regex_search(line, m, quoted)) continue;
      const std::string inc = m[1].str();
      if (inc.rfind("absl/", 0) == 0 || inc.rfind("google/", 0) == 0) continue;
      todo.push_back(inc);
    }
  }
  EXPECT_EQ(installed, reached) << "installed headers the entry points do not reach, or missing";
  for (const std::string& h : installed) {
    for (const char* internal :
         {"kernels/cpu/", "kernels/cuda/", "coordinator/", "launcher/", "web/"}) {
      EXPECT_NE(h.rfind(internal, 0), 0u) << h;
    }
  }
  // They compile together against the prefix (and the system's Abseil and protobuf).
  std::string all;
  for (const std::string& h : installed) absl::StrAppend(&all, "#include \"", h, "\"\n");
  WriteFile(dir.File("all.cc"), all);
  auto syntax = RunCommand(
      absl::StrCat(STRATA_CXX, " -std=c++20 -fsyntax-only -I", include, " ", dir.File("all.cc")));
  EXPECT_EQ(syntax.exit_code, 0) << syntax.output;

  // The project, configured against the prefix alone, built and run.
  const std::string app = dir.File("app");
  auto configure = RunCommand(
      absl::StrCat(STRATA_CMAKE, " -S ", STRATA_SOURCE_DIR, "/examples/installed_package -B ", app,
                   " -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=", prefix,
                   " -DCMAKE_CXX_COMPILER=", STRATA_CXX));
  ASSERT_EQ(configure.exit_code, 0) << configure.output;
  auto build = RunCommand(absl::StrCat(STRATA_CMAKE, " --build ", app));
  ASSERT_EQ(build.exit_code, 0) << build.output;
  auto ldd = RunCommand("ldd " + app + "/custom_expert");
  EXPECT_NE(ldd.output.find(libdir + "/libstrata.so"), std::string::npos)
      << "the project runs on the installed library\n"
      << ldd.output;

  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(60000));
  const std::string args = " --data " + dir.File("text.txt") + " --steps 12";
  auto packaged = RunCommand(app + "/custom_expert" + args);
  auto in_tree = RunCommand(std::string(STRATA_BIN_DIR) + "/custom_expert_example" + args);
  ASSERT_EQ(packaged.exit_code, 0) << packaged.output;
  ASSERT_EQ(in_tree.exit_code, 0) << in_tree.output;
  // The first and last losses each printed. The expert's own loops are compiled by each build
  // with its own flags (this tree's -march=native contracts them into FMAs; the project's
  // Release flags may not), so the two runs agree to float rounding carried through 12 steps
  // (~1e-5 here), far inside the print's 3 decimals: at most one unit of the last digit apart.
  auto losses = [](const std::string& out) {
    std::smatch m;
    const std::regex re(
        R"(trained 12 steps with ScaledLinearExpert experts: loss ([0-9.]+) -> ([0-9.]+))");
    EXPECT_TRUE(std::regex_search(out, m, re)) << out;
    return m.empty() ? std::pair<double, double>{-1, -1}
                     : std::pair<double, double>{std::stod(m[1].str()), std::stod(m[2].str())};
  };
  const auto [first, last] = losses(packaged.output);
  const auto [tree_first, tree_last] = losses(in_tree.output);
  EXPECT_NEAR(first, tree_first, 1.5e-3) << packaged.output << in_tree.output;
  EXPECT_NEAR(last, tree_last, 1.5e-3) << packaged.output << in_tree.output;
  // It learned: the uniform loss over 256 bytes is 5.55 nats; 12 steps of this config take it
  // below 4 (3.72 in this tree's run).
  EXPECT_LT(last, 4.0) << "it trained";
  EXPECT_NE(packaged.output.find("gradient check of ScaledLinearExpert"), std::string::npos);
}

}  // namespace
}  // namespace strata
