#include "checkpoint/ledger_text.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/text_format.h"
#include "storage/crc32c.h"

namespace strata::checkpoint {

std::string LedgerText(const storage::CheckpointLedger& ledger) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(ledger, &text);
  text += absl::StrFormat("# crc32c %08x\n", storage::Crc32c(text.data(), text.size()));
  return text;
}

std::optional<storage::CheckpointLedger> ParseLedgerText(const std::string& text) {
  const size_t at = text.rfind("# crc32c ");
  storage::CheckpointLedger ledger;
  uint32_t crc = 0;
  if (at == std::string::npos ||
      !absl::SimpleHexAtoi(absl::StripAsciiWhitespace(text.substr(at + 9)), &crc) ||
      crc != storage::Crc32c(text.data(), at) ||
      !google::protobuf::TextFormat::ParseFromString(text.substr(0, at), &ledger)) {
    return std::nullopt;
  }
  return ledger;
}

StatusOr<LedgerReads> ParseLedgerReads(
    const std::optional<std::string>& before, const std::optional<std::string>& after,
    const std::function<StatusOr<storage::CheckpointLedger>(const std::string&)>& parse) {
  LedgerReads out;
  if (before) {
    ASSIGN_OR_RETURN(out.before, parse(*before));
  }
  if (after && after != before) {
    ASSIGN_OR_RETURN(out.after, parse(*after));
  } else {
    out.after = out.before;
  }
  if (!out.before) out.before = out.after;  // the first ledger was written meanwhile
  return out;
}

}  // namespace strata::checkpoint
