// Communicator over Gloo's TCP transport.
#include <gloo/allgatherv.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <signal.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "runtime/comm/communicator.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// Gloo's rendezvous interface on a strata Store. Gloo reports failures by exception.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<comm::Store> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_->Set(key, std::string(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->WaitGet(key, timeout_);
    Check(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    Check(store_->Wait(keys, timeout));
  }

 private:
  static void Check(const Status& s) {
    if (!s.ok()) throw std::runtime_error(std::string(s.message()));
  }
  std::shared_ptr<comm::Store> store_;
  std::chrono::milliseconds timeout_;
};

// A failure while waiting on the connection to one peer (a buffer of this file only ever talks
// to one peer, so the peer is known even when Gloo's message does not name it).
class PeerFailure : public std::runtime_error {
 public:
  PeerFailure(int peer, const std::string& what) : std::runtime_error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// Slots of this file's point-to-point messages: a prefix no Gloo collective uses (Gloo's are
// small numbers in the top byte), the call's tag, and the phase within the call.
uint64_t SlotOf(uint32_t tag, uint8_t phase) {
  return (uint64_t{0x53} << 56) | (uint64_t{tag} << 8) | phase;
}

// Every operation but AllGather and Broadcast is built from point-to-point sends and receives on
// unbound buffers this class creates, one buffer per peer and direction: Abort can interrupt
// every wait on them, and a failure is pinned to the peer it came from. (Gloo's own all-reduce
// and barrier wait on internal buffers that nothing outside can wake; closing the connections
// does not wake them either.) AllGather and Broadcast use Gloo's all-gather-v and broadcast on
// buffers of this class, which Abort can interrupt too.
class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> ctx, const CommOptions& o,
                   std::vector<std::vector<std::string>> peer_addresses)
      : ctx_(std::move(ctx)), options_(o), peer_addresses_(std::move(peer_addresses)) {}
  ~GlooCommunicator() override = default;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string backend() const override { return "gloo"; }

  Status AllReduce(float* data, size_t n) override { return Reduce(data, n); }
  Status AllReduce(double* data, size_t n) override { return Reduce(data, n); }

  Status AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, size_t element_bytes) override {
    const auto w = static_cast<size_t>(options_.world_size);
    if (send_counts.size() != w || recv_counts.size() != w) {
      return absl::InvalidArgumentError(
          absl::StrFormat("AllToAllV on rank %d: %d send and %d receive counts for %d ranks",
                          options_.rank, send_counts.size(), recv_counts.size(), w));
    }
    std::vector<int64_t> send_bytes(w), recv_bytes(w);
    for (size_t r = 0; r < w; ++r) {
      if (send_counts[r] < 0 || recv_counts[r] < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("AllToAllV on rank %d: negative count for rank %d", options_.rank, r));
      }
      send_bytes[r] = send_counts[r] * static_cast<int64_t>(element_bytes);
      recv_bytes[r] = recv_counts[r] * static_cast<int64_t>(element_bytes);
    }
    const auto self = static_cast<size_t>(options_.rank);
    if (send_counts[self] != recv_counts[self]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "AllToAllV on rank %d: sends %d elements to itself but expects %d from itself",
          options_.rank, send_counts[self], recv_counts[self]));
    }
    return Call("AllToAllV",
                [&](uint32_t tag) { ExchangeBytes(send, send_bytes, recv, recv_bytes, tag); });
  }

  Status AllGather(const void* send, size_t bytes, void* recv) override {
    return Call("AllGather", [&](uint32_t tag) {
      GatherBytes(const_cast<void*>(send), bytes, recv,
                  std::vector<size_t>(static_cast<size_t>(options_.world_size), bytes), tag);
    });
  }

  Status Broadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= options_.world_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Broadcast from rank %d: no such rank in a world of %d", root, options_.world_size));
    }
    return Call("Broadcast", [&](uint32_t tag) {
      gloo::BroadcastOptions opts(ctx_);
      auto out = Buffer(data, bytes);
      Watch watch(this, {out.get()});
      opts.setOutput<char>(std::move(out));
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::broadcast(opts);
      CheckNotAborted();
    });
  }

  Status Barrier() override {
    // One byte to and from every rank: nobody leaves before everybody arrived.
    return Call("Barrier", [&](uint32_t tag) {
      const auto w = static_cast<size_t>(options_.world_size);
      std::vector<char> in(w, 1), out(w, 0);
      ExchangeBytes(in.data(), std::vector<int64_t>(w, 1), out.data(), std::vector<int64_t>(w, 1),
                    tag);
    });
  }

  void Abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
      why_ = absl::StrFormat("aborted on rank %d: %s", options_.rank, why);
    }
    aborted_ = true;
    // First close every connection, so nothing more can land in a buffer and peers waiting on
    // this rank fail at once; then interrupt this rank's waits until the call in flight returns.
    CloseConnections();
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!in_call_) break;
        for (UnboundBuffer* b : watched_) {
          b->abortWaitRecv();
          b->abortWaitSend();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  std::unique_ptr<UnboundBuffer> Buffer(const void* p, size_t bytes) {
    static char empty[1];
    return ctx_->createUnboundBuffer(p != nullptr ? const_cast<void*>(p) : empty, bytes);
  }

  void CloseConnections() {
    try {
      ctx_->closeConnections();
    } catch (const std::exception&) {
      // Already closed.
    }
  }

  // Makes buffers visible to Abort for as long as it lives. Declared after the buffers, so it is
  // destroyed (and the buffers unlisted) before they are.
  class Watch {
   public:
    Watch(GlooCommunicator* c, std::vector<UnboundBuffer*> bufs) : c_(c) {
      std::lock_guard<std::mutex> lock(c_->mu_);
      c_->watched_ = std::move(bufs);
    }
    ~Watch() {
      std::lock_guard<std::mutex> lock(c_->mu_);
      c_->watched_.clear();
    }

   private:
    GlooCommunicator* c_;
  };

  // Runs `post` (a send or receive to or from `peer`): a connection that broke already fails
  // here, naming the peer.
  template <typename F>
  void Post(int peer, F&& post) {
    try {
      post();
    } catch (const std::exception& e) {
      CheckNotAborted();
      throw PeerFailure(peer, e.what());
    }
  }

  // Waits for the next receive (or send) on `b`, a buffer that only talks to `peer`, until the
  // call's deadline.
  void Wait(UnboundBuffer* b, bool recv, int peer) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    if (left.count() < 1) left = std::chrono::milliseconds(1);
    bool done = false;
    try {
      done = recv ? b->waitRecv(nullptr, left) : b->waitSend(nullptr, left);
    } catch (const std::exception& e) {
      CheckNotAborted();
      throw PeerFailure(peer, e.what());
    }
    if (!done) {
      CheckNotAborted();
      throw PeerFailure(peer, "the wait was interrupted");
    }
  }

  // All-to-all-v in bytes: one send buffer and one receive buffer per peer, so that every wait
  // names its peer. Zero-length pieces are not sent at all (both sides know the counts).
  void ExchangeBytes(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                     const std::vector<int64_t>& recv_bytes, uint32_t tag) {
    const int w = options_.world_size, r = options_.rank;
    std::vector<size_t> send_off(w + 1, 0), recv_off(w + 1, 0);
    for (int p = 0; p < w; ++p) {
      send_off[p + 1] = send_off[p] + static_cast<size_t>(send_bytes[p]);
      recv_off[p + 1] = recv_off[p] + static_cast<size_t>(recv_bytes[p]);
    }
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    std::vector<std::unique_ptr<UnboundBuffer>> sends(w), recvs(w);
    std::vector<UnboundBuffer*> all;
    for (int p = 0; p < w; ++p) {
      if (p == r) continue;
      if (send_bytes[p] > 0)
        all.push_back((sends[p] = Buffer(in + send_off[p], send_bytes[p])).get());
      if (recv_bytes[p] > 0)
        all.push_back((recvs[p] = Buffer(out + recv_off[p], recv_bytes[p])).get());
    }
    Watch watch(this, std::move(all));
    const uint64_t slot = SlotOf(tag, 0);
    // Peers in the order of Gloo's all-to-all-v: to r+i, from r-i.
    for (int i = 1; i < w; ++i) {
      const int to = (r + i) % w, from = (r + w - i) % w;
      if (sends[to]) Post(to, [&] { sends[to]->send(to, slot); });
      if (recvs[from]) Post(from, [&] { recvs[from]->recv(from, slot); });
    }
    if (send_bytes[r] > 0) std::memcpy(out + recv_off[r], in + send_off[r], send_bytes[r]);
    for (int i = 1; i < w; ++i) {
      const int from = (r + w - i) % w, to = (r + i) % w;
      if (recvs[from]) Wait(recvs[from].get(), /*recv=*/true, from);
      if (sends[to]) Wait(sends[to].get(), /*recv=*/false, to);
    }
  }

  void GatherBytes(void* send, size_t bytes, void* recv, std::vector<size_t> per_rank,
                   uint32_t tag) {
    size_t total = 0;
    for (size_t b : per_rank) total += b;
    gloo::AllgathervOptions opts(ctx_);
    auto in = Buffer(send, bytes);
    auto out = Buffer(recv, total);
    Watch watch(this, {in.get(), out.get()});
    opts.setInput<char>(std::move(in));
    opts.setOutput<char>(std::move(out), std::move(per_rank));
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    gloo::allgatherv(opts);
    CheckNotAborted();
  }

  // A wait that Abort interrupted returns normally inside Gloo; stop there.
  void CheckNotAborted() {
    if (aborted_) throw std::runtime_error("aborted");
  }

  // Reduce-scatter then all-gather, both direct (rank j owns chunk j: everybody sends it chunk j,
  // it adds the pieces in rank order and sends the sum back to everybody). Moves 2 (W-1)/W of the
  // data per rank, like a ring, and every rank adds the same numbers in the same order: the
  // result is bitwise the same on every rank and does not depend on a ring position.
  //
  // The chunks go in segments of at most kSegmentBytes, pipelined: while this rank adds segment
  // k, segment k+1 is on the wire, and the sum of segment k leaves for the peers as soon as it is
  // ready. The pieces of a segment wait in a scratch of 2 (W-1) segments, which stays in cache
  // (the sums go straight into `data`).
  template <typename T>
  Status Reduce(T* data, size_t n) {
    return Call("AllReduce", [&](uint32_t tag) {
      if (n > 0 && options_.world_size > 1) ReduceSegments(data, n, tag);
    });
  }

  static constexpr size_t kSegmentBytes = size_t{1} << 20;

  template <typename T>
  void ReduceSegments(T* data, size_t n, uint32_t tag) {
    const int w = options_.world_size, r = options_.rank;
    auto begin = [&](int j) { return n * static_cast<size_t>(j) / static_cast<size_t>(w); };
    auto len = [&](int j) { return begin(j + 1) - begin(j); };
    size_t longest = 0;
    for (int j = 0; j < w; ++j) longest = std::max(longest, len(j));
    const size_t seg_elems = std::max<size_t>(1, kSegmentBytes / sizeof(T));
    const size_t nseg = (longest + seg_elems - 1) / seg_elems;
    // Segment k of chunk j, relative to the chunk: every rank computes the same bounds.
    auto seg_begin = [&](int j, size_t k) { return len(j) * k / nseg; };
    auto seg_len = [&](int j, size_t k) { return seg_begin(j, k + 1) - seg_begin(j, k); };
    const size_t mine = len(r);
    const size_t seg_max = (mine + nseg - 1) / nseg;
    // Two segments per peer (the one being added, the one on the wire), peer after peer.
    scratch_.resize(std::max<size_t>(1, 2 * static_cast<size_t>(w) * seg_max) * sizeof(T));
    T* scratch = reinterpret_cast<T*>(scratch_.data());
    auto piece = [&](int p, size_t k) {
      return scratch + (2 * static_cast<size_t>(p) + k % 2) * seg_max;
    };

    // Per peer p: chunk[p] (chunk p of `data`: its pieces go to p, its sums come back from p),
    // parts[p] (the pieces of this rank's chunk that p sends), sums[p] (this rank's sums, to p).
    std::vector<std::unique_ptr<UnboundBuffer>> chunk(w), parts(w), sums(w);
    std::vector<UnboundBuffer*> all;
    for (int p = 0; p < w; ++p) {
      if (p == r) continue;
      chunk[p] = Buffer(data + begin(p), len(p) * sizeof(T));
      parts[p] = Buffer(piece(p, 0), 2 * seg_max * sizeof(T));
      sums[p] = Buffer(data + begin(r), mine * sizeof(T));
      all.insert(all.end(), {chunk[p].get(), parts[p].get(), sums[p].get()});
    }
    Watch watch(this, std::move(all));
    const uint64_t scatter = SlotOf(tag, 0), gather = SlotOf(tag, 1);
    auto post_scatter = [&](size_t k) {
      for (int i = 1; i < w; ++i) {
        const int to = (r + i) % w, from = (r + w - i) % w;
        if (seg_len(to, k) > 0) {
          Post(to, [&] {
            chunk[to]->send(to, scatter, seg_begin(to, k) * sizeof(T), seg_len(to, k) * sizeof(T));
          });
        }
        if (seg_len(r, k) > 0) {
          Post(from, [&] {
            parts[from]->recv(from, scatter, (k % 2) * seg_max * sizeof(T),
                              seg_len(r, k) * sizeof(T));
          });
        }
      }
    };
    post_scatter(0);
    // The sums of every peer's chunk can land as soon as they are ready: they only arrive after
    // the peer received this rank's pieces of the same segment, so nothing still to be sent is
    // overwritten.
    for (size_t k = 0; k < nseg; ++k) {
      for (int i = 1; i < w; ++i) {
        const int from = (r + w - i) % w;
        if (seg_len(from, k) > 0) {
          Post(from, [&] {
            chunk[from]->recv(from, gather, seg_begin(from, k) * sizeof(T),
                              seg_len(from, k) * sizeof(T));
          });
        }
      }
    }
    std::vector<const T*> src(w);
    for (size_t k = 0; k < nseg; ++k) {
      if (k + 1 < nseg) post_scatter(k + 1);
      const size_t m = seg_len(r, k);
      if (m == 0) continue;
      for (int i = 1; i < w; ++i) {
        const int from = (r + w - i) % w;
        Wait(parts[from].get(), /*recv=*/true, from);
      }
      T* out = data + begin(r) + seg_begin(r, k);
      for (int p = 0; p < w; ++p) src[p] = p == r ? out : piece(p, k);
      AddInRankOrder(src, out, m);
      for (int i = 1; i < w; ++i) {
        const int to = (r + i) % w;
        Post(to, [&] { sums[to]->send(to, gather, seg_begin(r, k) * sizeof(T), m * sizeof(T)); });
      }
    }
    // Everything sent, every peer's sums received.
    for (int i = 1; i < w; ++i) {
      const int from = (r + w - i) % w, to = (r + i) % w;
      for (size_t k = 0; k < nseg; ++k) {
        if (seg_len(from, k) > 0) Wait(chunk[from].get(), /*recv=*/true, from);
        if (seg_len(to, k) > 0) Wait(chunk[to].get(), /*recv=*/false, to);
        if (seg_len(r, k) > 0) Wait(sums[to].get(), /*recv=*/false, to);
      }
    }
  }

  // out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ...; out may be one of the sources. Blocks
  // small enough for the cache, so the compiler's vector loops read every source once.
  template <typename T>
  static void AddInRankOrder(const std::vector<const T*>& src, T* out, size_t m) {
    constexpr size_t kBlock = 2048;
    T acc[kBlock];
    for (size_t b = 0; b < m; b += kBlock) {
      const size_t e = std::min(kBlock, m - b);
      const T* s0 = src[0] + b;
      for (size_t i = 0; i < e; ++i) acc[i] = s0[i];
      for (size_t p = 1; p < src.size(); ++p) {
        const T* s = src[p] + b;
        for (size_t i = 0; i < e; ++i) acc[i] += s[i];
      }
      std::memcpy(out + b, acc, e * sizeof(T));
    }
  }

  template <typename F>
  Status Call(const char* op, F&& body) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) {
        return absl::AbortedError(absl::StrFormat(
            "%s on rank %d of %d: the communicator is finished (%s); build a new one for the "
            "next membership generation",
            op, options_.rank, options_.world_size, why_));
      }
      in_call_ = true;
    }
    const uint32_t tag = next_tag_++;
    deadline_ = Clock::now() + options_.timeout;
    Status result;
    try {
      body(tag);
    } catch (const PeerFailure& e) {
      result = Failed(op, e.what(), e.peer());
    } catch (const std::exception& e) {
      result = Failed(op, e.what(), -1);
    }
    std::lock_guard<std::mutex> lock(mu_);
    in_call_ = false;
    return result;
  }

  // The peer whose address Gloo's message names ("... [127.0.0.1]:41234") as "peer rank 2
  // ([127.0.0.1]:41234)"; when `peer` is given, that peer, under the address in the message if it
  // is one of its, else under its listening address. Empty when nothing fits.
  std::string PeerName(const std::string& what, int peer) const {
    for (size_t open = what.find('['); open != std::string::npos; open = what.find('[', open + 1)) {
      const size_t close = what.find("]:", open);
      if (close == std::string::npos) break;
      size_t end = close + 2;
      while (end < what.size() && what[end] >= '0' && what[end] <= '9') ++end;
      const std::string address = what.substr(open, end - open);
      for (size_t p = 0; p < peer_addresses_.size(); ++p) {
        if (peer >= 0 && static_cast<int>(p) != peer) continue;
        for (const std::string& a : peer_addresses_[p]) {
          if (a == address) return absl::StrFormat("peer rank %d (%s)", p, address);
        }
      }
    }
    if (peer < 0) return "";
    const auto& known = peer_addresses_[peer];
    return absl::StrFormat("peer rank %d (%s)", peer, known.empty() ? "address unknown" : known[0]);
  }

  Status Failed(const char* op, const std::string& what, int peer) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) {
        return absl::AbortedError(absl::StrFormat("%s on rank %d of %d: %s", op, options_.rank,
                                                  options_.world_size, why_));
      }
      finished_ = true;
      why_ = absl::StrFormat("%s failed", op);
    }
    // The communicator is finished: close its connections, so that peers still waiting on this
    // rank fail now rather than at their timeout.
    CloseConnections();
    const bool timed_out = absl::StrContains(what, "imed out") || absl::StrContains(what, "imeout");
    std::string at = PeerName(what, peer);
    if (!at.empty()) at = absl::StrCat(timed_out ? " waiting for " : " at ", at);
    const std::string msg = absl::StrFormat(
        "%s on rank %d of %d failed%s%s: %s (a peer died, hung, or called another operation; the "
        "communicator must be rebuilt)",
        op, options_.rank, options_.world_size,
        timed_out ? absl::StrFormat(" after the %d ms timeout", options_.timeout.count()) : "", at,
        what);
    return timed_out ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
  }

  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  CommOptions options_;
  // Per rank, the addresses Gloo's messages on this rank may print for its end of their
  // connection ("[127.0.0.1]:41234"): the one it listened on, and the one it connected from.
  std::vector<std::vector<std::string>> peer_addresses_;
  uint32_t next_tag_ = 0;
  Clock::time_point deadline_;
  std::vector<char> scratch_;
  std::mutex mu_;
  bool finished_ = false;
  bool in_call_ = false;
  std::vector<UnboundBuffer*> watched_;
  std::atomic<bool> aborted_{false};
  std::string why_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> ConnectGloo(std::shared_ptr<Store> store,
                                                    const CommOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank %d is not in a world of %d ranks", options.rank, options.world_size));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError("the communicator timeout must be positive");
  }
  // Gloo writes to its sockets without MSG_NOSIGNAL: a write to a dead peer would raise SIGPIPE
  // and kill this process instead of failing the operation with an error that names the peer.
  // Ignore it, unless the program installed a handler of its own.
  static std::once_flag sigpipe_once;
  std::call_once(sigpipe_once, [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
  const int w = options.world_size, r = options.rank;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  std::string mine;
  size_t address_bytes = 0;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    ctx = std::make_shared<gloo::rendezvous::Context>(r, w);
    ctx->setTimeout(options.timeout);
    GlooStore gs(store, options.timeout);
    ctx->connectFullMesh(gs, device);
    // This rank's end of each connection once connected, one line per rank.
    for (int p = 0; p < w; ++p) {
      if (p != r) {
        mine += ctx->getPair(p)->address().str();
        address_bytes = ctx->getPair(p)->address().bytes().size();
      }
      mine += "\n";
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrFormat(
        "rank %d of %d could not connect to its peers through the store: %s", r, w, e.what()));
  }
  // The addresses of every peer that this rank's errors may print, so that they can name the
  // rank. Gloo's messages print the address a pair was told to connect to, or the one it reads
  // off its socket; the first is the peer's listening address that Gloo published under the key
  // "<rank>" (one serialized address per peer, in rank order), the second each rank publishes
  // here once connected.
  const std::string key = "strata/pair_addresses/";
  RETURN_IF_ERROR(store->Set(key + std::to_string(r), mine));
  std::vector<std::vector<std::string>> addresses(w);
  for (int p = 0; p < w; ++p) {
    if (p == r) continue;
    auto listened = store->Get(std::to_string(p));
    const size_t at = static_cast<size_t>(r < p ? r : r - 1) * address_bytes;
    if (listened.ok() && address_bytes > 0 && listened->size() == (w - 1) * address_bytes) {
      try {
        const std::vector<char> bytes(listened->begin() + at,
                                      listened->begin() + at + address_bytes);
        addresses[p].push_back(gloo::transport::tcp::Address(bytes).str());
      } catch (const std::exception&) {
        // Not an address after all: this Gloo publishes something else; the other one will do.
      }
    }
    ASSIGN_OR_RETURN(std::string theirs, store->WaitGet(key + std::to_string(p), options.timeout));
    std::vector<std::string> lines = absl::StrSplit(theirs, '\n');
    if (lines.size() > static_cast<size_t>(r) && !lines[r].empty()) {
      addresses[p].push_back(lines[r]);
    }
  }
  return std::unique_ptr<Communicator>(
      new GlooCommunicator(std::move(ctx), options, std::move(addresses)));
}

}  // namespace strata::comm
