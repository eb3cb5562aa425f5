// A worker process for the communicator tests: connects through a FileStore and runs one
// scenario, checking every result against a reference it computes locally (every rank's inputs
// are a pure function of (rank, index), so each rank knows what the others sent).
//
//   comm_worker --rank R --world W --store DIR --scenario collectives|hierarchical|victim|survivor
//               [--timeout-ms T] [--local-size L] [--victim V] [--op allreduce|allgather]
//               [--staged-chunk-bytes N]
//
//   --staged-chunk-bytes: the Gloo communicator wrapped into the staging one (staging.h) on the
//                 CPU device, all-reducing in chunks of N bytes; every check is the same.
//   hierarchical: the two-level AllToAllV of W / L nodes x L local ranks against a flat one and
//                 the local reference, bit for bit; survivor: `op` fails, naming a peer rank
//                 (for allreduce, the victim V).
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
#include "runtime/comm/hierarchical.h"
#include "runtime/comm/staging.h"
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
  // The last size takes several of the all-reduce's 1 MiB segments per rank, unevenly.
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{300001}, size_t{1500007}}) {
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
  // Numbers whose sum depends on the order of the additions: every rank gets the same bits, and
  // they are the sum in rank order ((x0 + x1) + x2) + ... (several segments again).
  {
    const size_t n = 700001;
    std::vector<double> x(n);
    auto input = [](int k, size_t i) { return 1.0 / (3.0 + k + 7.0 * static_cast<double>(i)); };
    for (size_t i = 0; i < n; ++i) x[i] = input(r, i);
    Status s = c.AllReduce(x.data(), n);
    CHECK_OR_COUNT(s.ok(), "AllReduce(rank order): %s", s.ToString().c_str());
    size_t wrong = 0;
    for (size_t i = 0; i < n && s.ok(); ++i) {
      double ref = input(0, i);
      for (int k = 1; k < w; ++k) ref += input(k, i);
      wrong += std::memcmp(&ref, &x[i], sizeof(double)) != 0;
    }
    CHECK_OR_COUNT(wrong == 0, "AllReduce(rank order): %zu of %zu sums are not the rank-order sum",
                   wrong, n);
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

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Elements rank s sends to rank d in round `seed`: uneven, a quarter of the pairs empty; in round
// 2 rank 1 sends nothing at all and nobody sends to rank 0; round 3 moves ~7 MB among 4 ranks.
int64_t HierCount(int seed, int s, int d) {
  if (seed == 2 && (s == 1 || d == 0)) return 0;
  const uint64_t h = Mix(Mix(seed * 1000003ull + s) + d);
  if (h % 4 == 0) return 0;
  return static_cast<int64_t>(h % (seed == 3 ? 200000 : 50));
}
char HierByte(int seed, int s, int d, int64_t i) {
  return static_cast<char>(Mix((static_cast<uint64_t>(seed * 64 + s) << 40) ^
                               (static_cast<uint64_t>(d) << 32) ^ static_cast<uint64_t>(i)));
}

// The two-level AllToAllV against the flat one and against the reference, byte for byte, with
// 6-byte elements (neither a float nor a power of two).
void Hierarchical(Communicator& flat, Communicator& hier) {
  const int r = hier.rank(), w = hier.world_size();
  CHECK_OR_COUNT(hier.backend().find("hierarchical") != std::string::npos, "backend %s",
                 hier.backend().c_str());
  const size_t eb = 6;
  for (int seed : {1, 2, 3}) {
    std::vector<int64_t> sc(w), rc(w);
    int64_t st = 0, rt = 0;
    for (int d = 0; d < w; ++d) st += sc[d] = HierCount(seed, r, d);
    for (int s = 0; s < w; ++s) rt += rc[s] = HierCount(seed, s, r);
    std::vector<char> send(st * eb), ref(rt * eb), got(rt * eb + 1, 0), got_flat(rt * eb + 1, 1);
    int64_t o = 0;
    for (int d = 0; d < w; ++d) {
      for (int64_t i = 0; i < sc[d] * static_cast<int64_t>(eb); ++i)
        send[o++] = HierByte(seed, r, d, i);
    }
    o = 0;
    for (int s = 0; s < w; ++s) {
      for (int64_t i = 0; i < rc[s] * static_cast<int64_t>(eb); ++i)
        ref[o++] = HierByte(seed, s, r, i);
    }
    Status s = hier.AllToAllV(send.data(), sc, got.data(), rc, eb);
    CHECK_OR_COUNT(s.ok(), "hierarchical AllToAllV (round %d): %s", seed, s.ToString().c_str());
    s = flat.AllToAllV(send.data(), sc, got_flat.data(), rc, eb);
    CHECK_OR_COUNT(s.ok(), "flat AllToAllV (round %d): %s", seed, s.ToString().c_str());
    CHECK_OR_COUNT(std::memcmp(got.data(), ref.data(), ref.size()) == 0,
                   "hierarchical AllToAllV (round %d, %ld bytes) differs from the reference", seed,
                   static_cast<long>(ref.size()));
    CHECK_OR_COUNT(std::memcmp(got.data(), got_flat.data(), ref.size()) == 0,
                   "hierarchical AllToAllV (round %d) differs from the flat one", seed);
  }
  // Everything else goes to the world communicator.
  std::vector<float> x(1001, static_cast<float>(r + 1));
  Status s = hier.AllReduce(x.data(), x.size());
  CHECK_OR_COUNT(s.ok() && x.front() == w * (w + 1) / 2.0f && x.back() == x.front(),
                 "hierarchical AllReduce: %s, %g", s.ToString().c_str(), x.front());
  s = hier.Barrier();
  CHECK_OR_COUNT(s.ok(), "hierarchical Barrier: %s", s.ToString().c_str());
}

int Main(int argc, char** argv) {
  int rank = -1, world = 0;
  std::string store_dir, scenario;
  int timeout_ms = 20000, local_size = 1, victim = -1;
  size_t staged_chunk_bytes = 0;
  std::string op = "allreduce";
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
    else if (a == "--local-size")
      local_size = std::stoi(v);
    else if (a == "--victim")
      victim = std::stoi(v);
    else if (a == "--op")
      op = v;
    else if (a == "--staged-chunk-bytes")
      staged_chunk_bytes = std::stoul(v);
    else
      return 2;
  }
  auto store = MakeFileStore(store_dir);
  if (!store.ok()) return 2;
  CommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  if (scenario == "hierarchical") {
    auto gen = MakePrefixStore(*store, GenerationPrefix(0));
    auto flat = ConnectGloo(MakePrefixStore(gen, "flat/"), o);
    auto hier = ConnectHierarchicalGloo(MakePrefixStore(gen, "hier/"), o, local_size);
    if (!flat.ok() || !hier.ok()) {
      std::fprintf(stderr, "rank %d: %s %s\n", rank, flat.status().ToString().c_str(),
                   hier.status().ToString().c_str());
      return 2;
    }
    Hierarchical(**flat, **hier);
    return failures == 0 ? 0 : 1;
  }
  auto comm = ConnectGloo(MakePrefixStore(*store, GenerationPrefix(0)), o);
  if (comm.ok() && staged_chunk_bytes > 0) {
    comm = MakeStaging(*std::move(comm), Device::Cpu(), StagingOptions{staged_chunk_bytes});
    if (comm.ok() && (*comm)->backend().find("staged") == std::string::npos) return 2;
  }
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    return 2;
  }
  if (scenario == "collectives") {
    Collectives(**comm);
    return failures == 0 ? 0 : 1;
  }
  // Failure scenarios: everybody meets once, then the victim stops answering (the test kills it
  // with SIGKILL) while the survivors are inside a collective that needs it.
  Status s = (*comm)->Barrier();
  if (!s.ok()) return 2;
  if (!(*store)->Add("ready", 1).ok()) return 2;
  if (scenario == "victim") {
    std::this_thread::sleep_for(std::chrono::hours(1));
    return 0;
  }
  if (scenario == "survivor") {
    std::vector<float> x(1 << 20, 1.f), all;
    const auto t0 = std::chrono::steady_clock::now();
    if (op == "allgather") {
      all.resize(x.size() * world);
      s = (*comm)->AllGather(x.data(), x.size() * sizeof(float), all.data());
    } else {
      s = (*comm)->AllReduce(x.data(), x.size());
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("rank %d: %.3f s: %s\n", rank, sec, s.ToString().c_str());
    CHECK_OR_COUNT(!s.ok(), "%s with a dead peer returned OK", op.c_str());
    const char* name = op == "allgather" ? "AllGather on rank" : "AllReduce on rank";
    CHECK_OR_COUNT(s.message().find(name) != std::string_view::npos,
                   "the error does not name the operation and rank: %s", s.ToString().c_str());
    // AllReduce waits on each peer's connection itself, so its error names the killed rank.
    // Gloo's all-gather waits on all of them at once; its message names an address, which maps
    // to the killed rank, or to a survivor that failed first and closed its connections.
    const std::string peer =
        op == "allgather" ? "peer rank " : "peer rank " + std::to_string(victim) + " (";
    CHECK_OR_COUNT(s.message().find(peer) != std::string_view::npos,
                   "the error does not name %s...: %s", peer.c_str(), s.ToString().c_str());
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
