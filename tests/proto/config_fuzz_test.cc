// A config fuzzer: mutations of the shipped example configs go through the loader, the validation
// and the memory estimate that `strata check` runs — in this process (thousands of cases; a crash
// kills the test binary, a watchdog turns a hang into a failure), and a few hundred through the
// real `strata check` binary as child processes (a signal death or a timeout fails the test).
// Deterministic: the seed is fixed, and a failing case is printed whole.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <mutex>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "proto/config_io.h"
#include "runtime/model/memory_estimate.h"
#include "tests/test_util.h"

namespace strata::config {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// The shipped configs: every examples/*/config.textproto.
std::vector<std::string> ShippedConfigs() {
  std::vector<std::string> out;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(STRATA_SOURCE_DIR) + "/examples")) {
    const auto file = entry.path() / "config.textproto";
    if (std::filesystem::is_regular_file(file)) out.push_back(testing::ReadFile(file.string()));
  }
  return out;
}

// Every scalar field of JobConfig, by path from the root, for reflection mutations.
struct FieldPath {
  std::vector<const FieldDescriptor*> path;
};
void CollectFields(const Descriptor* d, std::vector<const FieldDescriptor*>& prefix,
                   std::vector<FieldPath>* out) {
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    prefix.push_back(f);
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      CollectFields(f->message_type(), prefix, out);
    } else {
      out->push_back({prefix});
    }
    prefix.pop_back();
  }
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {
    std::vector<const FieldDescriptor*> prefix;
    CollectFields(JobConfig::descriptor(), prefix, &fields_);
  }

  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Coin() { return rng_() & 1; }

  // A numeric value as text: edges, near-overflow, random.
  std::string Number() {
    static const char* kEdges[] = {"0",
                                   "-1",
                                   "1",
                                   "2147483647",
                                   "-2147483648",
                                   "2147483644",
                                   "4294967295",
                                   "4294967296",
                                   "1000000000",
                                   "65536",
                                   "65537",
                                   "1e6",
                                   "1e30",
                                   "-1e30",
                                   "1e999",
                                   "nan",
                                   "inf",
                                   "-inf",
                                   "0x7fffffff",
                                   "99999999999999999999",
                                   "18446744073709551615",
                                   "-0",
                                   "0.5",
                                   "1e-45",
                                   "3",
                                   "12000000000000"};
    switch (Below(3)) {
      case 0:
        return kEdges[Below(std::size(kEdges))];
      case 1:
        return absl::StrCat(static_cast<int64_t>(rng_()) >> Below(64));
      default:
        return absl::StrCat(Below(1 << Below(20)));
    }
  }

  // Sets a random scalar field of `c` through reflection to a bad or extreme value.
  void MutateField(JobConfig* c) {
    const FieldPath& fp = fields_[Below(fields_.size())];
    Message* m = c;
    for (size_t i = 0; i + 1 < fp.path.size(); ++i) {
      m = m->GetReflection()->MutableMessage(m, fp.path[i]);
    }
    const FieldDescriptor* f = fp.path.back();
    const Reflection* r = m->GetReflection();
    if (f->is_repeated()) {
      const int n = static_cast<int>(Below(Coin() ? 3 : 9000));
      for (int i = 0; i < n; ++i) r->AddInt32(m, f, static_cast<int32_t>(Signed32()));
      return;
    }
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        r->SetInt32(m, f, static_cast<int32_t>(Signed32()));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        r->SetInt64(m, f, static_cast<int64_t>(rng_()));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(m, f, static_cast<uint32_t>(Signed32()));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(m, f, Coin() ? rng_() : std::numeric_limits<uint64_t>::max() - Below(3));
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
      case FieldDescriptor::CPPTYPE_DOUBLE: {
        static const double kFloats[] = {0,         -1,    1e30, -1e30, NAN, INFINITY,
                                         -INFINITY, 1e-45, 0.5,  2,     1e9};
        const double v = kFloats[Below(std::size(kFloats))];
        if (f->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT) {
          r->SetFloat(m, f, static_cast<float>(v));
        } else {
          r->SetDouble(m, f, v);
        }
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(m, f, Coin());
        break;
      case FieldDescriptor::CPPTYPE_ENUM: {
        const auto* e = f->enum_type();
        r->SetEnum(m, f, e->value(static_cast<int>(Below(e->value_count()))));
        break;
      }
      case FieldDescriptor::CPPTYPE_STRING: {
        static const char* kStrings[] = {"", "cuda", "cuda:99999999", "/", "..", "cpu ", "\x01"};
        r->SetString(m, f, kStrings[Below(std::size(kStrings))]);
        break;
      }
      default:
        break;
    }
  }

  // A text mutation of `text`.
  std::string MutateText(const std::string& text) {
    std::vector<std::string> lines = absl::StrSplit(text, '\n');
    const size_t i = Below(lines.size());
    switch (Below(9)) {
      case 0:  // delete a line
        lines.erase(lines.begin() + static_cast<long>(i));
        break;
      case 1:  // duplicate a line
        lines.insert(lines.begin() + static_cast<long>(i), lines[i]);
        break;
      case 2: {  // replace the value after a ':' by a number
        const size_t colon = lines[i].find(':');
        if (colon != std::string::npos) lines[i] = lines[i].substr(0, colon + 1) + " " + Number();
        break;
      }
      case 3: {  // an invalid enum value, by name or by number
        static const char* kEnums[] = {"norm: BATCH_NORM",      "activation: 7", "mode: -1",
                                       "type: TOP_K_TOP_K",     "format: 2",     "schedule: 99",
                                       "expert_update: LAZIEST"};
        lines.insert(lines.begin() + static_cast<long>(i), kEnums[Below(std::size(kEnums))]);
        break;
      }
      case 4: {  // random bytes spliced in
        std::string bytes;
        for (uint64_t n = Below(16) + 1; n > 0; --n) bytes += static_cast<char>(rng_());
        lines[i].insert(Below(lines[i].size() + 1), bytes);
        break;
      }
      case 5: {  // truncated anywhere
        std::string joined = absl::StrJoin(lines, "\n");
        return joined.substr(0, Below(joined.size() + 1));
      }
      case 6: {  // a repeated field with bad entries, or a message section duplicated
        if (Coin()) {
          std::string s = "parallel {";
          for (uint64_t n = Below(6); n > 0; --n)
            absl::StrAppend(&s, " experts_per_worker: ", Number());
          lines.insert(lines.begin() + static_cast<long>(i), s + " }");
        } else {
          lines.push_back(Coin() ? "model { d_model: 64 }"
                                 : "train { steps: 1 } train { steps: 2 }");
        }
        break;
      }
      case 7: {  // a brace or quote dropped or added
        static const char* kBits[] = {"{", "}", "\"", "<", ">", "[", "]", ":", ";", "#"};
        lines[i].insert(Below(lines[i].size() + 1), kBits[Below(std::size(kBits))]);
        break;
      }
      default: {  // a known field with an extreme value in a random section
        static const char* kSections[] = {"model",   "train",      "storage", "parallel",
                                          "elastic", "checkpoint", "data"};
        static const char* kNames[] = {"d_model",      "n_layers",   "seq_len",   "vocab_size",
                                       "n_heads",      "d_ff",       "moe_every", "global_batch",
                                       "eval_batches", "steps",      "threads",   "io_block_bytes",
                                       "bucket_bytes", "timeout_ms", "replicas",  "every"};
        lines.push_back(absl::StrCat(kSections[Below(std::size(kSections))], " { ",
                                     kNames[Below(std::size(kNames))], ": ", Number(), " }"));
      }
    }
    return absl::StrJoin(lines, "\n");
  }

  // One case: 1-3 mutations of a shipped config, by reflection and/or on the text.
  std::string Case(const std::vector<std::string>& bases) {
    const std::string& base = bases[Below(bases.size())];
    std::string text = base;
    if (Coin()) {
      JobConfig c;
      google::protobuf::TextFormat::ParseFromString(base, &c);
      for (uint64_t n = Below(3) + 1; n > 0; --n) MutateField(&c);
      text = ToText(c);
    }
    for (uint64_t n = Below(3); n > 0; --n) text = MutateText(text);
    return text;
  }

 private:
  uint64_t Signed32() {
    static const int64_t kEdges[] = {0,          -1,    1,     2147483647, -2147483648LL,
                                     2147483644, 65536, 65537, 1000000000, 100000000,
                                     4096,       4097};
    return static_cast<uint64_t>(Coin() ? kEdges[Below(std::size(kEdges))]
                                        : static_cast<int32_t>(rng_()) >> Below(31));
  }

  std::mt19937_64 rng_;
  std::vector<FieldPath> fields_;
};

// Turns a hang into a failure: if one case runs longer than the limit, print it and abort.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit) : limit_(limit), thread_([this] { Loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Start(const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    text_ = text;
    started_ = std::chrono::steady_clock::now();
    running_ = true;
  }
  void Done() {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      if (running_ && std::chrono::steady_clock::now() - started_ > limit_) {
        std::fprintf(stderr, "config fuzzer: a case ran longer than %llds (a hang):\n%s\n",
                     static_cast<long long>(limit_.count()), text_.c_str());
        std::abort();
      }
    }
  }
  const std::chrono::seconds limit_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, running_ = false;
  std::string text_;
  std::chrono::steady_clock::time_point started_;
  std::thread thread_;
};

TEST(ConfigFuzzTest, MutatedConfigsLoadOrFailWithALocatedError) {
  const std::vector<std::string> bases = ShippedConfigs();
  ASSERT_GE(bases.size(), 3u) << "examples/*/config.textproto";
  Mutator mutator(20240601);
  Watchdog watchdog(std::chrono::seconds(10));
  const int kCases = 20000;
  int accepted = 0, rejected = 0, refused_memory = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCases; ++i) {
    const std::string text = mutator.Case(bases);
    watchdog.Start(text);
    // What `strata check` does: load (parse, normalise, validate), then validate against this
    // machine with the memory estimate.
    auto c = ParseJobConfig(text, "fuzz.textproto", "/base");
    if (!c.ok()) {
      ++rejected;
      const std::string msg(c.status().message());
      ASSERT_EQ(msg.rfind("invalid config fuzz.textproto:\n  fuzz.textproto", 0), 0u)
          << "case " << i << ": an error must name the file:\n"
          << msg << "\n--- config:\n"
          << text;
    } else {
      const MemoryEstimate e = EstimateMemory(*c);
      (void)FormatMemoryEstimate(e);
      (void)CheckMemory(*c, e, uint64_t{1} << 30, "fuzz.textproto");
      const Status s = ValidateJobConfig(*c, "fuzz.textproto");
      if (s.ok()) {
        ++accepted;
      } else {
        ++refused_memory;
        EXPECT_NE(s.message().find("fuzz.textproto"), std::string::npos) << s;
      }
    }
    watchdog.Done();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "config fuzzer: %d cases in process in %.2f s: %d accepted, %d rejected by the "
      "loader, %d refused by the memory check\n",
      kCases, seconds, accepted, rejected, refused_memory);
  // The mutations must exercise both outcomes, or the fuzzer tests nothing.
  EXPECT_GT(accepted, kCases / 20);
  EXPECT_GT(rejected, kCases / 4);
}

struct ChildResult {
  bool timed_out = false;
  int signal = 0;  // the signal that ended it, or 0
  int exit_code = -1;
  std::string output;
};

// Starts argv with stdout and stderr to `log`.
pid_t StartChild(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// Waits for `pid`, killing it at `deadline`.
ChildResult WaitChild(pid_t pid, const std::string& log,
                      std::chrono::steady_clock::time_point deadline) {
  ChildResult r;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (!r.timed_out) {
    if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  }
  r.output = testing::ReadFile(log);
  return r;
}

ChildResult RunChild(const std::vector<std::string>& argv, const std::string& log,
                     std::chrono::milliseconds limit) {
  return WaitChild(StartChild(argv, log), log, std::chrono::steady_clock::now() + limit);
}

TEST(ConfigFuzzTest, StrataCheckNeverCrashesOrHangs) {
  const std::string strata = std::string(STRATA_BIN_DIR) + "/strata";
  testing::TempDir dir;
  testing::WriteFile(dir.File("text.txt"), testing::SyntheticText(20000));
  std::vector<std::string> bases;
  for (std::string base : ShippedConfigs()) {
    // The examples' data (prepared by a script) need not exist here: train on text.txt.
    const size_t open = base.find('"', base.find("path:"));
    ASSERT_NE(open, std::string::npos);
    base.replace(open, base.find('"', open + 1) + 1 - open, "\"text.txt\"");
    bases.push_back(base);
  }
  Mutator mutator(777);
  // The paths that are not config files at all, then mutated configs; two runs at a time.
  std::vector<std::pair<std::vector<std::string>, std::string>> runs = {
      // argv, config text
      {{strata, "check", "--config", dir.path()}, ""},
      {{strata, "check", "--config", dir.File("missing.textproto")}, ""},
      {{strata, "check", "--config", "/dev/zero"}, ""},
      {{strata, "check", "--config", dir.File("text.txt/x")}, ""},
      {{strata, "check", "--config", strata}, ""},  // binary garbage
  };
  const int kCases = 200;
  for (int i = 0; i < kCases; ++i) {
    const std::string config = dir.File(absl::StrCat("fuzz-", i, ".textproto"));
    runs.push_back({{strata, "check", "--config", config}, mutator.Case(bases)});
    testing::WriteFile(config, runs.back().second);
  }
  int ok = 0, errors = 0;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < runs.size(); i += 2) {
    std::vector<std::pair<pid_t, std::string>> children;  // pid, log
    for (size_t j = i; j < std::min(i + 2, runs.size()); ++j) {
      const std::string log = dir.File(absl::StrCat("out-", j - i, ".txt"));
      children.push_back({StartChild(runs[j].first, log), log});
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (size_t j = 0; j < children.size(); ++j) {
      const ChildResult r = WaitChild(children[j].first, children[j].second, deadline);
      const std::string& text = runs[i + j].second;
      const std::string what = absl::StrCat("run ", i + j, " (", runs[i + j].first.back(), ")");
      EXPECT_FALSE(r.timed_out) << what << " hung:\n" << text;
      EXPECT_EQ(r.signal, 0) << what << " died of signal " << r.signal << ":\n"
                             << r.output << "\n--- config:\n"
                             << text;
      EXPECT_TRUE(r.timed_out || r.signal != 0 || r.exit_code == 0 || r.exit_code == 1)
          << what << " exit " << r.exit_code << ":\n"
          << r.output << "\n--- config:\n"
          << text;
      if (r.exit_code == 0) {
        ++ok;
        EXPECT_NE(r.output.find("# memory:"), std::string::npos) << r.output;
      } else {
        ++errors;
        EXPECT_NE(r.output.find("strata: error: "), std::string::npos) << what << r.output;
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("config fuzzer: %zu runs of strata check in %.1f s: %d valid, %d clear errors\n",
              runs.size(), seconds, ok, errors);
  EXPECT_GT(ok, 0);
  EXPECT_GT(errors, kCases / 4);
}

// The configs an adversarial user found: each aborted, hung or misreported `strata check` or
// `strata train`; each is now a clear error from both, before anything is allocated.
TEST(ConfigFuzzTest, ReportedConfigsAreClearErrorsFromCheckAndTrain) {
  const std::string strata = std::string(STRATA_BIN_DIR) + "/strata";
  testing::TempDir dir;
  testing::WriteFile(dir.File("text.txt"), testing::SyntheticText(20000));
  struct Case {
    std::string body;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"parallel { experts_per_worker: 5 experts_per_worker: -1 }",
       ":2:12: field parallel.experts_per_worker: experts_per_worker must be non-negative"},
      {"model { d_model: 1000000 n_heads: 1 }", "field model.d_model: d_model = 1000000"},
      {"model { d_model: 65536 n_heads: 1 moe { d_expert: 65536 } }", "the job needs"},
      {"model { n_layers: 100000000 }", "field model.n_layers"},
      {"train { global_batch: 2000000000 }", "field train.global_batch"},
      {"model { seq_len: 65536 }", "lower train.global_batch or model.seq_len"},
      {"train { eval_batches: 1000000000 }", "field train.eval_batches"},
      {"model { d_model: 2147483644 n_heads: 1 }", "field model.d_model: d_model = 2147483644"},
  };
  const std::string config = dir.File("job.textproto"), log = dir.File("out.txt");
  for (const Case& c : cases) {
    testing::WriteFile(config, "data { path: \"text.txt\" }\n" + c.body + "\n");
    for (const char* command : {"check", "train"}) {
      std::vector<std::string> argv = {strata, command, "--config", config};
      if (command == std::string("train"))
        argv.insert(argv.end(), {"--steps", "1", "--threads", "1"});
      const ChildResult r = RunChild(argv, log, std::chrono::seconds(30));
      ASSERT_FALSE(r.timed_out) << command << " " << c.body;
      ASSERT_EQ(r.signal, 0) << command << " " << c.body << "\n" << r.output;
      EXPECT_EQ(r.exit_code, 1) << command << " " << c.body << "\n" << r.output;
      EXPECT_NE(r.output.find(c.expect), std::string::npos) << command << " " << c.body << "\n"
                                                            << r.output;
    }
  }
  const ChildResult d =
      RunChild({strata, "check", "--config", dir.path()}, log, std::chrono::seconds(30));
  EXPECT_EQ(d.exit_code, 1) << d.output;
  EXPECT_NE(d.output.find("' is a directory; --config takes a .textproto file"), std::string::npos)
      << d.output;
}

}  // namespace
}  // namespace strata::config
