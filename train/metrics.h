// MetricsWriter: the JSONL metrics file, one JSON object per line, flushed line by line so a
// crash loses at most the line being written.
//
// The writer owns its open file; `env` is used only inside Open. Not synchronised: one thread at a
// time calls Write (the trainer's).
#pragma once

#include <memory>
#include <string>

#include "core/common/status.h"
#include "storage/env.h"

namespace strata::train {

class MetricsWriter {
 public:
  // Creates (truncates) `path`; its folder must exist.
  [[nodiscard]] static StatusOr<std::unique_ptr<MetricsWriter>> Open(const std::string& path,
                                                                     storage::Env* env);
  // Appends one line (a complete JSON value, without the newline) and flushes it to the OS.
  [[nodiscard]] Status Write(const std::string& json);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<storage::WritableFile> file_;
};

}  // namespace strata::train
