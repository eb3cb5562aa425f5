// The hierarchical communicator: two-stage all-to-all-v over an intra-node and an inter-node
// communicator, everything else on the world communicator.
#include "runtime/comm/hierarchical.h"

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace strata::comm {
namespace {

class HierarchicalCommunicator : public Communicator {
 public:
  HierarchicalCommunicator(std::unique_ptr<Communicator> world, std::unique_ptr<Communicator> intra,
                           std::unique_ptr<Communicator> inter, int local_size)
      : world_(std::move(world)),
        intra_(std::move(intra)),
        inter_(std::move(inter)),
        local_size_(local_size),
        nodes_(world_->world_size() / local_size),
        node_(world_->rank() / local_size),
        local_rank_(world_->rank() % local_size) {}

  int rank() const override { return world_->rank(); }
  int world_size() const override { return world_->world_size(); }
  std::string backend() const override {
    return absl::StrFormat("%s, hierarchical %d x %d", world_->backend(), nodes_, local_size_);
  }

  Status AllReduce(float* data, size_t n) override {
    return OnWorld("AllReduce", world_->AllReduce(data, n));
  }
  Status AllReduce(double* data, size_t n) override {
    return OnWorld("AllReduce", world_->AllReduce(data, n));
  }
  Status AllGather(const void* send, size_t bytes, void* recv) override {
    return OnWorld("AllGather", world_->AllGather(send, bytes, recv));
  }
  Status Broadcast(void* data, size_t bytes, int root) override {
    return OnWorld("Broadcast", world_->Broadcast(data, bytes, root));
  }
  Status Barrier() override { return OnWorld("Barrier", world_->Barrier()); }

  void Abort(const std::string& why) override {
    world_->Abort(why);
    intra_->Abort(why);
    inter_->Abort(why);
  }

  Status AllToAllV(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                   const std::vector<int64_t>& recv_counts, size_t element_bytes) override {
    const int w = world_size(), r = rank(), L = local_size_, N = nodes_;
    if (send_counts.size() != static_cast<size_t>(w) ||
        recv_counts.size() != static_cast<size_t>(w)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("AllToAllV on rank %d: %d send and %d receive counts for %d ranks", r,
                          send_counts.size(), recv_counts.size(), w));
    }
    for (int p = 0; p < w; ++p) {
      if (send_counts[p] < 0 || recv_counts[p] < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("AllToAllV on rank %d: negative count for rank %d", r, p));
      }
    }
    if (send_counts[r] != recv_counts[r]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "AllToAllV on rank %d: sends %d elements to itself but expects %d from itself", r,
          send_counts[r], recv_counts[r]));
    }
    // One level only: the flat exchange on the communicator that spans the world.
    if (N == 1) {
      return Staged("intra-node", *intra_,
                    intra_->AllToAllV(send, send_counts, recv, recv_counts, element_bytes));
    }
    if (L == 1) {
      return Staged("inter-node", *inter_,
                    inter_->AllToAllV(send, send_counts, recv, recv_counts, element_bytes));
    }
    const auto eb = static_cast<int64_t>(element_bytes);
    auto global = [L](int node, int local) { return node * L + local; };

    // Stage 0: to each local rank l, what this rank sends to (n', l) for every node n'; from it,
    // counts[l * N + n'] = what local rank l sends to (n', this rank's local rank).
    std::vector<int64_t> mine(static_cast<size_t>(L) * N), counts(static_cast<size_t>(L) * N);
    for (int l = 0; l < L; ++l) {
      for (int n = 0; n < N; ++n) mine[l * N + n] = send_counts[global(n, l)];
    }
    const std::vector<int64_t> fixed(L, N);
    RETURN_IF_ERROR(Staged("count exchange", *intra_,
                           intra_->AllToAllV(mine.data(), fixed, counts.data(), fixed)));

    // Stage 1, intra-node: the caller's rows, by destination (n', l'), regrouped by l' then n'.
    std::vector<int64_t> send_offset(w + 1, 0);
    for (int p = 0; p < w; ++p) send_offset[p + 1] = send_offset[p] + send_counts[p] * eb;
    std::vector<int64_t> stage1_send(L, 0), stage1_recv(L, 0);
    for (int l = 0; l < L; ++l) {
      for (int n = 0; n < N; ++n) {
        stage1_send[l] += send_counts[global(n, l)];
        stage1_recv[l] += counts[l * N + n];
      }
    }
    int64_t stage1_total = 0, stage1_in = 0;
    for (int l = 0; l < L; ++l) {
      stage1_total += stage1_send[l] * eb;
      stage1_in += stage1_recv[l] * eb;
    }
    regrouped_.resize(static_cast<size_t>(stage1_total) + 1);
    const char* in = static_cast<const char*>(send);
    int64_t o = 0;
    for (int l = 0; l < L; ++l) {
      for (int n = 0; n < N; ++n) {
        const int d = global(n, l);
        const int64_t bytes = send_counts[d] * eb;
        if (bytes > 0) std::memcpy(regrouped_.data() + o, in + send_offset[d], bytes);
        o += bytes;
      }
    }
    received_.resize(static_cast<size_t>(stage1_in) + 1);
    RETURN_IF_ERROR(Staged("intra-node", *intra_,
                           intra_->AllToAllV(regrouped_.data(), stage1_send, received_.data(),
                                             stage1_recv, element_bytes)));

    // Stage 2, inter-node: what arrived, by source local rank l then destination node n',
    // regrouped by n' then l; it lands in the caller's buffer in source-rank order (n, l).
    std::vector<int64_t> stage2_send(N, 0), stage2_recv(N, 0);
    for (int n = 0; n < N; ++n) {
      for (int l = 0; l < L; ++l) {
        stage2_send[n] += counts[l * N + n];
        stage2_recv[n] += recv_counts[global(n, l)];
      }
    }
    std::vector<int64_t> received_offset(static_cast<size_t>(L) * N + 1, 0);
    for (int i = 0; i < L * N; ++i) received_offset[i + 1] = received_offset[i] + counts[i] * eb;
    regrouped_.resize(static_cast<size_t>(stage1_in) + 1);
    o = 0;
    for (int n = 0; n < N; ++n) {
      for (int l = 0; l < L; ++l) {
        const int64_t bytes = counts[l * N + n] * eb;
        if (bytes > 0) {
          std::memcpy(regrouped_.data() + o, received_.data() + received_offset[l * N + n], bytes);
        }
        o += bytes;
      }
    }
    return Staged(
        "inter-node", *inter_,
        inter_->AllToAllV(regrouped_.data(), stage2_send, recv, stage2_recv, element_bytes));
  }

 private:
  // The world rank of rank k of `c` (one of the three communicators).
  int WorldRank(const Communicator& c, int k) const {
    if (&c == intra_.get()) return node_ * local_size_ + k;
    if (&c == inter_.get()) return k * local_size_ + local_rank_;
    return k;
  }

  // Finishes the communicators (but `spared`) after a failure, so that the wrapper fails as a
  // whole and the peers waiting on this rank fail now, not at their timeout.
  void AbortAllBut(const Communicator* spared, const std::string& why) {
    for (Communicator* c : {world_.get(), intra_.get(), inter_.get()}) {
      if (c != spared) c->Abort(absl::StrFormat("world rank %d: %s", rank(), why));
    }
  }

  Status OnWorld(const char* op, Status s) {
    if (!s.ok() && !absl::IsInvalidArgument(s)) {
      AbortAllBut(world_.get(), absl::StrFormat("%s failed on the world communicator", op));
    }
    return s;
  }

  // The status of a stage of AllToAllV, with the stage, this rank's place and the world ranks
  // of the peers the sub-communicator's message names ("peer rank 1" of the intra-node stage of
  // node 2 with 4 local ranks is world rank 9). A failed stage leaves the exchange half done on
  // some ranks (even an INVALID_ARGUMENT: counts that disagree between ranks), so it finishes
  // all three communicators.
  Status Staged(const char* stage, Communicator& c, Status s) {
    if (s.ok()) return s;
    AbortAllBut(nullptr,
                absl::StrFormat("the hierarchical AllToAllV failed in its %s stage", stage));
    std::string inner(s.message());
    const std::string key = "peer rank ";
    for (size_t p = inner.find(key); p != std::string::npos; p = inner.find(key, p + 1)) {
      size_t e = p + key.size();
      int k = 0;
      while (e < inner.size() && inner[e] >= '0' && inner[e] <= '9')
        k = 10 * k + (inner[e++] - '0');
      if (e == p + key.size()) continue;
      const std::string world = absl::StrFormat(" (world rank %d)", WorldRank(c, k));
      inner.insert(e, world);
      p = e + world.size();
    }
    return Status(s.code(), absl::StrFormat("hierarchical AllToAllV on rank %d of %d (node %d of "
                                            "%d, local rank %d of %d), %s stage: %s",
                                            rank(), world_size(), node_, nodes_, local_rank_,
                                            local_size_, stage, inner));
  }

  std::unique_ptr<Communicator> world_, intra_, inter_;
  const int local_size_, nodes_, node_, local_rank_;
  // Stage buffers, kept between calls (one call at a time).
  std::vector<char> regrouped_, received_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> MakeHierarchical(std::unique_ptr<Communicator> world,
                                                         std::unique_ptr<Communicator> intra_node,
                                                         std::unique_ptr<Communicator> inter_node,
                                                         int local_size) {
  if (!world || !intra_node || !inter_node) {
    return absl::InvalidArgumentError("MakeHierarchical needs three communicators");
  }
  const int w = world->world_size(), r = world->rank();
  if (local_size < 1 || w % local_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a world of %d ranks cannot be split into nodes of %d local ranks", w, local_size));
  }
  const int nodes = w / local_size, node = r / local_size, local = r % local_size;
  if (intra_node->world_size() != local_size || intra_node->rank() != local) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d of %d: the intra-node communicator is rank %d of %d, expected local rank %d of "
        "%d",
        r, w, intra_node->rank(), intra_node->world_size(), local, local_size));
  }
  if (inter_node->world_size() != nodes || inter_node->rank() != node) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d of %d: the inter-node communicator is rank %d of %d, expected node %d of %d", r, w,
        inter_node->rank(), inter_node->world_size(), node, nodes));
  }
  return std::unique_ptr<Communicator>(new HierarchicalCommunicator(
      std::move(world), std::move(intra_node), std::move(inter_node), local_size));
}

StatusOr<std::unique_ptr<Communicator>> ConnectHierarchicalGloo(std::shared_ptr<Store> store,
                                                                const CommOptions& options,
                                                                int local_size) {
  if (local_size < 1 || options.world_size < 1 || options.world_size % local_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a world of %d ranks cannot be split into nodes of %d local ranks",
                        options.world_size, local_size));
  }
  const int node = options.rank / local_size, local = options.rank % local_size;
  ASSIGN_OR_RETURN(auto world, ConnectGloo(MakePrefixStore(store, "world/"), options));
  CommOptions intra = options;
  intra.rank = local;
  intra.world_size = local_size;
  ASSIGN_OR_RETURN(auto intra_node,
                   ConnectGloo(MakePrefixStore(store, absl::StrCat("intra/", node, "/")), intra));
  CommOptions inter = options;
  inter.rank = node;
  inter.world_size = options.world_size / local_size;
  ASSIGN_OR_RETURN(auto inter_node,
                   ConnectGloo(MakePrefixStore(store, absl::StrCat("inter/", local, "/")), inter));
  return MakeHierarchical(std::move(world), std::move(intra_node), std::move(inter_node),
                          local_size);
}

}  // namespace strata::comm
