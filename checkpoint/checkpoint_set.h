// The global manifests and the global ledger of a sharded checkpoint folder
// (docs/sharded_checkpoints.md): the commit that makes a checkpoint of many shards exist, and the
// list of committed checkpoints a resume chooses from.
//
//   DIR/manifests/<step>.manifest   one CheckpointSet per committed checkpoint (binary proto,
//                                   then its CRC-32C in 4 bytes, little-endian)
//   DIR/manifests/LEDGER            the global ledger: a CheckpointLedger in text form, then a line
//                                   with the CRC-32C of that text (the local ledger's format)
//
// Design decisions:
// - A set exists from the rename of its manifest on; the ledger is replaced after it. A crash in
//   between leaves a manifest the ledger does not know: it is listed (it committed) when its
//   sequence is above the ledger's last and it follows the ledger's newest set (its previous_step
//   and previous_sequence name that set; none when the ledger lists none), or follows such a
//   manifest (a committer stopped twice in a row), and the next commit records it. Any other
//   manifest the ledger does not know, a ledger entry whose manifest is missing, and a manifest
//   whose bytes fail their CRC or do not parse make ListCheckpointSets fail with DATA_LOSS naming
//   each step and file: the list never lies, and a resume must not silently fall back past a
//   checkpoint it was told exists. RemoveCheckpointSet works on any listed or damaged step, so `rm`
//   of the named step is the way out.
// - Removal is recorded first (the ledger moves the entry to `removing`), then the manifest goes,
//   then the ledger forgets it: a crash leaves the set either listed or gone, never half there.
//   A pending removal is finished by the next commit or removal. A `removing` entry names the
//   step and the sequence of the set being removed, and hides or deletes only the manifest of that
//   step with that sequence (or one too damaged to tell): a step removed and committed again is a
//   new set with a new sequence. A commit finishes pending removals and writes the ledger without
//   them before it renames its manifest, so a committer stopped before its own ledger update never
//   leaves its set next to a `removing` entry of its step.
// - The ledger lives in manifests/, not at DIR/LEDGER: a folder written before sharding has its
//   one shard's local ledger there, and it opens as a shard named ".".
//
// Threads and ownership: these are free functions over files, with no state of their own; the
// caller owns every argument (the Env too) and keeps nothing of theirs after the call. Every file
// operation goes through the `env` argument, on the calling thread. CheckpointSetLayoutOf,
// ValidateShardName and ShardNameOfWorker touch no file and may run anywhere. One committer per
// folder: CommitCheckpointSet and RemoveCheckpointSet must not run at the same time on one folder,
// in one process or several (the committer is one thread: the coordinator's record, or rank 0's
// writer; `strata ckpt rm` takes DIR/LOCK, which that committer holds). ListCheckpointSets and
// VerifyShardRefs only read and may run on any thread beside a committer: a listing that races
// commits and removals lists what was committed before it ended (a set removed meanwhile may still
// be in it), never an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "proto/config.pb.h"
#include "proto/storage.pb.h"
#include "storage/env.h"

namespace strata::checkpoint {

using storage::CheckpointSet;

// What a whole set holds: every expert 0 .. experts_per_layer - 1 of every layer in `moe_layers`
// (Transformer block indices), and exactly the dense tensors named in `dense` (none when it is
// empty), each in one shard.
struct CheckpointSetLayout {
  std::vector<int32_t> moe_layers;
  int32_t experts_per_layer = 0;
  std::vector<std::string> dense;
};

// The layout of `model`'s checkpoints: its MoE layers (config::IsMoeLayer), its experts per layer,
// and `dense_names`, every dense parameter of the model (the names of Model::DenseParameters(),
// in the model's order), which the layout keeps as given.
CheckpointSetLayout CheckpointSetLayoutOf(const config::ModelConfig& model,
                                          std::vector<std::string> dense_names);

// Shard names become folder names (DIR/shards/<name>): "p0", "r<rank>" (a decimal rank without
// leading zeros, below 2^31), "." (DIR itself: a folder written before sharding is its one shard,
// and is written on in place) or "w<id>" (1 to kMaxWorkerShardIdChars characters of A-Z a-z 0-9 .
// _ -, so that the folder name fits the 255 bytes Linux file systems allow; ShardNameOfWorker
// makes one of any worker id that is not too long). INVALID_ARGUMENT naming the name otherwise.
inline constexpr size_t kMaxWorkerShardIdChars = 254;
[[nodiscard]] Status ValidateShardName(const std::string& name);

// The shard name of a coordinator's worker: "w" followed by its id with A-Z a-z 0-9 . - kept and
// every other byte, '_' included, written as '_' and two lowercase hex digits ("host:1234" ->
// "whost_3a1234", "a_b" -> "wa_5fb"). Injective: a kept character is never '_' and an escape is
// always three characters, so the name decodes back to the one id it came from; two workers never
// share a shard. ValidateShardName accepts every name it returns. INVALID_ARGUMENT for an empty id,
// and for an id whose encoding is longer than kMaxWorkerShardIdChars (a shorter prefix or a hash
// could name two workers alike, so such an id is refused, naming it, rather than shortened).
[[nodiscard]] StatusOr<std::string> ShardNameOfWorker(const std::string& worker_id);
// The shard of every rank of a generation of `world_size` workers: "r<rank>" without worker ids,
// else ShardNameOfWorker of each (INTERNAL when there are ids but not one per rank).
[[nodiscard]] StatusOr<std::vector<std::string>> ShardNamesOf(
    const std::vector<std::string>& member_ids, int world_size, int64_t generation);

// Commits `set` to the folder `dir` (created if need be): checks it is whole for `layout` (every
// expert and every dense tensor of the layout in exactly one shard, no dense tensor the layout
// does not have, every shard name valid and used once) and refuses it naming what is missing,
// doubled or unknown, writing nothing; refuses a step already committed. Otherwise finishes any
// pending removal (and records that in the ledger) before anything of the new set is written,
// gives the set the next sequence and the newest set as its predecessor (created_unix_ms: now,
// unless set), writes DIR/manifests/<step>.manifest atomically, then replaces the global ledger.
// Every file operation goes through `env`. Returns the set as written — also when a write after
// the manifest's rename failed (syncing its folder, the ledger: logged), since the set exists from
// the rename on; an error means the set does not exist. REQUIRES: no other commit or removal of
// `dir` runs.
[[nodiscard]] StatusOr<CheckpointSet> CommitCheckpointSet(
    const std::string& dir, const CheckpointSetLayout& layout, CheckpointSet set,
    storage::Env* env = storage::Env::Default());

// The committed sets of `dir`, by increasing step, checked against the global ledger (see the
// top of this file). An empty list for a folder without manifests/LEDGER and manifests.
[[nodiscard]] StatusOr<std::vector<CheckpointSet>> ListCheckpointSets(
    const std::string& dir, storage::Env* env = storage::Env::Default());

// Returns the bytes of shard `shard`'s local manifest with sequence `local_sequence`; NOT_FOUND
// when the shard or that manifest is missing.
using LocalManifestReader =
    std::function<StatusOr<std::string>(const std::string& shard, uint64_t local_sequence)>;

// Checks that every shard of `set` has its local manifest and that its bytes have the CRC the set
// recorded. DATA_LOSS naming each failing shard, its local sequence and the set's step.
[[nodiscard]] Status VerifyShardRefs(const std::string& dir, const CheckpointSet& set,
                                     const LocalManifestReader& reader);

// Removes the set of `step` (listed or damaged): the ledger records the removal (the step and the
// sequence of the ledger's entry and of the manifest on disk, where they differ), the manifest
// goes, the folder is synced, the ledger forgets it; pending removals are finished with it.
// NOT_FOUND naming the steps there are when the folder has none of that step. REQUIRES: no other
// commit or removal of `dir` runs.
[[nodiscard]] Status RemoveCheckpointSet(const std::string& dir, int64_t step,
                                         storage::Env* env = storage::Env::Default());

}  // namespace strata::checkpoint
