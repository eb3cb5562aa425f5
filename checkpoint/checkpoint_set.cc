#include "checkpoint/checkpoint_set.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/ledger_text.h"
#include "core/common/fault_point.h"
#include "core/common/logging.h"
#include "proto/config_io.h"
#include "storage/crc32c.h"

namespace strata::checkpoint {
namespace {

using storage::CheckpointLedger;
using storage::LedgerEntry;

constexpr char kManifestSuffix[] = ".manifest";

std::string ManifestsDir(const std::string& dir) { return dir + "/manifests"; }
std::string GlobalLedgerPath(const std::string& dir) { return dir + "/manifests/LEDGER"; }
std::string ManifestPath(const std::string& dir, int64_t step) {
  return absl::StrCat(ManifestsDir(dir), "/", step, kManifestSuffix);
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A manifest on disk: the serialized set, then its CRC-32C in 4 bytes, little-endian.
std::string EncodeManifest(const CheckpointSet& set) {
  std::string bytes = set.SerializeAsString();
  const uint32_t crc = storage::Crc32c(bytes.data(), bytes.size());
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
  return bytes;
}

// The set in `bytes` read from the manifest of `step`, or why it cannot be trusted.
StatusOr<CheckpointSet> DecodeManifest(const std::string& bytes, int64_t step) {
  if (bytes.size() < 4) {
    return absl::DataLossError(
        absl::StrFormat("is %d bytes, too short to hold its checksum", bytes.size()));
  }
  const size_t n = bytes.size() - 4;
  uint32_t stored = 0;
  for (int i = 0; i < 4; ++i)
    stored |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[n + i])) << (8 * i);
  const uint32_t crc = storage::Crc32c(bytes.data(), n);
  if (crc != stored) {
    return absl::DataLossError(absl::StrFormat(
        "fails its checksum (CRC-32C %08x of its %d bytes, %08x stored): it is damaged or cut "
        "short",
        crc, n, stored));
  }
  CheckpointSet set;
  if (!set.ParseFromArray(bytes.data(), static_cast<int>(n))) {
    return absl::DataLossError("passes its checksum but does not parse as a CheckpointSet");
  }
  if (set.step() != step) {
    return absl::DataLossError(absl::StrFormat("holds step %d", set.step()));
  }
  return set;
}

StatusOr<CheckpointLedger> DecodeLedger(const std::string& dir, const std::string& text) {
  std::optional<CheckpointLedger> ledger = ParseLedgerText(text);
  if (!ledger) {
    return absl::DataLossError(absl::StrFormat(
        "the global checkpoint ledger '%s' is damaged (its checksum or its contents are wrong), "
        "so the sharded checkpoints of '%s' cannot be listed; restore the folder from a copy",
        GlobalLedgerPath(dir), dir));
  }
  return *std::move(ledger);
}

// The ledger's text; nullopt when there is none.
StatusOr<std::optional<std::string>> ReadLedgerBytes(const std::string& dir, storage::Env* env) {
  const std::string path = GlobalLedgerPath(dir);
  if (!env->FileExists(path)) return std::optional<std::string>();
  StatusOr<std::string> text = env->ReadFile(path);
  // Replaced between the two calls by a commit that ran beside: read the new one.
  if (!text.ok() && absl::IsNotFound(text.status())) text = env->ReadFile(path);
  if (!text.ok()) return text.status();
  return std::optional<std::string>(std::move(*text));
}

// One file DIR/manifests/<step>.manifest.
struct ManifestFile {
  int64_t step = 0;
  std::string path;
  StatusOr<CheckpointSet> set;  // or why it cannot be trusted
};

// The manifests in DIR/manifests (none when the folder is missing), by step. Other files
// (the ledger, temporaries of an interrupted write) are not manifests.
StatusOr<std::vector<ManifestFile>> ScanManifests(const std::string& dir, storage::Env* env) {
  std::vector<ManifestFile> files;
  StatusOr<std::vector<std::string>> names = env->ListDir(ManifestsDir(dir));
  if (absl::IsNotFound(names.status())) return files;
  if (!names.ok()) {
    return Status(names.status().code(),
                  absl::StrFormat("the sharded checkpoints of '%s' cannot be listed: %s", dir,
                                  names.status().message()));
  }
  for (const std::string& name : *names) {
    const size_t suffix = name.size() - std::strlen(kManifestSuffix);
    int64_t step = 0;
    // Only the canonical name of a step ("10.manifest", not "010.manifest") is its manifest.
    if (name.size() <= std::strlen(kManifestSuffix) || name.substr(suffix) != kManifestSuffix ||
        !std::all_of(name.begin(), name.begin() + suffix, absl::ascii_isdigit) ||
        !absl::SimpleAtoi(name.substr(0, suffix), &step) ||
        name != absl::StrCat(step, kManifestSuffix)) {
      continue;
    }
    files.push_back({step, ManifestPath(dir, step), absl::UnknownError("not read")});
  }
  std::sort(files.begin(), files.end(),
            [](const auto& a, const auto& b) { return a.step < b.step; });
  std::vector<ManifestFile> read;
  for (ManifestFile& f : files) {
    StatusOr<std::string> bytes = env->ReadFile(f.path);
    // Removed since the folder was listed, by a removal running beside: not there.
    if (!bytes.ok() && absl::IsNotFound(bytes.status())) continue;
    f.set = bytes.ok() ? DecodeManifest(*bytes, f.step) : StatusOr<CheckpointSet>(bytes.status());
    read.push_back(std::move(f));
  }
  return read;
}

using Key = std::pair<int64_t, uint64_t>;  // step, sequence

// Whether one of the `removing` entries covers the manifest `f`: an entry names the step and the
// sequence of the set it removes, so a set committed again at a step being removed (a new
// sequence) is not covered. A manifest too damaged to tell its sequence is covered by any entry of
// its step. (Sequences start at 1; an entry of sequence 0 was recorded for such a manifest.)
bool BeingRemoved(const std::vector<LedgerEntry>& removing, const ManifestFile& f) {
  return std::any_of(removing.begin(), removing.end(), [&](const LedgerEntry& e) {
    return e.step() == f.step && (!f.set.ok() || e.sequence() == f.set->sequence());
  });
}

// What the folder holds, checked against the ledger read before and after the manifests.
struct Listing {
  CheckpointLedger ledger;          // the newer of the two (empty: there is none)
  std::vector<CheckpointSet> live;  // by increasing step
  std::vector<ManifestFile> files;
  std::vector<std::string> problems;  // each names a step and its file
};

// A commit writes its manifest, then the ledger; a removal records it in the ledger, removes the
// manifest, then updates the ledger again. A reader that runs beside them reads the ledger
// before and after the manifests, and accepts a manifest either ledger accounts for; a manifest
// is missing only if both list it.
StatusOr<Listing> ReadListingOnce(const std::string& dir, storage::Env* env) {
  ASSIGN_OR_RETURN(std::optional<std::string> before, ReadLedgerBytes(dir, env));
  ASSIGN_OR_RETURN(std::vector<ManifestFile> files, ScanManifests(dir, env));
  ASSIGN_OR_RETURN(std::optional<std::string> after, ReadLedgerBytes(dir, env));
  ASSIGN_OR_RETURN(LedgerReads reads, ParseLedgerReads(before, after, [&](const std::string& text) {
                     return DecodeLedger(dir, text);
                   }));
  const CheckpointLedger old_ledger = reads.before.value_or(CheckpointLedger());
  const CheckpointLedger ledger = reads.after.value_or(CheckpointLedger());

  Listing out;
  std::set<Key> old_live, live, in_files;
  std::vector<LedgerEntry> removing;
  for (const auto& e : old_ledger.live()) old_live.insert({e.step(), e.sequence()});
  for (const auto& e : ledger.live()) live.insert({e.step(), e.sequence()});
  for (const auto* l : {&old_ledger, &ledger}) {
    removing.insert(removing.end(), l->removing().begin(), l->removing().end());
  }
  std::vector<const ManifestFile*> newer;
  for (const ManifestFile& f : files) {
    if (!f.set.ok()) {
      if (!BeingRemoved(removing, f)) {
        out.problems.push_back(absl::StrFormat("checkpoint %d: its manifest '%s' %s", f.step,
                                               f.path, f.set.status().message()));
      }
      continue;
    }
    const Key k{f.step, f.set->sequence()};
    in_files.insert(k);
    if (old_live.count(k) || live.count(k)) {
      out.live.push_back(*f.set);
    } else if (BeingRemoved(removing, f) ||
               (k.second > old_ledger.last_sequence() && k.second <= ledger.last_sequence())) {
      // Being removed, or committed and removed while the manifests were read.
    } else if (k.second > ledger.last_sequence()) {
      newer.push_back(&f);
    } else {
      out.problems.push_back(absl::StrFormat(
          "checkpoint %d: its manifest '%s' (sequence %d) is not in the global ledger, which "
          "has given sequences up to %d: a removed checkpoint came back",
          f.step, f.path, k.second, ledger.last_sequence()));
    }
  }
  for (const auto& e : ledger.live()) {
    const Key k{e.step(), e.sequence()};
    const bool damaged = std::any_of(files.begin(), files.end(), [&](const ManifestFile& f) {
      return f.step == e.step() && !f.set.ok();
    });
    if (old_live.count(k) && !in_files.count(k) && !damaged) {
      out.problems.push_back(absl::StrFormat(
          "checkpoint %d: its manifest '%s' (sequence %d) is missing, but the global ledger "
          "lists it",
          e.step(), ManifestPath(dir, e.step()), e.sequence()));
    }
  }
  // Commits the ledger missed (a committer stopped before the ledger's update, maybe more than
  // once in a row) are accepted when they chain from the newest set the ledger records.
  const LedgerEntry* newest = nullptr;
  for (const auto& e : ledger.live()) {
    if (newest == nullptr || e.sequence() > newest->sequence()) newest = &e;
  }
  std::optional<Key> previous;
  if (newest != nullptr) previous = Key{newest->step(), newest->sequence()};
  std::sort(newer.begin(), newer.end(),
            [](const auto* a, const auto* b) { return a->set->sequence() < b->set->sequence(); });
  for (const ManifestFile* f : newer) {
    const CheckpointSet& s = *f->set;
    const bool follows = previous ? s.has_previous_step() && s.previous_step() == previous->first &&
                                        s.previous_sequence() == previous->second
                                  : !s.has_previous_step();
    if (follows) {
      out.live.push_back(s);
      previous = Key{s.step(), s.sequence()};
      continue;
    }
    out.problems.push_back(absl::StrFormat(
        "checkpoint %d: its manifest '%s' (sequence %d) is not in the global ledger and does "
        "not follow the newest checkpoint before it (%s), so it was never committed as it is",
        s.step(), f->path, s.sequence(),
        previous ? absl::StrFormat("step %d, sequence %d", previous->first, previous->second)
                 : std::string("none")));
  }
  std::sort(out.live.begin(), out.live.end(),
            [](const auto& a, const auto& b) { return a.step() < b.step(); });
  out.ledger = ledger;
  out.files = std::move(files);
  return out;
}

// ReadListingOnce, read again when it finds problems: a scan of the manifests beside a committer
// can miss a manifest that both ledger reads list (readdir promises nothing for a directory that
// is being changed, and a commit renames into it), which a second read does not repeat. Damage
// stays: after three reads it is reported.
StatusOr<Listing> ReadListing(const std::string& dir, storage::Env* env) {
  for (int attempt = 1;; ++attempt) {
    ASSIGN_OR_RETURN(Listing listing, ReadListingOnce(dir, env));
    if (listing.problems.empty() || attempt == 3) return listing;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Status ProblemsError(const std::string& dir, const std::vector<std::string>& problems) {
  return absl::DataLossError(absl::StrFormat(
      "the sharded checkpoints of '%s' do not match their global ledger '%s': %s. Restore the "
      "named manifests from a copy of the folder, or remove those checkpoints (by their "
      "steps) to go on with the others",
      dir, GlobalLedgerPath(dir), absl::StrJoin(problems, "; ")));
}

// "expert 3" or "experts 3-5".
std::string ExpertRun(int32_t first, int32_t last) {
  return first == last ? absl::StrCat("expert ", first)
                       : absl::StrCat("experts ", first, "-", last);
}

// Why `set` is not whole for `layout` (empty: it is).
std::vector<std::string> WholenessProblems(const CheckpointSetLayout& layout,
                                           const CheckpointSet& set) {
  std::vector<std::string> problems;
  std::map<std::string, int> names;
  for (const auto& shard : set.shards()) {
    if (Status s = ValidateShardName(shard.name()); !s.ok()) {
      problems.push_back(std::string(s.message()));
    }
    if (++names[shard.name()] == 2) {
      problems.push_back(absl::StrFormat("shard name '%s' is used twice", shard.name()));
    }
  }
  if (set.shards_size() == 0) problems.push_back("the set has no shards");
  // holders[layer][expert]: the shards that hold it.
  std::map<int32_t, std::vector<std::vector<std::string>>> holders;
  for (int32_t layer : layout.moe_layers) holders[layer].resize(layout.experts_per_layer);
  std::map<std::string, std::vector<std::string>> dense;
  for (const auto& shard : set.shards()) {
    for (const auto& r : shard.experts()) {
      auto it = holders.find(r.layer());
      if (it == holders.end()) {
        problems.push_back(absl::StrFormat(
            "shard '%s' lists experts of layer %d, which is not an MoE layer (those are: %s)",
            shard.name(), r.layer(), absl::StrJoin(layout.moe_layers, ", ")));
        continue;
      }
      if (r.count() < 1 || r.first() < 0 ||
          int64_t{r.first()} + r.count() > layout.experts_per_layer) {
        problems.push_back(absl::StrFormat(
            "shard '%s' lists experts first %d count %d of layer %d, outside the layer's "
            "experts 0-%d",
            shard.name(), r.first(), r.count(), r.layer(), layout.experts_per_layer - 1));
        continue;
      }
      for (int32_t e = r.first(); e < r.first() + r.count(); ++e) {
        it->second[e].push_back(shard.name());
      }
    }
    for (const std::string& name : shard.dense()) dense[name].push_back(shard.name());
  }
  // Runs of experts with the same holders, reported when they are not exactly one.
  for (const auto& [layer, experts] : holders) {
    for (int32_t e = 0; e < static_cast<int32_t>(experts.size());) {
      int32_t last = e;
      while (last + 1 < static_cast<int32_t>(experts.size()) && experts[last + 1] == experts[e]) {
        ++last;
      }
      if (experts[e].empty()) {
        problems.push_back(absl::StrFormat("layer %d, %s: in no shard", layer, ExpertRun(e, last)));
      } else if (experts[e].size() > 1) {
        problems.push_back(absl::StrFormat("layer %d, %s: in more than one shard (%s)", layer,
                                           ExpertRun(e, last), absl::StrJoin(experts[e], ", ")));
      }
      e = last + 1;
    }
  }
  for (const auto& [name, in] : dense) {
    if (in.size() > 1) {
      problems.push_back(absl::StrFormat("dense tensor '%s' is in more than one shard (%s)", name,
                                         absl::StrJoin(in, ", ")));
    }
  }
  const std::set<std::string> expected(layout.dense.begin(), layout.dense.end());
  std::vector<std::string> missing, unknown;
  for (const std::string& name : expected) {
    if (!dense.count(name)) missing.push_back(name);
  }
  for (const auto& [name, in] : dense) {
    if (!expected.count(name)) unknown.push_back(absl::StrFormat("'%s' (%s)", name, in[0]));
  }
  if (!missing.empty()) {
    problems.push_back(
        absl::StrFormat("dense tensors in no shard: '%s'", absl::StrJoin(missing, "', '")));
  }
  if (!unknown.empty()) {
    problems.push_back(
        absl::StrFormat("dense tensors the model does not have: %s", absl::StrJoin(unknown, ", ")));
  }
  return problems;
}

// The characters a worker id keeps in its shard name; '_' starts an escape, so it is not kept.
bool KeptInShardName(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '-'; }

LedgerEntry EntryOf(int64_t step, uint64_t sequence) {
  LedgerEntry e;
  e.set_step(step);
  e.set_sequence(sequence);
  return e;
}

// The ledger listing `live` (by step), none being removed, with `last_sequence`.
CheckpointLedger LedgerOf(const std::vector<LedgerEntry>& live, uint64_t last_sequence) {
  CheckpointLedger ledger;
  ledger.set_format(1);
  ledger.set_last_sequence(last_sequence);
  std::vector<LedgerEntry> sorted = live;
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.step() < b.step(); });
  for (const LedgerEntry& e : sorted) *ledger.add_live() = e;
  return ledger;
}

// Removes the manifests in `listing.files` that the ledger records as being removed, then syncs
// the folder, also when they were gone already: a remover stopped between its delete and its sync
// may have left a delete that a crash of the machine would undo after the ledger forgets it.
Status FinishRemovals(const std::string& dir, const Listing& listing, storage::Env* env) {
  const std::vector<LedgerEntry> removing(listing.ledger.removing().begin(),
                                          listing.ledger.removing().end());
  if (removing.empty()) return absl::OkStatus();
  for (const ManifestFile& f : listing.files) {
    if (!BeingRemoved(removing, f)) continue;
    int64_t step = f.step;
    STRATA_FAULT_POINT("checkpoint_set.before_delete", &step);
    if (Status s = env->DeleteFile(f.path); !s.ok() && !absl::IsNotFound(s)) return s;
  }
  return env->SyncDir(ManifestsDir(dir));
}

}  // namespace

CheckpointSetLayout CheckpointSetLayoutOf(const config::ModelConfig& model,
                                          std::vector<std::string> dense_names) {
  CheckpointSetLayout layout;
  for (int32_t i = 0; i < model.n_layers(); ++i) {
    if (config::IsMoeLayer(model, i)) layout.moe_layers.push_back(i);
  }
  layout.experts_per_layer = model.moe().num_experts();
  layout.dense = std::move(dense_names);
  return layout;
}

Status ValidateShardName(const std::string& name) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shard name '%s' %s; a shard is named p0 (one process), r<rank> (e.g. r3), w<worker "
        "id> (e.g. w7, 1 to %d characters of A-Z a-z 0-9 . _ -) or . (a folder written before "
        "sharding)",
        absl::CHexEscape(name), why, kMaxWorkerShardIdChars));
  };
  // "." is the folder itself: a folder written before sharding is its one shard.
  if (name == "p0" || name == ".") return absl::OkStatus();
  if (name.empty()) return bad("is empty");
  const std::string rest = name.substr(1);
  if (name[0] == 'r') {
    int32_t rank = 0;
    if (rest.empty() || !std::all_of(rest.begin(), rest.end(), absl::ascii_isdigit) ||
        (rest.size() > 1 && rest[0] == '0') || !absl::SimpleAtoi(rest, &rank)) {
      return bad("is not r followed by a rank (0 to 2147483647, no leading zeros)");
    }
    return absl::OkStatus();
  }
  if (name[0] == 'w') {
    if (rest.empty() || rest.size() > kMaxWorkerShardIdChars ||
        !std::all_of(rest.begin(), rest.end(),
                     [](char c) { return KeptInShardName(c) || c == '_'; })) {
      return bad(absl::StrFormat("is not w followed by 1 to %d characters of A-Z a-z 0-9 . _ -",
                                 kMaxWorkerShardIdChars));
    }
    return absl::OkStatus();
  }
  return bad("does not start with p0, r or w");
}

StatusOr<std::string> ShardNameOfWorker(const std::string& worker_id) {
  if (worker_id.empty()) {
    return absl::InvalidArgumentError(
        "a worker with an empty id has no shard name; every coordinator worker has an id");
  }
  std::string name = "w";
  for (const char c : worker_id) {
    if (KeptInShardName(c)) {
      name.push_back(c);
    } else {
      absl::StrAppendFormat(&name, "_%02x", static_cast<uint8_t>(c));
    }
  }
  if (name.size() - 1 > kMaxWorkerShardIdChars) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker id '%s' (%d bytes) makes a shard name of %d characters after 'w' (every byte "
        "but A-Z a-z 0-9 . - takes 3), more than the %d a folder name allows; start the worker "
        "with a shorter --id",
        absl::CHexEscape(worker_id), worker_id.size(), name.size() - 1, kMaxWorkerShardIdChars));
  }
  return name;
}

StatusOr<std::vector<std::string>> ShardNamesOf(const std::vector<std::string>& member_ids,
                                                int world_size, int64_t generation) {
  std::vector<std::string> names;
  for (int r = 0; r < world_size; ++r) {
    if (member_ids.empty()) {
      names.push_back(absl::StrCat("r", r));
      continue;
    }
    if (member_ids.size() != static_cast<size_t>(world_size)) {
      return absl::InternalError(absl::StrFormat("generation %d lists %d worker ids for %d ranks",
                                                 generation, member_ids.size(), world_size));
    }
    ASSIGN_OR_RETURN(std::string name, ShardNameOfWorker(member_ids[static_cast<size_t>(r)]));
    names.push_back(std::move(name));
  }
  return names;
}

StatusOr<CheckpointSet> CommitCheckpointSet(const std::string& dir,
                                            const CheckpointSetLayout& layout, CheckpointSet set,
                                            storage::Env* env) {
  if (!set.has_step() || set.step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a checkpoint set needs a step of 0 or more, not %s",
                        set.has_step() ? absl::StrCat(set.step()) : std::string("none")));
  }
  if (std::vector<std::string> problems = WholenessProblems(layout, set); !problems.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the checkpoint set of step %d is not whole, so nothing was written to '%s': %s. Each "
        "expert of every MoE layer and each dense tensor must be in exactly one shard",
        set.step(), dir, absl::StrJoin(problems, "; ")));
  }
  ASSIGN_OR_RETURN(Listing listing, ReadListing(dir, env));
  if (!listing.problems.empty()) return ProblemsError(dir, listing.problems);
  for (const CheckpointSet& s : listing.live) {
    if (s.step() == set.step()) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "checkpoint %d is already committed in '%s' (sequence %d); remove it first to commit "
          "it again",
          set.step(), dir, s.sequence()));
    }
  }
  const bool fresh = !env->FileExists(ManifestsDir(dir));
  RETURN_IF_ERROR(env->CreateDirs(ManifestsDir(dir)));
  if (fresh) RETURN_IF_ERROR(env->SyncDir(dir));

  uint64_t last_sequence = listing.ledger.last_sequence();
  const CheckpointSet* previous = nullptr;
  std::vector<LedgerEntry> live;
  for (const CheckpointSet& s : listing.live) {
    last_sequence = std::max(last_sequence, s.sequence());
    if (previous == nullptr || s.sequence() > previous->sequence()) previous = &s;
    live.push_back(EntryOf(s.step(), s.sequence()));
  }
  // Pending removals are finished, and the ledger forgets them, before this set's manifest
  // appears: a `removing` entry of this step must never stand beside it, should this process stop
  // before its own ledger update below.
  if (listing.ledger.removing_size() > 0) {
    RETURN_IF_ERROR(FinishRemovals(dir, listing, env));
    RETURN_IF_ERROR(
        env->WriteFileAtomic(GlobalLedgerPath(dir), LedgerText(LedgerOf(live, last_sequence))));
  }
  set.set_sequence(last_sequence + 1);
  set.clear_previous_step();
  set.clear_previous_sequence();
  if (previous != nullptr) {
    set.set_previous_step(previous->step());
    set.set_previous_sequence(previous->sequence());
  }
  if (!set.has_created_unix_ms()) set.set_created_unix_ms(NowMs());
  Status written = env->WriteFileAtomic(ManifestPath(dir, set.step()), EncodeManifest(set));
  // A failure after the rename (syncing the folder) leaves the manifest in place: the set exists
  // (no file of this step was there before), and the caller must not undo what it names.
  if (!written.ok() && !env->FileExists(ManifestPath(dir, set.step()))) return written;
  if (!written.ok()) {
    STRATA_LOG(WARNING) << "checkpoint " << set.step() << " is committed in " << dir
                        << ", but its manifest may not survive a crash of the machine: "
                        << written.message();
  }
  // The set exists from here on; a process stopped before the ledger's update leaves it
  // unrecorded, which listing accepts (it follows the ledger's newest) and the next commit records.
  int64_t step = set.step();
  STRATA_FAULT_POINT("checkpoint_set.before_ledger", &step);
  live.push_back(EntryOf(set.step(), set.sequence()));
  Status ledger =
      env->WriteFileAtomic(GlobalLedgerPath(dir), LedgerText(LedgerOf(live, set.sequence())));
  if (!ledger.ok()) {
    // As if stopped before the ledger: listing accepts the set and the next commit records it.
    STRATA_LOG(WARNING) << "checkpoint " << set.step() << " is committed in " << dir
                        << ", but the global ledger was not updated (the next commit records "
                           "it): "
                        << ledger.message();
  }
  return set;
}

StatusOr<std::vector<CheckpointSet>> ListCheckpointSets(const std::string& dir, storage::Env* env) {
  ASSIGN_OR_RETURN(Listing listing, ReadListing(dir, env));
  if (!listing.problems.empty()) return ProblemsError(dir, listing.problems);
  return std::move(listing.live);
}

Status VerifyShardRefs(const std::string& dir, const CheckpointSet& set,
                       const LocalManifestReader& reader) {
  std::vector<std::string> failures;
  absl::StatusCode code = absl::StatusCode::kDataLoss;
  for (const auto& shard : set.shards()) {
    StatusOr<std::string> bytes = reader(shard.name(), shard.local_sequence());
    if (!bytes.ok()) {
      if (!absl::IsNotFound(bytes.status())) code = bytes.status().code();
      failures.push_back(absl::StrFormat("shard '%s' (local manifest sequence %d): %s",
                                         shard.name(), shard.local_sequence(),
                                         bytes.status().message()));
      continue;
    }
    const uint32_t crc = storage::Crc32c(bytes->data(), bytes->size());
    if (crc != shard.local_manifest_crc32c()) {
      failures.push_back(absl::StrFormat(
          "shard '%s' (local manifest sequence %d): its local manifest's CRC-32C is %08x, but "
          "the checkpoint set recorded %08x: the shard was damaged or rewritten after the set "
          "committed",
          shard.name(), shard.local_sequence(), crc, shard.local_manifest_crc32c()));
    }
  }
  if (failures.empty()) return absl::OkStatus();
  return Status(code,
                absl::StrFormat("checkpoint %d in '%s': %d of %d shards fail: %s", set.step(), dir,
                                failures.size(), set.shards_size(), absl::StrJoin(failures, "; ")));
}

Status RemoveCheckpointSet(const std::string& dir, int64_t step, storage::Env* env) {
  ASSIGN_OR_RETURN(Listing listing, ReadListing(dir, env));
  const CheckpointLedger& ledger = listing.ledger;
  // The ledger's entries (damaged ones too) and a committed set it missed, less `step`.
  std::vector<LedgerEntry> live;
  std::vector<int64_t> steps;
  std::vector<LedgerEntry> targets;  // what of `step` to remove
  uint64_t last_sequence = ledger.last_sequence();
  for (const auto& e : ledger.live()) {
    steps.push_back(e.step());
    (e.step() == step ? targets : live).push_back(e);
  }
  for (const CheckpointSet& s : listing.live) {
    last_sequence = std::max(last_sequence, s.sequence());
    if (std::none_of(ledger.live().begin(), ledger.live().end(),
                     [&](const auto& e) { return e.step() == s.step(); })) {
      steps.push_back(s.step());
      (s.step() == step ? targets : live).push_back(EntryOf(s.step(), s.sequence()));
    }
  }
  // The manifest on disk, when it is not the one the ledger names (a stray copy, or one the
  // ledger never knew): sequence 0 when it is too damaged to tell.
  for (const ManifestFile& f : listing.files) {
    if (f.set.ok()) last_sequence = std::max(last_sequence, f.set->sequence());
    if (f.step == step && !BeingRemoved(targets, f)) {
      targets.push_back(EntryOf(step, f.set.ok() ? f.set->sequence() : 0));
    }
  }
  if (targets.empty()) {
    std::sort(steps.begin(), steps.end());
    return absl::NotFoundError(
        absl::StrFormat("no checkpoint %d in '%s' (its sharded checkpoints: %s)", step, dir,
                        steps.empty() ? std::string("none") : absl::StrJoin(steps, ", ")));
  }
  // Record the removal, remove the manifest (and any a crash left), then forget it.
  CheckpointLedger removing = LedgerOf(live, last_sequence);
  *removing.mutable_removing() = ledger.removing();
  for (const LedgerEntry& e : targets) *removing.add_removing() = e;
  RETURN_IF_ERROR(env->WriteFileAtomic(GlobalLedgerPath(dir), LedgerText(removing)));
  listing.ledger = removing;
  RETURN_IF_ERROR(FinishRemovals(dir, listing, env));
  return env->WriteFileAtomic(GlobalLedgerPath(dir), LedgerText(LedgerOf(live, last_sequence)));
}

}  // namespace strata::checkpoint
