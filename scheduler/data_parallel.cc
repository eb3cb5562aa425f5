#include "scheduler/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/common/logging.h"

namespace strata::scheduler {

DataParallel::DataParallel(model::MoeTransformer& model, comm::Communicator* world,
                           comm::Communicator* expert_replicas, const DataParallelOptions& options)
    : world_(world), replicas_(expert_replicas), options_(options) {
  CHECK(world_ != nullptr);
  world_thread_ = std::make_unique<CommThread>("gradient all-reduce");
  if (replicas_ != nullptr && replicas_ != world_ && replicas_->world_size() > 1) {
    replica_thread_ = std::make_unique<CommThread>("expert gradient all-reduce");
  }
  scale_ = 1.0f / static_cast<float>(world_->world_size());
  Plan(model);
}

DataParallel::~DataParallel() {
  // Queued buckets refer to buffers and parameters: finish them before anything goes, and the
  // copies into and out of the pinned buckets (a failed step may leave some) before the buckets.
  replica_thread_.reset();
  world_thread_.reset();
  for (CopyStream* stream : {gather_.get(), world_scatter_.get(), replica_scatter_.get()}) {
    if (stream != nullptr) (void)stream->Synchronize();
  }
}

int DataParallel::parts() const { return world_->world_size(); }

void DataParallel::Plan(model::MoeTransformer& model) {
  const std::vector<model::Parameter*>& dense = model.DenseParameters();
  const std::set<model::Parameter*> is_dense(dense.begin(), dense.end());
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(options_.bucket_bytes / 4));
  const int blocks = model.config().n_layers();
  ready_.assign(blocks + 1, {});
  int open[2] = {-1, -1};      // open dense / expert bucket
  int last_block[2] = {0, 0};  // block of the last parameter put in it
  auto close = [&](int kind) {
    if (open[kind] >= 0) ready_[last_block[kind] + 1].push_back(open[kind]);
    open[kind] = -1;
  };
  for (int b = blocks - 1; b >= -1; --b) {
    for (model::Parameter* p : model.BlockParameters(b)) {
      // Experts in the tiered store have no bound gradient here: each has one copy, and the
      // store's optimizer applies the average's 1 / workers itself.
      if (!p->grad.defined()) continue;
      const int kind = is_dense.count(p) ? 0 : 1;
      const int64_t n = p->shape.numel();
      if (open[kind] >= 0 && buckets_[open[kind]].floats + n > cap) close(kind);
      if (open[kind] < 0) {
        open[kind] = static_cast<int>(buckets_.size());
        buckets_.push_back(Bucket{});
        buckets_.back().expert = kind == 1;
      }
      Bucket& bucket = buckets_[open[kind]];
      bucket.params.push_back(p);
      bucket.floats += n;
      last_block[kind] = b;
    }
  }
  close(0);
  close(1);
  if (!buckets_.empty()) device_ = buckets_.front().params.front()->grad.device();
  for (const Bucket& b : buckets_) {
    for (const model::Parameter* p : b.params) {
      CHECK(p->grad.device() == device_)
          << p->name << "'s gradient is on " << p->grad.device().ToString()
          << ", the model's others on " << device_.ToString();
    }
  }
  for (Bucket& b : buckets_) {
    const Shape shape{std::max<int64_t>(1, b.floats)};
    if (device_.is_cpu()) {
      b.buffer = Tensor::Empty(shape);
      continue;
    }
    auto pinned = Buffer::AllocatePinned(static_cast<size_t>(shape.numel()) * sizeof(float));
    if (!pinned.ok()) {
      status_ = pinned.status();
      return;
    }
    b.buffer = Tensor::FromBuffer(*std::move(pinned), shape);
    b.gathered = std::make_unique<CopyEvent>();
  }
  if (device_.is_cpu()) return;
  for (auto* stream : {&gather_, &world_scatter_, &replica_scatter_}) {
    auto made = CopyStream::Create(device_);
    if (!made.ok()) {
      status_ = made.status();
      return;
    }
    *stream = *std::move(made);
  }
}

Status DataParallel::GatherOnDevice(Bucket& b) {
  float* buf = b.buffer.f32();
  int64_t at = 0;
  RETURN_IF_ERROR(gather_->WaitForDeviceWork());
  for (model::Parameter* p : b.params) {
    const int64_t n = p->shape.numel();
    RETURN_IF_ERROR(gather_->CopyAsync(buf + at, p->grad.f32(), static_cast<size_t>(n) * 4));
    at += n;
  }
  return gather_->Record(b.gathered.get());
}

void DataParallel::Launch(Bucket& b) {
  // Gather on this thread (the gradients are final; on a GPU, enqueue their copies); reduce,
  // average and scatter on the communication thread, which owns them until FinishGradients.
  if (!status_.ok()) return;
  if (device_.is_cpu()) {
    float* buf = b.buffer.f32();
    int64_t at = 0;
    for (model::Parameter* p : b.params) {
      const int64_t n = p->shape.numel();
      std::memcpy(buf + at, p->grad.f32(), static_cast<size_t>(n) * sizeof(float));
      at += n;
    }
  } else if (Status s = GatherOnDevice(b); !s.ok()) {
    // This worker stops reducing: the peers are told now rather than at their timeout.
    status_ = s;
    (void)gather_->Synchronize();  // its copies enqueued so far
    const std::string why = absl::StrCat("a gradient bucket's copy failed: ", s.message());
    world_->Abort(why);
    if (replicas_ != nullptr) replicas_->Abort(why);
    return;
  }
  comm::Communicator* comm = b.expert ? replicas_ : world_;
  const bool on_replicas = b.expert && replica_thread_;
  CommThread* thread = on_replicas ? replica_thread_.get() : world_thread_.get();
  CopyStream* scatter = on_replicas ? replica_scatter_.get() : world_scatter_.get();
  if (b.expert && (replicas_ == nullptr || replicas_->world_size() == 1)) comm = nullptr;
  thread->Submit(
      [&b, comm, scatter, scale = scale_] {
        float* buf = b.buffer.f32();
        if (b.gathered) RETURN_IF_ERROR(b.gathered->Synchronize());
        if (comm != nullptr) RETURN_IF_ERROR(comm->AllReduce(buf, static_cast<size_t>(b.floats)));
        int64_t at = 0;
        for (model::Parameter* p : b.params) {
          const int64_t n = p->shape.numel();
          if (scatter == nullptr) {
            float* g = p->grad.f32();
            for (int64_t i = 0; i < n; ++i) g[i] = buf[at + i] * scale;
          } else {
            for (int64_t i = 0; i < n; ++i) buf[at + i] *= scale;
            Status s =
                scatter->CopyAsync(p->grad.f32(), buf + at, static_cast<size_t>(n) * sizeof(float));
            if (!s.ok()) {
              (void)scatter->Synchronize();  // the copies enqueued so far read the bucket
              return s;
            }
          }
          at += n;
        }
        return scatter == nullptr ? absl::OkStatus() : scatter->Synchronize();
      },
      b.expert ? "expert gradient bucket" : "gradient bucket");
}

void DataParallel::BlockReady(int block) {
  for (int i : ready_[block + 1]) Launch(buckets_[i]);
}

Status DataParallel::FinishGradients() {
  Status s = world_thread_->Drain();
  if (replica_thread_) {
    Status r = replica_thread_->Drain();
    if (s.ok()) s = r;
  }
  if (status_.ok() && !s.ok()) status_ = s;
  return status_;
}

void DataParallel::Sum(double* data, size_t n) {
  if (!status_.ok()) return;
  Status s = world_thread_->Run([&] { return world_->AllReduce(data, n); }, "sum over workers");
  if (!s.ok()) status_ = s;
}

Status DataParallel::status() const {
  Status s = status_;
  if (s.ok()) s = world_thread_->status();
  if (s.ok() && replica_thread_) s = replica_thread_->status();
  return s;
}

double DataParallel::TakeCommSeconds() {
  double t = world_thread_->TakeBusySeconds();
  if (replica_thread_) t += replica_thread_->TakeBusySeconds();
  return t;
}

}  // namespace strata::scheduler
