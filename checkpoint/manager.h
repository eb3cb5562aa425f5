// CheckpointManager: one process's shard of a sharded checkpoint folder — save, persist, resume,
// verify and remove (docs/sharded_checkpoints.md)
//
// The folder DIR:
// - Each shard DIR/shards/<name>/ is one writer's SSD tier folder: data files of checksummed
//   extents, a RocksDB index (tensor_index.h), a local ledger and a lock.
// - A checkpoint exists once its global manifest DIR/manifests/<step>.manifest commits
//   (checkpoint_set.h), naming the local checkpoint each shard holds for it.
// - This manager writes the shard options.shard ("p0" for one process, "r<rank>" or "w<id>" for a
//   worker) and holds its LOCK. The committer (one process, or rank 0) also holds DIR/LOCK, commits
//   each set once every shard reported prepared (through DIR/prepared/), and on opening tidies the
//   shards no process holds.
// - A folder written before sharding (index, data files or ledger directly in DIR) is the shard
//   ".": one process writes on in place; workers read its checkpoints as one-shard sets and never
//   prune them (`strata ckpt rm` does).
//
// A local checkpoint:
// - One version of every tensor — dense parameters with their Adam moments, every expert's
//   weights and moments as one blob per expert and kind (the tiered store's format, so IN_MEMORY
//   and TIERED checkpoints resume in either mode) — plus a manifest: step, model-config hash,
//   seed, optimizer step count. Data order and gate randomness are functions of (seed, step): the
//   step is the whole cursor.
// - Save snapshots into host memory what is not clean on the SSD tier already, returns, and the
//   writer persists in the background: extents, fdatasync, the local manifest and index entries in
//   one synced RocksDB batch (prepared), then the global manifest. A process killed before leaves
//   extents and perhaps a prepared manifest nobody names, which the next open reclaims.
// - The last `keep` checkpoints are kept; an extent is freed once no checkpoint and no live tensor
//   uses it.
//
// Resume and its checks:
// - Resume takes the newest checkpoint whose shard reference matches (the local manifest the
//   global one names, with its CRC) and whose every extent passes its CRC check within the data
//   files; it removes newer ones that fail (naming shard, tensor and file) and refuses another
//   model's checkpoint before anything changes. `strata ckpt verify` applies the same checks.
// - The list never lies: every local manifest carries a sequence number and its predecessor's,
//   and the shard's LEDGER (replaced atomically after each commit and removal) records the live
//   list. An index that lost or regained checkpoints is refused, naming them; only commits after
//   the ledger's last update that follow its newest are accepted (a crash in between). A missing
//   index beside data files is refused too, unless `start_over` moves the contents aside.
//
// Threads and ownership:
// - One thread of its own, the writer, persists and commits what Save snapshotted. The manager
//   owns the folder's and the shard's locks and the shard's index, and shares its SSD tier
//   (ssd()).
// - Members are called from one thread at a time (the trainer's), except NewestCommitted,
//   PollError and Abandon: any thread, also while a persist runs. Steps() and CheckCompatible take
//   the lock the writer holds while it commits and prunes, so they may wait for that.
// - Save and Resume borrow model, optimizer and context for the call. The scheduler given to them
//   and Save's ctx.tracer are kept until no persist runs (Wait); a later Save or Continue given
//   the scheduler that now holds the same store (a re-form hands it on) uses that one.
// - The destructor and Continue abandon a commit waiting for other shards and wait for the
//   persist in flight. The static List, Verify and Remove run on any thread; List and Verify only
//   read (also while a process trains in the folder), Remove takes DIR/LOCK.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint_set.h"
#include "checkpoint/tensor_index.h"
#include "core/common/status.h"
#include "core/common/trace.h"
#include "proto/config.pb.h"
#include "proto/storage.pb.h"
#include "runtime/model/adamw.h"
#include "runtime/model/transformer.h"
#include "scheduler/tiered_scheduler.h"
#include "storage/ssd_tier.h"

namespace strata::checkpoint {

struct CheckpointOptions {
  std::string dir;  // the checkpoint folder DIR
  // The shard this process writes, DIR/shards/<shard> (see ValidateShardName); ignored in a folder
  // written before sharding, which is itself the one shard ".".
  std::string shard = "p0";
  uint32_t keep = 3;
  storage::UringOptions io;
  uint64_t file_bytes = 1ull << 30;
  uint64_t capacity_bytes = 0;
  // Tests wrap the block I/O to inject faults.
  std::function<std::unique_ptr<storage::BlockIo>(std::unique_ptr<storage::BlockIo>)> wrap_io;
  // Move whatever the folder holds (index, ledger, data files) aside to DIR.old-<time> before
  // opening it, so training starts afresh (`strata train --start-over`). Not with `must_exist`.
  bool start_over = false;
  // Whether this process commits the folder's checkpoints and holds DIR/LOCK: one process, or rank
  // 0 of a distributed job. Every other worker writes its shard and reports it prepared (a file
  // DIR/prepared/<generation>/<step>/<shard>, read by the committer), nothing more.
  bool committer = true;
  int64_t generation = 0;  // membership generation: prepared reports are kept apart by it
  // How long the committer waits for every shard's report before the checkpoint fails.
  std::chrono::milliseconds commit_timeout{600000};
  // Set by another thread once the checkpoint in flight can never commit (a newer membership
  // generation formed): the committer stops waiting for reports, as with Abandon. May be null.
  std::shared_ptr<const std::atomic<bool>> abandoned;
};

// The options a job's config gives: checkpoint.dir and keep, the storage section's I/O settings and
// file sizes (the rest at their defaults).
CheckpointOptions CheckpointOptionsOf(const config::JobConfig& config);

// What this process's shard of a checkpoint holds, and which shards make the checkpoint.
struct CheckpointShare {
  bool experts = true;  // this process's experts (false: a replica that is not its group's writer)
  // The dense parameters this shard holds, by name; nullopt: every one.
  std::optional<std::set<std::string>> dense;
  // Committer: every shard of the set, its own included (empty: only its own).
  std::vector<std::string> shards;
  int workers = 1;  // how many processes wrote the set
};

// The dense parameters of a checkpoint dealt out over `shards` writers, largest first, each to
// the writer holding the fewest bytes so far (ties: the lower index), so that every dense
// parameter has one writer and the shares are even. Every worker computes the same deal.
std::vector<std::set<std::string>> DealDenseParameters(const model::MoeTransformer& model,
                                                       int shards);

// Agreement of every worker on a resume candidate: called with whether this worker found what it
// needs of the candidate intact; returns whether every worker did (a collective: every worker
// calls it for the same candidates in the same order). Null: one process.
using ResumeAgreement = std::function<StatusOr<bool>(bool ok_here)>;

struct CheckpointInfo {
  int64_t step = 0;
  int64_t created_unix_ms = 0;
  int tensors = 0;
  uint64_t stored_bytes = 0;  // bytes of extents the checkpoint refers to
  // A committed set's: from the earliest shard's snapshot to the commit (each shard's clock
  // against the committer's; -1 when not known: no shard read, or clocks that disagree).
  int64_t write_ms = -1;
  uint64_t config_hash = 0;
  std::string storage_mode;
  std::vector<std::string> shards;  // where it lies: shard names ("." for the folder itself)
  std::string problem;              // why a shard's part could not be read ("": none)
};

class CheckpointManager {
 public:
  // Opens (creating it unless `must_exist`) the folder: takes its lock, opens the index and the
  // SSD tier, checks the index against the ledger, reclaims extents no checkpoint refers to.
  // `must_exist` opens the index read-only (Resume reopens it for writing once a checkpoint has
  // passed its checks).
  [[nodiscard]] static StatusOr<std::unique_ptr<CheckpointManager>> Open(
      const CheckpointOptions& options, bool must_exist);
  ~CheckpointManager();

  std::shared_ptr<storage::SsdTier> ssd() const { return ssd_; }
  // The steps of the folder's checkpoints (committed sets, and those of a folder written before
  // sharding), increasing.
  std::vector<int64_t> Steps() const ABSL_LOCKS_EXCLUDED(mu_);
  // The shard this process writes ("." for a folder written before sharding) and its folder.
  const std::string& shard_name() const { return shard_name_; }
  const std::string& shard_dir() const { return shard_dir_; }

  // Fails, naming the differences, when a checkpoint in the folder was written for another model.
  [[nodiscard]] Status CheckCompatible(const config::JobConfig& config) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Restores the newest valid checkpoint into the model, optimizer and (TIERED) the store, and
  // returns its step. The model must have been built from `config`; it may hold some of the
  // experts (a worker), and the checkpoint may have been written by any number of workers: each
  // expert and dense parameter the model holds is read from the shard that has it (read-only),
  // nothing else. With `agree` (workers), every worker takes the same checkpoint: the newest that
  // every worker found intact.
  [[nodiscard]] StatusOr<int64_t> Resume(const config::JobConfig& config,
                                         model::MoeTransformer& model, model::AdamW& optimizer,
                                         scheduler::TieredExpertScheduler* tiered,
                                         ops::Context& ctx, const ResumeAgreement& agree = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A store made while this shard already holds checkpoints, which no Resume read into it (a
  // worker that joins a running job under an id it had before, and takes its experts from the
  // other workers): the store takes references on the versions those checkpoints use and never
  // reuses their numbers, as Resume does. Call before the store writes anything, while no persist
  // runs; `tiered` is kept as Save keeps its scheduler.
  void AdoptStore(scheduler::TieredExpertScheduler* tiered) ABSL_LOCKS_EXCLUDED(mu_);
  // The store whose references this manager holds (Resume, AdoptStore, Save) has been handed to
  // `tiered` (a re-form): reach it through that scheduler from now on. While no persist runs.
  void RebindStore(scheduler::TieredExpertScheduler* tiered) ABSL_LOCKS_EXCLUDED(mu_);

  // Checkpoints the state after `step` steps: `share` of it, persisted in the background. Waits
  // for the previous checkpoint's persist first. Checkpoints of `step` and later steps (training
  // went back behind them: an elastic generation replaying from older copies) are removed first
  // — the committer's sets, a worker's own parts — and written anew.
  //
  // What lies in device memory or the tiered store is copied into host buffers before Save
  // returns; host tensors (dense parameters, IN_MEMORY experts, their Adam moments) are copied by
  // the writer thread while the caller goes on with the next step's forward and backward, which
  // only read them. The caller must call FinishSnapshot before anything changes them (the next
  // update, a re-form, a resume); Wait, Resume and the destructor finish the snapshot too.
  [[nodiscard]] Status Save(int64_t step, const config::JobConfig& config,
                            model::MoeTransformer& model, model::AdamW& optimizer,
                            scheduler::TieredExpertScheduler* tiered, ops::Context& ctx,
                            const CheckpointShare& share = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // Touches, on the writer thread, the host buffers a checkpoint of `share` will copy into
  // (`tiered`: the experts live in a TIERED store and are left out), so that the first checkpoint
  // does not fault them in while it overlaps a step; the first Save waits for it to finish. Call
  // once, before the first Save (later calls, and calls after a Save, do nothing).
  void Reserve(const model::MoeTransformer& model, const CheckpointShare& share, bool tiered)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Returns once the last Save's snapshot is taken: the tensors it copies may change from then
  // on. Immediate when it is (or there was no Save); a wait is traced as "checkpoint fence".
  void FinishSnapshot(Tracer* tracer = nullptr);
  bool committer() const { return options_.committer; }
  // A committer waiting for other shards' reports gives up (the checkpoint fails, the previous
  // ones stay); a persist's own writes still finish. Any thread; the destructor does the same.
  void Abandon() { cancel_ = true; }
  // A new membership generation of the same job, keeping this shard open — and with it its SSD
  // tier, which a live TIERED store shares (ssd()): reopening the shard would build a second tier
  // that takes the live tensors' extents, which no checkpoint lists, for free space. In order:
  //   - the checkpoint the old generation left in flight ends (as with Abandon: a commit waiting
  //     for reports gives up, the persist's own writes finish; its error is logged, not
  //     returned), so no writer work crosses generations;
  //   - the committer's role: taken (DIR/LOCK, as Open takes it; UNAVAILABLE, naming the pid,
  //     while another process holds it) or given up (the lock released, so that another worker
  //     can take it); the committer clears DIR/prepared/ of older generations' reports, never of
  //     this one's. Unlike Open, it does not tidy shards no process holds (a worker joining this
  //     generation may be opening its own);
  //   - the committed sets are read again (the old committer may have committed just before it
  //     stopped, or not), and every local checkpoint of this shard that none names goes — as
  //     Open reclaims them, but with the live store's references respected: an extent is freed
  //     only once no checkpoint and no live tensor uses it.
  // From then on prepared reports are written and collected under `generation`, and `abandoned`
  // (may be null) is the flag another thread sets to abandon this generation's commit.
  // A folder written before sharding (shard_name() ".") cannot continue (FAILED_PRECONDITION), nor
  // should a manager whose shard name the new generation changes (r<rank> shards): the caller
  // destroys it and opens the folder again. Called from the trainer's thread, like Save; not while
  // another thread calls Abandon. REQUIRES: the index is writable (opened without must_exist, or
  // resumed), and the previous generation's committer, if it still runs, has finished its persist
  // (its own Continue or destructor returned) before a worker continues — else it might still
  // commit a set naming a part this drops (the trainer continues rank 0 first, as
  // OpenWorkerCheckpoints opens). `tiered` (TIERED; else null) is the scheduler that holds, now,
  // the store given to Save or Resume before — the same scheduler, or the one a re-form handed the
  // store to (TieredExpertScheduler::ReleaseStore): dropped checkpoints give their versions back
  // to that store, and later removals go through it too. INVALID_ARGUMENT when the store holds
  // this shard's versions and `tiered` is null; the scheduler given before must stay alive until
  // Continue has waited for the persist in flight.
  [[nodiscard]] Status Continue(int64_t generation, bool committer,
                                std::shared_ptr<std::atomic<bool>> abandoned,
                                scheduler::TieredExpertScheduler* tiered) ABSL_LOCKS_EXCLUDED(mu_);
  // The step of the newest committed checkpoint (0: none); safe while a persist runs.
  int64_t NewestCommitted() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the persist in flight; returns its error, if any.
  [[nodiscard]] Status Wait() ABSL_LOCKS_EXCLUDED(mu_);
  // The error of a persist that already finished (OK while one runs or none failed).
  Status PollError() ABSL_LOCKS_EXCLUDED(mu_);

  // `strata ckpt`: list, verify (every extent's CRC; step -1: all), remove.
  [[nodiscard]] static StatusOr<std::vector<CheckpointInfo>> List(const std::string& dir);
  [[nodiscard]] static Status Verify(const std::string& dir, int64_t step,
                                     std::vector<std::string>* report);
  [[nodiscard]] static Status Remove(const std::string& dir, int64_t step);

  // The hash that must match to resume: of the model config's text form.
  static uint64_t ConfigHash(const config::ModelConfig& model);

  // Inference and evaluation (`strata eval`), read-only like List and Verify: the model of
  // checkpoint `step` of DIR (-1: the newest), from its manifest.
  struct ModelOfCheckpoint {
    int64_t step = 0;
    config::ModelConfig model;  // normalised, as the job built it
    uint64_t seed = 0;
    int workers = 1;  // how many processes wrote it
  };
  [[nodiscard]] static StatusOr<ModelOfCheckpoint> ReadModelConfig(const std::string& dir,
                                                                   int64_t step);
  // Reads the weights of checkpoint `step` (no Adam moments) into `model`, built from
  // ReadModelConfig's config and seed with every expert (bound or not), from whichever shards
  // hold them (a checkpoint written by any number of workers); every extent's CRC-32C is checked.
  // A model of another config is refused naming the difference. A model built with unbound
  // experts (ModelOptions::unbound_experts: they live in a residency) needs `expert_sink`: each
  // expert's weights blob (laid out by ExpertLayout), one expert at a time, goes to
  // expert_sink(moe_layer, expert, blob) — except an expert the checkpoint holds at its
  // initialisation, whose values the residency generates from the seed. The sink is called on the
  // caller's thread; its error stops the read.
  using ExpertSink = std::function<Status(int moe_layer, int expert, const float* blob)>;
  [[nodiscard]] static Status ReadWeights(const std::string& dir, int64_t step, uint64_t seed,
                                          model::MoeTransformer& model,
                                          const ExpertSink& expert_sink = nullptr);

 private:
  using VersionKey = std::tuple<int32_t, int32_t, int32_t, uint64_t>;  // layer, expert, kind, v
  static VersionKey KeyOf(const storage::TensorRef& r) {
    return {r.layer(), r.expert(), r.kind(), r.version()};
  }
  struct Pending;

  CheckpointManager() = default;
  // Open's steps: the folder (its lock, start_over, the committed sets, this shard's folder and
  // lock, old prepared reports, the sets of a folder written before sharding); the shard's index,
  // checked against its ledger; the extents its checkpoints list, marked used.
  [[nodiscard]] Status OpenFolder(bool must_exist) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  [[nodiscard]] Status OpenIndex(bool must_exist) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  [[nodiscard]] Status MarkListedExtents() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Save's steps: the local and global manifests' headers and this shard's entry; the copies of
  // the dense parameters and of the experts (a TIERED expert's from its store: a reference when
  // its SSD copy is current); the writer thread started.
  void DescribeCheckpoint(Pending& p, int64_t step, const config::JobConfig& config,
                          model::MoeTransformer& model, model::AdamW& optimizer, bool tiered,
                          const CheckpointShare& share) ABSL_LOCKS_EXCLUDED(mu_);
  // A copy of `bytes` into a snapshot buffer that `fill` writes: now when a source is off the
  // host, else on the writer thread (TakeSnapshot).
  void AddCopy(Pending& p, storage::TensorRef ref, uint64_t bytes,
               const std::vector<Tensor>& sources, std::function<void(void*)> fill);
  void SnapshotDense(Pending& p, model::MoeTransformer& model, model::AdamW& optimizer,
                     const CheckpointShare& share);
  [[nodiscard]] Status SnapshotExperts(Pending& p, model::MoeTransformer& model,
                                       model::AdamW& optimizer,
                                       scheduler::TieredExpertScheduler* tiered);
  [[nodiscard]] Status SnapshotTieredExpert(Pending& p, storage::TensorRef r,
                                            scheduler::TieredExpertScheduler& tiered);
  void StartWriter(std::shared_ptr<Pending> p) ABSL_LOCKS_EXCLUDED(mu_);
  // Persist's steps, on the writer thread: the extents written and synced and the local manifest
  // committed to the index (the shard is prepared); the global manifest committed (the committer)
  // or the shard reported prepared; what a failed checkpoint held given back; a committed one
  // recorded, the ledger written and the oldest pruned.
  [[nodiscard]] Status CommitLocal(Pending& p, std::vector<storage::TensorRef>* new_versions,
                                   bool* written) ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] Status CommitGlobal(Pending& p, const std::vector<storage::TensorRef>& new_versions)
      ABSL_LOCKS_EXCLUDED(mu_);
  void PersistFailed(Pending& p, const Status& s, bool written) ABSL_LOCKS_EXCLUDED(mu_);
  void PersistCommitted(Pending& p) ABSL_LOCKS_EXCLUDED(mu_);
  // Resume's steps: the newest checkpoint every worker found intact; older ones whose extents lie
  // beyond their data files; a checkpoint of this shard read into the model (dense parameters,
  // experts); the failed ones removed and the kept ones' versions given to the store.
  struct ResumeChoice;
  [[nodiscard]] StatusOr<ResumeChoice> ChooseCheckpoint(const model::MoeTransformer& model,
                                                        const ResumeAgreement& agree);
  void AddOlderOutsideFiles(int64_t step, std::vector<int64_t>* invalid) ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] Status ReadExtent(const storage::TensorRef& r, int64_t step, void* dst,
                                  uint64_t bytes) const;
  [[nodiscard]] Status ReadLocalDense(const storage::CheckpointManifest& m,
                                      model::MoeTransformer& model, model::AdamW& optimizer) const;
  [[nodiscard]] Status ReadLocalExperts(const storage::CheckpointManifest& m,
                                        const config::JobConfig& config,
                                        model::MoeTransformer& model, model::AdamW& optimizer,
                                        scheduler::TieredExpertScheduler* tiered) const;
  [[nodiscard]] Status KeepResumed(const std::vector<int64_t>& invalid,
                                   scheduler::TieredExpertScheduler* tiered)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The folder's checkpoints, the index read-only and checked against the ledger.
  [[nodiscard]] static StatusOr<std::vector<storage::CheckpointManifest>> ReadList(
      const std::string& dir);
  // The folder's checkpoints for `strata ckpt`, each with its shards' local manifests (read-only).
  struct FolderEntry;
  [[nodiscard]] static StatusOr<std::vector<FolderEntry>> ReadFolder(const std::string& dir);
  // The folder's checkpoint `step` (-1: the newest), every part of it readable.
  [[nodiscard]] static StatusOr<FolderEntry> ReadEntry(const std::string& dir, int64_t step);
  // Reads every stored extent of a checkpoint; the first failure.
  Status VerifyManifest(const storage::CheckpointManifest& m) const;
  // The first checks of checkpoint `step` before it is resumed: its set names this shard's local
  // checkpoint with the CRC it has. Returns a copy of that local manifest (VerifyManifest then
  // reads every extent back, without the lock).
  [[nodiscard]] StatusOr<storage::CheckpointManifest> LocalCheckpointLocked(int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a checkpoint: its global manifest first, then the local one from the ledger and the
  // index, releasing the extents only it used.
  [[nodiscard]] Status RemoveLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the local checkpoint `local` (of manifests_) alone: the ledger records its removal, the
  // index forgets it, and each version only it listed is released (ReleaseVersion).
  [[nodiscard]] Status RemoveLocalLocked(std::vector<storage::CheckpointManifest>::iterator local)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reopens the index for writing, then Tidy.
  [[nodiscard]] Status ReopenWritable() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With the index open for writing: finishes removals a killed process left half done and
  // brings the ledger up to date (a commit it missed, a folder that had none).
  [[nodiscard]] Status Tidy() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces DIR/LEDGER with the live list (less `removing`, recorded as being removed).
  [[nodiscard]] Status WriteLedger(const storage::CheckpointManifest* removing = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Persist(std::shared_ptr<Pending> p);
  // The writer: fills the copies Save deferred, then lets FinishSnapshot return.
  void TakeSnapshot(Pending& p);
  // Removes the checkpoints of `step` and later steps (see Save).
  [[nodiscard]] Status ReplaceFrom(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseVersion(const storage::TensorRef& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Steps() with mu_ held.
  std::vector<int64_t> StepsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // tiered_, read under mu_: the store it leads to is safe to use without the lock (the trainer
  // rebinds it only while no checkpoint is in flight, see Continue).
  scheduler::TieredExpertScheduler* Tiered() ABSL_LOCKS_EXCLUDED(mu_);

  CheckpointOptions options_;
  int lock_fd_ = -1;        // DIR/LOCK: the committer's (and a folder-shard's) lock
  int shard_lock_fd_ = -1;  // DIR/shards/<name>/LOCK
  std::string shard_name_, shard_dir_;
  std::shared_ptr<storage::SsdTier> ssd_;
  std::unique_ptr<TensorIndex> index_;
  // The shard's committed local checkpoints, by increasing step: those a committed set names, and
  // those of a folder written before sharding.
  std::vector<storage::CheckpointManifest> manifests_ ABSL_GUARDED_BY(mu_);
  // The folder's committed sets, by increasing step.
  std::vector<storage::CheckpointSet> sets_ ABSL_GUARDED_BY(mu_);
  // A worker's view of the checkpoints of a folder written before sharding (in the shard "."),
  // each as a one-shard set.
  std::vector<storage::CheckpointSet> folder_sets_ ABSL_GUARDED_BY(mu_);
  // Still in the index, but the ledger says they were being removed, or no committed set names
  // them (prepared, never committed): finished by Tidy.
  std::vector<storage::CheckpointManifest> removing_ ABSL_GUARDED_BY(mu_);
  uint64_t last_sequence_ ABSL_GUARDED_BY(mu_) = 0;  // the highest sequence given to a checkpoint
  std::map<VersionKey, int> listed_
      ABSL_GUARDED_BY(mu_);  // how many checkpoints list each stored version
  // Listed versions whose extents lie beyond the end of their data file (a file cut short): never
  // marked used, so never freed.
  std::set<VersionKey> outside_ ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<int32_t, int32_t, int32_t>, uint64_t> next_version_;  // in-memory mode
  // The scheduler whose store holds the live extent references (null: none yet).
  scheduler::TieredExpertScheduler* tiered_ ABSL_GUARDED_BY(mu_) = nullptr;

  // The committer: waits for the other shards' prepared reports of `p`'s step and adds their
  // entries to its set.
  [[nodiscard]] Status CollectPrepared(Pending& p);
  // A worker: reports its shard prepared for `p`'s step.
  [[nodiscard]] Status ReportPrepared(const Pending& p);
  // Reads the committed sets again and removes the local checkpoints of this shard that no
  // committed set names (the committer pruned or never committed them): those older than the
  // newest committed one (a worker at each save), or (`every`) all of them (Continue).
  [[nodiscard]] Status ReclaimUnnamed(bool every) ABSL_LOCKS_EXCLUDED(mu_);
  // The committer, when it opens: every other shard that no process holds lets go of the local
  // checkpoints no committed set names.
  void ReclaimIdleShards();
  // The newest checkpoint whose parts this model holds are intact, read into it (see Resume).
  struct SetReader;
  [[nodiscard]] Status CheckSetParts(SetReader& reader, const model::MoeTransformer& model) const;
  [[nodiscard]] Status ReadSetParts(SetReader& reader, const config::JobConfig& config,
                                    model::MoeTransformer& model, model::AdamW& optimizer,
                                    scheduler::TieredExpertScheduler* tiered);
  std::atomic<bool> cancel_{false};  // the destructor stops a committer waiting for reports
  // The snapshot buffers (4 KiB-aligned), reused by every checkpoint: they hold one snapshot's
  // bytes between checkpoints, this shard's state not clean on the SSD tier (all of it in memory;
  // within the budgets in a TIERED store). Save takes them once the writer is joined.
  struct SnapshotArena;
  std::unique_ptr<SnapshotArena> arena_;

  // Whether the last Save's snapshot is taken (the writer sets it; FinishSnapshot waits on it).
  absl::Mutex snapshot_mu_;
  absl::CondVar snapshot_cv_;
  bool snapshot_done_ ABSL_GUARDED_BY(snapshot_mu_) = true;

  // Guards what the writer thread and the trainer's thread share: the lists of checkpoints and
  // sets, the versions they list, and the writer's outcome. Taken after snapshot_mu_ is let go.
  mutable absl::Mutex mu_;
  std::thread writer_;
  Status writer_status_ ABSL_GUARDED_BY(mu_);
  bool writer_done_ ABSL_GUARDED_BY(mu_) = true;
};

}  // namespace strata::checkpoint
