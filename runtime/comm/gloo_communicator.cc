// Communicator over Gloo's TCP transport.
#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "runtime/comm/communicator.h"

namespace strata::comm {
namespace {

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

// Every operation is built from Gloo's all-to-all-v, all-gather-v and broadcast on buffers this
// class creates itself, because those operations wait only on their input and output buffers:
// Abort can then interrupt each wait (Gloo's own all-reduce and barrier wait on internal buffers
// that nothing outside can wake; closing the connections does not wake them either).
class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> ctx, const CommOptions& o)
      : ctx_(std::move(ctx)), options_(o) {}
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
    return Call("AllToAllV", [&](uint32_t tag) {
      ExchangeBytes(const_cast<void*>(send), send_bytes, recv, recv_bytes, tag);
    });
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
    try {
      ctx_->closeConnections();
    } catch (const std::exception&) {
      // Already closed.
    }
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!in_call_) break;
        for (gloo::transport::UnboundBuffer* b : watched_) {
          b->abortWaitRecv();
          b->abortWaitSend();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  std::unique_ptr<gloo::transport::UnboundBuffer> Buffer(void* p, size_t bytes) {
    static char empty[1];
    return ctx_->createUnboundBuffer(p != nullptr ? p : empty, bytes);
  }

  // Makes buffers visible to Abort for as long as it lives. Declared after the options that own
  // the buffers, so it is destroyed (and the buffers unlisted) before they are.
  class Watch {
   public:
    Watch(GlooCommunicator* c, std::vector<gloo::transport::UnboundBuffer*> bufs) : c_(c) {
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

  void ExchangeBytes(void* send, const std::vector<int64_t>& send_bytes, void* recv,
                     const std::vector<int64_t>& recv_bytes, uint32_t tag) {
    int64_t in_total = 0, out_total = 0;
    for (int64_t b : send_bytes) in_total += b;
    for (int64_t b : recv_bytes) out_total += b;
    gloo::AlltoallvOptions opts(ctx_);
    auto in = Buffer(send, static_cast<size_t>(in_total));
    auto out = Buffer(recv, static_cast<size_t>(out_total));
    Watch watch(this, {in.get(), out.get()});
    opts.setInput<char>(std::move(in), send_bytes);
    opts.setOutput<char>(std::move(out), recv_bytes);
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    gloo::alltoallv(opts);
    CheckNotAborted();
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

  // Reduce-scatter with one all-to-all-v (rank j receives everybody's chunk j and sums it in rank
  // order), then all-gather-v of the reduced chunks. Moves 2 (W-1)/W of the data per rank, like a
  // ring, and every rank adds the same numbers in the same order: the result is bitwise the same
  // on every rank and does not depend on a ring position.
  template <typename T>
  Status Reduce(T* data, size_t n) {
    return Call("AllReduce", [&](uint32_t tag) {
      const int w = options_.world_size, r = options_.rank;
      if (n == 0) return;
      auto begin = [&](int j) { return n * static_cast<size_t>(j) / static_cast<size_t>(w); };
      const size_t mine = begin(r + 1) - begin(r);
      std::vector<int64_t> send_bytes(w), recv_bytes(w, static_cast<int64_t>(mine * sizeof(T)));
      for (int j = 0; j < w; ++j) {
        send_bytes[j] = static_cast<int64_t>((begin(j + 1) - begin(j)) * sizeof(T));
      }
      scratch_.resize((static_cast<size_t>(w) + 1) * mine * sizeof(T) + sizeof(T));
      T* parts = reinterpret_cast<T*>(scratch_.data());
      T* sum = parts + static_cast<size_t>(w) * mine;
      ExchangeBytes(data, send_bytes, parts, recv_bytes, tag);
      for (size_t i = 0; i < mine; ++i) sum[i] = parts[i];
      for (int k = 1; k < w; ++k) {
        const T* p = parts + static_cast<size_t>(k) * mine;
        for (size_t i = 0; i < mine; ++i) sum[i] += p[i];
      }
      std::vector<size_t> per_rank(w);
      for (int j = 0; j < w; ++j) per_rank[j] = (begin(j + 1) - begin(j)) * sizeof(T);
      GatherBytes(sum, mine * sizeof(T), data, std::move(per_rank), tag + kTagStride / 2);
    });
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
    const uint32_t tag = next_tag_;
    next_tag_ += kTagStride;
    Status result;
    try {
      body(tag);
    } catch (const std::exception& e) {
      result = Failed(op, e.what());
    }
    std::lock_guard<std::mutex> lock(mu_);
    in_call_ = false;
    return result;
  }

  Status Failed(const char* op, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) {
      return absl::AbortedError(
          absl::StrFormat("%s on rank %d of %d: %s", op, options_.rank, options_.world_size, why_));
    }
    finished_ = true;
    why_ = absl::StrFormat("%s failed", op);
    const bool timed_out = absl::StrContains(what, "imed out") || absl::StrContains(what, "imeout");
    const std::string msg = absl::StrFormat(
        "%s on rank %d of %d failed%s: %s (a peer died, hung, or called another operation; the "
        "communicator must be rebuilt)",
        op, options_.rank, options_.world_size,
        timed_out ? absl::StrFormat(" after the %d ms timeout", options_.timeout.count()) : "",
        what);
    return timed_out ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
  }

  // Tags of one call: the call's own and, for AllReduce, a second for its gather.
  static constexpr uint32_t kTagStride = 2;

  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  CommOptions options_;
  uint32_t next_tag_ = 0;
  std::vector<char> scratch_;
  std::mutex mu_;
  bool finished_ = false;
  bool in_call_ = false;
  std::vector<gloo::transport::UnboundBuffer*> watched_;
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
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
    ctx->setTimeout(options.timeout);
    GlooStore gs(std::move(store), options.timeout);
    ctx->connectFullMesh(gs, device);
    return std::unique_ptr<Communicator>(new GlooCommunicator(std::move(ctx), options));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrFormat("rank %d of %d could not connect to its peers through the store: %s",
                        options.rank, options.world_size, e.what()));
  }
}

}  // namespace strata::comm
