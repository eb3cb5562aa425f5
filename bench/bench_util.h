// Shared by strata's benchmarks: peak-memory probes, a subprocess runner, and table printing.
#pragma once

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace strata::bench {

// Peak resident memory of this process, in MiB.
inline double PeakRssMb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return -1;
}

// Median wall time of `iters` calls of fn, in milliseconds, each call timed on its own: a median
// shrugs off the stalls a shared machine throws into a few iterations.
template <typename Fn>
double MedianMs(int iters, Fn&& fn) {
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
}

// Runs fn in a child process and returns what it wrote to its stdout-like pipe (the string fn
// returns). Each benchmark shape runs in a fresh process so its peak memory is its own.
template <typename Fn>
std::string InChildProcess(Fn&& fn) {
  int fds[2];
  if (pipe(fds) != 0) return "";
  std::fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const std::string out = fn();
    size_t off = 0;
    while (off < out.size()) {
      ssize_t n = write(fds[1], out.data() + off, out.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return out;
}

// Runs a command and returns its stdout (stderr passes through); exit status in *status.
inline std::string Capture(const std::string& command, int* status) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) {
    *status = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

// The number after "key": in a flat JSON object, or NaN.
inline double JsonNumber(const std::string& json, const std::string& key) {
  auto pos = json.find("\"" + key + "\":");
  if (pos == std::string::npos) return std::nan("");
  return std::strtod(json.c_str() + pos + key.size() + 3, nullptr);
}

// The directory of the running executable (to find helper scripts copied next to it).
inline std::string ExecutableDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

inline std::string HostDescription() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return absl::StrCat(model, ", ", sysconf(_SC_NPROCESSORS_ONLN), " online cores");
}

}  // namespace strata::bench
