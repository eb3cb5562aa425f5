// `strata train --device cuda` end to end: the default example trained on a GPU against the same
// job on the CPU, and a checkpoint written from GPU memory resumed on the CPU.
//
// Tolerance, stated: every step's loss within 5e-3 nats of the CPU run's (fp32 on both; the GPU
// adds in another order, and differences of 1e-7 grow through training once a top-2 choice near a
// tie flips — see tests/runtime/model_gpu_test.cc). Skips where no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>

#include "core/device/device.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using strata::testing::RunCommand;
using strata::testing::StepLosses;
using strata::testing::TempDir;

const std::string kStrata = strata::testing::BinDir() + "/strata";
const std::string kConfig = strata::testing::SourceDir() + "/examples/moe_lm/config.textproto";

TEST(TrainGpuTest, DefaultExampleOnAGpuTrainsLikeTheCpuAndItsCheckpointResumesOnTheCpu) {
  if (CudaDeviceCount() == 0) {
    GTEST_SKIP() << "no CUDA device: this test runs on a machine with an NVIDIA GPU";
  }
  TempDir dir;
  // fp32 on both devices (a GPU's default is bf16 GEMMs): the same arithmetic on each side.
  const std::string common =
      kStrata + " train --config " + kConfig + " --steps 30 --quiet --precision fp32";
  auto gpu = RunCommand(common + " --device cuda --metrics-out " + dir.File("gpu.jsonl") +
                        " --checkpoint-dir " + dir.File("ck") + " --checkpoint-every 15");
  ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
  auto cpu = RunCommand(common + " --device cpu --metrics-out " + dir.File("cpu.jsonl"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  // The GPU's checkpoint at step 15, resumed on the CPU for steps 16..30.
  auto resumed = RunCommand(common + " --device cpu --resume --checkpoint-dir " + dir.File("ck") +
                            " --metrics-out " + dir.File("resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;

  const auto g = StepLosses(dir.File("gpu.jsonl")), c = StepLosses(dir.File("cpu.jsonl"));
  const auto r = StepLosses(dir.File("resumed.jsonl"));
  ASSERT_EQ(g.size(), 30u);
  ASSERT_EQ(c.size(), 30u);
  for (const auto& [step, loss] : c) {
    ASSERT_TRUE(g.count(step)) << "step " << step;
    EXPECT_NEAR(g.at(step), loss, 5e-3) << "step " << step;
  }
  ASSERT_FALSE(r.empty());
  EXPECT_EQ(r.begin()->first, 16) << "the resume did not start after the step-15 checkpoint";
  for (const auto& [step, loss] : r) EXPECT_NEAR(loss, g.at(step), 5e-3) << "resumed step " << step;
}

}  // namespace
}  // namespace strata
