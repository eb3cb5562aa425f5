// Tracer: spans of work on named threads, written as Chrome trace-event JSON (`--trace FILE`),
// which Perfetto (ui.perfetto.dev) and chrome://tracing open. One track per thread: the compute
// threads, the SSD stage, the copy stage and the checkpoint writer, so the overlap of compute
// with I/O can be seen.
//
// Recording is cheap (a mutex and a vector push) and only happens when a tracer is attached.
//
// Thread-safe: every Tracer method takes the tracer's mutex, so compute, stage and checkpoint
// threads record into one tracer at once. Names are copied, but a span's `category` is kept by
// pointer until Write: pass a string literal. Whoever attaches a tracer keeps it alive until every
// thread recording into it has stopped.
#pragma once

#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/common/status.h"

namespace strata {

class Tracer {
 public:
  Tracer();

  // A complete span [start, end] (NowSeconds()) on the calling thread's track.
  void Span(std::string name, const char* category, double start, double end);
  // The same on a named track (for work done by a thread that is not traced itself).
  void SpanOn(const std::string& track, std::string name, const char* category, double start,
              double end);
  // Names the calling thread's track ("compute 0", "ssd stage", ...).
  void NameThisThread(const std::string& name);

  size_t size() const;
  // Writes {"traceEvents": [...]} with microsecond timestamps relative to the tracer's creation.
  [[nodiscard]] Status Write(const std::string& path) const;

 private:
  struct Event {
    std::string name;
    const char* category;
    int tid;
    double start, end;
  };
  int TidLocked(std::thread::id id);
  int TrackLocked(const std::string& name);

  double origin_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  std::unordered_map<std::thread::id, int> tids_;
  std::unordered_map<std::string, int> tracks_;
  std::vector<std::string> names_;  // by tid
};

// Records a span from construction to destruction on the calling thread, named `name` or
// "name index" (index >= 0). Without a tracer it does nothing and allocates nothing. Borrows
// `tracer`, `name` and `category` until destruction (string literals); lives on one thread.
class TraceScope {
 public:
  TraceScope(Tracer* tracer, const char* name, const char* category, int index = -1);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Tracer* tracer_;
  const char* name_;
  const char* category_;
  int index_;
  double start_ = 0;
};

}  // namespace strata
