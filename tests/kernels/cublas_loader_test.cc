// cuBLAS opened on first use (kernels/cuda/cublas.h), checked in fresh processes: this program
// re-runs itself with STRATA_CUBLAS_PROBE set, and the probe (below, as main begins) reads
// /proc/self/maps before and after the first use, so nothing an earlier test loaded can hide a
// library loaded at start. Needs no GPU: loading cuBLAS and asking it for a status's name does not
// touch the device. Built only with CUDA.
#include <gtest/gtest.h>

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "core/device/device.h"
#include "kernels/cuda/cublas.h"
#include "kernels/ops.h"
#include "tests/test_util.h"

namespace strata {
namespace {

std::string Maps() {
  std::ifstream in("/proc/self/maps");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The probe: prints one line per fact and exits, in place of the tests, when STRATA_CUBLAS_PROBE
// is set. A test environment's SetUp runs once main has begun: every static initializer of the
// program and its libraries has run, so one that loaded cuBLAS would show.
class ProbeEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (std::getenv("STRATA_CUBLAS_PROBE") == nullptr) return;
    std::printf("PROBE at start: libcublas %s, libcublasLt %s\n",
                Maps().find("/libcublas.so") != std::string::npos ? "mapped" : "not mapped",
                Maps().find("/libcublasLt.so") != std::string::npos ? "mapped" : "not mapped");
    const Status st = ops::CheckDeviceKernels(Device::Cuda(0));
    std::printf("PROBE check: %s\n", st.ok() ? "OK" : std::string(st.ToString()).c_str());
    if (st.ok()) {
      std::printf("PROBE after: libcublas %s, libcublasLt %s\n",
                  Maps().find("/libcublas.so") != std::string::npos ? "mapped" : "not mapped",
                  Maps().find("/libcublasLt.so") != std::string::npos ? "mapped" : "not mapped");
      std::printf("PROBE status name: %s\n",
                  cuda::Cublas().GetStatusName(CUBLAS_STATUS_NOT_SUPPORTED));
    }
    std::fflush(stdout);
    std::_Exit(0);
  }
};
[[maybe_unused]] ::testing::Environment* const kProbe =
    ::testing::AddGlobalTestEnvironment(new ProbeEnvironment);

testing::CommandResult Probe(const std::string& env) {
  char self[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  EXPECT_GT(n, 0);
  return testing::RunCommand("env STRATA_CUBLAS_PROBE=1 " + env + " '" + std::string(self) + "'");
}

TEST(CublasLoaderTest, CublasIsMappedOnlyOnceAGpuOpNeedsIt) {
  const testing::CommandResult r = Probe("");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("PROBE at start: libcublas not mapped, libcublasLt not mapped"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("PROBE check: OK"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("PROBE after: libcublas mapped, libcublasLt mapped"), std::string::npos)
      << r.output;
  // A call into the loaded library: cuBLAS's own name for the status.
  EXPECT_NE(r.output.find("PROBE status name: CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos)
      << r.output;
}

// The probe's check line with STRATA_CUBLAS_LIBRARY=`library`.
std::string CheckLineWith(const std::string& library) {
  const testing::CommandResult r = Probe("STRATA_CUBLAS_LIBRARY=" + library);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find("PROBE check: ");
  return at == std::string::npos ? r.output : r.output.substr(at, r.output.find('\n', at) - at);
}

TEST(CublasLoaderTest, ALibraryThatCannotBeLoadedIsAnErrorNamingItAndTheFix) {
  const std::string line = CheckLineWith("/nonexistent/libcublas.so.13");
  EXPECT_EQ(line.rfind("PROBE check: FAILED_PRECONDITION: ops on cuda:0: cannot load cuBLAS from "
                       "STRATA_CUBLAS_LIBRARY=/nonexistent/libcublas.so.13",
                       0),
            0u)
      << line;
  EXPECT_NE(line.find("unset it"), std::string::npos) << line;
}

TEST(CublasLoaderTest, ALibraryWithoutCublasEntryPointsIsAnErrorNamingTheFirstMissing) {
  // The C library loads but has none of cuBLAS's functions.
  const std::string line = CheckLineWith("libc.so.6");
  EXPECT_EQ(line.rfind("PROBE check: FAILED_PRECONDITION: ops on cuda:0: the cuBLAS library "
                       "loaded (/",
                       0),
            0u)
      << line;
  EXPECT_NE(line.find("libc.so.6) lacks cublasCreate_v2"), std::string::npos) << line;
}

TEST(CublasLoaderTest, TheCpuNeedsNoLibrary) {
  EXPECT_TRUE(ops::CheckDeviceKernels(Device::Cpu()).ok());
}

}  // namespace
}  // namespace strata
