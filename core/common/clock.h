// Monotonic time for step timing and progress output.
//
// Threads: NowSeconds and FormatDuration are pure and may be called from any thread. A Stopwatch
// is a plain value with no synchronisation: one thread at a time uses (or copies) it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace strata {

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Stopwatch {
 public:
  Stopwatch() : start_(NowSeconds()) {}
  void Reset() { start_ = NowSeconds(); }
  double Seconds() const { return NowSeconds() - start_; }
  double Millis() const { return 1e3 * Seconds(); }

 private:
  double start_;
};

// "1h02m", "3m07s", "42s": short human durations for ETAs.
std::string FormatDuration(double seconds);

}  // namespace strata
