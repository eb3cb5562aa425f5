// ExpertParallel: the ExpertExchange of an expert-parallel group, over a Communicator.
//
// The group's P workers split every MoE layer's experts by an ExpertPlacement (contiguous ranges,
// so rows that the local plan put in expert order are already grouped by destination). For one
// layer's forward:
//   1. counts: an all-to-all-v of the per-expert row counts (each worker learns how many rows of
//      each of its experts every source sends);
//   2. dispatch, in K chunks: chunk c carries rows [n c / K, n (c + 1) / K) of every (source,
//      expert) block of n rows. All K all-to-all-v's are queued on the communication thread at
//      once; the experts run on chunk c (rows regrouped expert-major, so each local expert runs
//      once per chunk on contiguous rows) as soon as its rows arrived, while later chunks are still
//      in flight;
//   3. return: chunk c's outputs go back as soon as they are computed (overlapping the compute of
//      chunk c + 1), and are put back in the caller's row order.
// Backward repeats 2-3 with the output gradients, reusing the rows and saved activations kept
// from the forward of the same layer. With K = 1 nothing overlaps (the baseline).
//
// A model on a GPU: the rows travel through page-locked host buffers (the all-to-alls are the
// host communicator's), copied to and from the device on the exchange's copy stream after the
// GPU's work so far; the experts compute on device buffers. The CPU path is memcpy.
//
// Every worker issues the same operations in the same order (counts, K dispatches, then the K
// returns as their compute finishes), so the order on the communication thread matches across
// ranks. Buffers grow to the largest step seen and are reused; the rows and saved activations of
// every MoE layer are kept from forward to backward.
//
// Of the layer it sees only the LocalExperts it is lent for each call (parallel.h). Forward,
// Backward, status, TakeTimes and set_tracer are called from one thread (the one running the
// model); the exchange's own communication thread touches only its staging buffers. The exchange
// borrows its communicator, which must outlive it; nothing else may use it while the exchange
// lives (Abort excepted, see communicator.h). The destructor waits for the all-to-alls in flight.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "kernels/ops.h"
#include "runtime/comm/communicator.h"
#include "runtime/model/parallel.h"
#include "scheduler/comm_thread.h"
#include "scheduler/placement.h"

namespace strata::scheduler {

struct ExpertParallelOptions {
  int chunks = 2;  // K above; 1 = no overlap
};

// Time of the last passes, for the step's metrics and the benchmark.
struct ExchangeTimes {
  double compute_seconds = 0;  // experts running on received rows
  double wait_seconds = 0;     // the compute thread waiting for communication (exposed)
  double comm_seconds = 0;     // the communication thread busy (all-to-all-v's)
};

class ExpertParallel : public model::ExpertExchange {
 public:
  // `comm` connects the group's workers (rank = index in the group); `placement` has one entry
  // per group rank. The exchange does not own comm.
  ExpertParallel(comm::Communicator* comm, ExpertPlacement placement,
                 const ExpertParallelOptions& options);
  ~ExpertParallel() override;

  // From the thread running the layer's pass (parallel.h); `experts` is borrowed for the call.
  void Forward(ops::Context& ctx, int layer, model::LocalExperts& experts, const Tensor& xp,
               const std::vector<int64_t>& counts, const Tensor& yp) override;
  void Backward(ops::Context& ctx, int layer, model::LocalExperts& experts, const Tensor& dyp,
                const Tensor& dxp) override;

  // The first communication error (OK while none); check after each pass.
  [[nodiscard]] Status status() const;
  // Times since the last call.
  ExchangeTimes TakeTimes();
  const ExpertPlacement& placement() const { return placement_; }
  // Records each all-to-all-v as a span on the communication thread's track.
  void set_tracer(Tracer* tracer) { thread_->set_tracer(tracer); }

 private:
  struct LayerState;
  // Moves `send` (caller order, counts of the layer) through the experts: `run(c, walk)` puts
  // chunk c's received rows through the experts and into the return buffer (RunChunk) and returns
  // its status; the result lands in `out` (caller order).
  template <typename Run>
  void Exchange(LayerState& L, int64_t C, const std::string& tag, const Tensor& send,
                const Tensor& out, Run&& run);
  // Runs chunk c of a pass: its received rows into `in` (expert-major), `compute`, and `out`'s
  // rows into the return buffer.
  template <typename Walk>
  [[nodiscard]] Status RunChunk(int c, int64_t C, Walk&& walk_received, const Tensor& in,
                                const Tensor& out, const std::function<void()>& compute);
  // Row copies between the caller's or the experts' tensors and the host staging buffers: memcpy
  // for a model on the CPU; for one on a GPU, copies on copies_ that start after the GPU's work so
  // far (BeginCopies) and are complete when EndCopies returns. BeginCopies(device) also makes the
  // copy stream when the model's device changes.
  [[nodiscard]] Status BeginCopies(Device device);
  [[nodiscard]] Status CopyRows(float* dst, const float* src, int64_t rows, int64_t C);
  [[nodiscard]] Status EndCopies();
  void Fail(const Status& s);

  comm::Communicator* comm_;
  ExpertPlacement placement_;
  ExpertParallelOptions options_;
  int rank_, P_;
  int64_t first_, local_;
  std::unique_ptr<CommThread> thread_;
  std::map<int, std::unique_ptr<LayerState>> layers_;
  // Shared staging (grow-only): caller-order chunks out and back, received rows and the rows to
  // return in source order, and the expert-major input/output of the current pass.
  // On a GPU the first four are page-locked host memory and the last two device memory.
  Tensor send_, back_, recv_, ret_, work_out_, work_dx_;
  Device device_;                       // where the model's rows live
  std::unique_ptr<CopyStream> copies_;  // for a model on a GPU
  Status status_;
  ExchangeTimes times_;
};

}  // namespace strata::scheduler
