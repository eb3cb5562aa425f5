#include "runtime/model/moe_layer.h"

#include <algorithm>
#include <limits>

#include "kernels/ops.h"

namespace strata::model {

MoeLayer::MoeLayer(int64_t d_model, int64_t max_tokens, std::unique_ptr<Gate> gate,
                   std::vector<std::unique_ptr<Expert>> experts, int64_t first_expert,
                   Device device, std::unique_ptr<FfnExpert> shared)
    : C_(d_model),
      device_(device),
      gate_(std::move(gate)),
      experts_(std::move(experts)),
      first_local_(first_expert),
      shared_(std::move(shared)) {
  CHECK(first_local_ >= 0 && first_local_ + num_local_experts() <= gate_->num_experts())
      << "experts [" << first_local_ << ", " << first_local_ + num_local_experts() << ") of "
      << gate_->num_experts();
  saved_stride_ = 0;
  for (auto& e : experts_) saved_stride_ = std::max(saved_stride_, e->SavedPerRow());
  // Every token's k slots; the rows they dispatch (fewer for expert choice, which has E slots).
  const int64_t rows = gate_->MaxDispatchRows(max_tokens);
  slot_ = Tensor::Empty({max_tokens * gate_->k()}, DType::kI32, device);
  CHECK_LE(max_tokens * gate_->k(), int64_t{std::numeric_limits<int32_t>::max()})
      << "slots and rows are int32: " << max_tokens << " tokens of " << gate_->k() << " slots";
  // The GPU's plan writes rows as it counts them, so it wants room for every slot (T * k).
  row_token_ = Tensor::Empty({device.is_cpu() ? rows : std::max(rows, max_tokens * gate_->k())},
                             DType::kI32, device);
  row_slot_ = Tensor::Empty({rows}, DType::kI32, device);
  task_rows_cap_ = std::min(rows, max_tokens);
  xp_ = Tensor::Empty({rows, C_}, DType::kF32, device);
  yp_ = Tensor::Empty({rows, C_}, DType::kF32, device);
  dxp_ = Tensor::Empty({rows, C_}, DType::kF32, device);
  saved_ = Tensor::Empty({std::max<int64_t>(1, rows * saved_stride_)}, DType::kF32, device);
  dweight_ = Tensor::Empty({max_tokens, gate_->k()}, DType::kF32, device);
  if (shared_) {
    CHECK_EQ(shared_->options().d_model, C_) << "shared experts of another width than the layer's";
    shared_y_ = Tensor::Empty({max_tokens, C_}, DType::kF32, device);
    shared_saved_ = Tensor::Empty({max_tokens, shared_->SavedPerRow()}, DType::kF32, device);
  }
  for (auto& e : experts_) {
    auto* ffn = dynamic_cast<FfnExpert*>(e.get());
    if (ffn == nullptr) {
      ffn_experts_.clear();
      break;
    }
    ffn_experts_.push_back(ffn);
  }
  if (!FfnExpert::SameShape(ffn_experts_)) ffn_experts_.clear();
  grouped_gemm_ = !device_.is_cpu() && !ffn_experts_.empty();
}

void MoeLayer::AttachResidency(ExpertResidency* residency, int layer) {
  residency_ = residency;
  layer_ = layer;
  expert_params_.clear();
  expert_layout_ = ExpertLayout{};
  if (residency == nullptr) return;
  for (auto& e : experts_) expert_params_.push_back(e->Parameters());
  if (!expert_params_.empty()) expert_layout_ = ExpertLayout::Of(expert_params_[0]);
  for (const auto& ps : expert_params_) {
    CHECK(expert_layout_.Fits(ps)) << "a residency needs every expert to have one layout";
  }
}

void MoeLayer::set_grouped_gemm(bool on) {
  CHECK(!on || !ffn_experts_.empty())
      << "a grouped GEMM needs every local expert to be an FfnExpert of one shape";
  grouped_gemm_ = on;
}

std::vector<Parameter*> MoeLayer::DenseParameters() {
  std::vector<Parameter*> ps = gate_->Parameters();
  if (shared_) {
    for (Parameter* p : shared_->Parameters()) ps.push_back(p);
  }
  return ps;
}

std::vector<Parameter*> MoeLayer::Parameters() {
  std::vector<Parameter*> ps = DenseParameters();
  for (auto& e : experts_) {
    for (Parameter* p : e->Parameters()) ps.push_back(p);
  }
  return ps;
}

void MoeLayer::PlanExpertGroups(int threads, const std::vector<int64_t>& offsets) {
  group_begin_.clear();
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, R = offsets.back() - offsets[0];
  if (threads < 2 || E < threads || R == 0) return;
  // Cut the expert order where the row prefix sum crosses i * R / threads.
  group_begin_.assign(threads + 1, E);
  group_begin_[0] = 0;
  int part = 1;
  for (int64_t e = 0; e < E && part < threads; ++e) {
    while (part < threads && (offsets[e + 1] - offsets[0]) * threads >= part * R) {
      // Put expert e in the earlier group if that lands closer to the ideal cut.
      const int64_t ideal = part * R / threads + offsets[0];
      const bool before = offsets[e + 1] - ideal <= ideal - offsets[e];
      group_begin_[part++] = before ? e + 1 : e;
    }
  }
  int64_t worst = 0;
  for (int i = 0; i < threads; ++i) {
    worst = std::max(worst, offsets[group_begin_[i + 1]] - offsets[group_begin_[i]]);
  }
  if (worst * threads > R * 115 / 100) group_begin_.clear();  // too uneven: split GEMMs instead
}

template <typename Fn>
void MoeLayer::ForEachExpert(ops::Context& ctx, const std::vector<int64_t>& offsets, Fn&& fn) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;  // tasks: experts (+ shared)
  if (group_begin_.empty()) {
    for (int64_t e = 0; e < E; ++e) {
      if (offsets[e + 1] > offsets[e]) fn(e, 0);
    }
    return;
  }
  CHECK_EQ(group_begin_.size(), static_cast<size_t>(ctx.pool->num_threads()) + 1)
      << "expert groups planned for a pool of " << group_begin_.size() - 1 << " threads, run on "
      << ctx.pool->num_threads() << "; run Backward on the pool its Forward ran on";
  // Inside a pool task every op runs on its own thread (nested parallelism is inline).
  ctx.pool->Run([&](int tid, int) {
    for (int64_t e = group_begin_[tid]; e < group_begin_[tid + 1]; ++e) {
      if (offsets[e + 1] > offsets[e]) fn(e, tid);
    }
  });
}

template <typename Fn>
void MoeLayer::RunExperts(ops::Context& ctx, ExpertResidency::Pass pass,
                          const std::vector<int64_t>& offsets, Fn&& fn) {
  // One more task than experts: the shared experts' (SharedInTasks), never with a residency.
  const int64_t tasks = static_cast<int64_t>(offsets.size()) - 1;
  CHECK(tasks == num_local_experts() ||
        (tasks == num_local_experts() + 1 && residency_ == nullptr && device_.is_cpu()))
      << tasks << " expert tasks for " << num_local_experts() << " local experts";
  if (!device_.is_cpu() && residency_ == nullptr) {
    // One stream orders the experts after the permutation and before the combine; fanning them
    // out to pool threads would put them on other threads' streams, unordered.
    for (int64_t e = 0; e < num_local_experts(); ++e) {
      if (offsets[e + 1] > offsets[e]) fn(e, 0);
    }
    return;
  }
  if (residency_ == nullptr) {
    // Backward keeps the groups of the matching forward (same rows per expert).
    if (pass == ExpertResidency::Pass::kForward) PlanExpertGroups(ctx.pool->num_threads(), offsets);
    ForEachExpert(ctx, offsets, fn);
    return;
  }
  group_begin_.clear();
  needed_.clear();
  for (int64_t e = 0; e < num_local_experts(); ++e) {
    if (offsets[e + 1] > offsets[e]) needed_.push_back(static_cast<int>(first_local_ + e));
  }
  residency_->BeginPass(layer_, pass, needed_);
  auto run_resident = [&](int tid) {
    while (true) {
      const ResidentExpert r = residency_->NextReady(layer_, pass);
      if (r.expert < 0) break;
      const int64_t e = r.expert - first_local_;
      CHECK(e >= 0 && e < num_local_experts()) << "the residency handed expert " << r.expert;
      // The handed blobs are the expert's parameters for this call only.
      expert_layout_.Bind(expert_params_[e], r.weights, r.grad);
      fn(e, tid);
      for (Parameter* p : expert_params_[e]) Unbind(*p);
      // On a GPU the expert's kernels are only queued: the residency's copies out of (or into)
      // these slots wait for the compute stream's work, so handing them back now is safe.
      residency_->Done(layer_, pass, r);
    }
  };
  if (!device_.is_cpu()) {
    // Experts in the order they become resident, each on this thread's stream (as above).
    run_resident(0);
    return;
  }
  ctx.pool->Run([&](int tid, int) { run_resident(tid); });
}

void MoeLayer::EnsureTaskRows(int threads) {
  if (static_cast<int>(task_rows_.size()) == threads) return;
  task_rows_.clear();
  for (int i = 0; i < threads; ++i) {
    task_rows_.push_back(Tensor::Empty({2 * task_rows_cap_, C_}, DType::kF32, device_));
  }
}

Tensor MoeLayer::TaskRows(int thread, bool dy, int64_t n) const {
  CHECK(thread >= 0 && thread < static_cast<int>(task_rows_.size()) && n <= task_rows_cap_)
      << "task rows of thread " << thread << " for " << n << " rows";
  const int64_t first = dy ? task_rows_cap_ : 0;
  return task_rows_[thread].Rows(first, first + n);
}

const std::vector<int64_t>& MoeLayer::TaskOffsets(const std::vector<int64_t>& offsets,
                                                  const InTask& in) {
  if (!in.shared) return offsets;
  CHECK(in.x != nullptr && shared_ != nullptr && residency_ == nullptr);
  task_offsets_.assign(offsets.begin(), offsets.end());
  task_offsets_.push_back(offsets.back() + in.x->dim(0));
  return task_offsets_;
}

void MoeLayer::RunLocalForward(ops::Context& ctx, const std::vector<int64_t>& offsets,
                               const Tensor& x, const Tensor& y, const Tensor& saved,
                               const InTask& in) {
  if (grouped_gemm_ && residency_ == nullptr) {
    CHECK(in.x == nullptr && !in.shared) << "the grouped GEMM takes rows already gathered";
    const int64_t r0 = offsets.front(), r1 = offsets.back();
    group_offsets_.clear();
    for (int64_t o : offsets) group_offsets_.push_back(o - r0);
    group_begin_.clear();
    FfnExpert::GroupForward(ctx, ffn_experts_, group_offsets_, x.Rows(r0, r1), y.Rows(r0, r1),
                            saved.View(r0 * saved_stride_, {(r1 - r0) * saved_stride_}));
    return;
  }
  const int64_t n = num_local_experts();
  RunExperts(
      ctx, ExpertResidency::Pass::kForward, TaskOffsets(offsets, in), [&](int64_t e, int tid) {
        if (e == n) {  // the shared experts, on every token
          const int64_t T = in.x->dim(0);
          shared_->Forward(ctx, *in.x, shared_y_.Rows(0, T), shared_saved_.Rows(0, T));
          return;
        }
        const int64_t r0 = offsets[e], r1 = offsets[e + 1];
        Tensor rows = x.Rows(r0, r1);
        if (in.x != nullptr) {
          rows = TaskRows(tid, /*dy=*/false, r1 - r0);
          ops::MoePermuteForward(ctx, rows, *in.x, row_token_.Rows(r0, r1));
        }
        experts_[e]->Forward(ctx, rows, y.Rows(r0, r1),
                             saved.View(r0 * saved_stride_, {r1 - r0, experts_[e]->SavedPerRow()}));
      });
}

void MoeLayer::RunLocalBackward(ops::Context& ctx, const std::vector<int64_t>& offsets,
                                const Tensor& x, const Tensor& dy, const Tensor& dx,
                                const Tensor& saved, const InTask& in) {
  if (grouped_gemm_ && residency_ == nullptr) {
    CHECK(in.dy == nullptr && !in.shared) << "the grouped GEMM takes rows already made";
    const int64_t r0 = offsets.front(), r1 = offsets.back();
    group_offsets_.clear();
    for (int64_t o : offsets) group_offsets_.push_back(o - r0);
    FfnExpert::GroupBackward(ctx, ffn_experts_, group_offsets_, x.Rows(r0, r1), dy.Rows(r0, r1),
                             dx.Rows(r0, r1),
                             saved.View(r0 * saved_stride_, {(r1 - r0) * saved_stride_}));
    return;
  }
  const int64_t n = num_local_experts();
  RunExperts(
      ctx, ExpertResidency::Pass::kBackward, TaskOffsets(offsets, in), [&](int64_t e, int tid) {
        if (e == n) {  // shared experts write dx; the routed rows' gradients add on later
          const int64_t T = in.x->dim(0);
          shared_->Backward(ctx, *in.x, *in.dy, *in.dx, shared_saved_.Rows(0, T));
          return;
        }
        const int64_t r0 = offsets[e], r1 = offsets[e + 1];
        Tensor x_rows = x.Rows(r0, r1), dy_rows = dy.Rows(r0, r1);
        if (in.x != nullptr) {
          x_rows = TaskRows(tid, /*dy=*/false, r1 - r0);
          ops::MoePermuteForward(ctx, x_rows, *in.x, row_token_.Rows(r0, r1));
        }
        if (in.dy != nullptr) {  // from the expert's outputs, which dy holds until now
          dy_rows = TaskRows(tid, /*dy=*/true, r1 - r0);
          ops::MoeCombineBackwardRows(ctx, dy_rows, dweight_.Rows(0, routing_.tokens), *in.dy,
                                      dy.Rows(r0, r1), routing_.weight, row_slot_.Rows(r0, r1));
        }
        experts_[e]->Backward(
            ctx, x_rows, dy_rows, dx.Rows(r0, r1),
            saved.View(r0 * saved_stride_, {r1 - r0, experts_[e]->SavedPerRow()}));
      });
}

void MoeLayer::Forward(ops::Context& ctx, const Tensor& x, const Tensor& y, const GateCall& call) {
  const int64_t T = x.dim(0);
  const int64_t E = num_experts();
  gate_->Forward(ctx, x, call, &routing_);
  const int k = routing_.k;
  const int64_t capacity = ops::MoeCapacity(gate_->CapacityFactor(call.training), T, k, E);
  Tensor slot = slot_.Rows(0, T * k).Reshape({T, k});
  ops::MoePlanDispatch(ctx, routing_.expert, routing_.eligible, E, capacity, slot, row_token_,
                       &plan_);
  const int64_t R = plan_.rows;
  Tensor xp = xp_.Rows(0, R), yp = yp_.Rows(0, R);
  // How this Forward ran its experts; its Backward runs them the same way.
  rows_in_tasks_ = RowsInTasks();  // never with an exchange
  shared_in_tasks_now_ = SharedInTasks();
  if (exchange_ != nullptr) {
    ops::MoePermuteForward(ctx, xp, x, row_token_);
    exchange_->Forward(ctx, layer_, local_, xp, plan_.counts, yp);
  } else if (rows_in_tasks_) {
    CHECK_EQ(num_local_experts(), E) << "experts on other workers need an ExpertExchange";
    // Each row's choice, for the backward's per-expert combine: the inverse of slot.
    const int32_t* s = slot.i32();
    int32_t* rs = row_slot_.i32();
    for (int64_t i = 0; i < T * k; ++i) {
      if (s[i] >= 0) rs[s[i]] = static_cast<int32_t>(i);
    }
    EnsureTaskRows(ctx.pool->num_threads());
    RunLocalForward(ctx, plan_.offsets, xp, yp, saved_,
                    InTask{&x, nullptr, nullptr, shared_in_tasks_now_});
  } else {
    CHECK_EQ(num_local_experts(), E) << "experts on other workers need an ExpertExchange";
    ops::MoePermuteForward(ctx, xp, x, row_token_);
    RunLocalForward(ctx, plan_.offsets, xp, yp, saved_, InTask{});
  }
  ops::MoeCombineForward(ctx, y, yp, routing_.weight, slot);
  if (shared_) {  // every token, with weight 1, whatever capacity dropped
    Tensor shared_y = shared_y_.Rows(0, T);
    if (!shared_in_tasks_now_) shared_->Forward(ctx, x, shared_y, shared_saved_.Rows(0, T));
    ops::Accumulate(ctx, y, shared_y);
  }

  stats_.tokens = T;
  stats_.load = plan_.counts;
  stats_.dropped = plan_.dropped;
  stats_.capacity = capacity > 0 ? capacity : gate_->ChosenCapacity();
  stats_.aux_loss = routing_.aux_loss;
  stats_.z_loss = routing_.z_loss;
  stats_.sequence_aux_loss = routing_.sequence_aux_loss;
  stats_.routed = gate_->BatchLoad();
  stats_.has_bias = gate_->BiasRange(&stats_.bias_min, &stats_.bias_max);
  const Tensor host_slot = slot.To(Device::Cpu());
  const int32_t* s = host_slot.i32();
  int64_t lost = 0;
  for (int64_t t = 0; t < T; ++t) {
    bool any = false;
    for (int j = 0; j < k; ++j) any |= s[t * k + j] >= 0;
    lost += !any;
  }
  stats_.dropped_tokens = lost;
}

void MoeLayer::Backward(ops::Context& ctx, const Tensor& x, const Tensor& dy, const Tensor& dx) {
  const int64_t T = routing_.tokens;
  const int k = routing_.k;
  const int64_t R = plan_.rows;
  CHECK_EQ(x.dim(0), T);
  Tensor slot = slot_.Rows(0, T * k).Reshape({T, k});
  Tensor xp = xp_.Rows(0, R), yp = yp_.Rows(0, R), dxp = dxp_.Rows(0, R);
  Tensor dweight = dweight_.Rows(0, T);
  // The shared experts write dx; the routed rows' gradients and the gate's add onto it.
  if (shared_ && !shared_in_tasks_now_) {
    shared_->Backward(ctx, x, dy, dx, shared_saved_.Rows(0, T));
  }
  // dyp overwrites yp in place (each row is read, then written, by one thread), except when the
  // expert tasks make their rows (they make them in their task rows).
  if (exchange_ != nullptr) {
    ops::MoeCombineBackward(ctx, yp, dweight, dy, yp, routing_.weight, slot);
    exchange_->Backward(ctx, layer_, local_, yp, dxp);
  } else if (rows_in_tasks_) {
    CHECK_EQ(static_cast<size_t>(ctx.pool->num_threads()), task_rows_.size())
        << "Backward on a pool of " << ctx.pool->num_threads() << " threads after a Forward on "
        << task_rows_.size() << "; run Backward on the pool its Forward ran on";
    dweight.SetZero();  // the choices capacity dropped have no row to write theirs
    RunLocalBackward(ctx, plan_.offsets, xp, yp, dxp, saved_,
                     InTask{&x, &dy, &dx, shared_in_tasks_now_});
  } else {
    ops::MoeCombineBackward(ctx, yp, dweight, dy, yp, routing_.weight, slot);
    RunLocalBackward(ctx, plan_.offsets, xp, yp, dxp, saved_, InTask{});
  }
  ops::MoePermuteBackward(ctx, dx, dxp, slot, /*accumulate=*/shared_ != nullptr);
  gate_->Backward(ctx, x, dweight, dx);
}

}  // namespace strata::model
