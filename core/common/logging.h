// Minimal logging and invariant checks.
//
// STRATA_LOG(INFO) << "..." writes one line to stderr with a timestamp and the level.
// CHECK(cond) aborts with file:line when an invariant that indicates a bug does not hold; it is
// never used for bad user input, which gets a Status instead.
//
// Threads: any thread may log. A message is built in the LogMessage of its own statement and
// written to stderr with one fwrite when the statement ends, so lines from different threads never
// interleave. SetMinLogLevel / MinLogLevel are atomic: any thread, at any time.
#pragma once

#include <sstream>
#include <string>

namespace strata {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

// Messages below this level are dropped. Default: kInfo; STRATA_LOG_LEVEL=debug|info|warning|error
// in the environment overrides it at start-up.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

namespace internal {
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();  // writes the line; aborts for kFatal
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
// Used to swallow the stream expression when a level is disabled.
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace internal

}  // namespace strata

#define STRATA_LOG_LEVEL_DEBUG ::strata::LogLevel::kDebug
#define STRATA_LOG_LEVEL_INFO ::strata::LogLevel::kInfo
#define STRATA_LOG_LEVEL_WARNING ::strata::LogLevel::kWarning
#define STRATA_LOG_LEVEL_ERROR ::strata::LogLevel::kError
#define STRATA_LOG_LEVEL_FATAL ::strata::LogLevel::kFatal

#define STRATA_LOG(level)                              \
  (STRATA_LOG_LEVEL_##level < ::strata::MinLogLevel()) \
      ? (void)0                                        \
      : ::strata::internal::LogVoidify() &             \
            ::strata::internal::LogMessage(STRATA_LOG_LEVEL_##level, __FILE__, __LINE__).stream()

#define CHECK(cond)                                                                           \
  (cond) ? (void)0                                                                            \
         : ::strata::internal::LogVoidify() &                                                 \
               ::strata::internal::LogMessage(::strata::LogLevel::kFatal, __FILE__, __LINE__) \
                       .stream()                                                              \
                   << "Check failed: " #cond " "

#define CHECK_EQ(a, b) CHECK((a) == (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_NE(a, b) CHECK((a) != (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_LE(a, b) CHECK((a) <= (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_LT(a, b) CHECK((a) < (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_GE(a, b) CHECK((a) >= (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_GT(a, b) CHECK((a) > (b)) << "(" << (a) << " vs " << (b) << ") "
#define CHECK_OK(expr)                                        \
  do {                                                        \
    ::absl::Status strata_check_status_ = (expr);             \
    CHECK(strata_check_status_.ok()) << strata_check_status_; \
  } while (0)
