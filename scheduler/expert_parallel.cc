#include "scheduler/expert_parallel.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/clock.h"
#include "core/common/logging.h"

namespace strata::scheduler {

namespace {

// A flat float tensor of at least n elements on `device`, reallocated (by half again) only when
// it must grow. `pinned`: page-locked host memory (the staging buffers of a model on a GPU).
Status Reserve(Tensor& t, int64_t n, Device device = Device::Cpu(), bool pinned = false) {
  n = std::max<int64_t>(n, 1);
  if (t.defined() && t.numel() >= n) return absl::OkStatus();
  const int64_t have = t.defined() ? t.numel() : 0;
  const Shape shape{std::max(n, have + have / 2)};
  if (!pinned) {
    t = Tensor::Empty(shape, DType::kF32, device);
    return absl::OkStatus();
  }
  t = Tensor();  // the old buffer goes before the new one is made
  ASSIGN_OR_RETURN(std::shared_ptr<Buffer> buffer,
                   Buffer::AllocatePinned(static_cast<size_t>(shape.numel()) * sizeof(float)));
  t = Tensor::FromBuffer(std::move(buffer), shape);
  return absl::OkStatus();
}

}  // namespace

struct ExpertParallel::LayerState {
  int64_t C = 0, stride = 0;
  std::vector<int64_t> counts;             // [E] rows this worker sends to each expert
  std::vector<int64_t> offsets;            // [E + 1] their first row in the caller's order
  std::vector<int64_t> recv_counts;        // [P * L] rows source s sends to local expert j
  std::vector<int64_t> send_rows;          // [K * P] rows to worker d in chunk c
  std::vector<int64_t> recv_rows;          // [K * P] rows from worker s in chunk c
  std::vector<int64_t> send_base;          // [K + 1] first row of chunk c, caller-side staging
  std::vector<int64_t> recv_base;          // [K + 1] first row of chunk c, received rows
  std::vector<std::vector<int64_t>> work;  // [K][L + 1] rows of local expert j in chunk c
  int64_t rows_in = 0;                     // rows received in all
  Tensor x, saved;                         // received inputs (expert-major) and activations
};

Status ExpertParallel::BeginCopies(Device device) {
  if (device_ == device) return copies_ ? copies_->WaitForDeviceWork() : absl::OkStatus();
  // A model on another device: buffers of the old one are not reused (nor pinned or not).
  device_ = device;
  copies_.reset();
  send_ = back_ = recv_ = ret_ = work_out_ = work_dx_ = Tensor();
  for (auto& [layer, state] : layers_) state->x = state->saved = Tensor();
  if (device.is_cpu()) return absl::OkStatus();
  ASSIGN_OR_RETURN(copies_, CopyStream::Create(device));
  return copies_->WaitForDeviceWork();
}

Status ExpertParallel::CopyRows(float* dst, const float* src, int64_t rows, int64_t C) {
  const size_t bytes = static_cast<size_t>(rows * C) * sizeof(float);
  if (rows <= 0) return absl::OkStatus();
  if (!copies_) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  return copies_->CopyAsync(dst, src, bytes);
}

Status ExpertParallel::EndCopies() { return copies_ ? copies_->Synchronize() : absl::OkStatus(); }

ExpertParallel::ExpertParallel(comm::Communicator* comm, ExpertPlacement placement,
                               const ExpertParallelOptions& options)
    : comm_(comm),
      placement_(std::move(placement)),
      options_(options),
      rank_(comm->rank()),
      P_(comm->world_size()) {
  CHECK_EQ(placement_.workers(), P_);
  CHECK_GE(options_.chunks, 1);
  first_ = placement_.first(rank_);
  local_ = placement_.count(rank_);
  thread_ = std::make_unique<CommThread>("expert all-to-all");
}

ExpertParallel::~ExpertParallel() {
  thread_.reset();  // queued all-to-alls refer to the staging buffers: finish them first
}

Status ExpertParallel::status() const { return status_; }

void ExpertParallel::Fail(const Status& s) {
  if (s.ok()) return;
  // No copy left in flight into or out of buffers the caller may free or reuse on return.
  if (copies_) (void)copies_->Synchronize();
  if (status_.ok()) status_ = s;
}

ExchangeTimes ExpertParallel::TakeTimes() {
  ExchangeTimes t = times_;
  t.comm_seconds = thread_->TakeBusySeconds();
  times_ = ExchangeTimes{};
  return t;
}

template <typename Run>
void ExpertParallel::Exchange(LayerState& L, int64_t C, const std::string& tag, const Tensor& send,
                              const Tensor& out, Run&& run) {
  const int K = options_.chunks;
  const int64_t E = placement_.num_experts();
  const bool pinned = !device_.is_cpu();
  for (auto [t, n] : {std::pair{&send_, L.send_base[K] * C}, std::pair{&back_, L.send_base[K] * C},
                      std::pair{&recv_, L.rows_in * C}, std::pair{&ret_, L.rows_in * C}}) {
    if (Status s = Reserve(*t, n, Device::Cpu(), pinned); !s.ok()) return Fail(s);
  }
  // Caller order -> chunk-major staging: chunk c, then destination, then expert.
  auto walk_caller = [&](int c, auto&& fn) {
    int64_t at = L.send_base[c];
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = L.counts[e], lo = n * c / K, hi = n * (c + 1) / K;
      fn(L.offsets[e] + lo, at, hi - lo);
      at += hi - lo;
    }
  };
  const float* src = send.f32();
  Status copied = BeginCopies(device_);
  for (int c = 0; c < K; ++c) {
    walk_caller(c, [&](int64_t row, int64_t at, int64_t n) {
      if (copied.ok()) copied = CopyRows(send_.f32() + at * C, src + row * C, n, C);
    });
  }
  if (copied.ok()) copied = EndCopies();
  if (!copied.ok()) return Fail(copied);
  auto counts_of = [&](const std::vector<int64_t>& rows, int c) {
    std::vector<int64_t> v(P_);
    for (int p = 0; p < P_; ++p) v[p] = rows[c * P_ + p] * C;
    return v;
  };
  std::vector<CommThread::Ticket> out_tickets(K), back_tickets(K);
  for (int c = 0; c < K; ++c) {
    out_tickets[c] = thread_->Submit(
        [this, &L, c, C, s = counts_of(L.send_rows, c), r = counts_of(L.recv_rows, c)] {
          return comm_->AllToAllV(send_.f32() + L.send_base[c] * C, s,
                                  recv_.f32() + L.recv_base[c] * C, r, sizeof(float));
        },
        absl::StrFormat("%s chunk %d out", tag, c));
  }
  // Received rows (chunk c: source, then local expert) <-> expert-major work rows.
  auto walk_received = [&](int c, auto&& fn) {
    std::vector<int64_t> pos(L.work[c].begin(), L.work[c].end() - 1);
    int64_t at = L.recv_base[c];
    for (int s = 0; s < P_; ++s) {
      for (int64_t j = 0; j < local_; ++j) {
        const int64_t n = L.recv_counts[s * local_ + j], lo = n * c / K, hi = n * (c + 1) / K;
        fn(at, pos[j], hi - lo);
        at += hi - lo;
        pos[j] += hi - lo;
      }
    }
  };
  for (int c = 0; c < K; ++c) {
    double t0 = NowSeconds();
    Status s = thread_->Wait(out_tickets[c]);
    times_.wait_seconds += NowSeconds() - t0;
    if (!s.ok()) {
      Fail(s);
      break;
    }
    t0 = NowSeconds();
    s = run(c, walk_received);
    times_.compute_seconds += NowSeconds() - t0;
    if (!s.ok()) {
      // A local failure (a copy): the peers waiting for this chunk's return are told now.
      Fail(s);
      comm_->Abort(absl::StrCat("the expert exchange's copies failed: ", s.message()));
      break;
    }
    back_tickets[c] = thread_->Submit(
        [this, &L, c, C, s = counts_of(L.recv_rows, c), r = counts_of(L.send_rows, c)] {
          return comm_->AllToAllV(ret_.f32() + L.recv_base[c] * C, s,
                                  back_.f32() + L.send_base[c] * C, r, sizeof(float));
        },
        absl::StrFormat("%s chunk %d back", tag, c));
  }
  const double t0 = NowSeconds();
  Status s = thread_->Drain();
  times_.wait_seconds += NowSeconds() - t0;
  if (!s.ok()) {
    Fail(s);
    return;
  }
  float* dst = out.f32();
  copied = BeginCopies(device_);
  for (int c = 0; c < K; ++c) {
    walk_caller(c, [&](int64_t row, int64_t at, int64_t n) {
      if (copied.ok()) copied = CopyRows(dst + row * C, back_.f32() + at * C, n, C);
    });
  }
  if (copied.ok()) copied = EndCopies();
  Fail(copied);
}

template <typename Walk>
Status ExpertParallel::RunChunk(int c, int64_t C, Walk&& walk_received, const Tensor& in,
                                const Tensor& out, const std::function<void()>& compute) {
  RETURN_IF_ERROR(BeginCopies(device_));
  Status s;
  walk_received(c, [&](int64_t at, int64_t row, int64_t n) {
    if (s.ok()) s = CopyRows(in.f32() + row * C, recv_.f32() + at * C, n, C);
  });
  RETURN_IF_ERROR(s);
  RETURN_IF_ERROR(EndCopies());
  compute();
  RETURN_IF_ERROR(BeginCopies(device_));  // after the experts' kernels
  walk_received(c, [&](int64_t at, int64_t row, int64_t n) {
    if (s.ok()) s = CopyRows(ret_.f32() + at * C, out.f32() + row * C, n, C);
  });
  RETURN_IF_ERROR(s);
  return EndCopies();
}

void ExpertParallel::Forward(ops::Context& ctx, int layer, model::LocalExperts& experts,
                             const Tensor& xp, const std::vector<int64_t>& counts,
                             const Tensor& yp) {
  const int K = options_.chunks;
  const int64_t E = placement_.num_experts(), C = experts.d_model();
  CHECK_EQ(static_cast<int64_t>(counts.size()), E);
  CHECK(experts.first() == first_ && experts.count() == local_)
      << "layer " << layer << " holds experts [" << experts.first() << ", +" << experts.count()
      << "), the placement gives this worker " << placement_.ToString();
  auto& slot = layers_[layer];
  if (!slot) slot = std::make_unique<LayerState>();
  LayerState& L = *slot;
  L.C = C;
  L.stride = experts.saved_stride();
  L.counts = counts;
  L.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) L.offsets[e + 1] = L.offsets[e] + counts[e];
  if (!status_.ok()) return;

  // 1. How many rows of each local expert every worker sends.
  std::vector<int64_t> send_counts(P_), recv_counts(P_, local_);
  for (int p = 0; p < P_; ++p) send_counts[p] = placement_.count(p);
  L.recv_counts.assign(P_ * local_, 0);
  const double t0 = NowSeconds();
  Status s = thread_->Run(
      [&] {
        return comm_->AllToAllV(counts.data(), send_counts, L.recv_counts.data(), recv_counts);
      },
      absl::StrFormat("fwd L%d counts", layer));
  times_.wait_seconds += NowSeconds() - t0;
  if (!s.ok()) return Fail(s);
  for (int64_t v : L.recv_counts) {
    if (v < 0 || v > (int64_t{1} << 40)) {
      return Fail(absl::DataLossError(absl::StrFormat(
          "layer %d: a peer announced %d rows for one of this worker's experts", layer, v)));
    }
  }

  // 2. The chunk layout, on both sides.
  L.send_rows.assign(K * P_, 0);
  L.recv_rows.assign(K * P_, 0);
  L.send_base.assign(K + 1, 0);
  L.recv_base.assign(K + 1, 0);
  L.work.assign(K, std::vector<int64_t>(local_ + 1, 0));
  int64_t work_at = 0;
  for (int c = 0; c < K; ++c) {
    for (int p = 0; p < P_; ++p) {
      for (int64_t e = placement_.first(p); e < placement_.first(p) + placement_.count(p); ++e) {
        L.send_rows[c * P_ + p] += counts[e] * (c + 1) / K - counts[e] * c / K;
      }
      L.send_base[c + 1] += L.send_rows[c * P_ + p];
    }
    L.send_base[c + 1] += L.send_base[c];
    L.work[c][0] = work_at;
    for (int64_t j = 0; j < local_; ++j) {
      int64_t n_j = 0;
      for (int p = 0; p < P_; ++p) {
        const int64_t n = L.recv_counts[p * local_ + j], piece = n * (c + 1) / K - n * c / K;
        L.recv_rows[c * P_ + p] += piece;
        n_j += piece;
      }
      L.work[c][j + 1] = L.work[c][j] + n_j;
    }
    work_at = L.work[c][local_];
    L.recv_base[c + 1] = L.recv_base[c];
    for (int p = 0; p < P_; ++p) L.recv_base[c + 1] += L.recv_rows[c * P_ + p];
  }
  L.rows_in = work_at;
  if (Status d = BeginCopies(xp.device()); !d.ok()) return Fail(d);
  // (Device memory: an allocation that fails stops the process, as for every activation.)
  (void)Reserve(L.x, L.rows_in * C, device_);
  (void)Reserve(L.saved, L.rows_in * L.stride, device_);
  (void)Reserve(work_out_, L.rows_in * C, device_);

  // 3. Dispatch, compute, return.
  Tensor x = L.x.View(0, {L.rows_in, C}), y = work_out_.View(0, {L.rows_in, C});
  Tensor saved = L.saved.View(0, {std::max<int64_t>(1, L.rows_in * L.stride)});
  Exchange(L, C, absl::StrFormat("fwd L%d", layer), xp, yp, [&](int c, auto&& walk_received) {
    return RunChunk(c, C, walk_received, x, y,
                    [&] { experts.Forward(ctx, L.work[c], x, y, saved); });
  });
}

void ExpertParallel::Backward(ops::Context& ctx, int layer, model::LocalExperts& experts,
                              const Tensor& dyp, const Tensor& dxp) {
  auto it = layers_.find(layer);
  CHECK(it != layers_.end()) << "backward of layer " << layer << " without its forward";
  LayerState& L = *it->second;
  if (!status_.ok()) return;
  const int64_t C = L.C;
  if (Status d = BeginCopies(dyp.device()); !d.ok()) return Fail(d);
  (void)Reserve(work_out_, L.rows_in * C, device_);
  (void)Reserve(work_dx_, L.rows_in * C, device_);
  Tensor x = L.x.View(0, {L.rows_in, C});
  Tensor dy = work_out_.View(0, {L.rows_in, C}), dx = work_dx_.View(0, {L.rows_in, C});
  Tensor saved = L.saved.View(0, {std::max<int64_t>(1, L.rows_in * L.stride)});
  Exchange(L, C, absl::StrFormat("bwd L%d", layer), dyp, dxp, [&](int c, auto&& walk_received) {
    return RunChunk(c, C, walk_received, dy, dx,
                    [&] { experts.Backward(ctx, L.work[c], x, dy, dx, saved); });
  });
}

}  // namespace strata::scheduler
