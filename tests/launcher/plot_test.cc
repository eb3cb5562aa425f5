// `strata plot`: a finished run's metrics file drawn by gnuplot. The SVG's training-loss curve
// has one vertex per step of the file and its panels are there (held-out points, the load map's
// image, the tiers); a PNG is a PNG; a missing file, a line that is not a step, an empty file and
// an unknown image type are refused with the file (and line) named, leaving no image behind.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/config_io.h"
#include "tests/test_util.h"
#include "tests/train/tiny_job.h"

namespace strata {
namespace {

using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const std::string kStrata = std::string(STRATA_BIN_DIR) + "/strata";

bool HaveGnuplot() { return RunCommand("gnuplot --version").exit_code == 0; }

// The vertices of the curve in the first SVG path after `<title>NAME</title>` (gnuplot's plot
// group): the path draws the key's sample line (M x,y L x,y), then the curve from its last M, one
// "x,y" per vertex.
int VerticesOf(const std::string& svg, const std::string& name) {
  const size_t at = svg.find("<title>" + name + "</title>");
  if (at == std::string::npos) return -1;
  const size_t d = svg.find(" d='", at);
  if (d == std::string::npos) return -1;
  const std::string path = svg.substr(d + 4, svg.find('\'', d + 4) - d - 4);
  const std::string curve = path.substr(path.rfind('M'));
  return static_cast<int>(std::count(curve.begin(), curve.end(), ','));
}

TEST(PlotTest, ARunsMetricsFileBecomesTheDashboardsPanels) {
  if (!HaveGnuplot()) GTEST_SKIP() << "no gnuplot: scripts/install-deps.sh installs gnuplot-nox";
  TempDir dir;
  WriteFile(dir.File("text.txt"), strata::testing::SyntheticText(30000));
  config::JobConfig cfg = strata::testing::TinyMoeJob(
      dir.File("text.txt"),
      absl::StrCat("train { steps: 37 global_batch: 4 eval_every: 10 threads: 1 }\n"
                   "storage { mode: TIERED io_block_bytes: 8192 ssd_dir: \"",
                   dir.File("ssd"), "\" }\n"));
  WriteFile(dir.File("job.textproto"), config::ToText(cfg));
  auto train =
      RunCommand(absl::StrCat(kStrata, " train --quiet --config ", dir.File("job.textproto"),
                              " --metrics-out ", dir.File("m.jsonl")));
  ASSERT_EQ(train.exit_code, 0) << train.output;

  auto svg =
      RunCommand(absl::StrCat(kStrata, " plot ", dir.File("m.jsonl"), " -o ", dir.File("run.svg")));
  ASSERT_EQ(svg.exit_code, 0) << svg.output;
  EXPECT_NE(svg.output.find("37 steps (1 to 37)"), std::string::npos) << svg.output;
  const std::string image = ReadFile(dir.File("run.svg"));
  ASSERT_NE(image.find("<svg"), std::string::npos);
  EXPECT_EQ(VerticesOf(image, "training"), 37) << "one vertex per step";
  EXPECT_NE(image.find("<title>held-out</title>"), std::string::npos);
  EXPECT_NE(image.find("<title>stall ms per step</title>"), std::string::npos) << "tiers panel";
  EXPECT_NE(image.find("<image"), std::string::npos) << "the load map";
  EXPECT_NE(image.find("Expert load over the mean (rows: experts of MoE blocks 0, 1"),
            std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir.File("run.svg.tmp")));

  // The default name, a PNG.
  auto png = RunCommand(absl::StrCat(kStrata, " plot ", dir.File("m.jsonl")));
  ASSERT_EQ(png.exit_code, 0) << png.output;
  const std::string bytes = ReadFile(dir.File("m.png"));
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_GT(bytes.size(), 10000u);

  // Bad input.
  const std::string lines = ReadFile(dir.File("m.jsonl"));
  WriteFile(dir.File("bad.jsonl"),
            lines.substr(0, lines.find('\n', lines.find('\n') + 1) + 1) + "{\"step\": oops}\n");
  WriteFile(dir.File("empty.jsonl"), "\n");
  struct Case {
    std::string args;
    int code;
    std::string says;
  };
  const Case cases[] = {
      {dir.File("none.jsonl"), 1, "cannot open the metrics file '" + dir.File("none.jsonl")},
      {dir.File("bad.jsonl") + " -o " + dir.File("bad.png"), 1, dir.File("bad.jsonl") + ":3:"},
      {dir.File("empty.jsonl"), 1, "holds no step"},
      {dir.File("m.jsonl") + " -o " + dir.File("run.gif"), 2, "the image is .png or .svg"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(absl::StrCat(kStrata, " plot ", c.args));
    EXPECT_EQ(r.exit_code, c.code) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("bad.png")));
}

}  // namespace
}  // namespace strata
