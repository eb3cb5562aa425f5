// TieredExpertScheduler: the per-step plan of training with experts in the tiered store.
//
// It owns the TieredExpertStore and is the model's ExpertResidency:
//   forward of an MoE layer — as soon as the gate has routed, the routed experts' weights are
//     fetched to the device (a window of them, as many as the device tier has room for, sliding
//     as experts finish), and the next MoE layer's experts with the most routing history are
//     fetched while this layer computes (horizontal prefetch from history);
//   backward of an MoE layer — the routed experts' weights come back (exact: routing is known),
//     the previous layer's routed experts are prefetched behind them, gradients go to zeroed
//     device buffers and stay there until their slot is needed (then they move to the host
//     tier, oldest first) or the optimizer takes them;
//   end of backward — the update that follows is known before backward ends (its experts are the
//     forward's routed ones, or all of them), but it cannot start: clipping needs the global
//     gradient norm. So when backward reaches the first MoE layer (the last it computes, when the
//     other layers' gradients have their slots), the state the update reads first (weights and
//     Adam moments of its first storage.backward_prefetch experts, layer 0 first) is fetched to
//     the host tier while backward computes, each tensor only into the slot of state the plan
//     needs later (below), so the SSD works through backward too;
//   optimizer — every expert (DENSE) or every expert with a gradient (LAZY) takes its AdamW step
//     on the host tier (ZeRO-Offload style), on the scheduler's optimizer thread, fetching the
//     next experts' state from SSD (and their gradients from the device) while it updates the
//     current one. The moments it has stepped are next needed at the same point of the next
//     update: it tells the store (SetNextUse), which evicts them before anything else, the one
//     needed latest first, rather than the gradients and weights needed sooner. The step runs layer
//     by layer behind the next step's forward (storage.overlap_optimizer): the forward of MoE layer
//     l waits only until layer l's experts are updated, so the SSD reads and writes of the Adam
//     moments of later layers overlap with forward compute. The values are exactly those of the
//     update done in place: nothing reads an expert before its update is complete.
// The SSD->host and host->device stages run beside all of this (vertical prefetch), so both
// links and the compute stay busy (SE-MoE's 2D prefetch).
//
// Every expert's tensors are one flat blob laid out by model::ExpertLayout (its parameters in
// Expert::Parameters() order); all experts of a model must have the same layout. The scheduler
// never touches the model's parameters: NextReady hands the MoE layer the resident weight blob
// (and in backward a zeroed gradient blob), which the layer binds to its expert for one call and
// gives back with Done.
//
// With expert replicas (several expert-parallel groups, each holding a copy of the same experts in
// its own members' stores), each copy's backward leaves the gradient of its own group's rows;
// SumGradientsOver adds them up over the copies between backward and StepExperts, a few experts
// at a time through host slots and a staging buffer of as many gradients (never every gradient at
// once: that is what the tiers are for), so that every copy takes the same update from the same
// sum and the copies stay bitwise equal.
//
// Threads: BeginPass, NextReady and Done are called from the MoE layer's threads as
// expert_residency.h says; StepExperts, SumGradientsOver, ReadExpert, ReadExpertRange,
// WriteExpert, WriteExpertRange, FinishExpertStep, EndStep, ExpertGradSumSquares, set_tracer,
// Quiesce and ReleaseStore from the thread that drives the step (the
// trainer's), never during a pass (ExpertGradSumSquares reads what Done and SumGradientsOver
// write, unsynchronised), and set_tracer also never while an expert update is in flight (the
// optimizer thread reads the tracer). status() may be called
// from any thread; layout(), Key() and the other const accessors read what Create fixed, from any
// thread. The scheduler runs one thread of its own, the optimizer thread, which runs the expert
// update StepExperts queues; the store runs its stage threads. The destructor lets the update in
// flight finish, then stops the optimizer thread.
//
// Ownership: the scheduler owns its store (store() lives as long as the scheduler, or until
// ReleaseStore hands it on; the store is safe for concurrent use, see storage/tiered_store.h),
// shares the SSD tier of options.shared_ssd, and borrows the budgets and the tracer, which must
// outlive it. The budgets are the store's: they must outlive the store too, also when it is handed
// to another scheduler. The blobs NextReady hands out are lent until Done.
//
// Handing the store on (an elastic re-form keeps a worker's experts in its store while its range
// of experts changes). The store's keys name global experts (Key), so one store can serve a
// scheduler over another model whose range overlaps: ReleaseStore takes the store from a quiesced
// scheduler, and Create adopts it for the new model, dropping the experts the new range does not
// hold and every gradient, and re-pointing the initializer. The experts both ranges hold keep
// their values bitwise; one new to the range reads as initialised until WriteExpert gives it its
// value. A whole expert set is never in memory: values move one tensor (or a range of one) at a
// time through a host slot of the store.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/common/thread_pool.h"
#include "core/common/trace.h"
#include "proto/config.pb.h"
#include "runtime/comm/communicator.h"
#include "runtime/model/adamw.h"
#include "runtime/model/expert_residency.h"
#include "runtime/model/transformer.h"
#include "storage/tiered_store.h"

namespace strata::scheduler {

struct TieredOptions {
  config::StorageConfig storage;
  std::string ssd_dir;  // resolved folder of the SSD tier
  uint64_t seed = 0;
  int threads = 1;
  // Charged for the store's device slots (the trainer has already charged the dense state).
  MemoryBudget* device_budget = nullptr;
  uint64_t device_slot_bytes = 0;  // what the store may use of it; 0 = unlimited
  MemoryBudget* host_budget = nullptr;
  // Tests wrap the block I/O to inject faults.
  std::function<std::unique_ptr<storage::BlockIo>(std::unique_ptr<storage::BlockIo>)> wrap_io;
  // The SSD tier of the checkpoint folder, when there is one (else the store opens ssd_dir).
  std::shared_ptr<storage::SsdTier> shared_ssd;
  // Inference (forward passes only, one after another): the last MoE layer's forward prefetches
  // the first layer's experts by history too, for the next pass — the layers form a ring.
  bool ring = false;
};

// How well the experts routed in forward passes had been predicted: of `routed` experts (one
// count per layer and pass), `guessed` had been named by the history prefetch for that layer
// before its gate routed (whether or not their copy was still in the device tier by then), and
// `resident` were not guessed but still in the device tier from before.
struct ForwardPrefetchCounts {
  uint64_t routed = 0, guessed = 0, resident = 0;
};

class TieredExpertScheduler : public model::ExpertResidency {
 public:
  // The model must have been built with unbound experts and this scheduler attached afterwards
  // (model.AttachResidency(scheduler)). The scheduler keeps (const) pointers to the model's expert
  // parameters to read their names and init rules: the model must outlive it.
  //
  // With `store` (one a ReleaseStore gave up, over a model of the same configuration) the
  // scheduler adopts it instead of making one: options' budgets, SSD folder, shared SSD tier and
  // wrap_io are then the store's from its creation, and options.threads must not exceed the
  // compute threads it was made for. Tensors of experts outside this model's range, and every
  // gradient (a step cut short left them), are discarded (their SSD versions stay readable by
  // the checkpoints that reference them); the rest keep their values. INVALID_ARGUMENT when the
  // store's tensors are not this model's expert size; on any error the store is destroyed.
  [[nodiscard]] static StatusOr<std::unique_ptr<TieredExpertScheduler>> Create(
      model::MoeTransformer& model, const TieredOptions& options,
      std::unique_ptr<storage::TieredExpertStore> store = nullptr);
  ~TieredExpertScheduler() override;

  void BeginPass(int layer, Pass pass, std::span<const int> experts) override;
  // The handle's blobs are views of the store's device slots, pinned until Done.
  model::ResidentExpert NextReady(int layer, Pass pass) override;
  void Done(int layer, Pass pass, const model::ResidentExpert& expert) override;

  // The first error since the last EndStep (a failed read, a corrupt extent, a full disk).
  Status status() const;
  // Sum of squares of this step's expert gradients, added in (layer, expert) order.
  double ExpertGradSumSquares() const;
  // After backward, before StepExperts: replaces each expert's gradient by its sum over
  // `replicas`, the workers holding a copy of this worker's experts (rank order of the sum fixed
  // by the communicator, so every copy gets the same bits). A collective: every copy calls it at
  // the same point of the same step. An expert that no copy has a gradient for is skipped by all;
  // one that only some copies have a gradient for is summed with zeros on the others and has one
  // on every copy afterwards (LAZY updates it everywhere). The experts go in (layer, expert) order,
  // in batches of up to storage.optimizer_prefetch (and at most half the host slots), one
  // all-reduce per batch through a staging buffer of as many gradients it owns for the call; each
  // expert of a batch is pinned in a host slot of the store while it travels, and the next batch
  // is brought to the host behind it. The communicator is borrowed for the call.
  // ExpertGradSumSquares then reports the sums' squares. On an error the gradients are partly
  // summed and the step cannot go on (the other copies fail their collective within the
  // communicator's timeout).
  [[nodiscard]] Status SumGradientsOver(comm::Communicator& replicas);
  // Copies the current value of one of this worker's experts' tensors (local index `expert`, its
  // blob laid out by layout()) into `out` (expert_floats() floats), through a host slot of the
  // store. Waits for the expert update in flight first.
  [[nodiscard]] Status ReadExpert(int moe_layer, int expert, storage::TensorKind kind, float* out);
  // Floats [offset, offset + n) of it into `out` (n floats). INVALID_ARGUMENT for a layer, expert
  // or range outside this scheduler's.
  [[nodiscard]] Status ReadExpertRange(int moe_layer, int expert, storage::TensorKind kind,
                                       int64_t offset, int64_t n, float* out);
  // The mirror of ReadExpert: makes `in` (expert_floats() floats) the current value of one of this
  // worker's experts' tensors, through a host slot of the store (any device copy is dropped; the
  // value reaches the SSD tier when its slot is needed). Waits for the expert update in flight
  // first. For state that arrives from elsewhere (an elastic re-form's moves), between steps.
  [[nodiscard]] Status WriteExpert(int moe_layer, int expert, storage::TensorKind kind,
                                   const float* in);
  // Makes `in` floats [offset, offset + n) of that tensor; the others keep their current value
  // (for a tensor never written: its initial value, or zero). So a tensor can arrive in pieces
  // without ever being whole in the caller's memory. INVALID_ARGUMENT as ReadExpertRange.
  [[nodiscard]] Status WriteExpertRange(int moe_layer, int expert, storage::TensorKind kind,
                                        int64_t offset, int64_t n, const float* in);
  // Starts AdamW step `step` (1-based, as the dense optimizer's) of the experts on the host tier,
  // on the optimizer thread. With storage.overlap_optimizer it returns at once and the next
  // forward's BeginPass of MoE layer l waits until layer l is updated; without, it returns when
  // the step is done. Fails with the error of an earlier update or of this step's passes.
  [[nodiscard]] Status StepExperts(const model::AdamWOptions& options, double lr, double grad_scale,
                                   int64_t step);
  // Waits until the expert update in flight (if any) is done; the error of a failed update (it
  // stays: the experts are then partly updated and training cannot go on).
  [[nodiscard]] Status FinishExpertStep();
  // Ends the step: decays routing history and LFU hits.
  void EndStep();
  // Since Create. Any thread.
  ForwardPrefetchCounts forward_prefetch() const;

  // Records expert compute, stall and optimizer spans (and the store's stage spans) from now on.
  void set_tracer(Tracer* tracer);
  // Waits for the expert update in flight and for the stages to finish what is queued
  // (prefetches for a next step that will not come), and moves their spans to the tracer.
  void Quiesce();
  // Quiesces, stops the optimizer thread and hands the store on (for Create to adopt). The
  // scheduler is then unusable except for destruction. Until a new scheduler adopts it, the store
  // must not be given work: its initializer refers to no model (a never-written weights tensor
  // loaded then is a bug, and stops the process).
  [[nodiscard]] std::unique_ptr<storage::TieredExpertStore> ReleaseStore();

  storage::TieredExpertStore& store() { return *store_; }
  uint64_t expert_floats() const { return static_cast<uint64_t>(layout_.floats); }
  // The layout of every expert's blob (weights, gradient and moments alike).
  const model::ExpertLayout& layout() const { return layout_; }
  int moe_layers() const { return static_cast<int>(layers_.size()); }
  int num_experts(int moe_layer) const {
    return static_cast<int>(layers_[moe_layer].experts.size());
  }
  int block_of(int moe_layer) const { return layers_[moe_layer].block; }
  // The key of an expert tensor (layer = block index, expert = its global id).
  storage::TensorKey Key(int moe_layer, int expert, storage::TensorKind kind) const {
    return storage::TensorKey{layers_[moe_layer].block, static_cast<int>(first_expert_ + expert),
                              kind};
  }
  // With expert parallelism the store holds this worker's experts only: local index e is global
  // expert first_expert() + e. The residency interface speaks global ids.
  int64_t first_expert() const { return first_expert_; }
  // Tensors fetched to the host tier during backward ahead of the update, since Create
  // (storage.backward_prefetch). Trainer thread.
  uint64_t backward_hinted() const { return backward_hinted_; }

 private:
  int64_t first_expert_ = 0;
  // The model's device: the store's device tier is there, and the blobs handed out are its memory.
  Device device_ = Device::Cpu();
  struct Layer {
    int block;
    // [expert][param]: read for their initial values only (the layer binds them).
    std::vector<std::vector<const model::Parameter*>> experts;
    std::vector<double> history;  // routing frequency, decayed per step
    std::vector<int> routed;      // experts with rows in the last forward
    std::vector<double> grad_sq;  // this step's gradient sums of squares
    std::vector<double> started;  // trace: when each expert's work began
    std::vector<int> guessed;     // history prefetches since the layer's last forward
  };
  struct Item {  // one expert's optimizer step
    int li, e;
    bool grad;  // it has a gradient (else: zero, DENSE)
  };
  // The experts the next update steps, in its order: layer by layer, first layer first; every
  // expert (DENSE) or those with a gradient (LAZY). `grad` comes from the store when `planned`
  // is false; when true (a hint during backward, before gradients exist) the list is the forward's
  // routed experts for LAZY and `grad` is not filled in.
  std::vector<Item> UpdateItems(bool planned) const;
  // Once per step, at the start of backward: prefetches to the host tier the weights and Adam
  // moments of the first experts the update will step (see the class comment).
  void HintUpdateReads();
  // How many experts HintUpdateReads fetches ahead (storage.backward_prefetch, bounded by the
  // host slots; 0 with an unlimited host tier, where nothing is evicted).
  int BackwardPrefetchItems() const;

  struct Update {
    model::AdamWOptions options;
    double lr = 0, grad_scale = 1;
    int64_t step = 0;
    uint64_t next_use_base = 0;             // item i's moments are next used at this + i
    std::vector<Item> items;                // layer by layer, first layer first
    std::vector<int> first_layer_prefetch;  // fetched to the device once layer 0 is updated
  };

  TieredExpertScheduler() = default;
  int MoeIndex(int block) const;
  // Fills a never-written weights tensor of this scheduler's experts from the seed, exactly as
  // in memory (the store's initializer).
  void Initialize(const storage::TensorKey& key, float* dst) const;
  // Makes a store for Create, or adopts `store` (see Create).
  [[nodiscard]] Status SetUpStore(std::unique_ptr<storage::TieredExpertStore> store);
  // INVALID_ARGUMENT unless (moe_layer, expert) is one of this scheduler's experts and [offset,
  // offset + n) lies within its blob.
  [[nodiscard]] Status CheckRange(int moe_layer, int expert, int64_t offset, int64_t n) const;
  // A flat [layout_.floats] tensor over a slot of the store (wrapped once per slot).
  Tensor Blob(float* data);
  void Fail(const Status& s);
  // Trace: moves the store's stage spans to the tracer.
  void FlushStageSpans();
  void PrefetchWeights(int li, std::span<const int> experts);
  // The experts of layer `li` with the most routing history, as many as prefetch may fetch.
  std::vector<int> ByHistory(int li, int limit) const;
  void SlideWindowLocked();
  int Window() const;
  // The optimizer thread: runs queued updates.
  void UpdaterLoop();
  [[nodiscard]] Status RunUpdate(const Update& u);
  // Waits until MoE layer `li` has no update in flight (the wait counts as stall).
  void WaitUpdated(int li);
  bool Updated(int li);

  TieredOptions options_;
  Tracer* tracer_ = nullptr;
  std::unique_ptr<storage::TieredExpertStore> store_;
  std::vector<Layer> layers_;
  model::ExpertLayout layout_;
  std::vector<float> zeros_;  // the gradient of an expert without tokens (DENSE)

  mutable std::mutex mu_;
  Status error_;
  // The pass in progress.
  int pass_li_ = -1;
  Pass pass_ = Pass::kForward;
  std::vector<int> pending_;      // not handed out yet
  std::vector<int> to_prefetch_;  // routed experts not yet prefetched
  bool hinted_update_ = false;    // HintUpdateReads ran this step
  uint64_t backward_hinted_ = 0;
  std::unordered_map<float*, std::shared_ptr<Buffer>> blobs_;
  ForwardPrefetchCounts prefetch_counts_;

  // The expert update (optimizer thread). updated_layers_: the leading MoE layers the update in
  // flight has finished (all of them when none is in flight).
  mutable std::mutex umu_;
  std::condition_variable ucv_;
  std::optional<Update> queued_;
  bool updating_ = false;
  bool stop_updater_ = false;
  int updated_layers_ = 0;
  Status update_error_;
  std::unique_ptr<ThreadPool> update_pool_;  // one thread: the update is elementwise
  // The store's next-use order of the moments an update steps (SetNextUse): the last queued
  // update's base (item i of it is planned at base + i). Trainer thread (StepExperts, BeginPass).
  uint64_t next_use_base_ = 0;
  std::thread updater_;
};

}  // namespace strata::scheduler
