// The on-disk form shared by a checkpoint folder's two ledgers: a shard's local ledger DIR/LEDGER
// (checkpoint.cc) and the global ledger DIR/manifests/LEDGER (checkpoint_set.cc). A ledger is a
// CheckpointLedger in protobuf text form, then a line "# crc32c XXXXXXXX" with the CRC-32C of that
// text, replaced atomically (Env::WriteFileAtomic) after every change to the list it records.
//
// A reader beside a writer reads the ledger file before and after what it lists, and checks what
// it found against both: ParseLedgerReads turns the two reads into the two ledgers.
//
// Pure functions over the caller's values; any thread.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/common/status.h"
#include "proto/storage.pb.h"

namespace strata::checkpoint {

std::string LedgerText(const storage::CheckpointLedger& ledger);

// The ledger in `text`; nullopt when its checksum line is missing or wrong or it does not parse.
std::optional<storage::CheckpointLedger> ParseLedgerText(const std::string& text);

// The ledgers of two reads of one ledger file (nullopt: there was no file then): `before` and
// `after`. Where only one read found a file (the first ledger was written in between), both are
// that one; where neither did, both are nullopt. `parse` turns a read into a ledger or an error
// naming the file; its first error is returned.
struct LedgerReads {
  std::optional<storage::CheckpointLedger> before, after;
};
StatusOr<LedgerReads> ParseLedgerReads(
    const std::optional<std::string>& before, const std::optional<std::string>& after,
    const std::function<StatusOr<storage::CheckpointLedger>(const std::string&)>& parse);

}  // namespace strata::checkpoint
