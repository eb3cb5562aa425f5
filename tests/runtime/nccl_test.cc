// The NCCL communicator: every collective on device memory against a reference computed on the
// host, with 1 and 2 ranks (one GPU each, real processes rendezvousing through a file store).
// Each rank runs in a forked child so that CUDA is never initialised in the test process; a child
// exits 77 when the machine lacks the GPUs, and the test is skipped. Without a GPU (or without
// NCCL in the build) the test checks that ConnectNccl says so clearly.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <vector>

#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"
#include "tests/test_util.h"

#ifdef STRATA_WITH_NCCL
#include <cuda_runtime.h>
#endif

namespace strata::comm {
namespace {

constexpr int kSkip = 77;

// Runs fn(rank) in `ranks` children; returns kSkip if any skipped, else the first failure, else 0.
int RunRanks(int ranks, const std::function<int(int)>& fn) {
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    std::fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) _exit(fn(r));
    pids.push_back(pid);
  }
  int result = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == kSkip && result == 0) result = kSkip;
    if (code != 0 && code != kSkip) result = code;
  }
  return result;
}

TEST(NcclTest, WithoutAGpuOrWithoutNcclConnectSaysWhy) {
  const int code = RunRanks(1, [](int) {
    CommOptions o;
    auto c = ConnectNccl(MakeInMemoryStore(), o, 0);
#ifndef STRATA_WITH_NCCL
    const bool ok = c.status().code() == absl::StatusCode::kUnimplemented &&
                    c.status().message().find("no NCCL") != std::string::npos;
    if (!ok) std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return ok ? 0 : 1;
#else
    if (c.ok()) return kSkip;  // this machine has a GPU: the other tests cover it
    const bool ok = c.status().code() == absl::StatusCode::kFailedPrecondition &&
                    c.status().message().find("has none") != std::string::npos;
    if (!ok) std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return ok ? 0 : 1;
#endif
  });
  if (code == kSkip) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(code, 0);
}

class NcclCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(NcclCollectivesTest, EveryCollectiveMatchesAHostReference) {
#ifndef STRATA_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL";
#else
  const int W = GetParam();
  strata::testing::TempDir dir;
  const std::string store_dir = dir.path();
  const int code = RunRanks(W, [&](int rank) -> int {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < W) return kSkip;
    auto store = MakeFileStore(store_dir);
    if (!store.ok()) return 2;
    CommOptions o;
    o.rank = rank;
    o.world_size = W;
    o.timeout = std::chrono::milliseconds(20000);
    auto comm = ConnectNccl(*store, o, rank);
    if (!comm.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
      return 3;
    }
    Communicator& c = **comm;
    int bad = 0;
    auto check = [&](bool cond, const char* what) {
      if (!cond) {
        std::fprintf(stderr, "rank %d: %s\n", rank, what);
        ++bad;
      }
    };
    // AllReduce: rank r holds r + i; the sum is W i + W (W - 1) / 2.
    const size_t n = 1 << 20;
    std::vector<float> host(n);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(rank + (i % 1000));
    float* dev = nullptr;
    cudaMalloc(&dev, n * sizeof(float));
    cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    check(c.AllReduce(dev, n).ok(), "AllReduce failed");
    cudaMemcpy(host.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < n; ++i) {
      const float want = static_cast<float>(W * (i % 1000) + W * (W - 1) / 2);
      if (host[i] != want) {
        check(false, "AllReduce value");
        break;
      }
    }
    // AllToAllV: rank s sends (s + d) % 3 * 1000 ints to d (zero-length pieces included), each
    // holding s * 1000000 + d * 1000 + j.
    auto count = [](int s, int d) { return static_cast<int64_t>((s + d) % 3) * 1000; };
    std::vector<int64_t> sc(W), rc(W);
    std::vector<int32_t> send, want;
    for (int d = 0; d < W; ++d) {
      sc[d] = count(rank, d);
      for (int64_t j = 0; j < sc[d]; ++j) send.push_back(rank * 1000000 + d * 1000 + (int)j);
    }
    for (int s = 0; s < W; ++s) {
      rc[s] = count(s, rank);
      for (int64_t j = 0; j < rc[s]; ++j) want.push_back(s * 1000000 + rank * 1000 + (int)j);
    }
    int32_t *ds = nullptr, *dr = nullptr;
    cudaMalloc(&ds, std::max<size_t>(1, send.size()) * 4);
    cudaMalloc(&dr, std::max<size_t>(1, want.size()) * 4);
    cudaMemcpy(ds, send.data(), send.size() * 4, cudaMemcpyHostToDevice);
    check(c.AllToAllV(ds, sc, dr, rc, 4).ok(), "AllToAllV failed");
    std::vector<int32_t> got(want.size());
    cudaMemcpy(got.data(), dr, got.size() * 4, cudaMemcpyDeviceToHost);
    check(got == want, "AllToAllV values");
    // AllGather and Broadcast of 4 KiB.
    std::vector<char> mine(4096, static_cast<char>('a' + rank)), all(4096 * W);
    char *dm = nullptr, *da = nullptr;
    cudaMalloc(&dm, 4096);
    cudaMalloc(&da, 4096 * W);
    cudaMemcpy(dm, mine.data(), 4096, cudaMemcpyHostToDevice);
    check(c.AllGather(dm, 4096, da).ok(), "AllGather failed");
    cudaMemcpy(all.data(), da, all.size(), cudaMemcpyDeviceToHost);
    for (int r = 0; r < W; ++r) check(all[r * 4096 + 17] == 'a' + r, "AllGather values");
    check(c.Broadcast(dm, 4096, W - 1).ok(), "Broadcast failed");
    cudaMemcpy(mine.data(), dm, 4096, cudaMemcpyDeviceToHost);
    check(mine[4095] == 'a' + (W - 1), "Broadcast values");
    check(c.Barrier().ok(), "Barrier failed");
    // After Abort every call fails with ABORTED.
    c.Abort("test");
    check(c.Barrier().code() == absl::StatusCode::kAborted, "call after Abort");
    return bad == 0 ? 0 : 4;
  });
  if (code == kSkip) GTEST_SKIP() << "needs " << W << " GPUs";
  EXPECT_EQ(code, 0);
#endif
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclCollectivesTest, ::testing::Values(1, 2));

}  // namespace
}  // namespace strata::comm
