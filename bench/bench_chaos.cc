// bench_chaos: randomised failure drills against real elastic jobs. Each trial runs a small job of
// `strata worker` processes on loopback, injects failures at random moments, and checks what must
// hold however the failures land:
//
//   - the job reaches its last step, and `strata launch` (or the standalone coordinator, once its
//     job finished) exits 0; a standalone job's workers exit 0 too;
//   - every step's samples, as the workers' metrics files (--metrics-out) record them for the
//     highest generation that finished the step, tile [(s-1) B, s B) exactly once: no sample lost,
//     none seen twice (B the global batch). A worker's share of a step may lack its line only
//     where the step was trained whole without it: the worker was killed after the step's
//     exchange, or its step failed after it (a buddy copy to the worker that died) and the next
//     generation went on from that step instead of redoing it;
//   - the last step's loss is finite;
//   - a replacement worker started from the job's own "add a worker:" line exits 0, or finds no
//     coordinator only because the job finished and its coordinator exited before it connected.
//
//   build/bin/bench_chaos [--trials 8] [--seed S] [--trial K] [--scenarios a,b,c,d] [--keep]
//                         [--json] [--trial-limit 120] [--restart-with-flags] [--worker-config]
//
// Scenarios (one per trial, drawn from the seeded generator; so is every time and victim):
//   a  SIGKILL a worker of `strata launch` at a random step, then start a replacement;
//   b  the same with a checkpoint every few steps, each commit held open
//      (STRATA_FAULTS=checkpoint.before_commit=sleep_ms:N), and the kill landing inside that
//      window;
//   c  SIGKILL a second worker shortly after the first, while the survivors re-form;
//   d  a standalone `strata coordinator`: SIGKILL it, SIGKILL a worker while it is down (or within
//      3 s after it is back), restart it on the same port and folder, start a replacement.
//
// Replacements run exactly the command the job prints after "add a worker: " (through /bin/sh),
// with only --metrics-out, --id and --quiet appended: the job's settings come from the job, never
// from this program. A replacement refused because the job is still at its maximum (the
// coordinator has not yet dropped the dead worker) is started again under a new id, as an operator
// would. The restarted coordinator gets only --dir and --listen (its record holds the rest);
// --restart-with-flags also passes the original --config and worker counts.
//
// Every trial has a wall-clock limit and runs each process it starts in a process group of its
// own; on the way out every group is SIGKILLed and reaped. A trial's plan is a function of
// (--seed, trial number, --scenarios) only: `--seed S --trial K` replays one.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"

extern char** environ;

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr int kBatch = 12;  // splits evenly over 1 to 4 workers
constexpr const char* kToken = "chaos-token";

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "bench_chaos: %s\n", what.c_str());
  std::exit(2);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The last `n` lines of a file, indented, for a failure message.
std::string Tail(const std::string& path, int n = 6) {
  std::vector<std::string> lines = absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty());
  const size_t from = lines.size() > static_cast<size_t>(n) ? lines.size() - n : 0;
  std::string out;
  for (size_t i = from; i < lines.size(); ++i) absl::StrAppend(&out, "\n      | ", lines[i]);
  return out.empty() ? absl::StrCat(" (", path, " is empty)") : out;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The highest step in a metrics file (0 when none yet).
int64_t LastStep(const std::string& path) {
  int64_t last = 0;
  for (const auto& l : absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty())) {
    const double s = bench::JsonNumber(std::string(l), "step");
    if (std::isfinite(s)) last = std::max(last, static_cast<int64_t>(s));
  }
  return last;
}

// SIGINT or SIGTERM: the running trial ends (killing what it started) and no other begins.
volatile sig_atomic_t g_interrupted = 0;
void OnInterrupt(int) { g_interrupted = 1; }

struct Options {
  int trials = 8;
  uint64_t seed = 0;
  int trial = -1;  // replay this one only
  std::string scenarios = "abcd";
  bool keep = false;
  bool json = false;
  double trial_limit_s = 120;
  bool restart_with_flags = false;
  bool worker_config = false;  // a standalone job's workers also get --config (--worker-config)
};

// What one trial does; drawn from (seed, trial, scenarios) alone.
struct Plan {
  int trial = 0;
  char scenario = 'a';
  int workers = 2, min_workers = 1, steps = 60, checkpoint_every = 10, replicas = 1;
  int kill_step = 10;     // the victim is killed once its metrics show this step ...
  int kill_after_ms = 0;  // ... and this much later
  int victim = 0;
  int commit_delay_ms = 0;                      // b
  int second_victim = -1, second_after_ms = 0;  // c
  int replacements = 1;
  bool kill_while_down = false;             // d
  int down_ms = 0, kill_after_back_ms = 0;  // d: kill_after_ms counts from the coordinator's kill

  std::string Describe() const {
    std::string s = absl::StrFormat(
        "%c: %d workers (min %d, max %d), %d steps, checkpoint every %d, replicas %d; ", scenario,
        workers, min_workers, workers, steps, checkpoint_every, replicas);
    switch (scenario) {
      case 'a':
        absl::StrAppendFormat(&s, "SIGKILL worker %d %d ms after its step %d", victim,
                              kill_after_ms, kill_step);
        break;
      case 'b':
        absl::StrAppendFormat(&s,
                              "commits held %d ms; SIGKILL worker %d %d ms after its step %d "
                              "(a checkpoint step)",
                              commit_delay_ms, victim, kill_after_ms, kill_step);
        break;
      case 'c':
        absl::StrAppendFormat(&s,
                              "SIGKILL worker %d %d ms after its step %d, worker %d %d ms later",
                              victim, kill_after_ms, kill_step, second_victim, second_after_ms);
        break;
      case 'd':
        absl::StrAppendFormat(&s, "SIGKILL the coordinator after step %d, down %d ms; ", kill_step,
                              down_ms);
        if (kill_while_down) {
          absl::StrAppendFormat(&s, "SIGKILL worker %d %d ms into that", victim, kill_after_ms);
        } else {
          absl::StrAppendFormat(&s, "SIGKILL worker %d %d ms after it is back", victim,
                                kill_after_back_ms);
        }
        break;
    }
    absl::StrAppendFormat(&s, "; %d replacement%s", replacements, replacements == 1 ? "" : "s");
    return s;
  }
  std::string Json() const {
    return absl::StrFormat(
        "{\"scenario\":\"%c\",\"workers\":%d,\"min_workers\":%d,\"steps\":%d,"
        "\"checkpoint_every\":%d,\"replicas\":%d,\"kill_step\":%d,\"kill_after_ms\":%d,"
        "\"victim\":%d,\"commit_delay_ms\":%d,\"second_victim\":%d,\"second_after_ms\":%d,"
        "\"replacements\":%d,\"kill_while_down\":%s,\"down_ms\":%d,\"kill_after_back_ms\":%d}",
        scenario, workers, min_workers, steps, checkpoint_every, replicas, kill_step, kill_after_ms,
        victim, commit_delay_ms, second_victim, second_after_ms, replacements,
        kill_while_down ? "true" : "false", down_ms, kill_after_back_ms);
  }
};

Plan MakePlan(uint64_t seed, int trial, const std::string& scenarios) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(trial) * 1000003 + 1);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Plan p;
  p.trial = trial;
  p.scenario = scenarios[uni(0, static_cast<int>(scenarios.size()) - 1)];
  p.workers = p.scenario == 'c' ? 3 : uni(2, 3);
  // min == workers makes the replacement necessary: the survivors wait for it.
  p.min_workers = uni(1, p.scenario == 'c' ? 2 : p.workers);
  p.steps = uni(40, 80);
  p.replicas = uni(0, 1);
  p.checkpoint_every = 10;
  p.victim = uni(0, p.workers - 1);
  // Early enough that a replacement gets in while the job still runs.
  p.kill_step = uni(5, p.steps / 2);
  p.kill_after_ms = uni(0, 60);
  switch (p.scenario) {
    case 'b':
      p.checkpoint_every = uni(3, 5);
      p.commit_delay_ms = uni(300, 800);
      p.kill_step = p.checkpoint_every * uni(1, (p.steps / 2) / p.checkpoint_every);
      // Extents are written and synced within a few ms of the step; then the commit is held.
      p.kill_after_ms = uni(30, p.commit_delay_ms - 50);
      break;
    case 'c':
      p.second_victim = (p.victim + uni(1, p.workers - 1)) % p.workers;
      p.second_after_ms = uni(5, 400);
      p.replacements = uni(1, 2);
      break;
    case 'd':
      p.kill_while_down = uni(0, 1) == 1;
      p.down_ms = uni(300, 2500);
      p.kill_after_ms = p.kill_while_down ? uni(100, p.down_ms - 100) : 0;
      p.kill_after_back_ms = p.kill_while_down ? 0 : uni(0, 3000);
      break;
  }
  return p;
}

// One trial: its folder, the processes it started, what failed.
class Trial {
 public:
  Trial(const Plan& plan, const Options& o, std::string dir, std::string strata)
      : p_(plan), o_(o), dir_(std::move(dir)), strata_(std::move(strata)), t0_(Clock::now()) {
    fs::create_directories(dir_);
    std::ofstream(dir_ + "/corpus.txt") << bench::WordCorpus(60000);
    if (p_.scenario == 'b') {
      env_.push_back(
          absl::StrCat("STRATA_FAULTS=checkpoint.before_commit=sleep_ms:", p_.commit_delay_ms));
    }
    if (p_.scenario == 'd') env_.push_back(absl::StrCat("STRATA_JOB_TOKEN=", kToken));
  }
  ~Trial() {
    for (auto& [name, proc] : procs_) {
      if (!proc.running) continue;
      kill(-proc.pid, SIGKILL);
      waitpid(proc.pid, nullptr, 0);
    }
  }

  void Run() {
    WriteConfig();
    if (p_.scenario == 'd') {
      RunStandalone();
    } else {
      RunLaunched();
    }
    if (!failures_.empty()) ReportExits();
    CheckMetrics();
  }
  const std::vector<std::string>& failures() const { return failures_; }
  const std::vector<std::string>& notes() const { return notes_; }
  double seconds() const { return Since(t0_); }

 private:
  struct Proc {
    pid_t pid = -1;  // leader of its own process group
    bool running = true;
    int code = 0;  // exit code, or 128 + signal
    Clock::time_point ended;
  };
  // A replacement worker: its base name (r1) and how often it was refused.
  struct Replacement {
    std::string base;
    int attempts = 0;
    std::string current;  // the name of its latest process
  };

  // The job: a small MoE (2 layers, d_model 32, 8 experts) on a byte corpus. Its settings are in
  // the file as well as on `strata launch`'s flags, so a replacement started from the printed line
  // trains the same job whether or not the coordinator hands it the flags' overrides.
  void WriteConfig() {
    std::ofstream(dir_ + "/job.textproto") << absl::StrFormat(
        "name: \"chaos\"\n"
        "seed: 5\n"
        "model { vocab_size: 256 seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2\n"
        "        moe { num_experts: 8 top_k: 2 d_expert: 32 gate { capacity_factor_train: 0 } } }\n"
        "data { path: \"corpus.txt\" format: BYTES }\n"
        "train { steps: %d global_batch: %d lr: 0.004 warmup_steps: 2 schedule: CONSTANT "
        "eval_every: 0 eval_batches: 2 threads: 1 log_every: 10 }\n"
        "parallel { expert_parallel: 0 timeout_ms: 20000 }\n"
        "elastic { replicas: %d }\n"
        "checkpoint { every: %d dir: \"ckpt\" keep: 2 }\n",
        p_.steps, kBatch, p_.replicas, p_.checkpoint_every);
  }

  void Fail(const std::string& what) { failures_.push_back(what); }
  bool Expired() const { return g_interrupted || Since(t0_) > o_.trial_limit_s; }

  // Starts `cmd` (run in the trial's folder through /bin/sh) as the leader of a new process group.
  void Spawn(const std::string& name, const std::string& cmd) {
    const std::string full = absl::StrCat("cd ", dir_, " && ", cmd);
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    for (const std::string& e : env_) env.push_back(e);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) Die("fork failed");
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      execle("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr), envp.data());
      _exit(127);
    }
    setpgid(pid, pid);
    Proc proc;
    proc.pid = pid;
    procs_[name] = proc;
  }
  // Notes every process that ended, without waiting.
  void Reap() {
    for (auto& [name, proc] : procs_) {
      int status = 0;
      if (proc.running && waitpid(proc.pid, &status, WNOHANG) == proc.pid) {
        proc.running = false;
        proc.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        proc.ended = Clock::now();
      }
    }
  }
  // SIGKILLs a process group this trial started, and reaps its leader.
  void KillGroup(const std::string& name) {
    killed_procs_.insert(name);
    Proc& proc = procs_.at(name);
    if (!proc.running) return;
    kill(-proc.pid, SIGKILL);
    int status = 0;
    waitpid(proc.pid, &status, 0);
    proc.running = false;
    proc.code = 128 + SIGKILL;
    proc.ended = Clock::now();
  }
  bool Running(const std::string& name) {
    Reap();
    return procs_.count(name) && procs_.at(name).running;
  }

  // The child of `parent` whose command line has `--id id` (a worker `strata launch` started).
  static pid_t ChildWithId(pid_t parent, const std::string& id) {
    const std::string needle = std::string("--id") + '\0' + id + '\0';
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string pid = e.path().filename();
      if (pid.empty() || !std::all_of(pid.begin(), pid.end(), ::isdigit)) continue;
      const std::string stat = ReadFile(e.path() / "stat");
      const size_t close = stat.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(stat.substr(close + 1));
      std::string state;
      pid_t ppid = 0;
      rest >> state >> ppid;
      if (ppid != parent) continue;
      if (ReadFile(e.path() / "cmdline").find(needle) != std::string::npos) return std::stoi(pid);
    }
    return -1;
  }

  // After a failure: the processes of the job that exited with an error on their own (not
  // killed here, not a replacement refused at the job's maximum), which often say why.
  void ReportExits() {
    Reap();
    for (const auto& [name, proc] : procs_) {
      if (proc.running || proc.code == 0 || killed_procs_.count(name)) continue;
      const std::string log = dir_ + "/" + name + ".log";
      if (ReadFile(log).find("was not admitted") != std::string::npos) continue;
      const std::string what = absl::StrFormat("%s exited %d", name, proc.code);
      if (std::any_of(failures_.begin(), failures_.end(),
                      [&](const std::string& f) { return f.find(what) != std::string::npos; })) {
        continue;
      }
      Fail(absl::StrCat(what, ":", Tail(log, 2)));
    }
    // The processes still running (a hang says where it waits) and the coordinators (which
    // generations they formed, whom they declared failed): CI keeps no trial folder.
    for (const auto& [name, proc] : procs_) {
      const bool coordinator = name.rfind("coordinator", 0) == 0;
      if (!proc.running && !coordinator) continue;
      notes_.push_back(absl::StrFormat(
          "%s %s; its log ends:%s", name,
          proc.running ? "was still running" : absl::StrFormat("exited %d", proc.code),
          Tail(dir_ + "/" + name + ".log", coordinator ? 12 : 6)));
    }
  }

  // Starts (or, once refused, starts again) the replacements, from the job's own line.
  void StartReplacement(Replacement& r) {
    r.current = absl::StrCat(r.base, "-", ++r.attempts);
    // The printed command, plus the three flags that say where this worker writes: nothing else.
    Spawn(r.current, absl::StrCat(add_cmd_, " --metrics-out m.", r.current, ".jsonl --id ",
                                  r.current, " --quiet > ", r.current, ".log 2>&1"));
  }
  // A replacement the coordinator refused for being at its maximum (the dead worker not yet
  // dropped) is started again shortly after, up to 30 times.
  void PumpReplacements() {
    Reap();
    for (Replacement& r : replacements_) {
      const Proc& proc = procs_.at(r.current);
      if (proc.running || proc.code == 0 || r.attempts >= 30) continue;
      const std::string log = ReadFile(dir_ + "/" + r.current + ".log");
      const bool refused = log.find("max_workers") != std::string::npos ||
                           log.find("was not admitted") != std::string::npos;
      if (!refused) continue;
      if (std::chrono::duration<double>(Clock::now() - proc.ended).count() < 0.3) continue;
      StartReplacement(r);
    }
  }

  // Polls `done` (pumping the replacements) until it holds; false and a failure naming `what` if
  // the trial's time runs out or a process in `must_live` ends first.
  bool WaitFor(const std::function<bool()>& done, const std::string& what,
               const std::vector<std::string>& must_live = {}) {
    while (true) {
      PumpReplacements();
      if (done()) return true;
      for (const std::string& name : must_live) {
        if (!Running(name)) {
          Fail(absl::StrFormat("%s exited %d while waiting for %s:%s", name, procs_.at(name).code,
                               what, Tail(dir_ + "/" + name + ".log")));
          return false;
        }
      }
      if (Expired()) {
        Fail(
            absl::StrFormat("the trial's %.0f s ran out waiting for %s (highest step in the "
                            "metrics: %d)",
                            o_.trial_limit_s, what, HighestStep()));
        return false;
      }
      SleepMs(10);
    }
  }
  // Sleeps (pumping the replacements); false once the trial's time runs out.
  bool Pause(int ms) {
    const auto until = Clock::now() + std::chrono::milliseconds(ms);
    while (Clock::now() < until) {
      PumpReplacements();
      if (Expired()) return false;
      SleepMs(std::min<int>(10, ms));
    }
    return true;
  }

  std::vector<std::string> MetricsFiles() const {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string name = e.path().filename();
      if (name.rfind("m.", 0) == 0) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    return files;
  }
  int64_t HighestStep() const {
    int64_t s = 0;
    for (const std::string& f : MetricsFiles()) s = std::max(s, LastStep(f));
    return s;
  }

  // The line after "add a worker: " in a log, or "".
  std::string AddWorkerLine(const std::string& log) const {
    const std::string out = ReadFile(dir_ + "/" + log);
    const std::string key = "add a worker: ";
    const size_t at = out.find(key);
    if (at == std::string::npos) return "";
    const size_t end = out.find('\n', at);
    if (end == std::string::npos) return "";  // not all written yet
    return out.substr(at + key.size(), end - at - key.size());
  }

  void KillVictim(int worker) {
    const pid_t launch = procs_.at("launch").pid;
    const std::string id = absl::StrCat("worker-", worker);
    const pid_t pid = ChildWithId(launch, id);
    if (pid < 0) {
      Fail(absl::StrFormat("%s was not running when it was to be killed", id));
      return;
    }
    kill(pid, SIGKILL);
    killed_.push_back(absl::StrCat("m.jsonl.", worker));
  }

  // Scenarios a, b, c: `strata launch` starts the workers and runs the coordinator.
  void RunLaunched() {
    Spawn("launch",
          absl::StrFormat("exec %s launch --config job.textproto --workers %d --min-workers %d "
                          "--max-workers %d --steps %d --checkpoint-dir ckpt --checkpoint-every "
                          "%d --threads 1 --coordinator-dir coord --metrics-out m.jsonl > "
                          "launch.log 2>&1",
                          strata_, p_.workers, p_.min_workers, p_.workers, p_.steps,
                          p_.checkpoint_every));
    if (!WaitFor([&] { return !(add_cmd_ = AddWorkerLine("launch.log")).empty(); },
                 "the \"add a worker:\" line", {"launch"})) {
      return;
    }
    const std::string victim_metrics = absl::StrCat(dir_, "/m.jsonl.", p_.victim);
    if (!WaitFor([&] { return LastStep(victim_metrics) >= p_.kill_step; },
                 absl::StrFormat("worker %d's step %d", p_.victim, p_.kill_step), {"launch"}) ||
        !Pause(p_.kill_after_ms)) {
      return;
    }
    KillVictim(p_.victim);
    if (p_.scenario == 'c') {
      if (!Pause(p_.second_after_ms)) return;
      KillVictim(p_.second_victim);
    }
    for (int i = 1; i <= p_.replacements; ++i) {
      replacements_.push_back(Replacement{absl::StrCat("r", i), 0, ""});
      StartReplacement(replacements_.back());
    }
    if (!WaitFor([&] { return !Running("launch"); }, "strata launch to exit")) return;
    if (procs_.at("launch").code != 0) {
      Fail(absl::StrFormat("strata launch exited %d:%s", procs_.at("launch").code,
                           Tail(dir_ + "/launch.log")));
    }
    FinishReplacements();
  }

  // Scenario d: a standalone coordinator, killed and restarted; the workers started here.
  void RunStandalone() {
    const std::string flags = absl::StrFormat(
        "--config job.textproto --workers %d --min-workers %d "
        "--max-workers %d",
        p_.workers, p_.min_workers, p_.workers);
    Spawn("coordinator", absl::StrFormat("exec %s coordinator --dir record --listen 127.0.0.1:0 %s "
                                         "> coordinator.log 2>&1",
                                         strata_, flags));
    std::string address;
    // Serving once its "coordinator listening on ADDRESS (...)" line is out (the same port when
    // restarted). Log lines may come before it: a restarted coordinator checks its checkpoint
    // catalog against the folder while it opens.
    auto listening = [&](const std::string& log) {
      const std::string out = ReadFile(dir_ + "/" + log);
      static constexpr char kLine[] = "coordinator listening on ";
      const size_t line = out.find(kLine);
      if (line == std::string::npos) return false;
      const size_t at = line + sizeof(kLine) - 1;
      const size_t end = out.find_first_of(" \n", at);
      if (end == std::string::npos) return false;  // the line is not complete yet
      address = out.substr(at, end - at);
      return true;
    };
    if (!WaitFor([&] { return listening("coordinator.log"); }, "the coordinator to listen",
                 {"coordinator"})) {
      return;
    }
    // The coordinator's own "add a worker:" line when it prints one; else the documented command.
    SleepMs(50);
    add_cmd_ = AddWorkerLine("coordinator.log");
    if (add_cmd_.empty()) {
      add_cmd_ = absl::StrCat(strata_, " worker --coordinator ", address);
      if (o_.worker_config) absl::StrAppend(&add_cmd_, " --config ", dir_, "/job.textproto");
    }
    std::vector<std::string> workers;
    for (int i = 0; i < p_.workers; ++i) {
      workers.push_back(absl::StrCat("w", i));
      Spawn(workers.back(), absl::StrCat(add_cmd_, " --metrics-out m.w", i, ".jsonl --id w", i,
                                         " --quiet > w", i, ".log 2>&1"));
    }
    std::vector<std::string> must_live = workers;
    must_live.push_back("coordinator");
    const std::string victim = workers[p_.victim];
    const std::string victim_metrics = absl::StrCat(dir_, "/m.", victim, ".jsonl");
    if (!WaitFor([&] { return LastStep(victim_metrics) >= p_.kill_step; },
                 absl::StrFormat("worker %d's step %d", p_.victim, p_.kill_step), must_live)) {
      return;
    }
    KillGroup("coordinator");
    const auto down = Clock::now();
    if (p_.kill_while_down) {
      if (!Pause(p_.kill_after_ms)) return;
      KillGroup(victim);
      killed_.push_back(victim_metrics.substr(dir_.size() + 1));
    }
    if (!Pause(std::max(0, p_.down_ms - static_cast<int>(1e3 * Since(down))))) return;
    Spawn("coordinator.2",
          absl::StrFormat("exec %s coordinator --dir record --listen %s %s > "
                          "coordinator.2.log 2>&1",
                          strata_, address, o_.restart_with_flags ? flags : std::string()));
    if (!WaitFor([&] { return listening("coordinator.2.log"); },
                 "the restarted coordinator to listen", {"coordinator.2"})) {
      return;
    }
    if (!p_.kill_while_down) {
      if (!Pause(p_.kill_after_back_ms)) return;
      KillGroup(victim);
      killed_.push_back(victim_metrics.substr(dir_.size() + 1));
    }
    replacements_.push_back(Replacement{"r1", 0, ""});
    StartReplacement(replacements_.back());
    std::vector<std::string> survivors;
    for (const std::string& w : workers) {
      if (w != victim) survivors.push_back(w);
    }
    if (!WaitFor(
            [&] {
              return std::none_of(survivors.begin(), survivors.end(),
                                  [&](const std::string& w) { return Running(w); });
            },
            "the workers to finish")) {
      return;
    }
    for (const std::string& w : survivors) {
      if (procs_.at(w).code != 0) {
        Fail(absl::StrFormat("worker %s exited %d:%s", w, procs_.at(w).code,
                             Tail(dir_ + "/" + w + ".log")));
      }
    }
    FinishReplacements();
    // Once its job finished, a standalone coordinator exits 0 by itself.
    const auto last = Clock::now();
    while (Running("coordinator.2") && Since(last) < 10 && !Expired()) SleepMs(20);
    if (Running("coordinator.2")) {
      Fail(absl::StrFormat(
          "the restarted coordinator was still running %.0f s after the job's workers exited (it "
          "should exit 0 once its job finished):%s",
          Since(last), Tail(dir_ + "/coordinator.2.log", 3)));
      KillGroup("coordinator.2");
    } else if (procs_.at("coordinator.2").code != 0) {
      Fail(absl::StrFormat("the restarted coordinator exited %d:%s",
                           procs_.at("coordinator.2").code, Tail(dir_ + "/coordinator.2.log")));
    }
  }

  // Whether replacement `name` failed only because the job's coordinator (the launch's, or the
  // restarted one) had finished the job and exited 0 before it could reach it: its log names the
  // address that coordinator served (a wrong address in the "add a worker:" line is a failure).
  bool CameAfterTheJobEnded(const std::string& name) {
    const std::string log = ReadFile(dir_ + "/" + name + ".log");
    const std::string key = "cannot reach the coordinator at ";
    const size_t at = log.find(key);
    if (at == std::string::npos) return false;
    const std::string address =
        log.substr(at + key.size(), log.find(' ', at + key.size()) - at - key.size());
    const Proc& replacement = procs_.at(name);
    for (const auto& [coordinator, served] :
         {std::pair<std::string, std::string>{"launch", " coordinator on " + address + ";"},
          {"coordinator.2", "coordinator listening on " + address + " "}}) {
      auto it = procs_.find(coordinator);
      if (it != procs_.end() && !it->second.running && it->second.code == 0 &&
          it->second.ended <= replacement.ended &&
          ReadFile(dir_ + "/" + coordinator + ".log").find(served) != std::string::npos) {
        return true;
      }
    }
    return false;
  }

  // Once the job's own processes are done: every replacement exits 0. One still running 5 s
  // later never got into the job (it ended first): a note, and it is killed. One that found no
  // coordinator because the job had finished and its coordinator exited: a note too.
  void FinishReplacements() {
    const auto from = Clock::now();
    for (Replacement& r : replacements_) {
      while (Running(r.current) && Since(from) < 5) SleepMs(20);
      const std::string log = dir_ + "/" + r.current + ".log";
      if (Running(r.current)) {
        notes_.push_back(absl::StrFormat(
            "replacement %s was still running 5 s after the job ended (never got in?); killed:%s",
            r.current, Tail(log, 2)));
        KillGroup(r.current);
      } else if (procs_.at(r.current).code != 0 && CameAfterTheJobEnded(r.current)) {
        // A job that finished while the replacement started up has no coordinator left to
        // reach: the same outcome as joining too late to train, not a failure.
        notes_.push_back(absl::StrFormat(
            "replacement %s found no coordinator: the job had finished and its coordinator exited "
            "before it connected",
            r.current));
      } else if (procs_.at(r.current).code != 0) {
        Fail(absl::StrFormat("%s exited %d (replacement, attempt %d):%s", r.current,
                             procs_.at(r.current).code, r.attempts, Tail(log)));
      } else {
        if (r.attempts > 1) {
          notes_.push_back(absl::StrFormat("replacement %s was refused %d times before %s", r.base,
                                           r.attempts - 1, r.current));
        }
        // It exited 0: it finished the job with the others, or came too late to train at all.
        if (LastStep(absl::StrCat(dir_, "/m.", r.current, ".jsonl")) == 0) {
          notes_.push_back(absl::StrFormat(
              "replacement %s trained no step (the job ended before it got in)", r.current));
        }
      }
    }
  }

  // The metrics: each step 1..steps done, its samples tiled exactly once by the highest generation
  // that finished it, the last loss finite.
  void CheckMetrics() {
    struct Line {
      int64_t generation, first, count;
      double loss;
      std::string file;
    };
    std::map<int64_t, std::vector<Line>> by_step;
    // A killed worker's last line: it may have died after its step's exchange and before writing
    // the next step's line; that step's share of it is then missing from an otherwise whole step.
    std::map<std::string, Line> last_of_killed;
    std::map<std::string, int64_t> last_step_of_killed;
    // Any worker's lines (file -> step -> lines), and the last step each generation wrote: a
    // survivor whose step failed after its last exchange (a buddy copy to the worker that just
    // died) applied the step without writing its line, and the next generation went on from it.
    std::map<std::string, std::map<int64_t, std::vector<Line>>> lines_of_file;
    std::map<int64_t, int64_t> last_step_of_generation;
    for (const std::string& f : MetricsFiles()) {
      const std::string name = fs::path(f).filename();
      for (const auto& l : absl::StrSplit(ReadFile(f), '\n', absl::SkipEmpty())) {
        const std::string line(l);
        const double step = bench::JsonNumber(line, "step");
        if (!std::isfinite(step) || line.back() != '}') continue;  // a line cut by the kill
        Line x{static_cast<int64_t>(bench::JsonNumber(line, "generation")),
               static_cast<int64_t>(bench::JsonNumber(line, "first_sample")),
               static_cast<int64_t>(bench::JsonNumber(line, "samples")),
               bench::JsonNumber(line, "loss"), name};
        by_step[static_cast<int64_t>(step)].push_back(x);
        lines_of_file[name][static_cast<int64_t>(step)].push_back(x);
        last_step_of_generation[x.generation] =
            std::max(last_step_of_generation[x.generation], static_cast<int64_t>(step));
        if (std::find(killed_.begin(), killed_.end(), name) != killed_.end()) {
          last_of_killed[name] = x;
          last_step_of_killed[name] = static_cast<int64_t>(step);
        }
      }
    }
    int reported = 0;
    auto fail = [&](const std::string& what) {
      if (++reported <= 4) Fail(what);
    };
    // Steps in no metrics file, as runs [first, last].
    std::vector<std::pair<int64_t, int64_t>> missing;
    for (int64_t s = 1; s <= p_.steps; ++s) {
      auto it = by_step.find(s);
      if (it == by_step.end()) {
        if (!missing.empty() && missing.back().second == s - 1) {
          missing.back().second = s;
        } else {
          missing.emplace_back(s, s);
        }
        continue;
      }
      int64_t gen = 0;
      for (const Line& x : it->second) gen = std::max(gen, x.generation);
      std::vector<Line> lines;
      for (const Line& x : it->second) {
        if (x.generation == gen) lines.push_back(x);
      }
      std::sort(lines.begin(), lines.end(),
                [](const Line& a, const Line& b) { return a.first < b.first; });
      int64_t next = (s - 1) * kBatch;
      auto gap = [&](int64_t from, int64_t to) {
        // The share a killed worker would have trained in this step, had it lived to write it.
        for (const auto& [file, last] : last_of_killed) {
          const int64_t offset = last.first - (last_step_of_killed[file] - 1) * kBatch;
          if (last_step_of_killed[file] == s - 1 && last.generation == gen &&
              from == (s - 1) * kBatch + offset && to == from + last.count) {
            notes_.push_back(absl::StrFormat(
                "step %d: samples [%d, %d) have no line: %s's share, killed after the step's "
                "exchange and before writing it",
                s, from, to, file));
            return;
          }
        }
        // Workers without a line at the last step their generation wrote, where the next
        // generation went on from that step rather than redoing it: the step's state existed, so
        // every member's exchange of it completed, with these shares (their share of the step
        // before, one batch on). Together they must cover the gap exactly.
        bool went_on = false;
        if (auto after = by_step.find(s + 1); after != by_step.end()) {
          for (const Line& x : after->second) went_on = went_on || x.generation > gen;
        }
        if (went_on && last_step_of_generation[gen] == s) {
          std::vector<std::pair<int64_t, int64_t>> shares;
          std::vector<std::string> whose;
          for (const auto& [file, steps] : lines_of_file) {
            auto has = [&, &steps = steps](int64_t step) -> const Line* {
              auto it = steps.find(step);
              if (it == steps.end()) return nullptr;
              for (const Line& x : it->second) {
                if (x.generation == gen) return &x;
              }
              return nullptr;
            };
            const Line* before = has(s - 1);
            if (before == nullptr || has(s) != nullptr) continue;
            shares.emplace_back(before->first + kBatch, before->first + kBatch + before->count);
            whose.push_back(file);
          }
          std::sort(shares.begin(), shares.end());
          int64_t at = from;
          for (const auto& [a, b] : shares) {
            if (a == at && b <= to) at = b;
          }
          if (at == to) {
            notes_.push_back(absl::StrFormat(
                "step %d: samples [%d, %d) have no line: the shares of %s, whose step of "
                "generation %d ended after its exchange; the next generation went on from it",
                s, from, to, absl::StrJoin(whose, ", "), gen));
            return;
          }
        }
        fail(absl::StrFormat("step %d: samples [%d, %d) lost (generation %d)", s, from, to, gen));
      };
      for (const Line& x : lines) {
        if (x.first > next) gap(next, x.first);
        if (x.first < next) {
          fail(absl::StrFormat("step %d: samples [%d, %d) seen twice (generation %d, %s)", s,
                               x.first, std::min(next, x.first + x.count), gen, x.file));
        }
        next = std::max(next, x.first + x.count);
      }
      if (next < s * kBatch) gap(next, s * kBatch);
      if (next > s * kBatch) {
        fail(absl::StrFormat("step %d: samples up to %d, past the step's batch [%d, %d)", s, next,
                             (s - 1) * kBatch, s * kBatch));
      }
      if (s == p_.steps) {
        for (const Line& x : lines) {
          if (!std::isfinite(x.loss)) {
            fail(absl::StrFormat("step %d (the last): the loss is not finite (%s)", s, x.file));
            break;
          }
        }
      }
    }
    for (const auto& [first, last] : missing) {
      fail(absl::StrFormat("step%s %s: in no metrics file (the highest step in them: %d of %d)",
                           first == last ? "" : "s",
                           first == last ? absl::StrCat(first) : absl::StrCat(first, "-", last),
                           by_step.empty() ? 0 : by_step.rbegin()->first, p_.steps));
    }
    if (reported > 4) Fail(absl::StrFormat("... and %d more metrics failures", reported - 4));
  }

  Plan p_;
  Options o_;
  std::string dir_, strata_;
  Clock::time_point t0_;
  std::vector<std::string> env_;  // added to every process's environment
  std::map<std::string, Proc> procs_;
  std::vector<Replacement> replacements_;
  std::string add_cmd_;
  std::vector<std::string> killed_;     // the metrics files of the killed workers
  std::set<std::string> killed_procs_;  // the processes SIGKILLed here
  std::vector<std::string> failures_, notes_;
};

// "abd" -> "a,b,d", as --scenarios takes it.
std::string Letters(const std::string& scenarios) {
  std::vector<std::string> v;
  for (char c : scenarios) v.emplace_back(1, c);
  return absl::StrJoin(v, ",");
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  Options o;
  bool seed_given = false;
  const char* kUsage =
      "usage: bench_chaos [--trials N] [--seed S] [--trial K] [--scenarios a,b,c,d] [--keep] "
      "[--json] [--trial-limit SECONDS] [--restart-with-flags] [--worker-config]";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(a + " needs a value; " + kUsage);
      return argv[++i];
    };
    if (a == "--trials") {
      o.trials = std::atoi(value().c_str());
    } else if (a == "--seed") {
      o.seed = std::strtoull(value().c_str(), nullptr, 10);
      seed_given = true;
    } else if (a == "--trial") {
      o.trial = std::atoi(value().c_str());
    } else if (a == "--scenarios") {
      o.scenarios.clear();
      for (const auto& s : absl::StrSplit(value(), ',', absl::SkipEmpty())) {
        if (s.size() != 1 || s[0] < 'a' || s[0] > 'd') {
          Die(absl::StrCat("--scenarios takes letters a to d separated by commas, not '", s, "'"));
        }
        o.scenarios += s[0];
      }
      if (o.scenarios.empty()) Die("--scenarios needs at least one of a, b, c, d");
    } else if (a == "--keep") {
      o.keep = true;
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--trial-limit") {
      o.trial_limit_s = std::atof(value().c_str());
    } else if (a == "--restart-with-flags") {
      o.restart_with_flags = true;
    } else if (a == "--worker-config") {
      o.worker_config = true;
    } else {
      Die("unknown flag " + a + "; " + kUsage);
    }
  }
  if (o.trials < 1) Die("--trials must be at least 1");
  if (o.trial_limit_s <= 0) Die("--trial-limit must be positive");
  if (!seed_given) o.seed = std::random_device()() % 1000000;
  const std::string strata = (fs::canonical("/proc/self/exe").parent_path() / "strata").string();
  if (!fs::exists(strata)) Die("no strata binary next to this one: " + strata);
  char tmpl[] = "/tmp/strata-chaos-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) Die("cannot create a temporary folder under /tmp");
  const std::string base = tmpl;
  signal(SIGINT, OnInterrupt);
  signal(SIGTERM, OnInterrupt);

  std::vector<int> trials;
  if (o.trial >= 0) {
    trials.push_back(o.trial);
  } else {
    for (int t = 0; t < o.trials; ++t) trials.push_back(t);
  }
  std::printf("bench_chaos: seed %llu, scenarios %s, %zu trial(s)\n",
              static_cast<unsigned long long>(o.seed), Letters(o.scenarios).c_str(), trials.size());
  std::fflush(stdout);
  int passed = 0, failed = 0;
  std::map<char, std::pair<int, int>> per_scenario;  // scenario -> (passed, failed)
  bool kept_any = false;
  for (int t : trials) {
    if (g_interrupted) break;
    const Plan plan = MakePlan(o.seed, t, o.scenarios);
    std::printf("trial %d: %s\n", t, plan.Describe().c_str());
    std::fflush(stdout);
    const std::string dir = absl::StrCat(base, "/trial-", t);
    std::vector<std::string> failures, notes;
    double seconds = 0;
    {
      Trial trial(plan, o, dir, strata);
      trial.Run();
      failures = trial.failures();
      notes = trial.notes();
      seconds = trial.seconds();
    }
    if (g_interrupted) failures.push_back("interrupted");
    const bool ok = failures.empty();
    (ok ? passed : failed)++;
    (ok ? per_scenario[plan.scenario].first : per_scenario[plan.scenario].second)++;
    if (ok) {
      std::printf("trial %d: PASS in %.1f s\n", t, seconds);
    } else {
      std::printf("trial %d: FAIL in %.1f s: %s\n", t, seconds,
                  absl::StrJoin(failures, "\n    ").c_str());
    }
    for (const std::string& n : notes) std::printf("    note: %s\n", n.c_str());
    if (!ok) {
      std::string replay =
          absl::StrFormat("%s --seed %llu --trial %d --scenarios %s", argv[0],
                          static_cast<unsigned long long>(o.seed), t, Letters(o.scenarios));
      if (o.restart_with_flags) absl::StrAppend(&replay, " --restart-with-flags");
      if (o.worker_config) absl::StrAppend(&replay, " --worker-config");
      std::printf("    replay: %s\n", replay.c_str());
    }
    if (!ok && o.keep) {
      std::printf("    kept: %s\n", dir.c_str());
      kept_any = true;
    } else {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
    if (o.json) {
      std::vector<std::string> f, n;
      for (const auto& s : failures) f.push_back(JsonString(s));
      for (const auto& s : notes) n.push_back(JsonString(s));
      std::printf(
          "{\"trial\":%d,\"seed\":%llu,\"scenario\":\"%c\",\"pass\":%s,\"seconds\":%.2f,"
          "\"failures\":[%s],\"notes\":[%s],\"plan\":%s}\n",
          t, static_cast<unsigned long long>(o.seed), plan.scenario, ok ? "true" : "false", seconds,
          absl::StrJoin(f, ",").c_str(), absl::StrJoin(n, ",").c_str(), plan.Json().c_str());
    }
    std::fflush(stdout);
  }
  if (!kept_any) {
    std::error_code ec;
    fs::remove_all(base, ec);
  }
  for (const auto& [s, pf] : per_scenario) {
    std::printf("scenario %c: %d passed, %d failed\n", s, pf.first, pf.second);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed > 0 || g_interrupted ? 1 : 0;
}
