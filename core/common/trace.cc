#include "core/common/trace.h"

#include <fstream>

#include "absl/strings/str_format.h"
#include "core/common/clock.h"
#include "core/common/json.h"

namespace strata {

Tracer::Tracer() : origin_(NowSeconds()) {}

int Tracer::TidLocked(std::thread::id id) {
  auto it = tids_.find(id);
  if (it != tids_.end()) return it->second;
  const int tid = static_cast<int>(names_.size());
  names_.push_back(absl::StrFormat("thread %d", tid));
  tids_.emplace(id, tid);
  return tid;
}

int Tracer::TrackLocked(const std::string& name) {
  auto it = tracks_.find(name);
  if (it != tracks_.end()) return it->second;
  const int tid = static_cast<int>(names_.size());
  names_.push_back(name);
  tracks_.emplace(name, tid);
  return tid;
}

void Tracer::Span(std::string name, const char* category, double start, double end) {
  std::lock_guard<std::mutex> lock(mu_);
  const int tid = TidLocked(std::this_thread::get_id());
  events_.push_back(Event{std::move(name), category, tid, start, end});
}

void Tracer::SpanOn(const std::string& track, std::string name, const char* category, double start,
                    double end) {
  std::lock_guard<std::mutex> lock(mu_);
  const int tid = TrackLocked(track);
  events_.push_back(Event{std::move(name), category, tid, start, end});
}

void Tracer::NameThisThread(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  names_[TidLocked(std::this_thread::get_id())] = name;
}

size_t Tracer::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

Status Tracer::Write(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ofstream out(path, std::ios::trunc);
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cannot write the trace to '%s': check that its folder exists and is "
                        "writable",
                        path));
  }
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& line) {
    if (!first) out << ",\n";
    first = false;
    out << line;
  };
  for (size_t tid = 0; tid < names_.size(); ++tid) {
    JsonWriter j;
    j.BeginObject()
        .Field("ph", "M")
        .Field("name", "thread_name")
        .Field("pid", 1)
        .Field("tid", static_cast<int64_t>(tid));
    j.Key("args").BeginObject().Field("name", names_[tid]).EndObject().EndObject();
    emit(j.str());
    JsonWriter order;
    order.BeginObject()
        .Field("ph", "M")
        .Field("name", "thread_sort_index")
        .Field("pid", 1)
        .Field("tid", static_cast<int64_t>(tid));
    order.Key("args").BeginObject().Field("sort_index", static_cast<int64_t>(tid)).EndObject();
    emit(order.EndObject().str());
  }
  for (const Event& e : events_) {
    JsonWriter j;
    j.BeginObject()
        .Field("ph", "X")
        .Field("name", e.name)
        .Field("cat", e.category)
        .Field("pid", 1)
        .Field("tid", e.tid)
        .Key("ts")
        .Double(1e6 * (e.start - origin_), 12)
        .Key("dur")
        .Double(1e6 * std::max(0.0, e.end - e.start), 9)
        .EndObject();
    emit(j.str());
  }
  out << "\n]}\n";
  out.close();
  if (!out) {
    return absl::DataLossError(
        absl::StrFormat("writing the trace to '%s' failed (disk full?)", path));
  }
  return absl::OkStatus();
}

TraceScope::TraceScope(Tracer* tracer, const char* name, const char* category, int index)
    : tracer_(tracer), name_(name), category_(category), index_(index) {
  if (tracer_ != nullptr) start_ = NowSeconds();
}

TraceScope::~TraceScope() {
  if (tracer_ == nullptr) return;
  const double end = NowSeconds();
  tracer_->Span(index_ >= 0 ? absl::StrFormat("%s %d", name_, index_) : std::string(name_),
                category_, start_, end);
}

}  // namespace strata
