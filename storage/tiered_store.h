// TieredExpertStore: expert weights, gradients and Adam moments in device / host / SSD tiers.
//
// Where a tensor's value is:
// - Every tensor has a key (layer, expert, kind) and the same size. Its current value is in
//   exactly one place that counts, checked in this order: a dirty device copy (a gradient just
//   written by backward); a resident host copy (dirty when newer than the SSD copy); the latest
//   stored SSD version, when it is current; nowhere (never written: weights come from the
//   initialiser, everything else is zero).
// - A device copy of weights is a clean copy: dropping it loses nothing. A dirty host copy is
//   written to the SSD tier before its slot is reused.
//
// How residency moves (two stages, so both links are busy at once: SE-MoE's vertical prefetch):
// - ssd stage, SSD -> host: reads (or initialises) tensors into host slots, evicting the coldest
//   unpinned host entry, written back first if dirty. StoreOptions::ssd_threads serve it, so one
//   thread's I/O is on the device while another picks a victim and checks a CRC. With nothing
//   queued they write back the next victims ahead of eviction (StoreOptions::clean_ahead).
// - copy stage, one thread: host -> device copies into device slots (evicting the least recently
//   used unpinned clean copy), and device -> host write-backs of dirty device tensors.
// - Compute threads Acquire a tensor where they need it, which pins it and waits (counted as
//   stall time) until a stage has brought it; hints (Prefetch*) queue the same work without
//   pinning. Demand work goes ahead of hints.
//
// Budgets and eviction:
// - Budgets are hard: a limited tier never allocates past its budget. Progress needs a few free
//   slots (StoreOptions::MinDeviceSlots / MinHostSlots); Create checks them.
// - LFU with decay (SE-MoE): every Acquire adds a hit; every `lfu_decay_interval` steps (EndStep)
//   all hits are multiplied by `lfu_decay`; eviction takes the fewest hits, then the least
//   recently used (of a step's gradients the first ones backward wrote go first, and the last
//   ones, which the optimizer takes first, stay).
// - Where the caller knows when an entry is next used (SetNextUse: the optimizer's Adam moments),
//   that plan comes first: such entries go before the others, the one needed latest first.
// - A tensor a hint brought in and nobody has used yet goes only when nothing else can.
//
// Ownership and threads:
// - Every method may be called from any thread (compute threads, the optimizer, the checkpoint
//   writer) except where it says otherwise. One absl::Mutex, whose guarded members clang checks,
//   guards the entry table; transfers run outside it.
// - The store owns its stage threads, arenas and copy stream; it shares the SSD tier.
// - Destroying it stops the stages (queued work is dropped) and joins them; no other thread may be
//   inside a call then.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/common/status.h"
#include "core/device/device.h"
#include "storage/block_io.h"
#include "storage/slot_arena.h"
#include "storage/ssd_tier.h"

namespace strata::storage {

enum class TensorKind : uint8_t { kWeights = 0, kGrad = 1, kAdamM = 2, kAdamV = 3 };
const char* KindName(TensorKind kind);

struct TensorKey {
  int32_t layer = 0;
  int32_t expert = 0;
  TensorKind kind = TensorKind::kWeights;

  bool operator==(const TensorKey& o) const {
    return layer == o.layer && expert == o.expert && kind == o.kind;
  }
  bool operator<(const TensorKey& o) const {
    if (layer != o.layer) return layer < o.layer;
    if (expert != o.expert) return expert < o.expert;
    return kind < o.kind;
  }
  std::string ToString() const;
};

struct TensorKeyHash {
  size_t operator()(const TensorKey& k) const {
    return (static_cast<size_t>(static_cast<uint32_t>(k.layer)) * 1000003u) ^
           (static_cast<size_t>(static_cast<uint32_t>(k.expert)) * 8191u) ^
           static_cast<size_t>(k.kind);
  }
};

struct StoreOptions {
  uint64_t tensor_bytes = 0;  // bytes of every tensor (multiple of 4)
  // Where the device tier lives. On a GPU (cuda:N) device slots are cudaMalloc memory, host slots
  // are page-locked (so SSD reads land in memory the GPU copies from by DMA), and host<->device
  // copies run on the copy stage's own CUDA stream, off the compute stream. On the CPU device the
  // device tier is host memory under its budget, so out-of-core behaviour is the same everywhere.
  // AcquireDevice returns pointers on this device.
  Device device = Device::Cpu();
  uint64_t device_budget_bytes = 0;  // device slots; 0 = unlimited
  uint64_t host_budget_bytes = 0;    // host slots; 0 = unlimited
  // Charged for device / host slots (may be null); borrowed: they must outlive the store.
  MemoryBudget* device_budget = nullptr;  // shared with the dense state
  MemoryBudget* host_budget = nullptr;
  uint32_t lfu_decay_interval = 10;
  double lfu_decay = 0.5;
  SsdOptions ssd;
  UringOptions io;
  // Fills a never-written weights tensor with its initial value (a pure function of the key).
  // Called on the ssd stage threads, several at once and without the store's lock: it must be
  // thread-safe, and whatever it refers to must outlive the store.
  std::function<void(const TensorKey&, float*)> initializer;
  // Tests inject faults by wrapping the block I/O. Called once, inside Create.
  std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> wrap_io;
  // An SSD tier shared with the checkpoints (then `ssd` and `io` above are not used).
  std::shared_ptr<SsdTier> shared_ssd;
  // Compute threads that hold tensors at once; sets the minimum slot counts.
  int compute_threads = 1;
  // Threads of the ssd stage. Each has one tensor transfer in flight (plus, before it, the
  // write-back of the entry it evicts), so this is how many requests the store keeps at the SSD.
  int ssd_threads = 4;
  // An ssd stage thread with nothing queued writes back the dirty entries the next evictions
  // will take (the next ssd_threads + 1 victims), keeping them resident and now clean, so that
  // loads and the copy stage's gradient write-backs find a clean slot instead of waiting for an
  // SSD write. Off: every eviction writes its dirty victim itself (tests of exact I/O counts).
  bool clean_ahead = true;

  // Device slots compute can need at once: weights + gradient per thread, plus one to load into.
  int MinDeviceSlots() const { return 2 * compute_threads + 1; }
  // Host slots: 4 per compute thread (weights, gradient and the Adam moments of what it holds,
  // which also covers the optimizer thread), plus 3 being filled by the stages. More ssd stage
  // threads do not need more: a thread that finds no slot waits until a fill in flight ends and
  // its tensor becomes evictable.
  int MinHostSlots() const { return 4 * compute_threads + 3; }
};

// Per-tier counters since the last TakeStats().
struct TierStats {
  uint64_t hits = 0, misses = 0;         // Acquire found it resident / had to wait
  uint64_t bytes_in = 0, bytes_out = 0;  // into / out of this tier
  uint64_t evictions = 0;
  uint64_t used_bytes = 0, budget_bytes = 0;  // at the time of TakeStats
};
struct StoreStats {
  TierStats device, host, ssd;
  double ssd_read_seconds = 0, ssd_write_seconds = 0;
  double stall_seconds = 0;            // compute threads waiting in Acquire*, summed
  double background_wait_seconds = 0;  // the background optimizer waiting for the SSD stage
};

// One span of stage work, for the trace (copy or SSD I/O).
struct StageSpan {
  const char* name;   // "ssd_read", "ssd_write", "h2d_copy", "d2h_copy"
  int thread;         // 0 and 2.. ssd stage, 1 copy stage
  double start, end;  // NowSeconds()
  TensorKey key;
};

class TieredExpertStore {
 public:
  [[nodiscard]] static StatusOr<std::unique_ptr<TieredExpertStore>> Create(
      const StoreOptions& options);
  ~TieredExpertStore();

  uint64_t tensor_bytes() const { return options_.tensor_bytes; }
  // Where its device tier lives (StoreOptions::device): AcquireDevice's pointers are there.
  Device device() const { return options_.device; }
  // The compute threads its minimum slot counts were checked for (StoreOptions).
  int compute_threads() const { return options_.compute_threads; }

  // --- Handing the store on ------------------------------------------------------------------
  // A store may outlive the scheduler that made it (an elastic re-form keeps a worker's experts
  // while its range of experts changes): keys name global experts, and the new owner re-points
  // the initializer and drops what it no longer holds. Both calls REQUIRE that no other thread
  // uses the store during the call and that the stages have nothing queued (WaitIdle): the
  // initializer is read by the stage threads without the lock.
  //
  // Replaces StoreOptions::initializer (same contract).
  void set_initializer(std::function<void(const TensorKey&, float*)> initializer);
  // Discards (as Discard) every tensor for which keep(key) is false: its host and device slots
  // are freed and its reference on its SSD version given back, so the version's extent is freed
  // unless a checkpoint still references it (it stays readable by that checkpoint). Version
  // numbers are not reused if the tensor comes back. Returns how many tensors were discarded.
  int DiscardUnless(const std::function<bool(const TensorKey&)>& keep);

  // --- Compute-side access -----------------------------------------------------------------
  // Pins `key` in the device tier and returns its data, waiting for the stages as needed. With
  // `zero` the tensor is not loaded: its device copy starts at zero and its old value is dropped
  // (gradients). Each Acquire needs one Release; the pointer is valid until then. Several threads
  // may pin one tensor at once; the store does not order their accesses to its bytes.
  [[nodiscard]] StatusOr<float*> AcquireDevice(const TensorKey& key, bool zero = false);
  // Unpins; `modified` marks the device copy dirty (its value is now newer than any other copy).
  void ReleaseDevice(const TensorKey& key, bool modified);
  // Pins `key` in the host tier (optimizer, ZeRO-Offload style) and returns its data, with
  // exclusive access: stage copies of the tensor wait until it is released, and it waits for
  // copies in progress. A `background` caller (the optimizer running behind the next forward)
  // does not stall compute: its waits count as background_wait_seconds. The pointer is valid until
  // the matching ReleaseHost.
  [[nodiscard]] StatusOr<float*> AcquireHost(const TensorKey& key, bool background = false);
  // Unpins; `modified` makes the host copy the current value and drops any device copy.
  void ReleaseHost(const TensorKey& key, bool modified);
  // Queues a dirty device tensor's move to the host tier (frees its device slot when done).
  // Without it, a dirty device tensor moves down when its slot is needed or when AcquireHost
  // asks for it.
  void WriteBack(const TensorKey& key);
  // Forgets a tensor's value (it reads as zero again): gradients after the optimizer.
  void Discard(const TensorKey& key);
  // Whether the tensor's current value has ever been written (else initialiser or zero).
  bool Materialized(const TensorKey& key) const;
  // Whether a device copy is resident right now (a hint for ordering work; may change at once).
  bool DeviceReady(const TensorKey& key) const;

  // --- Hints ---------------------------------------------------------------------------------
  void PrefetchDevice(std::span<const TensorKey> keys);
  // Queues SSD -> host loads of the keys not resident, loading or on the device; returns how many.
  // With `needed_at` (> 0, in SetNextUse's order) a load takes only a free slot or that of an
  // entry planned for later than `needed_at`, and is dropped when there is none: it never
  // displaces what is needed sooner, nor anything without a plan. An unconditional prefetch (or
  // PrefetchDevice, or an Acquire) of a tensor whose conditional load is queued makes it
  // unconditional.
  int PrefetchHost(std::span<const TensorKey> keys, uint64_t needed_at = 0);
  // The caller's plan: these entries are next used at `when` (> 0, a point of the caller's own
  // order, later = larger). Until an Acquire uses them again, they are evicted from the host
  // tier before any entry without a plan, the latest `when` first (Belady: keep what is needed
  // soonest); entries without one keep LFU order. Keys not in the store are ignored.
  void SetNextUse(std::span<const TensorKey> keys, uint64_t when);
  // Drops every plan (a new owner of the store plans from scratch).
  void ForgetNextUses();
  // Waits until the queued write-backs are done (before the optimizer reads gradients).
  [[nodiscard]] Status DrainWriteBacks();
  // Waits until both stages have nothing queued or in progress (prefetches and writes ahead of
  // eviction included).
  void WaitIdle();

  // --- Steps and statistics ------------------------------------------------------------------
  void EndStep();
  // Compute waited `seconds` for work that feeds the store (counted in stall_seconds).
  void AddStall(double seconds);
  StoreStats TakeStats();
  std::vector<StageSpan> TakeSpans();
  // Read by the stage threads without the lock: set it before the store is given work.
  void set_record_spans(bool on) { record_spans_ = on; }
  int device_slots() const;  // -1 when unlimited
  int host_slots() const;
  SsdTier& ssd() { return *ssd_; }  // valid for the store's life

  // --- Checkpoints ---------------------------------------------------------------------------
  // The current value of a tensor for a checkpoint: either a current SSD version (returned in
  // *stored, with a reference the caller must give back with UnrefVersion), or a copy of its host
  // copy's bytes into `copy` (host memory of tensor_bytes, borrowed for the call), or neither when
  // it was never written (*generated). FAILED_PRECONDITION while a dirty device copy holds the
  // value (a gradient being computed): snapshot between steps.
  struct Snapshot {
    bool generated = false;
    bool has_stored = false;
    StoredExtent stored;
    uint64_t version = 0;
    uint64_t generation = 0;  // the value's generation when copied
  };
  [[nodiscard]] Status SnapshotTensor(const TensorKey& key, float* copy, Snapshot* out);
  // After a copied value was written to the SSD tier as `version`: if the tensor has not changed
  // since, that version becomes its current SSD copy (the host copy is then clean). Takes a
  // reference on the version either way; the caller keeps its own.
  void AdoptVersion(const TensorKey& key, uint64_t generation, uint64_t version,
                    const StoredExtent& stored);
  // Version references (a checkpoint holds one per tensor version it lists).
  void RefVersion(const TensorKey& key, uint64_t version, const StoredExtent& stored);
  void UnrefVersion(const TensorKey& key, uint64_t version);
  uint64_t NextVersion(const TensorKey& key);
  // Versions up to `version` of `key` exist elsewhere (older checkpoints): never reuse them.
  void ReserveVersions(const TensorKey& key, uint64_t version);
  // Resume: the tensor's current value is `stored` (a checkpoint's version), nothing resident.
  void SetStored(const TensorKey& key, uint64_t version, const StoredExtent& stored);

 private:
  enum class HostState { kAbsent, kLoading, kReady, kEvicting };
  enum class DevState { kAbsent, kLoading, kReady };
  struct Entry {
    TensorKey key;
    // SSD
    bool has_ssd = false;
    uint64_t ssd_version = 0;
    StoredExtent ssd;
    bool ssd_current = false;
    bool materialized = false;
    uint64_t generation = 0;  // bumped on every change of the value
    // host
    int host_slot = -1;
    HostState host = HostState::kAbsent;
    bool host_dirty = false;
    int host_pins = 0;     // any holder: protects the slot from eviction
    int host_writers = 0;  // AcquireHost holders (they may write)
    int host_readers = 0;  // stage copies / snapshots reading the host copy
    double hits = 0;
    uint64_t host_last_use = 0;   // host LRU clock, to break ties between equally cold entries
    bool host_unused = false;     // loaded by a hint and not used yet: evicted last
    uint64_t next_use = 0;        // SetNextUse's plan (0: none); cleared by an Acquire
    uint64_t hint_needed_at = 0;  // a queued conditional PrefetchHost's `needed_at`
    bool host_claimed = false;    // an ssd stage thread is loading it
    bool cleaning = false;        // an ssd stage thread is writing it back ahead of eviction
    // device
    int dev_slot = -1;
    DevState dev = DevState::kAbsent;
    bool dev_dirty = false;
    int dev_pins = 0;
    uint64_t dev_last_use = 0;
    bool write_back_queued = false;
    Status error;  // a failed load; waiters return it
  };
  struct Job {
    TensorKey key;
    enum Type { kLoadHost, kLoadDevice, kWriteBack } type;
    bool demand = false;  // a compute thread waits for it (else a prefetch hint)
  };
  struct VersionRef {
    StoredExtent stored;
    int refs = 0;
  };

  explicit TieredExpertStore(const StoreOptions& options);
  Entry& EntryLocked(const TensorKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EnqueueLocked(int stage, Job job, bool demand) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `track` names the thread in the trace: 0 and 2.. the ssd stage, 1 the copy stage.
  void StageLoop(int stage, int track) ABSL_LOCKS_EXCLUDED(mu_);
  // Stage work; called without the lock held, take it as needed.
  Status LoadHost(const TensorKey& key, bool hint) ABSL_LOCKS_EXCLUDED(mu_);
  Status LoadDevice(const TensorKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  Status DoWriteBack(const TensorKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // A free host slot, evicting the coldest unpinned entry if needed (may write it to SSD, which
  // releases and re-takes the lock); waits while everything is pinned. Fails when the write-back
  // of a dirty victim fails.
  // With `needed_at` > 0 (a conditional hint) it returns -1 instead of evicting an entry that is
  // not planned for later than that (see PrefetchHost). An entry being written back ahead is not
  // a candidate; while one is, a dirty victim waits for it rather than being written here.
  StatusOr<int> HostSlotLocked(uint64_t needed_at = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether eviction takes `a` before `b` (see the class comment).
  static bool EvictsBefore(const Entry& a, const Entry& b);
  // Cleaning ahead (ssd stage threads, when they have nothing queued): the first dirty entry
  // among the next ssd_threads + 1 slots evictions will take; false when they are all free or
  // clean. Clean writes it to the SSD tier and keeps it resident, now clean (unless it changed
  // meanwhile); releases and re-takes the lock.
  bool PickCleanLocked(TensorKey* key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Clean(const TensorKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Something may have become a dirty victim: wake an ssd stage thread to look.
  void WantCleanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NextVersionLocked(const TensorKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int DeviceSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the write-back of the least recently used unpinned dirty device tensor (a finished
  // gradient left on the device until its room is needed); false when there is none.
  bool QueueDirtyWriteBackLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropDeviceLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnrefLocked(const TensorKey& key, uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefLocked(const TensorKey& key, uint64_t version, const StoredExtent& stored)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a queued write-back has not finished; the first error of one into *error.
  bool WriteBacksPendingLocked(Status* error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Span(const char* name, int thread, double start, const TensorKey& key)
      ABSL_LOCKS_EXCLUDED(mu_);

  StoreOptions options_;
  std::shared_ptr<SsdTier> ssd_;
  std::unique_ptr<SlotArena> host_, device_;
  // Host<->device copies of the copy stage (a CUDA stream on a GPU; immediate on the CPU). Only
  // the copy stage thread uses it.
  std::unique_ptr<CopyStream> copy_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;          // entries changed state
  absl::CondVar work_cv_[2];  // per stage: it has work
  std::unordered_map<TensorKey, Entry, TensorKeyHash> entries_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<TensorKey, uint64_t>, VersionRef> versions_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<TensorKey, uint64_t, TensorKeyHash> next_version_ ABSL_GUARDED_BY(mu_);
  std::deque<Job> queue_[2] ABSL_GUARDED_BY(mu_);  // per stage
  int busy_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;  // device and host LRU clock
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  StoreStats stats_ ABSL_GUARDED_BY(mu_);
  SsdStats last_ssd_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> record_spans_{false};  // read by the stage threads without the lock
  // An ssd stage thread should look for entries to clean.
  bool clean_wanted_ ABSL_GUARDED_BY(mu_) = false;
  // A write ahead of eviction failed: no more of them.
  bool clean_failed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<StageSpan> spans_ ABSL_GUARDED_BY(mu_);
  // Stage threads: options_.ssd_threads on the ssd stage, then the copy stage.
  std::vector<std::thread> stages_;
};

}  // namespace strata::storage
