// An independent reader of Prometheus's text exposition format (version 0.0.4), for the tests:
// it checks the format's rules as it reads — a line is a comment, a sample or empty and ends in a
// newline; HELP and TYPE name a metric and come at most once each, TYPE before its samples with
// one of the five types; a sample is NAME[{LABEL="VALUE",...}] VALUE [TIMESTAMP] with names of
// [a-zA-Z_:][a-zA-Z0-9_:]*, label names of [a-zA-Z_][a-zA-Z0-9_]*, label values escaped (\\, \",
// \n) and a Go float value; a family's samples are contiguous; no series is given twice — and
// returns every sample by its series ("name" or "name{label=\"value\"}").
#pragma once

#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>

namespace strata::testing {

struct Exposition {
  std::map<std::string, double> samples;     // series -> value
  std::map<std::string, std::string> types;  // family -> type
  std::string error;                         // the first rule broken, "" when none
};

inline Exposition ParseExposition(const std::string& text) {
  Exposition out;
  auto fail = [&](int line, const std::string& why) {
    if (out.error.empty()) out.error = "line " + std::to_string(line) + ": " + why;
  };
  auto is_name = [](const std::string& s, bool colon) {
    if (s.empty()) return false;
    for (size_t i = 0; i < s.size(); ++i) {
      const char c = s[i];
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                      (colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
      if (!ok) return false;
    }
    return true;
  };
  auto parse_value = [](const std::string& s, double* v) {
    if (s == "NaN" || s == "+Inf" || s == "-Inf") {
      *v = s == "NaN" ? std::nan("") : (s[0] == '+' ? HUGE_VAL : -HUGE_VAL);
      return true;
    }
    char* end = nullptr;
    *v = std::strtod(s.c_str(), &end);
    return !s.empty() && end == s.c_str() + s.size();
  };
  if (!text.empty() && text.back() != '\n') fail(0, "the text does not end in a newline");
  std::set<std::string> helped, finished_families;
  std::string current_family;
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::istringstream words(line.substr(1));
      std::string kind, name, rest;
      words >> kind >> name;
      if (kind != "HELP" && kind != "TYPE") continue;  // another comment
      if (!is_name(name, true)) fail(n, "HELP/TYPE of a bad metric name '" + name + "'");
      std::getline(words, rest);
      if (!rest.empty() && rest[0] == ' ') rest.erase(0, 1);
      if (kind == "HELP") {
        if (!helped.insert(name).second) fail(n, "a second HELP for " + name);
        continue;
      }
      if (out.types.count(name)) fail(n, "a second TYPE for " + name);
      if (rest != "counter" && rest != "gauge" && rest != "histogram" && rest != "summary" &&
          rest != "untyped") {
        fail(n, "TYPE '" + rest + "' of " + name);
      }
      if (finished_families.count(name) || current_family == name) {
        fail(n, "the TYPE of " + name + " after its samples");
      }
      out.types[name] = rest;
      continue;
    }
    // A sample.
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    const std::string name = line.substr(0, i);
    if (!is_name(name, true)) fail(n, "bad metric name '" + name + "'");
    std::string series = name;
    if (i < line.size() && line[i] == '{') {
      series += '{';
      ++i;
      bool first = true;
      while (i < line.size() && line[i] != '}') {
        size_t eq = line.find('=', i);
        if (eq == std::string::npos) {
          fail(n, "a label without '='");
          break;
        }
        const std::string label = line.substr(i, eq - i);
        if (!is_name(label, false)) fail(n, "bad label name '" + label + "'");
        if (eq + 1 >= line.size() || line[eq + 1] != '"') {
          fail(n, "label value not quoted");
          break;
        }
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            if (j + 1 >= line.size() ||
                (line[j + 1] != '\\' && line[j + 1] != '"' && line[j + 1] != 'n')) {
              fail(n, "a bad escape in a label value");
            }
            value += line[j + 1] == 'n' ? '\n' : line[j + 1];
            ++j;
          } else {
            value += line[j];
          }
        }
        if (j >= line.size()) {
          fail(n, "an unterminated label value");
          break;
        }
        series += (first ? "" : ",") + label + "=\"" + value + "\"";
        first = false;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) {
        fail(n, "labels without '}'");
        continue;
      }
      series += '}';
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') {
      fail(n, "no space before the value");
      continue;
    }
    std::istringstream rest(line.substr(i + 1));
    std::string value_text, timestamp, extra;
    rest >> value_text >> timestamp >> extra;
    double value = 0;
    if (!parse_value(value_text, &value)) fail(n, "bad value '" + value_text + "'");
    if (!extra.empty()) fail(n, "more than a value and a timestamp");
    // The family: a histogram's or summary's _sum/_count/_bucket belong to theirs; none here.
    if (name != current_family) {
      if (finished_families.count(name)) fail(n, "the samples of " + name + " are not together");
      if (!current_family.empty()) finished_families.insert(current_family);
      current_family = name;
    }
    if (!out.samples.emplace(series, value).second) fail(n, "the series " + series + " twice");
  }
  return out;
}

}  // namespace strata::testing
