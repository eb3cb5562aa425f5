// Command-line flags of the strata subcommands: --name value or --name=value, with typed
// accessors and errors that name the flag and list the known ones.
//
// Flags is a value (parsed once, then only read): its const members may be called from any thread.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::launcher {

struct FlagSpec {
  std::string name;  // without the dashes
  std::string help;
  bool takes_value = true;
};

class Flags {
 public:
  // Parses args (after the subcommand). Unknown flags, missing values and stray arguments are
  // INVALID_ARGUMENT errors.
  [[nodiscard]] static StatusOr<Flags> Parse(const std::string& command,
                                             const std::vector<FlagSpec>& specs,
                                             const std::vector<std::string>& args);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> String(const std::string& name) const;
  // Parses an integer flag within [min, max]; nullopt when absent.
  [[nodiscard]] StatusOr<std::optional<int64_t>> Int(const std::string& name, int64_t min,
                                                     int64_t max) const;

  // "  --name VALUE   help" lines.
  static std::string Usage(const std::vector<FlagSpec>& specs);

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
};

}  // namespace strata::launcher
