// Communicators over device memory: NCCL (1 and 2 ranks, one GPU each) and the staging one (2 ranks
// on one GPU, Gloo through pinned host memory), every collective against a reference computed on
// the host (real processes rendezvousing through a file store).
// Each rank runs in a forked child so that CUDA is never initialised in the test process; a child
// exits 77 when the machine lacks the GPUs, and the test is skipped. Without a GPU (or without
// NCCL in the build) the test checks that ConnectNccl says so clearly.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "core/device/device.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/staging.h"
#include "runtime/comm/store.h"
#include "tests/test_util.h"

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

// Every collective on device memory against a reference computed on the host; 0 when all match.
// The device buffers are strata's (core/device), so the same checks serve NCCL and staging.
int CheckCollectives(Communicator& c, Device device) {
  const int rank = c.rank(), W = c.world_size();
  int bad = 0;
  auto check = [&](bool cond, const char* what) {
    if (!cond) {
      std::fprintf(stderr, "rank %d (%s): %s\n", rank, c.backend().c_str(), what);
      ++bad;
    }
  };
  auto on_device = [&](const void* host, size_t bytes) {
    auto b = Buffer::Allocate(device, std::max<size_t>(1, bytes));
    if (!b.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, b.status().ToString().c_str());
      std::_Exit(3);
    }
    if (bytes > 0) CopyBytes((*b)->data(), host, bytes);
    return *b;
  };
  // AllReduce: rank r holds r + i % 1000; the sum is W (i % 1000) + W (W - 1) / 2, exact in
  // float. 3M elements: several chunks of a staging communicator, the last one partial.
  const size_t n = 3 * (1 << 20) + 12345;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(rank + (i % 1000));
  auto x = on_device(host.data(), n * sizeof(float));
  check(c.AllReduce(static_cast<float*>(x->data()), n).ok(), "AllReduce failed");
  CopyBytes(host.data(), x->data(), n * sizeof(float));
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
  auto ds = on_device(send.data(), send.size() * 4);
  std::vector<int32_t> got(want.size(), -1);
  auto dr = on_device(got.data(), got.size() * 4);
  check(c.AllToAllV(ds->data(), sc, dr->data(), rc, 4).ok(), "AllToAllV failed");
  CopyBytes(got.data(), dr->data(), got.size() * 4);
  check(got == want, "AllToAllV values");
  // AllGather and Broadcast of 4 KiB.
  std::vector<char> mine(4096, static_cast<char>('a' + rank)), all(4096 * W);
  auto dm = on_device(mine.data(), 4096);
  auto da = on_device(all.data(), all.size());
  check(c.AllGather(dm->data(), 4096, da->data()).ok(), "AllGather failed");
  CopyBytes(all.data(), da->data(), all.size());
  for (int r = 0; r < W; ++r) check(all[r * 4096 + 17] == 'a' + r, "AllGather values");
  check(c.Broadcast(dm->data(), 4096, W - 1).ok(), "Broadcast failed");
  CopyBytes(mine.data(), dm->data(), 4096);
  check(mine[4095] == 'a' + (W - 1), "Broadcast values");
  check(c.Barrier().ok(), "Barrier failed");
  // After Abort every call fails with ABORTED.
  c.Abort("test");
  check(c.Barrier().code() == absl::StatusCode::kAborted, "call after Abort");
  return bad == 0 ? 0 : 4;
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
    if (CudaDeviceCount() < W) return kSkip;
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
    return CheckCollectives(**comm, Device::Cuda(rank));
  });
  if (code == kSkip) GTEST_SKIP() << "needs " << W << " GPUs";
  EXPECT_EQ(code, 0);
#endif
}

// Two workers on one GPU, where NCCL cannot serve them (it refuses two ranks on one device): Gloo
// through the staging communicator, 1 MiB chunks, the same checks on device memory.
TEST(StagedGpuCollectivesTest, TwoRanksOnOneGpuMatchAHostReference) {
  strata::testing::TempDir dir;
  const std::string store_dir = dir.path();
  const int code = RunRanks(2, [&](int rank) -> int {
    if (CudaDeviceCount() < 1) return kSkip;
    auto store = MakeFileStore(store_dir);
    if (!store.ok()) return 2;
    CommOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.timeout = std::chrono::milliseconds(20000);
    auto comm = ConnectGloo(*store, o);
    if (comm.ok()) comm = MakeStaging(*std::move(comm), Device::Cuda(0), StagingOptions{1 << 20});
    if (!comm.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
      return 3;
    }
    return CheckCollectives(**comm, Device::Cuda(0));
  });
  if (code == kSkip) GTEST_SKIP() << "needs a GPU";
  EXPECT_EQ(code, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclCollectivesTest, ::testing::Values(1, 2));

}  // namespace
}  // namespace strata::comm
