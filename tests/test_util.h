// Helpers shared by strata's tests: temporary folders, files, and running a real command.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace strata::testing {

// The source tree (examples/, bench/) and the folder of strata's binaries: STRATA_SOURCE_DIR and
// STRATA_BIN_DIR from the environment when set (a package run on another machine:
// scripts/gpu-check.sh sets them), else the paths compiled into the test.
inline std::string SourceDir() {
  const char* e = std::getenv("STRATA_SOURCE_DIR");
  return e != nullptr && *e != '\0' ? std::string(e) : std::string(STRATA_SOURCE_DIR);
}
inline std::string BinDir() {
  const char* e = std::getenv("STRATA_BIN_DIR");
  return e != nullptr && *e != '\0' ? std::string(e) : std::string(STRATA_BIN_DIR);
}

// A fresh folder under $TMPDIR (or /tmp), removed with everything in it on destruction, unless
// STRATA_KEEP_TEST_DIRS is set (then kept, for reading a failed test's logs and files).
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/strata_test_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    path_ = mkdtemp(buf.data());
  }
  ~TempDir() {
    if (std::getenv("STRATA_KEEP_TEST_DIRS") != nullptr) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out << data;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command, capturing its output.
inline CommandResult RunCommand(const std::string& command) {
  CommandResult r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Deterministic English-like text: sentences drawn from a small grammar. A model can learn it
// quickly, so "the loss falls" is a real signal within a few dozen steps.
inline std::string SyntheticText(size_t bytes, unsigned seed = 7) {
  static const char* kSubjects[] = {"the cat", "a dog", "my friend", "the old man", "she", "he"};
  static const char* kVerbs[] = {"sees", "likes", "finds", "takes", "wants", "reads"};
  static const char* kObjects[] = {"the ball", "a book", "some bread", "the red hat", "a letter"};
  std::mt19937 rng(seed);
  std::string s;
  while (s.size() < bytes) {
    s += kSubjects[rng() % 6];
    s += ' ';
    s += kVerbs[rng() % 6];
    s += ' ';
    s += kObjects[rng() % 5];
    s += ". ";
    if (rng() % 4 == 0) s += '\n';
  }
  s.resize(bytes);
  return s;
}

// A field of one JSON line of a metrics file ({"step":12,"loss":3.4,...}); -1 / NaN when absent.
inline int64_t IntField(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  return std::stoll(line.substr(at + key.size() + 3));
}
inline double DoubleField(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return std::nan("");
  return std::stod(line.substr(at + key.size() + 3));
}

// The exit code of a child process (128 + the signal if a signal ended it), once it ends.
inline int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs `workers` processes of `strata worker --rank R --world-size W FLAGS` in folder `dir`, each
// one's output in dir/worker<R>.log, until all end. Empty when every one exited with 0, else each
// failure's exit code and log. FLAGS may differ by rank: flags_of(rank).
inline std::string RunWorkers(const std::string& dir, int workers,
                              const std::function<std::string(int rank)>& flags_of) {
  std::vector<pid_t> pids;
  for (int r = 0; r < workers; ++r) {
    const std::string cmd = "cd " + dir + " && exec " + BinDir() + "/strata worker --rank " +
                            std::to_string(r) + " --world-size " + std::to_string(workers) + " " +
                            flags_of(r) + " > worker" + std::to_string(r) + ".log 2>&1";
    const pid_t pid = fork();
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::string failures;
  for (int r = 0; r < workers; ++r) {
    const int code = WaitExit(pids[r]);
    if (code != 0) {
      failures += "worker " + std::to_string(r) + " exited with " + std::to_string(code) + ":\n" +
                  ReadFile(dir + "/worker" + std::to_string(r) + ".log");
    }
  }
  return failures;
}

inline std::string RunWorkers(const std::string& dir, int workers, const std::string& flags) {
  return RunWorkers(dir, workers, [&](int) { return flags; });
}

// The steps `strata ckpt ls` printed, in order (the first word of each line that is a number).
inline std::vector<int64_t> ListedSteps(const std::string& output) {
  std::vector<int64_t> steps;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::string first;
    words >> first;
    if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) continue;
    steps.push_back(std::stoll(first));
  }
  return steps;
}

// step -> loss of a metrics file (JSONL) written by --metrics-out.
inline std::map<int64_t, double> StepLosses(const std::string& path) {
  std::map<int64_t, double> out;
  std::istringstream in(ReadFile(path));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out[IntField(line, "step")] = DoubleField(line, "loss");
  }
  return out;
}

}  // namespace strata::testing
