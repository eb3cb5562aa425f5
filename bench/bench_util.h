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
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace strata::bench {

// Words of English-like text, so the byte-level model sees realistic token statistics.
inline void WriteSyntheticText(const std::string& path, size_t bytes) {
  static const char* kWords[] = {
      "the",    "of",  "and",  "a",     "to",  "in",    "expert", "is",      "that",
      "memory", "for", "it",   "with",  "as",  "tier",  "on",     "storage", "be",
      "at",     "by",  "this", "had",   "not", "are",   "but",    "from",    "or",
      "have",   "an",  "they", "which", "one", "token", "you",    "were",    "all"};
  std::mt19937 gen(42);
  std::string text;
  while (text.size() < bytes) {
    text += kWords[gen() % (sizeof(kWords) / sizeof(kWords[0]))];
    text += gen() % 9 == 0 ? ".\n" : " ";
  }
  std::ofstream(path) << text;
}

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

// The number after "key": in a flat JSON object, or NaN (also when the value is not a number,
// such as the null that strata writes for a non-finite value).
inline double JsonNumber(const std::string& json, const std::string& key) {
  auto pos = json.find("\"" + key + "\":");
  if (pos == std::string::npos) return std::nan("");
  const char* begin = json.c_str() + pos + key.size() + 3;
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  return end == begin ? std::nan("") : v;
}

// `bytes` of text from a small vocabulary (fixed seed): a training corpus for jobs that measure
// the runtime, not the model.
inline std::string WordCorpus(size_t bytes) {
  static const char* kWords[] = {"the",    "expert", "router", "token", "layer", "memory",
                                 "worker", "step",   "loss",   "batch", "tier",  "storage",
                                 "of",     "and",    "a",      "to",    "in",    "gradient"};
  std::mt19937 rng(7);
  std::string s;
  while (s.size() < bytes) {
    s += kWords[rng() % (sizeof(kWords) / sizeof(kWords[0]))];
    s += rng() % 11 == 0 ? ".\n" : " ";
  }
  return s;
}

// The directory of the running executable (to find helper scripts copied next to it).
inline std::string ExecutableDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

// Median of the finite values (NaN when there are none).
inline double MedianOf(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Where a benchmark puts its scratch folders unless told (--dir): $TMPDIR, else /tmp.
inline std::string ScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp ? tmp : "/tmp";
}

// The value after the flag argv[*i] (advancing *i); exits with status 2 naming the flag when the
// command line ends there.

inline std::string FlagValue(const char* bench, int argc, char** argv, int* i) {
  if (*i + 1 >= argc) {
    std::fprintf(stderr, "%s: %s needs a value\n", bench, argv[*i]);
    std::exit(2);
  }
  return argv[++*i];
}

// fio, for the storage benchmarks' baseline: false (with a message naming `bench`) when missing.
inline bool FioAvailable(const char* bench, const char* without) {
  int status = 0;
  Capture("fio --version 2>&1", &status);
  if (status == 0) return true;
  std::fprintf(stderr,
               "%s: fio is not installed (scripts/install-deps.sh installs it); run with --no-fio "
               "%s\n",
               bench, without);
  return false;
}

// One fio job on `file` (io_uring, O_DIRECT): GB/s (1e9 bytes per second) of `rw` ("read" or
// "write"), or NaN with fio's output on stderr. `iomem` is fio's --iomem (where its buffers come
// from: "mmaphuge" for huge pages); empty leaves fio's default, malloc.
inline double RunFio(const std::string& file, const std::string& rw, uint64_t bs, uint64_t total,
                     uint64_t depth, bool fixed_buffers, const std::string& iomem = "") {
  const std::string cmd = absl::StrCat(
      "fio --name=bench --filename=", file, " --size=", total, " --bs=", bs, " --rw=", rw,
      " --ioengine=io_uring --direct=1 --iodepth=", depth, fixed_buffers ? " --fixedbufs" : "",
      iomem.empty() ? "" : " --iomem=", iomem, " --output-format=json 2>&1");
  int status = 0;
  const std::string out = Capture(cmd, &status);
  // bw_bytes of the job's "read" or "write" section
  const size_t s = out.find("\"" + rw + "\" : {");
  const size_t b = s == std::string::npos ? s : out.find("\"bw_bytes\" : ", s);
  const double bw = b == std::string::npos ? 0.0 : std::strtod(out.c_str() + b + 13, nullptr);
  if (status != 0 || !(bw > 0)) {
    std::fprintf(stderr, "fio failed (%s):\n%s\n", cmd.c_str(), out.c_str());
    return std::nan("");
  }
  return bw / 1e9;
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
