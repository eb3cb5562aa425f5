#include "train/worker_comms.h"

#include <chrono>
#include <future>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/comm/hierarchical.h"

namespace strata::train {
namespace {

using Connected = StatusOr<std::unique_ptr<comm::Communicator>>;

// Runs `connect` so that `superseded` can abandon it: Gloo's TCP connect to a peer that published
// its address and then died retries until the timeout, and nothing can interrupt it. It runs on a
// thread of its own, left behind (it ends at that timeout and drops what it made) when a newer
// generation makes it moot.
Connected ConnectUnlessSuperseded(std::function<Connected()> connect,
                                  const std::function<bool()>& superseded) {
  if (!superseded) return connect();
  auto task = std::make_shared<std::packaged_task<Connected()>>(std::move(connect));
  std::future<Connected> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  while (done.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
    if (superseded()) {
      return absl::AbortedError("a newer generation formed while this one's workers connected");
    }
  }
  return done.get();
}

}  // namespace

Status AllWorkersOk(comm::Communicator& world, Status mine, const std::string& others_failed) {
  double failed = mine.ok() ? 0.0 : 1.0;
  RETURN_IF_ERROR(world.AllReduce(&failed, 1));
  if (!mine.ok()) return mine;
  if (failed > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(others_failed, " (its log says why); this worker stops with it"));
  }
  return absl::OkStatus();
}

Status WorkerComms::Connect(std::shared_ptr<comm::Store> store, const comm::CommOptions& options,
                            const Layout& layout, const std::function<bool()>& superseded) {
  const int W = layout.world_size, ep = layout.group_size;
  auto connect = [&](const std::string& prefix, int rank, int size, bool two_level,
                     std::unique_ptr<comm::Communicator>* slot,
                     std::atomic<comm::Communicator*>* ptr) -> Status {
    comm::CommOptions o = options;
    o.rank = rank;
    o.world_size = size;
    Connected c = ConnectUnlessSuperseded(
        [prefixed = comm::MakePrefixStore(store, prefix), o, two_level,
         local = layout.local_size]() -> Connected {
          if (two_level) return comm::ConnectHierarchicalGloo(prefixed, o, local);
          return comm::ConnectGloo(prefixed, o);
        },
        superseded);
    if (!c.ok()) {
      return Status(c.status().code(),
                    absl::StrCat("connecting the ", prefix, " group",
                                 two_level ? " (two-level)" : "", ": ", c.status().message()));
    }
    Adopt(std::move(*c), slot, ptr);
    return absl::OkStatus();
  };
  // Every worker connects the groups in the same order: all workers, its expert-parallel group,
  // its expert replicas.
  RETURN_IF_ERROR(connect("world/", layout.rank, W, false, &world_, &world_ptr_));
  if (ep > 1) {
    const bool two_level = layout.local_size > 0 && layout.local_size < ep;
    RETURN_IF_ERROR(connect(absl::StrCat("ep/", layout.rank / ep, "/"), layout.rank % ep, ep,
                            two_level, &ep_, &ep_ptr_));
    if (W / ep > 1) {
      RETURN_IF_ERROR(connect(absl::StrCat("replicas/", layout.rank % ep, "/"), layout.rank / ep,
                              W / ep, false, &replicas_, &replicas_ptr_));
    }
  }
  return absl::OkStatus();
}

void WorkerComms::Adopt(std::unique_ptr<comm::Communicator> c,
                        std::unique_ptr<comm::Communicator>* slot,
                        std::atomic<comm::Communicator*>* ptr) {
  absl::MutexLock lock(&mu_);
  // A newer generation that formed while this one connected aborts what is connected already;
  // a communicator that connects after that abort is born aborted.
  if (aborted_why_) c->Abort(*aborted_why_);
  *slot = std::move(c);
  ptr->store(slot->get(), std::memory_order_release);
}

void WorkerComms::Abort(const std::string& why, int64_t newer_generation) {
  absl::MutexLock lock(&mu_);
  if (newer_generation <= generation_) return;  // late: that generation is this one
  aborted_why_ = why;
  // A committer waiting for the reports of a worker that is gone would wait past the re-form.
  if (checkpoint_abandoned_) *checkpoint_abandoned_ = true;
  for (comm::Communicator* c : {world_.get(), ep_.get(), replicas_.get()}) {
    if (c != nullptr) c->Abort(why);
  }
}

void WorkerComms::Reset(int64_t generation) {
  absl::MutexLock lock(&mu_);
  aborted_why_.reset();
  generation_ = generation;
  for (auto* p : {&world_ptr_, &ep_ptr_, &replicas_ptr_})
    p->store(nullptr, std::memory_order_release);
  replicas_.reset();
  ep_.reset();
  world_.reset();
}

std::shared_ptr<std::atomic<bool>> WorkerComms::CheckpointAbandonFlag() {
  absl::MutexLock lock(&mu_);
  // A newer generation may have aborted this one's collectives already.
  checkpoint_abandoned_ = std::make_shared<std::atomic<bool>>(aborted_why_.has_value());
  return checkpoint_abandoned_;
}

Status WorkerComms::Barrier() const {
  comm::Communicator* w = world();
  return w == nullptr ? absl::OkStatus() : w->Barrier();
}

Status WorkerComms::SumOverWorkers(double* data, size_t n) const {
  comm::Communicator* w = world();
  return w == nullptr ? absl::OkStatus() : w->AllReduce(data, n);
}

}  // namespace strata::train
