#include "storage/tiered_store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/strings/str_format.h"
#include "core/common/clock.h"
#include "core/common/logging.h"

namespace strata::storage {

const char* KindName(TensorKind kind) {
  switch (kind) {
    case TensorKind::kWeights:
      return "weights";
    case TensorKind::kGrad:
      return "grad";
    case TensorKind::kAdamM:
      return "adam_m";
    case TensorKind::kAdamV:
      return "adam_v";
  }
  return "?";
}

std::string TensorKey::ToString() const {
  return absl::StrFormat("layer %d expert %d %s", layer, expert, KindName(kind));
}

namespace {
enum Stage { kSsdStage = 0, kCopyStage = 1 };
thread_local int t_track = -1;  // the stage thread's trace track
}  // namespace

TieredExpertStore::TieredExpertStore(const StoreOptions& options) : options_(options) {}

StatusOr<std::unique_ptr<TieredExpertStore>> TieredExpertStore::Create(
    const StoreOptions& options) {
  if (options.tensor_bytes == 0 || options.tensor_bytes % 4 != 0) {
    return absl::InvalidArgumentError("expert tensors must be a positive number of floats");
  }
  if (options.ssd_threads < 1 || options.ssd_threads > 64) {
    return absl::InvalidArgumentError("storage.ssd_threads must be in [1, 64]");
  }
  std::unique_ptr<TieredExpertStore> s(new TieredExpertStore(options));
  if (options.shared_ssd) {
    s->ssd_ = options.shared_ssd;
  } else {
    ASSIGN_OR_RETURN(std::unique_ptr<BlockIo> io, MakeUringIo(options.io));
    if (options.wrap_io) io = options.wrap_io(std::move(io));
    ASSIGN_OR_RETURN(s->ssd_, SsdTier::Open(options.ssd, std::move(io)));
  }
  const bool gpu = !options.device.is_cpu();
  ASSIGN_OR_RETURN(s->host_,
                   SlotArena::Create("host", options.tensor_bytes, options.host_budget_bytes,
                                     options.host_budget, Device::Cpu(), /*pin=*/gpu));
  ASSIGN_OR_RETURN(s->device_,
                   SlotArena::Create("device", options.tensor_bytes, options.device_budget_bytes,
                                     options.device_budget, options.device));
  ASSIGN_OR_RETURN(s->copy_, CopyStream::Create(options.device));
  const uint64_t slot = s->host_->slot_bytes();
  if (s->device_->limited() && s->device_->capacity() < options.MinDeviceSlots()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "storage.device_budget_bytes leaves room for %d expert tensors of %d bytes, but %d "
        "compute threads need at least %d; raise the device budget by %d bytes or use fewer "
        "threads",
        s->device_->capacity(), slot, options.compute_threads, options.MinDeviceSlots(),
        (options.MinDeviceSlots() - s->device_->capacity()) * slot));
  }
  if (s->host_->limited() && s->host_->capacity() < options.MinHostSlots()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "storage.host_budget_bytes holds %d expert tensors of %d bytes, but %d compute threads "
        "need at least %d; raise it to at least %d bytes",
        s->host_->capacity(), slot, options.compute_threads, options.MinHostSlots(),
        options.MinHostSlots() * slot));
  }
  s->ssd_->RegisterRegions(s->host_->Regions());
  // Trace tracks: 0 the first ssd stage thread, 1 the copy stage, 2.. the other ssd threads.
  const int ssd_threads = options.ssd_threads;
  for (int i = 0; i <= ssd_threads; ++i) {
    const int stage = i < ssd_threads ? kSsdStage : kCopyStage;
    const int track = i == 0 ? 0 : i < ssd_threads ? 1 + i : 1;
    s->stages_.emplace_back([ptr = s.get(), stage, track] { ptr->StageLoop(stage, track); });
  }
  return s;
}

TieredExpertStore::~TieredExpertStore() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& cv : work_cv_) cv.SignalAll();
  cv_.SignalAll();
  for (auto& t : stages_) {
    if (t.joinable()) t.join();
  }
}

int TieredExpertStore::device_slots() const { return device_->capacity(); }
int TieredExpertStore::host_slots() const { return host_->capacity(); }

TieredExpertStore::Entry& TieredExpertStore::EntryLocked(const TensorKey& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    it = entries_.emplace(key, Entry{}).first;
    it->second.key = key;
  }
  return it->second;
}

void TieredExpertStore::EnqueueLocked(int stage, Job job, bool demand) {
  auto& q = queue_[stage];
  for (auto it = q.begin(); it != q.end(); ++it) {
    if (it->key == job.key && it->type == job.type) {
      if (!demand) return;
      q.erase(it);  // promote: demand goes ahead of hints
      break;
    }
  }
  if (demand) {
    // Behind earlier demand jobs, ahead of all hints: find the first hint.
    auto pos = q.begin();
    while (pos != q.end() && pos->demand) ++pos;
    job.demand = true;
    q.insert(pos, job);
  } else {
    job.demand = false;
    q.push_back(job);
  }
  work_cv_[stage].SignalAll();
}

void TieredExpertStore::Span(const char* name, int thread, double start, const TensorKey& key) {
  if (!record_spans_) return;
  if (t_track >= 0) thread = t_track;
  absl::MutexLock lock(&mu_);
  spans_.push_back(StageSpan{name, thread, start, NowSeconds(), key});
}

// --- Compute-side access ----------------------------------------------------------------------

StatusOr<float*> TieredExpertStore::AcquireDevice(const TensorKey& key, bool zero) {
  absl::ReleasableMutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  e.hits += 1;
  e.next_use = 0;
  e.dev_pins++;
  e.dev_last_use = ++clock_;
  if (zero) {
    // A fresh gradient: its previous value is dropped wherever it was.
    while (e.dev != DevState::kReady) {
      if (e.dev == DevState::kAbsent) {
        const int slot = DeviceSlotLocked();
        if (slot >= 0) {
          e.dev_slot = slot;
          e.dev = DevState::kReady;
          break;
        }
        QueueDirtyWriteBackLocked();  // make room: move the oldest finished gradient down
      }
      const double t0 = NowSeconds();
      cv_.Wait(&mu_);
      stats_.stall_seconds += NowSeconds() - t0;
    }
    if (e.host_slot >= 0 && e.host == HostState::kReady && e.host_pins == 0) {
      host_->Free(e.host_slot);
      e.host_slot = -1;
      e.host = HostState::kAbsent;
    }
    if (e.has_ssd) {
      UnrefLocked(key, e.ssd_version);
      e.has_ssd = false;
    }
    e.ssd_current = false;
    e.host_dirty = false;
    e.materialized = true;
    e.generation++;
    float* p = device_->data(e.dev_slot);
    lock.Release();
    ZeroBytes(options_.device, p, options_.tensor_bytes);
    return p;
  }
  if (e.dev == DevState::kReady) {
    stats_.device.hits++;
    return device_->data(e.dev_slot);
  }
  stats_.device.misses++;
  if (e.dev == DevState::kAbsent) {
    e.dev = DevState::kLoading;
    e.error = absl::OkStatus();
  }
  EnqueueLocked(kCopyStage, Job{key, Job::kLoadDevice}, /*demand=*/true);
  const double t0 = NowSeconds();
  while (!(e.dev == DevState::kReady || !e.error.ok())) cv_.Wait(&mu_);
  stats_.stall_seconds += NowSeconds() - t0;
  if (!e.error.ok()) {
    e.dev_pins--;
    return e.error;
  }
  return device_->data(e.dev_slot);
}

void TieredExpertStore::ReleaseDevice(const TensorKey& key, bool modified) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  CHECK_GT(e.dev_pins, 0) << key.ToString();
  e.dev_pins--;
  if (modified) {
    e.dev_dirty = true;
    e.ssd_current = false;
    e.materialized = true;
    e.generation++;
    if (e.host_slot >= 0 && e.host == HostState::kReady && e.host_pins == 0) {
      host_->Free(e.host_slot);  // stale now
      e.host_slot = -1;
      e.host = HostState::kAbsent;
      e.host_dirty = false;
    }
  }
  cv_.SignalAll();
}

StatusOr<float*> TieredExpertStore::AcquireHost(const TensorKey& key, bool background) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  e.hits += 1;
  e.host_last_use = ++clock_;
  e.host_unused = false;
  e.next_use = 0;
  e.host_pins++;
  double& waited = background ? stats_.background_wait_seconds : stats_.stall_seconds;
  bool counted = false;
  const double t0 = NowSeconds();
  while (true) {
    if (!e.error.ok()) {
      e.host_pins--;
      Status s = e.error;
      e.error = absl::OkStatus();
      return s;
    }
    if (e.dev_dirty) {
      // The value is on the device: bring it down first.
      if (!e.write_back_queued) {
        e.write_back_queued = true;
        EnqueueLocked(kCopyStage, Job{key, Job::kWriteBack}, true);
      }
    } else if (e.host == HostState::kReady && e.host_readers == 0) {
      if (!counted) stats_.host.hits++;
      waited += NowSeconds() - t0;
      e.host_unused = false;
      e.host_writers++;
      return host_->data(e.host_slot);
    } else if (e.host == HostState::kAbsent) {
      e.host = HostState::kLoading;
      EnqueueLocked(kSsdStage, Job{key, Job::kLoadHost}, true);
    } else if (e.host == HostState::kLoading) {
      EnqueueLocked(kSsdStage, Job{key, Job::kLoadHost}, true);  // promote a hint
    }
    if (!counted) {
      stats_.host.misses++;
      counted = true;
    }
    cv_.Wait(&mu_);
  }
}

void TieredExpertStore::ReleaseHost(const TensorKey& key, bool modified) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  CHECK_GT(e.host_pins, 0) << key.ToString();
  CHECK_GT(e.host_writers, 0) << key.ToString();
  e.host_pins--;
  e.host_writers--;
  if (modified) {
    e.host_dirty = true;
    e.ssd_current = false;
    e.materialized = true;
    e.generation++;
    WantCleanLocked();
    if (e.dev != DevState::kAbsent) {
      CHECK_EQ(e.dev_pins, 0) << key.ToString() << " changed on the host while pinned on device";
      if (e.dev == DevState::kReady) DropDeviceLocked(e);
    }
  }
  cv_.SignalAll();
}

void TieredExpertStore::WriteBack(const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  if (!e.dev_dirty || e.write_back_queued) return;
  e.write_back_queued = true;
  EnqueueLocked(kCopyStage, Job{key, Job::kWriteBack}, true);
}

bool TieredExpertStore::WriteBacksPendingLocked(Status* error) {
  for (auto& [k, e] : entries_) {
    if (e.write_back_queued && e.error.ok()) return true;
    if (!e.error.ok() && error->ok()) *error = e.error;
  }
  return false;
}

Status TieredExpertStore::DrainWriteBacks() {
  absl::MutexLock lock(&mu_);
  const double t0 = NowSeconds();
  Status error;
  while (WriteBacksPendingLocked(&error)) cv_.Wait(&mu_);
  stats_.stall_seconds += NowSeconds() - t0;
  return error;
}

void TieredExpertStore::WaitIdle() {
  absl::MutexLock lock(&mu_);
  while (!(stop_ || (queue_[0].empty() && queue_[1].empty() && busy_[0] == 0 && busy_[1] == 0 &&
                     !clean_wanted_))) {
    cv_.Wait(&mu_);
  }
}

void TieredExpertStore::Discard(const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  while (!(e.host != HostState::kLoading && e.host != HostState::kEvicting &&
           e.dev != DevState::kLoading && !e.write_back_queued && e.host_pins == 0 &&
           e.dev_pins == 0)) {
    cv_.Wait(&mu_);
  }
  if (e.host_slot >= 0) host_->Free(e.host_slot);
  if (e.dev_slot >= 0) device_->Free(e.dev_slot);
  if (e.has_ssd) UnrefLocked(key, e.ssd_version);
  // By key: the wait let other threads insert entries, which may have rehashed the table.
  entries_.erase(key);
  cv_.SignalAll();
}

void TieredExpertStore::set_initializer(std::function<void(const TensorKey&, float*)> initializer) {
  absl::MutexLock lock(&mu_);
  CHECK(queue_[kSsdStage].empty() && queue_[kCopyStage].empty() && busy_[kSsdStage] == 0 &&
        busy_[kCopyStage] == 0)
      << "the initializer of a tiered store changed while its stages had work";
  options_.initializer = std::move(initializer);
}

int TieredExpertStore::DiscardUnless(const std::function<bool(const TensorKey&)>& keep) {
  std::vector<TensorKey> gone;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [k, e] : entries_) {
      if (!keep(k)) gone.push_back(k);
    }
  }
  for (const TensorKey& k : gone) Discard(k);
  return static_cast<int>(gone.size());
}

bool TieredExpertStore::Materialized(const TensorKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.materialized;
}

bool TieredExpertStore::DeviceReady(const TensorKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  return it != entries_.end() && it->second.dev == DevState::kReady;
}

// --- Hints --------------------------------------------------------------------------------------

void TieredExpertStore::PrefetchDevice(std::span<const TensorKey> keys) {
  absl::MutexLock lock(&mu_);
  for (const TensorKey& k : keys) {
    Entry& e = EntryLocked(k);
    if (e.dev != DevState::kAbsent || e.dev_dirty) continue;
    e.dev = DevState::kLoading;
    e.error = absl::OkStatus();
    EnqueueLocked(kCopyStage, Job{k, Job::kLoadDevice}, false);
    e.hint_needed_at = 0;  // the device copy needs the host copy, whatever an earlier hint said
    // Start the SSD read now, so both links work at once.
    if (e.host == HostState::kAbsent) {
      e.host = HostState::kLoading;
      EnqueueLocked(kSsdStage, Job{k, Job::kLoadHost}, false);
    }
  }
}

int TieredExpertStore::PrefetchHost(std::span<const TensorKey> keys, uint64_t needed_at) {
  absl::MutexLock lock(&mu_);
  int queued = 0;
  for (const TensorKey& k : keys) {
    Entry& e = EntryLocked(k);
    if (e.host == HostState::kLoading && needed_at == 0) e.hint_needed_at = 0;  // now wanted
    if (e.host != HostState::kAbsent || e.dev_dirty) continue;
    e.host = HostState::kLoading;
    e.hint_needed_at = needed_at;
    e.error = absl::OkStatus();
    EnqueueLocked(kSsdStage, Job{k, Job::kLoadHost}, false);
    ++queued;
  }
  return queued;
}

void TieredExpertStore::WantCleanLocked() {
  if (clean_wanted_ || !options_.clean_ahead || !host_->limited()) return;
  // Only when the next evictions are near: fewer free slots than the entries it keeps clean.
  if (host_->capacity() - host_->in_use() > options_.ssd_threads) return;
  clean_wanted_ = true;
  work_cv_[kSsdStage].Signal();
}

void TieredExpertStore::ForgetNextUses() {
  absl::MutexLock lock(&mu_);
  for (auto& [k, e] : entries_) e.next_use = 0;
}

void TieredExpertStore::SetNextUse(std::span<const TensorKey> keys, uint64_t when) {
  absl::MutexLock lock(&mu_);
  for (const TensorKey& k : keys) {
    auto it = entries_.find(k);
    if (it != entries_.end()) it->second.next_use = when;
  }
}

// --- Stage threads -----------------------------------------------------------------------------

void TieredExpertStore::StageLoop(int stage, int track) {
  t_track = track;
  // Its CUDA calls (page-locking a grown host slot, copies) in the context of the store's GPU.
  UseDevice(options_.device);
  absl::MutexLock lock(&mu_);
  while (true) {
    while (!(stop_ || !queue_[stage].empty() || (stage == kSsdStage && clean_wanted_))) {
      work_cv_[stage].Wait(&mu_);
    }
    if (stop_) return;
    if (queue_[stage].empty()) {
      // Nothing asked for: write back the dirty entries the next evictions will take, so that
      // they (and the copy stage's gradient write-backs, which need a host slot) find clean
      // victims and do not wait for an SSD write.
      TensorKey key;
      if (!PickCleanLocked(&key)) {
        clean_wanted_ = false;
        cv_.SignalAll();  // WaitIdle
        continue;
      }
      busy_[stage]++;
      Clean(key);
      busy_[stage]--;
      cv_.SignalAll();
      continue;
    }
    Job job = queue_[stage].front();
    queue_[stage].pop_front();
    busy_[stage]++;
    mu_.Unlock();
    Status s;
    switch (job.type) {
      case Job::kLoadHost:
        s = LoadHost(job.key, !job.demand);
        break;
      case Job::kLoadDevice:
        s = LoadDevice(job.key);
        break;
      case Job::kWriteBack:
        s = DoWriteBack(job.key);
        break;
    }
    mu_.Lock();
    busy_[stage]--;
    if (!s.ok()) {
      STRATA_LOG(ERROR) << "tiered store: " << s;
      Entry& e = EntryLocked(job.key);
      e.error = s;
    }
    cv_.SignalAll();
  }
}

bool TieredExpertStore::EvictsBefore(const Entry& a, const Entry& b) {
  // An entry whose next use the plan puts latest (SetNextUse), else LFU: the one with the fewest
  // hits (ties: the least recently used); a prefetched entry not used yet goes last.
  auto order = [](const Entry& e) {
    return std::make_tuple(e.host_unused, e.next_use == 0,
                           std::numeric_limits<uint64_t>::max() - e.next_use, e.hits,
                           e.host_last_use);
  };
  return order(a) < order(b);
}

bool TieredExpertStore::PickCleanLocked(TensorKey* key) {
  if (!options_.clean_ahead || !host_->limited() || clean_failed_) return false;
  // The slots the next evictions will take: free ones first, then the first victims in order.
  const int want = options_.ssd_threads + 1 - (host_->capacity() - host_->in_use());
  if (want <= 0) return false;
  std::vector<Entry*> next;
  for (auto& [k, e] : entries_) {
    if (e.host == HostState::kReady && (e.host_pins == 0 || e.cleaning)) next.push_back(&e);
  }
  const size_t n = std::min(next.size(), static_cast<size_t>(want));
  std::partial_sort(next.begin(), next.begin() + static_cast<std::ptrdiff_t>(n), next.end(),
                    [](const Entry* a, const Entry* b) {
                      // An entry being cleaned is as good as clean: it comes first.
                      if (a->cleaning != b->cleaning) return a->cleaning;
                      return EvictsBefore(*a, *b);
                    });
  for (size_t i = 0; i < n; ++i) {
    if (next[i]->host_dirty && !next[i]->cleaning && !next[i]->dev_dirty) {
      *key = next[i]->key;
      return true;
    }
  }
  return false;
}

void TieredExpertStore::Clean(const TensorKey& key) {
  Entry& e = EntryLocked(key);
  e.cleaning = true;
  e.host_pins++;
  e.host_readers++;
  const uint64_t generation = e.generation;
  const uint64_t version = NextVersionLocked(key);
  const float* data = host_->data(e.host_slot);
  mu_.Unlock();
  const double t0 = NowSeconds();
  auto stored = ssd_->Write(data, options_.tensor_bytes);
  Span("ssd_write", kSsdStage, t0, key);
  mu_.Lock();
  e.cleaning = false;
  e.host_pins--;
  e.host_readers--;
  cv_.SignalAll();
  if (!stored.ok()) {
    // The value is still on the host, and an eviction writes it (and reports a failure) later.
    STRATA_LOG(WARNING) << "tiered store: writing back " << key.ToString()
                        << " ahead of its eviction failed (" << stored.status()
                        << "); evictions write their victims themselves until the next step";
    clean_failed_ = true;
    return;
  }
  stats_.ssd.bytes_in += stored->extent.length;
  stats_.host.bytes_out += options_.tensor_bytes;
  if (e.generation != generation || !e.host_dirty || e.host != HostState::kReady) {
    ssd_->Free(stored->extent);  // changed meanwhile: this copy is stale
    return;
  }
  RefLocked(key, version, *stored);
  if (e.has_ssd) UnrefLocked(key, e.ssd_version);
  e.has_ssd = true;
  e.ssd_version = version;
  e.ssd = *stored;
  e.ssd_current = true;
  e.host_dirty = false;
}

StatusOr<int> TieredExpertStore::HostSlotLocked(uint64_t needed_at) {
  while (true) {
    if (stop_) return absl::CancelledError("the store is shutting down");
    const int free_slot = host_->Allocate();
    WantCleanLocked();
    if (free_slot >= 0) return free_slot;
    // The first unpinned resident entry in eviction order; entries being written back ahead are
    // not candidates, but one dirty victim is not worth writing here while such a write, which
    // leaves a clean victim, is in flight.
    Entry* victim = nullptr;
    bool cleaning = false;
    for (auto& [k, e] : entries_) {
      cleaning = cleaning || e.cleaning;
      if (e.host != HostState::kReady || e.host_pins > 0) continue;
      if (victim == nullptr || EvictsBefore(e, *victim)) victim = &e;
    }
    if (needed_at > 0 &&
        (victim == nullptr || victim->host_unused || victim->next_use <= needed_at)) {
      return -1;  // nothing needed later than the caller's tensor
    }
    if (victim == nullptr || (victim->host_dirty && cleaning)) {
      // Everything is pinned or in flight, or a clean victim is about to appear: wait.
      cv_.Wait(&mu_);
      continue;
    }
    Entry& v = *victim;
    v.host = HostState::kEvicting;
    if (v.host_dirty) {
      const uint64_t version = NextVersionLocked(v.key);
      const float* data = host_->data(v.host_slot);
      const TensorKey key = v.key;
      mu_.Unlock();
      const double t0 = NowSeconds();
      auto stored = ssd_->Write(data, options_.tensor_bytes);
      Span("ssd_write", kSsdStage, t0, key);
      mu_.Lock();
      if (!stored.ok()) {
        v.host = HostState::kReady;  // keep it; the write failed
        cv_.SignalAll();
        return absl::Status(stored.status().code(), absl::StrCat("writing back ", key.ToString(),
                                                                 ": ", stored.status().message()));
      }
      stats_.ssd.bytes_in += stored->extent.length;
      stats_.host.bytes_out += options_.tensor_bytes;
      RefLocked(v.key, version, *stored);
      if (v.has_ssd) UnrefLocked(v.key, v.ssd_version);
      v.has_ssd = true;
      v.ssd_version = version;
      v.ssd = *stored;
      v.ssd_current = true;
      v.host_dirty = false;
    }
    const int slot = v.host_slot;
    v.host_slot = -1;
    v.host = HostState::kAbsent;
    stats_.host.evictions++;
    cv_.SignalAll();
    return slot;
  }
}

int TieredExpertStore::DeviceSlotLocked() {
  const int free_slot = device_->Allocate();
  if (free_slot >= 0) return free_slot;
  // LRU among unpinned clean copies.
  Entry* victim = nullptr;
  for (auto& [k, e] : entries_) {
    if (e.dev != DevState::kReady || e.dev_pins > 0 || e.dev_dirty) continue;
    if (victim == nullptr || e.dev_last_use < victim->dev_last_use) victim = &e;
  }
  if (victim == nullptr) return -1;
  const int slot = victim->dev_slot;
  victim->dev_slot = -1;
  victim->dev = DevState::kAbsent;
  stats_.device.evictions++;
  return slot;
}

bool TieredExpertStore::QueueDirtyWriteBackLocked() {
  Entry* oldest = nullptr;
  for (auto& [k, e] : entries_) {
    if (e.dev != DevState::kReady || !e.dev_dirty || e.dev_pins > 0 || e.write_back_queued) {
      continue;
    }
    if (oldest == nullptr || e.dev_last_use < oldest->dev_last_use) oldest = &e;
  }
  if (oldest == nullptr) return false;
  oldest->write_back_queued = true;
  EnqueueLocked(kCopyStage, Job{oldest->key, Job::kWriteBack}, true);
  return true;
}

void TieredExpertStore::DropDeviceLocked(Entry& e) {
  device_->Free(e.dev_slot);
  e.dev_slot = -1;
  e.dev = DevState::kAbsent;
  e.dev_dirty = false;
}

Status TieredExpertStore::LoadHost(const TensorKey& key, bool hint) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  // Another job for the same tensor (a hint promoted after it was taken) finds it in hand.
  if (e.host != HostState::kLoading || e.host_slot >= 0 || e.host_claimed) return absl::OkStatus();
  if (e.dev_dirty) {  // the value lives on the device; AcquireHost will write it back
    e.host = HostState::kAbsent;
    return absl::OkStatus();
  }
  e.host_claimed = true;
  const uint64_t needed_at = hint ? e.hint_needed_at : 0;
  e.hint_needed_at = 0;
  auto slot = HostSlotLocked(needed_at);
  if (!slot.ok() || *slot < 0) {
    e.host_claimed = false;
    e.host = HostState::kAbsent;
    cv_.SignalAll();
    return slot.ok() ? absl::OkStatus()
                     : slot.status();  // a conditional hint with no room: dropped
  }
  e.host_slot = *slot;
  float* dst = host_->data(e.host_slot);
  const bool from_ssd = e.has_ssd && e.ssd_current;
  const bool generated = !e.materialized;
  const StoredExtent stored = e.ssd;
  const uint64_t version = e.ssd_version;
  mu_.Unlock();
  Status s;
  const double t0 = NowSeconds();
  if (from_ssd) {
    s = ssd_->Read(stored, dst, absl::StrFormat("%s v%d", key.ToString(), version));
    Span("ssd_read", kSsdStage, t0, key);
  } else if (generated && key.kind == TensorKind::kWeights && options_.initializer) {
    options_.initializer(key, dst);
  } else if (generated) {
    std::memset(dst, 0, options_.tensor_bytes);
  } else {
    s = absl::InternalError(absl::StrCat(key.ToString(), " has no readable copy"));
  }
  mu_.Lock();
  e.host_claimed = false;
  if (!s.ok()) {
    host_->Free(e.host_slot);
    e.host_slot = -1;
    e.host = HostState::kAbsent;
    e.error = s;
    if (e.dev == DevState::kLoading) e.dev = DevState::kAbsent;
    return s;
  }
  if (from_ssd) {
    stats_.ssd.bytes_out += stored.extent.length;
    stats_.host.bytes_in += options_.tensor_bytes;
  }
  e.host = HostState::kReady;
  e.host_dirty = false;  // a generated value can be generated again; an SSD copy is current
  e.host_last_use = ++clock_;
  e.host_unused = hint;
  cv_.SignalAll();
  return absl::OkStatus();
}

Status TieredExpertStore::LoadDevice(const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  if (e.dev != DevState::kLoading) return absl::OkStatus();
  // The host copy first (the SSD stage brings it), and nobody writing it.
  while (e.host != HostState::kReady || e.host_writers > 0) {
    if (!e.error.ok()) {
      e.dev = DevState::kAbsent;
      return absl::OkStatus();  // already reported by the SSD stage
    }
    if (e.host == HostState::kAbsent) {
      e.host = HostState::kLoading;
      EnqueueLocked(kSsdStage, Job{key, Job::kLoadHost}, true);
    } else if (e.host == HostState::kLoading) {
      EnqueueLocked(kSsdStage, Job{key, Job::kLoadHost}, true);
    }
    cv_.Wait(&mu_);
    if (stop_) return absl::CancelledError("shutting down");
  }
  e.host_pins++;
  e.host_readers++;
  e.host_unused = false;  // the device copy is its use
  int slot;
  while ((slot = DeviceSlotLocked()) < 0) {
    // Full of pinned or dirty tensors: finish queued write-backs (they free slots), or wait.
    auto& q = queue_[kCopyStage];
    auto wb =
        std::find_if(q.begin(), q.end(), [](const Job& j) { return j.type == Job::kWriteBack; });
    if (wb != q.end()) {
      const TensorKey wkey = wb->key;
      q.erase(wb);
      mu_.Unlock();
      Status s = DoWriteBack(wkey);
      mu_.Lock();
      if (!s.ok()) EntryLocked(wkey).error = s;
      continue;
    }
    if (QueueDirtyWriteBackLocked()) continue;
    cv_.Wait(&mu_);
    if (stop_) return absl::CancelledError("shutting down");
  }
  e.dev_slot = slot;
  float* dst = device_->data(slot);
  const float* src = host_->data(e.host_slot);
  mu_.Unlock();
  const double t0 = NowSeconds();
  // After the kernels that last read this slot (h2d) or wrote this gradient (d2h).
  Status copied = copy_->WaitForDeviceWork();
  if (copied.ok()) copied = copy_->CopyAsync(dst, src, options_.tensor_bytes);
  if (copied.ok()) copied = copy_->Synchronize();
  Span("h2d_copy", kCopyStage, t0, key);
  mu_.Lock();
  if (!copied.ok()) {
    e.host_pins--;
    e.host_readers--;
    device_->Free(slot);
    e.dev_slot = -1;
    e.dev = DevState::kAbsent;
    e.error = copied;
    cv_.SignalAll();
    return copied;
  }
  e.host_pins--;
  e.host_readers--;
  e.dev = DevState::kReady;
  e.dev_last_use = ++clock_;  // a fresh prefetch is not the next victim
  stats_.device.bytes_in += options_.tensor_bytes;
  stats_.host.bytes_out += options_.tensor_bytes;
  cv_.SignalAll();
  return absl::OkStatus();
}

Status TieredExpertStore::DoWriteBack(const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  if (!e.dev_dirty) {
    e.write_back_queued = false;
    cv_.SignalAll();
    return absl::OkStatus();
  }
  // Also until no stage or snapshot reads a stale host copy it is about to replace.
  while (!((e.dev_pins == 0 && e.host_readers == 0) || stop_)) cv_.Wait(&mu_);
  if (stop_) return absl::CancelledError("shutting down");
  auto slot = HostSlotLocked();
  if (!slot.ok()) {
    e.write_back_queued = false;
    return slot.status();
  }
  if (e.host_slot >= 0) {  // a stale copy
    host_->Free(e.host_slot);
  }
  e.host_slot = *slot;
  e.host = HostState::kLoading;
  e.dev_pins++;
  float* dst = host_->data(e.host_slot);
  const float* src = device_->data(e.dev_slot);
  mu_.Unlock();
  const double t0 = NowSeconds();
  // After the kernels that last read this slot (h2d) or wrote this gradient (d2h).
  Status copied = copy_->WaitForDeviceWork();
  if (copied.ok()) copied = copy_->CopyAsync(dst, src, options_.tensor_bytes);
  if (copied.ok()) copied = copy_->Synchronize();
  Span("d2h_copy", kCopyStage, t0, key);
  mu_.Lock();
  e.dev_pins--;
  if (!copied.ok()) {  // the gradient is still on the device: keep it there, report the error
    host_->Free(e.host_slot);
    e.host_slot = -1;
    e.host = HostState::kAbsent;
    e.write_back_queued = false;
    cv_.SignalAll();
    return copied;
  }
  DropDeviceLocked(e);
  e.host = HostState::kReady;
  e.host_dirty = true;
  WantCleanLocked();
  e.host_last_use = ++clock_;
  e.write_back_queued = false;
  stats_.device.bytes_out += options_.tensor_bytes;
  stats_.host.bytes_in += options_.tensor_bytes;
  cv_.SignalAll();
  return absl::OkStatus();
}

// --- Versions and checkpoints -----------------------------------------------------------------

uint64_t TieredExpertStore::NextVersionLocked(const TensorKey& key) { return ++next_version_[key]; }

void TieredExpertStore::ReserveVersions(const TensorKey& key, uint64_t version) {
  absl::MutexLock lock(&mu_);
  auto& next = next_version_[key];
  next = std::max(next, version);
}

uint64_t TieredExpertStore::NextVersion(const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  return NextVersionLocked(key);
}

void TieredExpertStore::RefLocked(const TensorKey& key, uint64_t version,
                                  const StoredExtent& stored) {
  auto& r = versions_[{key, version}];
  if (r.refs == 0) r.stored = stored;
  r.refs++;
}

void TieredExpertStore::UnrefLocked(const TensorKey& key, uint64_t version) {
  auto it = versions_.find({key, version});
  CHECK(it != versions_.end()) << "unref of an unknown version " << key.ToString() << " v"
                               << version;
  if (--it->second.refs == 0) {
    ssd_->Free(it->second.stored.extent);
    versions_.erase(it);
  }
}

void TieredExpertStore::RefVersion(const TensorKey& key, uint64_t version,
                                   const StoredExtent& stored) {
  absl::MutexLock lock(&mu_);
  RefLocked(key, version, stored);
}

void TieredExpertStore::UnrefVersion(const TensorKey& key, uint64_t version) {
  absl::MutexLock lock(&mu_);
  UnrefLocked(key, version);
}

Status TieredExpertStore::SnapshotTensor(const TensorKey& key, float* copy, Snapshot* out) {
  absl::MutexLock lock(&mu_);
  *out = Snapshot{};
  Entry& e = EntryLocked(key);
  while (!(e.host != HostState::kLoading && e.host != HostState::kEvicting &&
           !e.write_back_queued && e.host_writers == 0)) {
    cv_.Wait(&mu_);
  }
  if (e.dev_dirty) {
    return absl::FailedPreconditionError(
        absl::StrCat(key.ToString(), " is being computed; checkpoint between steps"));
  }
  if (!e.materialized) {
    out->generated = true;
    return absl::OkStatus();
  }
  if (e.has_ssd && e.ssd_current) {
    RefLocked(key, e.ssd_version, e.ssd);
    out->has_stored = true;
    out->stored = e.ssd;
    out->version = e.ssd_version;
    return absl::OkStatus();
  }
  CHECK(e.host == HostState::kReady) << key.ToString() << ": value neither on SSD nor host";
  e.host_pins++;
  e.host_readers++;
  out->generation = e.generation;
  const float* src = host_->data(e.host_slot);
  mu_.Unlock();
  std::memcpy(copy, src, options_.tensor_bytes);
  mu_.Lock();
  e.host_pins--;
  e.host_readers--;
  cv_.SignalAll();
  return absl::OkStatus();
}

void TieredExpertStore::AdoptVersion(const TensorKey& key, uint64_t generation, uint64_t version,
                                     const StoredExtent& stored) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (e.generation != generation || e.dev_dirty || e.host == HostState::kEvicting) return;
  RefLocked(key, version, stored);
  if (e.has_ssd) UnrefLocked(key, e.ssd_version);
  e.has_ssd = true;
  e.ssd_version = version;
  e.ssd = stored;
  e.ssd_current = true;
  e.host_dirty = false;
}

void TieredExpertStore::SetStored(const TensorKey& key, uint64_t version,
                                  const StoredExtent& stored) {
  absl::MutexLock lock(&mu_);
  Entry& e = EntryLocked(key);
  CHECK(e.host == HostState::kAbsent && e.dev == DevState::kAbsent)
      << key.ToString() << ": resume into a store that already holds it";
  RefLocked(key, version, stored);
  if (e.has_ssd) UnrefLocked(key, e.ssd_version);
  e.has_ssd = true;
  e.ssd_version = version;
  e.ssd = stored;
  e.ssd_current = true;
  e.materialized = true;
  auto& next = next_version_[key];
  next = std::max(next, version);
}

// --- Steps and statistics ---------------------------------------------------------------------

void TieredExpertStore::EndStep() {
  absl::MutexLock lock(&mu_);
  ++steps_;
  clean_failed_ = false;  // a full disk may have room again
  if (options_.lfu_decay_interval > 0 && steps_ % options_.lfu_decay_interval == 0) {
    for (auto& [k, e] : entries_) e.hits *= options_.lfu_decay;
  }
}

void TieredExpertStore::AddStall(double seconds) {
  absl::MutexLock lock(&mu_);
  stats_.stall_seconds += seconds;
}

StoreStats TieredExpertStore::TakeStats() {
  absl::MutexLock lock(&mu_);
  StoreStats s = stats_;
  stats_ = StoreStats{};
  const SsdStats io = ssd_->stats();
  s.ssd_read_seconds = io.read_seconds - last_ssd_.read_seconds;
  s.ssd_write_seconds = io.write_seconds - last_ssd_.write_seconds;
  last_ssd_ = io;
  s.device.used_bytes = device_->bytes_in_use();
  s.device.budget_bytes = options_.device_budget_bytes;
  s.host.used_bytes = host_->bytes_in_use();
  s.host.budget_bytes = options_.host_budget_bytes;
  s.ssd.used_bytes = ssd_->used_bytes();
  s.ssd.budget_bytes = options_.ssd.capacity_bytes;
  return s;
}

std::vector<StageSpan> TieredExpertStore::TakeSpans() {
  absl::MutexLock lock(&mu_);
  std::vector<StageSpan> out;
  out.swap(spans_);
  return out;
}

}  // namespace strata::storage
