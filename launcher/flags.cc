#include "launcher/flags.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace strata::launcher {

StatusOr<Flags> Flags::Parse(const std::string& command, const std::vector<FlagSpec>& specs,
                             const std::vector<std::string>& args) {
  Flags f;
  f.command_ = command;
  auto known = [&]() {
    std::vector<std::string> names;
    for (const auto& s : specs) names.push_back("--" + s.name);
    return absl::StrJoin(names, ", ");
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "strata %s: unexpected argument '%s'; flags are written --name VALUE (known: %s)",
          command, a, known()));
    }
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    const FlagSpec* spec = nullptr;
    for (const auto& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (spec == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("strata %s: unknown flag --%s (known: %s)", command, name, known()));
    }
    if (spec->takes_value && !inline_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("strata %s: --%s needs a value", command, name));
      }
      value = args[++i];
    } else if (!spec->takes_value && inline_value) {
      return absl::InvalidArgumentError(
          absl::StrFormat("strata %s: --%s takes no value", command, name));
    }
    f.values_[name] = value;
  }
  return f;
}

std::optional<std::string> Flags::String(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

StatusOr<std::optional<int64_t>> Flags::Int(const std::string& name, int64_t min,
                                            int64_t max) const {
  auto s = String(name);
  if (!s) return std::optional<int64_t>();
  int64_t v = 0;
  if (!absl::SimpleAtoi(*s, &v) || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "strata %s: --%s '%s' must be an integer in [%d, %d]", command_, name, *s, min, max));
  }
  return std::optional<int64_t>(v);
}

std::string Flags::Usage(const std::vector<FlagSpec>& specs) {
  std::string out;
  for (const auto& s : specs) {
    std::string lhs = "--" + s.name + (s.takes_value ? " VALUE" : "");
    absl::StrAppendFormat(&out, "  %-24s %s\n", lhs, s.help);
  }
  return out;
}

}  // namespace strata::launcher
