// JsonWriter: builds one JSON value (object/array/scalars) into a string, for metrics lines and
// benchmark output. Non-finite doubles are written as null, since JSON has no NaN or Infinity.
//
// A JsonWriter is not thread-safe: one thread builds a value (writers on different threads are
// independent). Strings passed in are copied; str() borrows the writer's buffer, valid until the
// next call that writes or the writer's destruction. JsonEscape is pure: any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  // Inside an object, Key() precedes every value.
  JsonWriter& Key(std::string_view key);
  JsonWriter& String(std::string_view value);
  JsonWriter& Int(int64_t value);
  JsonWriter& Double(double value, int significant_digits = 8);
  JsonWriter& Bool(bool value);
  JsonWriter& Null();

  template <typename T>
  JsonWriter& Field(std::string_view key, const T& value) {
    Key(key);
    return Value(value);
  }
  JsonWriter& IntArray(const std::vector<int64_t>& values);

  const std::string& str() const { return out_; }

 private:
  JsonWriter& Value(std::string_view v) { return String(v); }
  JsonWriter& Value(const std::string& v) { return String(v); }
  JsonWriter& Value(const char* v) { return String(v); }
  JsonWriter& Value(bool v) { return Bool(v); }
  JsonWriter& Value(int v) { return Int(v); }
  JsonWriter& Value(int64_t v) { return Int(v); }
  JsonWriter& Value(uint64_t v) { return Int(static_cast<int64_t>(v)); }
  JsonWriter& Value(double v) { return Double(v); }
  JsonWriter& Value(float v) { return Double(v); }
  void Separator();

  std::string out_;
  // One entry per open container: true when the next element needs a leading comma.
  std::vector<bool> need_comma_;
  bool after_key_ = false;
};

// Escapes a string for inclusion in JSON (without the surrounding quotes).
std::string JsonEscape(std::string_view s);

}  // namespace strata
