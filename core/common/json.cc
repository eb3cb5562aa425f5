#include "core/common/json.h"

#include <cmath>
#include <cstdio>

namespace strata {

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

void JsonWriter::Separator() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!need_comma_.empty()) {
    if (need_comma_.back()) out_ += ',';
    need_comma_.back() = true;
  }
}

JsonWriter& JsonWriter::BeginObject() {
  Separator();
  out_ += '{';
  need_comma_.push_back(false);
  return *this;
}
JsonWriter& JsonWriter::EndObject() {
  out_ += '}';
  need_comma_.pop_back();
  return *this;
}
JsonWriter& JsonWriter::BeginArray() {
  Separator();
  out_ += '[';
  need_comma_.push_back(false);
  return *this;
}
JsonWriter& JsonWriter::EndArray() {
  out_ += ']';
  need_comma_.pop_back();
  return *this;
}
JsonWriter& JsonWriter::Key(std::string_view key) {
  Separator();
  out_ += '"';
  out_ += JsonEscape(key);
  out_ += "\":";
  after_key_ = true;
  return *this;
}
JsonWriter& JsonWriter::String(std::string_view value) {
  Separator();
  out_ += '"';
  out_ += JsonEscape(value);
  out_ += '"';
  return *this;
}
JsonWriter& JsonWriter::Int(int64_t value) {
  Separator();
  out_ += std::to_string(value);
  return *this;
}
JsonWriter& JsonWriter::Double(double value, int significant_digits) {
  Separator();
  if (!std::isfinite(value)) {
    out_ += "null";
    return *this;
  }
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.*g", significant_digits, value);
  out_ += buf;
  return *this;
}
JsonWriter& JsonWriter::Bool(bool value) {
  Separator();
  out_ += value ? "true" : "false";
  return *this;
}
JsonWriter& JsonWriter::Null() {
  Separator();
  out_ += "null";
  return *this;
}
JsonWriter& JsonWriter::IntArray(const std::vector<int64_t>& values) {
  BeginArray();
  for (int64_t v : values) Int(v);
  return EndArray();
}

}  // namespace strata
