// What the CheckpointManager's files share (checkpoint/*.cc only; not part of the layer's
// interface)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/manager.h"

namespace strata::checkpoint {

using storage::StoredExtent;

// A 4 KiB-aligned buffer with room for a rounded-up extent.
struct AlignedBuffer {
  static uint64_t Rounded(uint64_t bytes) {
    return std::max<uint64_t>((bytes + 4095) / 4096 * 4096, 4096);
  }
  explicit AlignedBuffer(uint64_t bytes)
      : size(Rounded(bytes)), data(static_cast<char*>(std::aligned_alloc(4096, size))) {}
  // Adopts `memory` (from aligned_alloc, `rounded` bytes).
  AlignedBuffer(uint64_t rounded, char* memory) : size(rounded), data(memory) {}
  char* Release() { return std::exchange(data, nullptr); }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint64_t size;
  char* data;
};

struct CheckedList {
  std::vector<CheckpointManifest> live;      // the folder's checkpoints, by increasing step
  std::vector<CheckpointManifest> removing;  // in the index, but being removed
  uint64_t last_sequence = 0;
};

StoredExtent FromRecord(const storage::ExtentRecord& r);

void ToRecord(const StoredExtent& s, storage::ExtentRecord* r);

// "checkpoint 10" or "checkpoint 10, shard p0" (a folder written before sharding is shard ".").
std::string Where(int64_t step, const std::string& shard);

std::string Describe(const TensorRef& r, int64_t step, const std::string& shard);

std::string ModelText(const config::ModelConfig& m);

// The lines where two model configs differ, for an error message.
std::string ConfigDiff(const std::string& checkpoint, const std::string& current);

int64_t NowMs();

// The SSD tier of the shard folder `dir`.
StatusOr<std::unique_ptr<storage::SsdTier>> OpenSsd(const CheckpointOptions& o,
                                                    const std::string& dir);

std::string LedgerPath(const std::string& dir);

// A folder written before sharding has its one shard's index, data files or ledger directly in
// it: it is the shard ".".
bool IsFolderShard(const std::string& dir);

// DIR/prepared/<generation>/<step>/<shard>: a worker's report that its shard is prepared for a
// checkpoint (its ShardEntry, serialized), for the committer to collect.
std::string PreparedRoot(const std::string& dir);

std::string PreparedDir(const std::string& dir, int64_t generation, int64_t step);

std::string ShardDir(const std::string& dir, const std::string& shard);

// Takes the lock file `path` of `folder` for this process (writing its pid), or says who has it.
StatusOr<int> LockFolder(const std::string& path, const std::string& folder);

void Unlock(int fd);

// The shard entry named `shard` in `set`, or null.
const storage::ShardEntry* FindShard(const storage::CheckpointSet& set, const std::string& shard);

uint32_t ManifestCrc(const CheckpointManifest& m);

// Whether the local manifest `m` of `shard` is the one `set` names (same sequence and bytes);
// otherwise why not.
Status MatchesSet(const CheckpointManifest& m, const storage::CheckpointSet& set,
                  const std::string& shard);

// DIR/LEDGER's bytes; nullopt when there is none.
StatusOr<std::optional<std::string>> ReadLedgerText(const std::string& dir);

// DIR/LEDGER holds the ledger in text form, then a line with the CRC-32C of that text.
StatusOr<storage::CheckpointLedger> ParseLedger(const std::string& dir, const std::string& text);

Status StoreLedger(const std::string& dir, const storage::CheckpointLedger& ledger);

// The index's checkpoints checked against the ledger: `before` and `after` are the ledger file's
// bytes read before and after the index (the same when the folder is locked). A process training
// into the folder may change both in between; between two ledger updates the index changes by at
// most one commit or one recorded removal, so an index entry is accepted if either ledger accounts
// for it, and missing only if both list it.
StatusOr<CheckedList> CheckList(const std::string& dir, const std::optional<std::string>& before,
                                const std::optional<std::string>& after,
                                std::vector<CheckpointManifest> indexed);

// A folder without an index is empty for checkpoints only if it holds no data files and its
// ledger (if any) lists nothing: otherwise the index was lost, and training would overwrite
// checkpoints that a copy of the index could still read.
Status CheckNoIndexIsNoLoss(const std::string& dir);

// `--start-over`: everything in the folder but its lock moves to a new sibling folder.
Status MoveAside(const std::string& dir);

// Snapshot memory: chunks carved into 4 KiB-aligned buffers in the order Save asks for them. Kept
// from one checkpoint to the next, which asks for the same sizes in the same order and so finds
// its pages touched already: a fresh buffer's first-touch faults were most of a snapshot's time
// (Reserve touches them before the first checkpoint). Huge pages (MADV_HUGEPAGE) are not asked
// for: they faulted in slower (docs/storage.md, "Measurements behind the design").
// Reset by Save once the writer is done with the last checkpoint's buffers.
struct CheckpointManager::SnapshotArena {
  static constexpr uint64_t kAlign = 4096;
  static constexpr uint64_t kChunk = 64ull << 20;
  struct Chunk {
    char* base;
    uint64_t size;
  };
  std::vector<Chunk> chunks;
  size_t chunk = 0;  // where the next buffer is carved from
  uint64_t offset = 0;
  size_t last_chunk = 0;  // where the last one was (ReturnLast)
  uint64_t last_offset = 0;

  ~SnapshotArena() {
    for (const Chunk& c : chunks) std::free(c.base);
  }
  void Reset() { chunk = 0, offset = 0; }
  char* Take(uint64_t bytes) {
    const uint64_t rounded = AlignedBuffer::Rounded(bytes);
    while (chunk < chunks.size() && offset + rounded > chunks[chunk].size) ++chunk, offset = 0;
    if (chunk == chunks.size()) {
      const uint64_t size = std::max(kChunk, (rounded + kAlign - 1) / kAlign * kAlign);
      char* base = static_cast<char*>(std::aligned_alloc(kAlign, size));
      CHECK(base != nullptr) << "cannot allocate " << size
                             << " bytes of checkpoint snapshot memory";
      chunks.push_back({base, size});
      offset = 0;
    }
    last_chunk = chunk, last_offset = offset;
    char* out = chunks[chunk].base + offset;
    offset += rounded;
    return out;
  }
  // Gives back the buffer Take returned last (unused).
  void ReturnLast() { chunk = last_chunk, offset = last_offset; }
};

// A checkpoint between its snapshot and its commit.
struct CheckpointManager::Pending {
  CheckpointManifest manifest;
  struct Copy {
    TensorRef ref;
    char* buffer = nullptr;  // from the manager's snapshot arena
    uint64_t bytes = 0;
    bool tiered = false;  // an expert tensor of the tiered store (adopt the version after)
    uint64_t generation = 0;
    StoredExtent stored;
    // Fills the buffer on the writer thread, before anything is written (the snapshot that
    // overlaps the next step; see Save). Null: filled by Save already.
    std::function<void(void*)> fill;
  };
  std::vector<Copy> copies;
  std::vector<TensorRef> refs;  // stored already (a store reference was taken) or generated
  Tracer* tracer = nullptr;
  // The global manifest to commit once the local one is durable (its shard entry's sequence and
  // CRC filled in then), and what a whole set of this model holds.
  CheckpointSet set;
  CheckpointSetLayout layout;
  std::vector<std::string> other_shards;  // the committer's: shards whose reports it waits for
};

// One checkpoint of a folder as `strata ckpt` sees it: a committed set, or a checkpoint of a folder
// written before sharding; and for each shard, its local manifest or why it cannot be read.
struct CheckpointManager::FolderEntry {
  int64_t step = 0;
  std::optional<CheckpointSet> set;
  struct Part {
    std::string shard;
    StatusOr<CheckpointManifest> local = absl::UnknownError("not read");
  };
  std::vector<Part> parts;
};

}  // namespace strata::checkpoint
