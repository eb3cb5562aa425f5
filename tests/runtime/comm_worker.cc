// A worker process for the communicator tests: connects through a FileStore and runs one
// scenario, checking every result against a reference it computes locally (every rank's inputs
// are a pure function of (rank, index), so each rank knows what the others sent).
//
//   comm_worker --rank R --world W --store DIR --scenario collectives|victim|survivor
//               [--timeout-ms T]
//
// Exit status 0: every check passed; 1: a check failed (printed); 2: bad arguments or setup.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"

namespace strata::comm {
namespace {

int failures = 0;

#define CHECK_OR_COUNT(cond, ...)        \
  do {                                   \
    if (!(cond)) {                       \
      std::fprintf(stderr, __VA_ARGS__); \
      std::fprintf(stderr, "\n");        \
      ++failures;                        \
    }                                    \
  } while (0)

float Value(int rank, int64_t i) {
  return static_cast<float>((rank + 1) * 1000 + (i % 997)) * 0.5f;
}

// How many elements rank s sends to rank d in the all-to-all-v: uneven, zero for some pairs.
int64_t Count(int s, int d, int world) {
  if ((s + 2 * d) % 3 == 0) return 0;
  return (s * 7 + d * 13) % 11 + (world > 2 ? 3 * d : 1);
}

void Collectives(Communicator& c) {
  const int r = c.rank(), w = c.world_size();
  // AllReduce over sizes that cover gloo's segmenting (small, odd, several segments).
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{300001}}) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = Value(r, static_cast<int64_t>(i));
    Status s = c.AllReduce(x.data(), n);
    CHECK_OR_COUNT(s.ok(), "AllReduce(%zu): %s", n, s.ToString().c_str());
    for (size_t i = 0; i < n && s.ok(); ++i) {
      float ref = 0;
      for (int k = 0; k < w; ++k) ref += Value(k, static_cast<int64_t>(i));
      // Integers and halves: exact in float, whatever the order of the sum.
      if (x[i] != ref) {
        CHECK_OR_COUNT(false, "AllReduce(%zu)[%zu] = %g, expected %g", n, i, x[i], ref);
        break;
      }
    }
  }
  {
    std::vector<double> x(513);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0 / (r + 1) + static_cast<double>(i);
    Status s = c.AllReduce(x.data(), x.size());
    CHECK_OR_COUNT(s.ok(), "AllReduce(double): %s", s.ToString().c_str());
    for (size_t i = 0; i < x.size(); ++i) {
      double ref = 0;
      for (int k = 0; k < w; ++k) ref += 1.0 / (k + 1) + static_cast<double>(i);
      CHECK_OR_COUNT(std::abs(x[i] - ref) <= 1e-12 * std::abs(ref), "AllReduce(double)[%zu]", i);
    }
  }
  // AllToAllV, uneven, with zero-length pieces.
  {
    std::vector<int64_t> sc(w), rc(w);
    int64_t st = 0, rt = 0;
    for (int d = 0; d < w; ++d) st += sc[d] = Count(r, d, w);
    for (int s = 0; s < w; ++s) rt += rc[s] = Count(s, r, w);
    std::vector<float> send(st), recv(rt, -1.f);
    int64_t o = 0;
    for (int d = 0; d < w; ++d) {
      for (int64_t i = 0; i < sc[d]; ++i) send[o++] = Value(r, d * 100000 + i);
    }
    Status s = c.AllToAllV(send.data(), sc, recv.data(), rc);
    CHECK_OR_COUNT(s.ok(), "AllToAllV: %s", s.ToString().c_str());
    o = 0;
    for (int src = 0; src < w && s.ok(); ++src) {
      for (int64_t i = 0; i < rc[src]; ++i, ++o) {
        CHECK_OR_COUNT(recv[o] == Value(src, r * 100000 + i), "AllToAllV from %d [%ld]: %g", src,
                       static_cast<long>(i), recv[o]);
      }
    }
    // Nothing at all to move on this rank's side must work too.
    std::vector<int64_t> zero(w, 0);
    std::vector<int64_t> only_to_next(w, 0), only_from_prev(w, 0);
    only_to_next[(r + 1) % w] = 5;
    only_from_prev[(r + w - 1) % w] = 5;
    std::vector<double> a(5, r + 0.25), b(5, -1);
    s = c.AllToAllV(a.data(), only_to_next, b.data(), only_from_prev);
    CHECK_OR_COUNT(s.ok(), "AllToAllV ring: %s", s.ToString().c_str());
    for (double v : b) CHECK_OR_COUNT(v == (r + w - 1) % w + 0.25, "AllToAllV ring got %g", v);
    s = c.AllToAllV<float>(nullptr, zero, nullptr, zero);
    CHECK_OR_COUNT(s.ok(), "AllToAllV all zero: %s", s.ToString().c_str());
  }
  // AllGather and Broadcast.
  {
    std::vector<int32_t> mine(3), all(3 * w, -1);
    for (int i = 0; i < 3; ++i) mine[i] = r * 10 + i;
    Status s = c.AllGather(mine.data(), sizeof(int32_t) * 3, all.data());
    CHECK_OR_COUNT(s.ok(), "AllGather: %s", s.ToString().c_str());
    for (int k = 0; k < w; ++k) {
      for (int i = 0; i < 3; ++i) {
        CHECK_OR_COUNT(all[3 * k + i] == k * 10 + i, "AllGather[%d][%d] = %d", k, i,
                       all[3 * k + i]);
      }
    }
    for (int root = 0; root < w; ++root) {
      std::vector<char> buf(100000, static_cast<char>(r == root ? 'a' + root : 0));
      s = c.Broadcast(buf.data(), buf.size(), root);
      CHECK_OR_COUNT(s.ok(), "Broadcast from %d: %s", root, s.ToString().c_str());
      CHECK_OR_COUNT(buf.front() == 'a' + root && buf.back() == 'a' + root,
                     "Broadcast from %d: got %d", root, buf.front());
    }
    s = c.Broadcast(nullptr, 0, w);
    CHECK_OR_COUNT(absl::IsInvalidArgument(s), "Broadcast from a rank outside the world: %s",
                   s.ToString().c_str());
  }
  Status s = c.Barrier();
  CHECK_OR_COUNT(s.ok(), "Barrier: %s", s.ToString().c_str());
}

int Main(int argc, char** argv) {
  int rank = -1, world = 0;
  std::string store_dir, scenario;
  int timeout_ms = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--rank")
      rank = std::stoi(v);
    else if (a == "--world")
      world = std::stoi(v);
    else if (a == "--store")
      store_dir = v;
    else if (a == "--scenario")
      scenario = v;
    else if (a == "--timeout-ms")
      timeout_ms = std::stoi(v);
    else
      return 2;
  }
  auto store = MakeFileStore(store_dir);
  if (!store.ok()) return 2;
  CommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  auto comm = ConnectGloo(MakePrefixStore(*store, GenerationPrefix(0)), o);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    return 2;
  }
  if (scenario == "collectives") {
    Collectives(**comm);
    return failures == 0 ? 0 : 1;
  }
  // Failure scenarios: everybody meets once, then the victim stops answering (the test kills it
  // with SIGKILL) while the survivors are inside an AllReduce that needs it.
  Status s = (*comm)->Barrier();
  if (!s.ok()) return 2;
  if (!(*store)->Add("ready", 1).ok()) return 2;
  if (scenario == "victim") {
    std::this_thread::sleep_for(std::chrono::hours(1));
    return 0;
  }
  if (scenario == "survivor") {
    std::vector<float> x(1 << 20, 1.f);
    const auto t0 = std::chrono::steady_clock::now();
    s = (*comm)->AllReduce(x.data(), x.size());
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("rank %d: %.3f s: %s\n", rank, sec, s.ToString().c_str());
    CHECK_OR_COUNT(!s.ok(), "AllReduce with a dead peer returned OK");
    CHECK_OR_COUNT(s.message().find("AllReduce on rank") != std::string_view::npos,
                   "the error does not name the operation and rank: %s", s.ToString().c_str());
    CHECK_OR_COUNT(sec < timeout_ms / 1000.0 + 5, "took %.1f s, longer than the timeout", sec);
    // The communicator is finished after a failure.
    s = (*comm)->Barrier();
    CHECK_OR_COUNT(absl::IsAborted(s), "a call after a failure: %s", s.ToString().c_str());
    return failures == 0 ? 0 : 1;
  }
  return 2;
}

}  // namespace
}  // namespace strata::comm

int main(int argc, char** argv) { return strata::comm::Main(argc, argv); }
