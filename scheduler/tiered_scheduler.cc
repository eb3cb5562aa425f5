#include "scheduler/tiered_scheduler.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/clock.h"
#include "core/common/logging.h"
#include "kernels/ops.h"

namespace strata::scheduler {

using storage::TensorKey;
using storage::TensorKind;

namespace {
constexpr double kHistoryDecay = 0.9;  // per step
}  // namespace

StatusOr<std::unique_ptr<TieredExpertScheduler>> TieredExpertScheduler::Create(
    model::MoeTransformer& model, const TieredOptions& options,
    std::unique_ptr<storage::TieredExpertStore> store) {
  std::unique_ptr<TieredExpertScheduler> s(new TieredExpertScheduler);
  s->options_ = options;
  if (model.moe_layers().empty()) {
    return absl::InvalidArgumentError("the tiered store needs a model with MoE layers");
  }
  // Every layer holds the same range of experts (the placement is per worker, not per layer).
  const model::MoeLayer& first_layer = *model.moe_layers()[0].layer;
  s->first_expert_ = first_layer.first_local_expert();
  s->device_ = first_layer.device();
  for (const auto& ref : model.moe_layers()) {
    if (ref.layer->first_local_expert() != s->first_expert_ ||
        ref.layer->num_local_experts() != first_layer.num_local_experts() ||
        ref.layer->num_local_experts() == 0) {
      return absl::InvalidArgumentError(
          "the tiered store needs every MoE layer to hold the same, non-empty range of experts");
    }
  }
  // The layout of an expert's blob, from the first expert; every other must match it.
  s->layout_ =
      model::ExpertLayout::Of(model.moe_layers()[0].layer->expert(s->first_expert_).Parameters());
  for (const auto& ref : model.moe_layers()) {
    Layer layer;
    layer.block = ref.block;
    for (int64_t e = s->first_expert_; e < s->first_expert_ + ref.layer->num_local_experts(); ++e) {
      std::vector<model::Parameter*> ps = ref.layer->expert(e).Parameters();
      if (!s->layout_.Fits(ps)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the tiered store needs every expert to have the same parameter shapes; expert %d "
            "of block %d differs from expert 0 of block %d",
            e, ref.block, model.moe_layers()[0].block));
      }
      for (model::Parameter* p : ps) {
        if (p->value.defined()) {
          return absl::FailedPreconditionError(
              "the model's experts own their parameters; build it with unbound_experts");
        }
      }
      layer.experts.emplace_back(ps.begin(), ps.end());
    }
    layer.history.assign(layer.experts.size(), 0.0);
    layer.grad_sq.assign(layer.experts.size(), 0.0);
    layer.started.assign(layer.experts.size(), 0.0);
    s->layers_.push_back(std::move(layer));
  }
  s->zeros_.assign(s->expert_floats(), 0.0f);

  RETURN_IF_ERROR(s->SetUpStore(std::move(store)));
  s->updated_layers_ = s->moe_layers();
  s->update_pool_ = std::make_unique<ThreadPool>(1);
  s->updater_ = std::thread([ptr = s.get()] { ptr->UpdaterLoop(); });
  return s;
}

void TieredExpertScheduler::Initialize(const TensorKey& key, float* dst) const {
  const int li = MoeIndex(key.layer);
  const auto& params = layers_[li].experts[key.expert - first_expert_];
  for (size_t i = 0; i < params.size(); ++i) {
    model::InitialValues(*params[i], options_.seed, dst + layout_.segments[i].offset);
  }
}

Status TieredExpertScheduler::SetUpStore(std::unique_ptr<storage::TieredExpertStore> store) {
  // Never-written weights are generated from the seed, exactly as in memory.
  auto initializer = [this](const TensorKey& key, float* dst) { Initialize(key, dst); };
  if (store) {
    const uint64_t bytes = expert_floats() * sizeof(float);
    if (store->tensor_bytes() != bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the tiered store handed over holds expert tensors of %d bytes, but this model's "
          "experts are %d bytes; a store can only go to a model of the same configuration",
          store->tensor_bytes(), bytes));
    }
    if (store->device() != device_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the tiered store handed over has its device tier on %s, but this model runs on %s; "
          "a store can only go to a model on the same device",
          store->device().ToString(), device_.ToString()));
    }
    if (store->compute_threads() < options_.threads) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the tiered store handed over has slots for %d compute threads, but this scheduler "
          "runs %d; keep the thread count across the re-form",
          store->compute_threads(), options_.threads));
    }
    store->WaitIdle();
    // What this range holds: its layers' experts, without gradients (a new scheduler starts
    // without any; a step cut short may have left some).
    const int64_t last = first_expert_ + static_cast<int64_t>(layers_[0].experts.size());
    store->DiscardUnless([&](const TensorKey& k) {
      const bool layer = std::any_of(layers_.begin(), layers_.end(),
                                     [&](const Layer& L) { return L.block == k.layer; });
      return layer && k.expert >= first_expert_ && k.expert < last && k.kind != TensorKind::kGrad;
    });
    store->set_initializer(std::move(initializer));
    store->ForgetNextUses();  // the plans of the scheduler that made it are not this one's
    store_ = std::move(store);
    return absl::OkStatus();
  }
  storage::StoreOptions so;
  so.device = device_;
  so.tensor_bytes = expert_floats() * sizeof(float);
  so.device_budget_bytes = options_.device_slot_bytes;
  so.host_budget_bytes = options_.storage.host_budget_bytes();
  so.device_budget = options_.device_budget;
  so.host_budget = options_.host_budget;
  so.lfu_decay_interval = options_.storage.lfu_decay_interval();
  so.lfu_decay = options_.storage.lfu_decay();
  so.ssd.dir = options_.ssd_dir;
  so.ssd.file_bytes = options_.storage.ssd_file_bytes();
  so.ssd.capacity_bytes = options_.storage.ssd_capacity_bytes();
  so.io.queue_depth = options_.storage.io_queue_depth();
  so.io.block_bytes = options_.storage.io_block_bytes();
  so.compute_threads = options_.threads;
  so.ssd_threads = static_cast<int>(options_.storage.ssd_threads());
  so.wrap_io = options_.wrap_io;
  so.shared_ssd = options_.shared_ssd;
  so.initializer = std::move(initializer);
  ASSIGN_OR_RETURN(store_, storage::TieredExpertStore::Create(so));
  return absl::OkStatus();
}

std::unique_ptr<storage::TieredExpertStore> TieredExpertScheduler::ReleaseStore() {
  Quiesce();
  {
    std::lock_guard<std::mutex> lock(umu_);
    stop_updater_ = true;
  }
  ucv_.notify_all();
  if (updater_.joinable()) updater_.join();
  store_->set_record_spans(false);
  store_->set_initializer([](const TensorKey& key, float*) {
    CHECK(false) << key.ToString() << " was loaded while its tiered store belonged to no scheduler";
  });
  {
    std::lock_guard<std::mutex> lock(mu_);
    blobs_.clear();
  }
  return std::move(store_);
}

TieredExpertScheduler::~TieredExpertScheduler() {
  {
    std::lock_guard<std::mutex> lock(umu_);
    stop_updater_ = true;  // after the update in flight, if any
  }
  ucv_.notify_all();
  if (updater_.joinable()) updater_.join();
}

void TieredExpertScheduler::set_tracer(Tracer* tracer) {
  tracer_ = tracer;
  store_->set_record_spans(tracer != nullptr);
}

void TieredExpertScheduler::Quiesce() {
  Status s = FinishExpertStep();  // its error is the trainer's to report
  (void)s;
  store_->WaitIdle();
  FlushStageSpans();
}

void TieredExpertScheduler::FlushStageSpans() {
  if (tracer_ == nullptr) return;
  for (const storage::StageSpan& s : store_->TakeSpans()) {
    tracer_->SpanOn(s.thread == 0   ? std::string("ssd stage")
                    : s.thread == 1 ? std::string("copy stage")
                                    : absl::StrCat("ssd stage ", s.thread),
                    absl::StrFormat("%s L%d E%d %s", s.name, s.key.layer, s.key.expert,
                                    storage::KindName(s.key.kind)),
                    s.thread == 1 ? "copy" : "io", s.start, s.end);
  }
}

int TieredExpertScheduler::MoeIndex(int block) const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].block == block) return static_cast<int>(i);
  }
  CHECK(false) << "block " << block << " has no MoE layer";
  return -1;
}

Tensor TieredExpertScheduler::Blob(float* data) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& b = blobs_[data];
  if (!b) b = Buffer::Wrap(device_, data, expert_floats() * sizeof(float));
  return Tensor::FromBuffer(b, {layout_.floats});
}

void TieredExpertScheduler::Fail(const Status& s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_.ok()) error_ = s;
}

Status TieredExpertScheduler::status() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
  }
  std::lock_guard<std::mutex> lock(umu_);
  return update_error_;
}

int TieredExpertScheduler::Window() const {
  const int slots = store_->device_slots();
  if (slots < 0) return 1 << 30;
  // Room left after every thread holds weights and a gradient.
  return std::max(1, slots - 2 * options_.threads - 1);
}

void TieredExpertScheduler::PrefetchWeights(int li, std::span<const int> experts) {
  std::vector<TensorKey> keys;
  for (int e : experts) keys.push_back(Key(li, e, TensorKind::kWeights));
  store_->PrefetchDevice(keys);
}

std::vector<int> TieredExpertScheduler::ByHistory(int li, int limit) const {
  const Layer& L = layers_[li];
  std::vector<int> order(L.experts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return L.history[a] > L.history[b]; });
  const int n = std::min<int>({limit, static_cast<int>(options_.storage.history_prefetch()),
                               static_cast<int>(order.size())});
  order.resize(std::max(0, n));
  order.erase(std::remove_if(order.begin(), order.end(), [&](int e) { return L.history[e] <= 0; }),
              order.end());
  return order;
}

void TieredExpertScheduler::SlideWindowLocked() {
  // Keep up to Window() routed experts of the pass loaded ahead of the threads.
  const int in_flight = static_cast<int>(pending_.size()) - static_cast<int>(to_prefetch_.size());
  const int room = Window() - std::max(0, in_flight);
  if (room <= 0 || to_prefetch_.empty()) return;
  const int n = std::min<int>(room, static_cast<int>(to_prefetch_.size()));
  std::vector<int> next(to_prefetch_.begin(), to_prefetch_.begin() + n);
  to_prefetch_.erase(to_prefetch_.begin(), to_prefetch_.begin() + n);
  PrefetchWeights(pass_li_, next);
}

void TieredExpertScheduler::BeginPass(int layer, Pass pass, std::span<const int> experts) {
  const int li = MoeIndex(layer);
  WaitUpdated(li);
  // The layer whose experts this forward prefetches by history: the next one, or with a ring
  // the first after the last (the next pass's).
  const int next = li + 1 < moe_layers() ? li + 1 : options_.ring ? 0 : -1;
  // Fetch the next layer's usual experts only once their update is done (a copy made before
  // would be dropped by it).
  const bool next_updated = next >= 0 && Updated(next);
  std::lock_guard<std::mutex> lock(mu_);
  pass_li_ = li;
  pass_ = pass;
  pending_.clear();
  for (int e : experts) pending_.push_back(static_cast<int>(e - first_expert_));
  to_prefetch_ = pending_;
  Layer& L = layers_[li];
  if (pass == Pass::kForward) {
    L.routed = pending_;
    for (int e : pending_) {
      L.history[e] += 1.0;
      ++prefetch_counts_.routed;
      if (std::find(L.guessed.begin(), L.guessed.end(), e) != L.guessed.end()) {
        ++prefetch_counts_.guessed;
      } else if (store_->DeviceReady(Key(li, e, TensorKind::kWeights))) {
        ++prefetch_counts_.resident;
      }
    }
    L.guessed.clear();
  }
  SlideWindowLocked();
  // Horizontal prefetch behind this layer's experts, if the device tier has room for more.
  const int spare = Window() - static_cast<int>(pending_.size());
  if (pass == Pass::kForward && next_updated && spare > 0) {
    const std::vector<int> guess = ByHistory(next, spare);
    PrefetchWeights(next, guess);
    std::vector<int>& g = layers_[next].guessed;
    g.insert(g.end(), guess.begin(), guess.end());
  }
  if (pass == Pass::kBackward && li == 0 && !hinted_update_) {
    hinted_update_ = true;
    HintUpdateReads();
  }
  if (pass == Pass::kBackward && li > 0 && spare > 0) {
    // Exact: the previous layer's routing is known from its forward.
    const auto& prev = layers_[li - 1].routed;
    const int n = std::min<int>(spare, static_cast<int>(prev.size()));
    std::vector<TensorKey> keys;
    for (int i = 0; i < n; ++i) keys.push_back(Key(li - 1, prev[i], TensorKind::kWeights));
    store_->PrefetchDevice(keys);
  }
}

bool TieredExpertScheduler::Updated(int li) {
  std::lock_guard<std::mutex> lock(umu_);
  return updated_layers_ > li;
}

void TieredExpertScheduler::WaitUpdated(int li) {
  std::unique_lock<std::mutex> lock(umu_);
  if (updated_layers_ > li || !update_error_.ok()) return;
  const double t0 = NowSeconds();
  ucv_.wait(lock, [&] { return updated_layers_ > li || !update_error_.ok(); });
  const double t1 = NowSeconds();
  lock.unlock();
  store_->AddStall(t1 - t0);
  if (tracer_) {
    tracer_->Span(absl::StrFormat("wait update L%d", layers_[li].block), "stall", t0, t1);
  }
}

model::ResidentExpert TieredExpertScheduler::NextReady(int layer, Pass pass) {
  const int li = MoeIndex(layer);
  int e;
  {
    if (!status().ok()) return {};
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.empty()) return {};
    // A resident expert first, so threads compute while the rest load.
    auto it = std::find_if(pending_.begin(), pending_.end(), [&](int x) {
      return store_->DeviceReady(Key(li, x, TensorKind::kWeights));
    });
    if (it == pending_.end()) it = pending_.begin();
    e = *it;
    pending_.erase(it);
    to_prefetch_.erase(std::remove(to_prefetch_.begin(), to_prefetch_.end(), e),
                       to_prefetch_.end());
  }
  const double t0 = tracer_ ? NowSeconds() : 0.0;
  auto w = store_->AcquireDevice(Key(li, e, TensorKind::kWeights));
  if (!w.ok()) {
    Fail(w.status());
    return {};
  }
  model::ResidentExpert r;
  r.expert = static_cast<int>(first_expert_ + e);
  if (pass == Pass::kBackward) {
    auto g = store_->AcquireDevice(Key(li, e, TensorKind::kGrad), /*zero=*/true);
    if (!g.ok()) {
      store_->ReleaseDevice(Key(li, e, TensorKind::kWeights), false);
      Fail(g.status());
      return {};
    }
    r.grad = Blob(*g);
  }
  r.weights = Blob(*w);
  if (tracer_) {
    const double t1 = NowSeconds();
    if (t1 - t0 > 20e-6) {
      tracer_->Span(absl::StrFormat("wait L%d E%d", layers_[li].block, e), "stall", t0, t1);
    }
    layers_[li].started[e] = t1;
  }
  return r;
}

void TieredExpertScheduler::Done(int layer, Pass pass, const model::ResidentExpert& expert) {
  const int li = MoeIndex(layer);
  const int e = static_cast<int>(expert.expert - first_expert_);
  if (pass == Pass::kBackward) {
    double sq = 0;
    if (device_.is_cpu()) {
      const float* g = expert.grad.f32();
      for (int64_t i = 0; i < layout_.floats; ++i) sq += static_cast<double>(g[i]) * g[i];
    } else {
      // On the compute stream, after the expert's backward; waits for that stream only.
      ops::Context ctx;
      sq = ops::SumSquares(ctx, expert.grad);
    }
    layers_[li].grad_sq[e] = sq;
  }
  if (tracer_) {
    tracer_->Span(
        absl::StrFormat("%s L%d E%d", pass == Pass::kForward ? "expert fwd" : "expert bwd",
                        layers_[li].block, e),
        "compute", layers_[li].started[e], NowSeconds());
  }
  store_->ReleaseDevice(Key(li, e, TensorKind::kWeights), false);
  if (pass == Pass::kBackward) {
    // The gradient stays on the device until its slot is needed (then it moves to the host) or
    // the optimizer takes it: the last layers' gradients, which the optimizer takes first, need
    // neither a host slot through the end of backward nor a trip through the SSD tier.
    store_->ReleaseDevice(Key(li, e, TensorKind::kGrad), /*modified=*/true);
  }
  std::lock_guard<std::mutex> lock(mu_);
  SlideWindowLocked();
}

double TieredExpertScheduler::ExpertGradSumSquares() const {
  double s = 0;
  for (const Layer& L : layers_) {
    for (double v : L.grad_sq) s += v;
  }
  return s;
}

Status TieredExpertScheduler::SumGradientsOver(comm::Communicator& replicas) {
  // The update in flight reads and discards gradients: it must be done before they are summed.
  RETURN_IF_ERROR(FinishExpertStep());
  RETURN_IF_ERROR(status());
  // Which experts some copy has a gradient for: every copy then walks the same list.
  std::vector<float> any;
  for (int li = 0; li < moe_layers(); ++li) {
    for (int e = 0; e < num_experts(li); ++e) {
      any.push_back(store_->Materialized(Key(li, e, TensorKind::kGrad)) ? 1.0f : 0.0f);
    }
  }
  RETURN_IF_ERROR(replicas.AllReduce(any.data(), any.size()));
  std::vector<TensorKey> keys;
  std::vector<std::pair<int, int>> experts;
  for (int li = 0, i = 0; li < moe_layers(); ++li) {
    for (int e = 0; e < num_experts(li); ++e, ++i) {
      if (any[static_cast<size_t>(i)] == 0.0f) continue;
      keys.push_back(Key(li, e, TensorKind::kGrad));
      experts.emplace_back(li, e);
    }
  }
  // A few experts travel together, in one all-reduce through a staging buffer of as many
  // gradients (a collective per expert would pay its latency once per expert), each pinned in a
  // host slot from its copy in to its copy back. The batch is storage.optimizer_prefetch experts at
  // most, and pins at most half the host slots, so the gradients prefetched behind it have room.
  const int slots = store_->host_slots();
  size_t batch = std::max<size_t>(1, options_.storage.optimizer_prefetch());
  if (slots > 0) batch = std::min<size_t>(batch, static_cast<size_t>(std::max(1, slots / 2)));
  const size_t floats = static_cast<size_t>(layout_.floats);
  std::vector<float> staging(std::min(batch, keys.size()) * floats);
  std::vector<float*> pinned;
  for (size_t first = 0; first < keys.size(); first += batch) {
    const size_t n = std::min(batch, keys.size() - first);
    // Behind this batch, the next one comes down to the host: a gradient still dirty on the device
    // is written back, one on the SSD tier read (one never written reads as zero).
    for (size_t j = first + n; j < std::min(keys.size(), first + n + batch); ++j) {
      store_->WriteBack(keys[j]);
      store_->PrefetchHost(std::span<const TensorKey>(&keys[j], 1));
    }
    const double t0 = tracer_ ? NowSeconds() : 0.0;
    pinned.clear();
    Status s;
    for (size_t k = 0; k < n && s.ok(); ++k) {
      StatusOr<float*> g = store_->AcquireHost(keys[first + k]);
      if (!g.ok()) {
        s = g.status();
        break;
      }
      pinned.push_back(*g);
      std::copy(*g, *g + floats, staging.data() + k * floats);
    }
    if (s.ok()) s = replicas.AllReduce(staging.data(), n * floats);
    for (size_t k = 0; k < pinned.size(); ++k) {
      const auto [li, e] = experts[first + k];
      if (s.ok()) {
        const float* sum = staging.data() + k * floats;
        std::copy(sum, sum + floats, pinned[k]);
        double sq = 0;
        for (size_t i = 0; i < floats; ++i) sq += static_cast<double>(sum[i]) * sum[i];
        layers_[li].grad_sq[e] = sq;
      }
      store_->ReleaseHost(keys[first + k], /*modified=*/s.ok());
    }
    if (!s.ok()) {
      const auto [li, e] = experts[first];
      return Status(s.code(),
                    absl::StrFormat("summing the gradients of %d experts from expert %d "
                                    "of block %d on, over their copies: %s",
                                    n, first_expert_ + e, layers_[li].block, s.message()));
    }
    if (tracer_) {
      const auto [li, e] = experts[first];
      tracer_->Span(absl::StrFormat("sum copies L%d E%d+%d", layers_[li].block, e, n), "comm", t0,
                    NowSeconds());
    }
  }
  return absl::OkStatus();
}

Status TieredExpertScheduler::CheckRange(int moe_layer, int expert, int64_t offset,
                                         int64_t n) const {
  if (moe_layer < 0 || moe_layer >= moe_layers() || expert < 0 ||
      expert >= num_experts(moe_layer)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "no expert %d of MoE layer %d here: this scheduler holds %d MoE layers of %d experts "
        "(local indices; global experts %d on)",
        expert, moe_layer, moe_layers(), num_experts(0), first_expert_));
  }
  if (offset < 0 || n < 0 || offset + n > layout_.floats) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "floats [%d, %d) of an expert tensor of %d floats (layer %d, expert %d)", offset,
        offset + n, layout_.floats, layers_[moe_layer].block, first_expert_ + expert));
  }
  return absl::OkStatus();
}

Status TieredExpertScheduler::ReadExpert(int moe_layer, int expert, TensorKind kind, float* out) {
  return ReadExpertRange(moe_layer, expert, kind, 0, layout_.floats, out);
}

Status TieredExpertScheduler::ReadExpertRange(int moe_layer, int expert, TensorKind kind,
                                              int64_t offset, int64_t n, float* out) {
  RETURN_IF_ERROR(CheckRange(moe_layer, expert, offset, n));
  RETURN_IF_ERROR(FinishExpertStep());
  const TensorKey key = Key(moe_layer, expert, kind);
  ASSIGN_OR_RETURN(const float* data, store_->AcquireHost(key));
  std::copy(data + offset, data + offset + n, out);
  store_->ReleaseHost(key, /*modified=*/false);
  return absl::OkStatus();
}

Status TieredExpertScheduler::WriteExpert(int moe_layer, int expert, TensorKind kind,
                                          const float* in) {
  return WriteExpertRange(moe_layer, expert, kind, 0, layout_.floats, in);
}

Status TieredExpertScheduler::WriteExpertRange(int moe_layer, int expert, TensorKind kind,
                                               int64_t offset, int64_t n, const float* in) {
  RETURN_IF_ERROR(CheckRange(moe_layer, expert, offset, n));
  RETURN_IF_ERROR(FinishExpertStep());
  const TensorKey key = Key(moe_layer, expert, kind);
  // The host slot holds the current value (read from the SSD tier, or initialised) so that the
  // floats outside the range keep it; a whole write pays that read too, which keeps one path.
  ASSIGN_OR_RETURN(float* data, store_->AcquireHost(key));
  std::copy(in, in + n, data + offset);
  store_->ReleaseHost(key, /*modified=*/true);
  return absl::OkStatus();
}

std::vector<TieredExpertScheduler::Item> TieredExpertScheduler::UpdateItems(bool planned) const {
  const bool lazy = options_.storage.expert_update() == config::StorageConfig::LAZY;
  std::vector<Item> items;
  for (int li = 0; li < moe_layers(); ++li) {
    if (planned && lazy) {
      // Backward computes a gradient for exactly the experts the forward routed rows to.
      std::vector<int> routed = layers_[li].routed;
      std::sort(routed.begin(), routed.end());
      for (int e : routed) items.push_back(Item{li, e, true});
      continue;
    }
    for (int e = 0; e < num_experts(li); ++e) {
      const bool grad = !planned && store_->Materialized(Key(li, e, TensorKind::kGrad));
      if (grad || !lazy) items.push_back(Item{li, e, grad});
    }
  }
  return items;
}

int TieredExpertScheduler::BackwardPrefetchItems() const {
  const int slots = store_->host_slots();
  if (slots < 0) return 0;  // unlimited: the update's state is resident already
  // Half the host slots at most, less what compute and the ssd stage need at any time: the rest
  // holds the weights backward brings up and the gradients it leaves.
  const int room =
      (slots / 2 - 4 * options_.threads - 3 - static_cast<int>(options_.storage.ssd_threads())) / 3;
  const int asked = static_cast<int>(options_.storage.backward_prefetch());
  return std::max(0, asked < 0 ? room : std::min(asked, room));
}

void TieredExpertScheduler::HintUpdateReads() {
  const int n = BackwardPrefetchItems();
  if (n == 0) return;
  const std::vector<Item> items = UpdateItems(/*planned=*/true);
  // Item i's state is next used at point next_use_base_ + i of the store's plan (where the last
  // update put the moments it stepped): each load may only displace state needed after it.
  for (size_t i = 0; i < std::min(items.size(), static_cast<size_t>(n)); ++i) {
    std::vector<TensorKey> keys;
    for (TensorKind k : {TensorKind::kWeights, TensorKind::kAdamM, TensorKind::kAdamV}) {
      keys.push_back(Key(items[i].li, items[i].e, k));
    }
    backward_hinted_ += static_cast<uint64_t>(store_->PrefetchHost(keys, next_use_base_ + i + 1));
  }
}

Status TieredExpertScheduler::StepExperts(const model::AdamWOptions& o, double lr,
                                          double grad_scale, int64_t step) {
  RETURN_IF_ERROR(FinishExpertStep());  // the forward has waited for it already
  RETURN_IF_ERROR(status());
  RETURN_IF_ERROR(store_->DrainWriteBacks());
  Update u;
  u.options = o;
  u.lr = lr;
  u.grad_scale = grad_scale;
  u.step = step;
  u.items = UpdateItems(/*planned=*/false);
  // Every update's plan lies after all earlier ones (a stride of every expert, whatever the
  // update steps), so the moments an update leaves go before those an earlier one left.
  next_use_base_ += static_cast<uint64_t>(moe_layers()) * num_experts(0) + 1;
  u.next_use_base = next_use_base_;
  // The next step starts with the first MoE layer: its usual experts are fetched to the device
  // as soon as their update is done.
  u.first_layer_prefetch = ByHistory(0, Window());
  {
    std::lock_guard<std::mutex> lock(umu_);
    updated_layers_ = u.items.empty() ? moe_layers() : u.items.front().li;
    updating_ = true;
    queued_ = std::move(u);
  }
  ucv_.notify_all();
  if (options_.storage.overlap_optimizer()) return absl::OkStatus();
  return FinishExpertStep();
}

Status TieredExpertScheduler::FinishExpertStep() {
  std::unique_lock<std::mutex> lock(umu_);
  ucv_.wait(lock, [&] { return !updating_; });
  return update_error_;
}

void TieredExpertScheduler::UpdaterLoop() {
  std::unique_lock<std::mutex> lock(umu_);
  while (true) {
    ucv_.wait(lock, [&] { return stop_updater_ || queued_.has_value(); });
    if (!queued_) return;  // stopping, nothing left
    const Update u = std::move(*queued_);
    queued_.reset();
    lock.unlock();
    Status s = RunUpdate(u);
    lock.lock();
    if (!s.ok() && update_error_.ok()) update_error_ = s;
    updating_ = false;
    updated_layers_ = moe_layers();
    ucv_.notify_all();
  }
}

Status TieredExpertScheduler::RunUpdate(const Update& u) {
  if (tracer_) tracer_->NameThisThread("expert optimizer");
  auto keys_of = [&](const Item& it) {
    std::vector<TensorKey> k = {Key(it.li, it.e, TensorKind::kWeights),
                                Key(it.li, it.e, TensorKind::kAdamM),
                                Key(it.li, it.e, TensorKind::kAdamV)};
    if (it.grad) k.push_back(Key(it.li, it.e, TensorKind::kGrad));
    return k;
  };
  const size_t ahead = options_.storage.optimizer_prefetch();
  const std::vector<Item>& items = u.items;
  if (items.empty() || items.front().li > 0) PrefetchWeights(0, u.first_layer_prefetch);
  for (size_t i = 0; i < items.size(); ++i) {
    for (size_t j = i + 1; j < std::min(items.size(), i + 1 + ahead); ++j) {
      // A gradient still on the device comes down now, not when the update reaches it.
      if (items[j].grad) store_->WriteBack(Key(items[j].li, items[j].e, TensorKind::kGrad));
      store_->PrefetchHost(keys_of(items[j]));
    }
    const Item& it = items[i];
    const std::vector<TensorKey> keys = keys_of(it);
    const double t0 = tracer_ ? NowSeconds() : 0.0;
    std::vector<float*> ptr;
    Status s;
    for (const TensorKey& k : keys) {
      auto p = store_->AcquireHost(k, /*background=*/true);
      if (!p.ok()) {
        s = p.status();
        break;
      }
      ptr.push_back(*p);
    }
    const double t1 = tracer_ ? NowSeconds() : 0.0;
    if (tracer_ && t1 - t0 > 20e-6) {
      tracer_->Span(absl::StrFormat("wait L%d E%d", layers_[it.li].block, it.e), "stall", t0, t1);
    }
    if (s.ok()) {
      float* w = ptr[0];
      float* m = ptr[1];
      float* v = ptr[2];
      const float* g = it.grad ? ptr[3] : zeros_.data();
      for (const model::ExpertLayout::Segment& seg : layout_.segments) {
        ops::AdamWHyper h;
        h.lr = u.lr;
        h.beta1 = u.options.beta1;
        h.beta2 = u.options.beta2;
        h.eps = u.options.eps;
        h.weight_decay = seg.decay ? u.options.weight_decay : 0.0;
        h.step = u.step;
        h.grad_scale = u.grad_scale;
        ops::AdamWHost(*update_pool_, w + seg.offset, g + seg.offset, m + seg.offset,
                       v + seg.offset, seg.shape.numel(), h);
      }
      if (tracer_) {
        tracer_->Span(absl::StrFormat("adamw L%d E%d", layers_[it.li].block, it.e), "optimizer", t1,
                      NowSeconds());
      }
    }
    for (size_t k = 0; k < ptr.size(); ++k) {
      store_->ReleaseHost(keys[k], /*modified=*/s.ok() && k < 3);
    }
    if (!s.ok()) return s;
    // The moments are next used at the same point of the next update: after everything this
    // update has still to read, and the later in that order the later they are needed.
    store_->SetNextUse(std::span<const TensorKey>(keys).subspan(1, 2), u.next_use_base + i);
    if (it.grad) store_->Discard(keys[3]);
    const bool layer_done = i + 1 == items.size() || items[i + 1].li != it.li;
    if (layer_done) {
      {
        std::lock_guard<std::mutex> lock(umu_);
        updated_layers_ = i + 1 == items.size() ? moe_layers() : items[i + 1].li;
      }
      ucv_.notify_all();
      if (it.li == 0) PrefetchWeights(0, u.first_layer_prefetch);
    }
  }
  return absl::OkStatus();
}

ForwardPrefetchCounts TieredExpertScheduler::forward_prefetch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prefetch_counts_;
}

void TieredExpertScheduler::EndStep() {
  hinted_update_ = false;
  for (Layer& L : layers_) {
    for (double& h : L.history) h *= kHistoryDecay;
    std::fill(L.grad_sq.begin(), L.grad_sq.end(), 0.0);
  }
  FlushStageSpans();
  store_->EndStep();
  std::lock_guard<std::mutex> lock(mu_);
  error_ = absl::OkStatus();
}

}  // namespace strata::scheduler
