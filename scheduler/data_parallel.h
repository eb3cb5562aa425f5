// DataParallel: what keeps workers that split a step's batch in step — fused, overlapped gradient
// all-reduce, and the small sums the model and the trainer need (gate statistics, the loss, the
// gradient norm).
//
// Gradients travel in buckets of ParallelConfig.bucket_bytes (default 25 MiB), filled in reverse
// block order — the order backward finishes them. When MoeTransformer::Backward reports a block
// done (GradientReadyListener), every bucket whose last parameter belongs to that block is copied
// into its buffer and all-reduced on a communication thread while backward goes on; the thread
// also writes the averaged result back. FinishGradients waits for the last bucket.
//
// Two groups: dense parameters are averaged over all workers; an expert's parameters over the
// workers holding a copy of that expert (one per expert-parallel group), and — because each copy
// already summed the rows that every worker of its group sent it — divided by the total number of
// workers too. Each worker's loss is the mean over its own tokens, so this average is the
// gradient of the mean loss over the global batch.
//
// A model on a GPU: the buckets are page-locked host memory and the communicators host ones
// (Gloo): each bucket's gradients are copied to it on a copy stream after the GPU's work so far
// (the backward kernels that wrote them), the communication thread waits for those copies,
// all-reduces and scales on the host, and copies the averages back on its own stream before the
// bucket counts as done. The same arithmetic as on the CPU, so a GPU worker's averaged gradients
// are bitwise the all-reduce's.
//
// Ownership and threads: DataParallel borrows the model (it keeps pointers to its parameters) and
// both communicators; all must outlive it. Its members are called from the thread running the
// model (the trainer's), one at a time: BlockReady from Backward, Sum from the gate's forward and
// the trainer's gradient sync (it blocks until the sum is done), FinishGradients, status and
// TakeCommSeconds after backward. From BlockReady(b) until FinishGradients returns, the
// communication threads read and write the gradients of the buckets block b launched, and use the
// communicators: nothing else may touch those gradients, and the caller uses a communicator
// directly only once FinishGradients has returned. The destructor waits for the buckets in
// flight.
#pragma once

#include <memory>
#include <vector>

#include "runtime/comm/communicator.h"
#include "runtime/model/parallel.h"
#include "runtime/model/transformer.h"
#include "scheduler/comm_thread.h"

namespace strata::scheduler {

struct DataParallelOptions {
  uint64_t bucket_bytes = 25ull << 20;
};

class DataParallel : public model::GradientReadyListener, public model::BatchReducer {
 public:
  // `world` connects all workers. `expert_replicas` connects the workers that hold the same
  // experts (null when each expert has one copy). Neither is owned.
  DataParallel(model::MoeTransformer& model, comm::Communicator* world,
               comm::Communicator* expert_replicas, const DataParallelOptions& options);
  ~DataParallel() override;

  // BatchReducer: sums over all workers, on the world communication thread.
  int parts() const override;
  void Sum(double* data, size_t n) override;
  // GradientReadyListener.
  void BlockReady(int block) override;

  // Waits until every bucket of this step is reduced and written back.
  [[nodiscard]] Status FinishGradients();
  // The first communication error (OK while none).
  [[nodiscard]] Status status() const;
  // Seconds the communication threads spent in collectives since the last call.
  double TakeCommSeconds();
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Records each all-reduce as a span on the communication threads' tracks.
  void set_tracer(Tracer* tracer) {
    world_thread_->set_tracer(tracer);
    if (replica_thread_) replica_thread_->set_tracer(tracer);
  }

 private:
  struct Bucket {
    std::vector<model::Parameter*> params;
    int64_t floats = 0;
    Tensor buffer;                        // host memory (page-locked for a model on a GPU)
    bool expert = false;                  // travels among expert replicas
    std::unique_ptr<CopyEvent> gathered;  // a model on a GPU: its gradients are in `buffer`
  };
  void Plan(model::MoeTransformer& model);
  void Launch(Bucket& b);
  // A model on a GPU: enqueues the copies of b's gradients into its buffer and marks them.
  [[nodiscard]] Status GatherOnDevice(Bucket& b);

  comm::Communicator* world_;
  comm::Communicator* replicas_;
  DataParallelOptions options_;
  std::unique_ptr<CommThread> world_thread_, replica_thread_;
  // Where the gradients live; for a GPU, the copy streams: gradients to the buckets (the training
  // thread's) and averages back (one per communication thread).
  Device device_;
  std::unique_ptr<CopyStream> gather_, world_scatter_, replica_scatter_;
  std::vector<Bucket> buckets_;
  // Buckets to launch when block b is done: ready_[b + 1] (block -1 at index 0).
  std::vector<std::vector<int>> ready_;
  float scale_ = 1.0f;
  Status status_;
};

}  // namespace strata::scheduler
