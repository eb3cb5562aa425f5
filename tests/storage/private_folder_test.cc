// PrivateFolder with real processes and real files: the folder of a process killed with SIGKILL
// goes with the next Create under the same parent (logged with its process id, path and the bytes
// its files took, measured here with lstat), a folder whose process is alive stays whatever its
// name says (also a process id that names no process here, as from another PID namespace), until
// its process exits without removing it; names that are not `<prefix><pid>-...` stay; the
// destructor removes the folder; a bad parent is refused with a message saying what to do. And
// through `strata train`: a TIERED job's temporary SSD-tier folder left by a run killed with
// SIGKILL goes with the next run in the same TMPDIR.
#include "storage/private_folder.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

namespace fs = std::filesystem;
using strata::testing::ReadFile;
using strata::testing::RunCommand;
using strata::testing::TempDir;
using strata::testing::WriteFile;

constexpr char kPrefix[] = "strata-test-";
constexpr char kWhat[] = "the test files";
constexpr size_t kDataBytes = 1 << 20;

// A child process holding a PrivateFolder under `parent` with kDataBytes written (and synced) in
// `data`. It waits until the parent closes `release`, then exits without removing the folder.
struct Holder {
  pid_t pid = -1;
  std::string path;  // empty when the child could not make it
  int release = -1;  // the write end; closing it lets the child go
};

Holder StartHolder(const std::string& parent) {
  int ready[2], release[2];
  EXPECT_EQ(::pipe(ready), 0);
  EXPECT_EQ(::pipe(release), 0);
  Holder h;
  h.pid = ::fork();
  if (h.pid == 0) {
    ::close(ready[0]);
    ::close(release[1]);
    auto f = PrivateFolder::Create(parent, kPrefix, kWhat);
    std::string path;
    if (f.ok()) {
      path = (*f)->path();
      const std::string data(kDataBytes, 'x');
      const int fd = ::open((path + "/data").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
      if (fd < 0 || ::write(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size()) ||
          ::fsync(fd) != 0) {
        path.clear();
      }
    }
    if (::write(ready[1], path.data(), path.size()) < 0) ::_exit(2);
    ::close(ready[1]);
    char c;
    while (::read(release[0], &c, 1) > 0) {
    }
    ::_exit(0);  // the folder stays: no destructor runs
  }
  ::close(ready[1]);
  ::close(release[0]);
  h.release = release[1];
  char buf[4096];
  ssize_t n;
  while ((n = ::read(ready[0], buf, sizeof(buf))) > 0) h.path.append(buf, n);
  ::close(ready[0]);
  return h;
}

// Disk space of the files the holder made (its lock file and `data`), by their allocated blocks.
uint64_t HolderBytes(const std::string& path) {
  uint64_t bytes = 0;
  for (const char* name : {"/lock", "/data"}) {
    struct stat st;
    EXPECT_EQ(::lstat((path + name).c_str(), &st), 0) << path << name;
    bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return bytes;
}

// A process id that names no process: a child's, reaped.
pid_t GonePid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  EXPECT_EQ(::waitpid(child, nullptr, 0), child);
  EXPECT_EQ(::kill(child, 0), -1);
  return child;
}

// Create, with what it writes to stderr (the log) captured.
StatusOr<std::unique_ptr<PrivateFolder>> CreateLogged(const std::string& parent, std::string* log) {
  const std::string file = parent + ".log";
  const int saved = ::dup(2);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ::dup2(fd, 2);
  auto f = PrivateFolder::Create(parent, kPrefix, kWhat);
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(fd);
  *log = ReadFile(file);
  std::remove(file.c_str());
  return f;
}

TEST(PrivateFolderTest, TheFolderOfAKilledProcessGoesWithTheNextCreate) {
  TempDir parent;
  Holder h = StartHolder(parent.path());
  ASSERT_FALSE(h.path.empty()) << "the child could not make its folder";
  EXPECT_EQ(h.path,
            parent.File(absl::StrCat(kPrefix, h.pid, "-", h.path.substr(h.path.size() - 6))));
  const uint64_t bytes = HolderBytes(h.path);
  // What the file system allocated for 1 MiB written (more on some, with preallocation).
  ASSERT_GE(bytes, kDataBytes);
  ASSERT_EQ(::kill(h.pid, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(h.pid, &wstatus, 0), h.pid);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);
  ::close(h.release);
  ASSERT_TRUE(fs::exists(h.path + "/data")) << "the killed child removed its folder";

  // Names the sweep must not judge: one of an older release (no process id: its six random
  // characters can be all digits), one being made (its process id after "new-"), a file.
  const std::string older = parent.File(absl::StrCat(kPrefix, "123456"));
  const std::string making = parent.File(absl::StrCat(kPrefix, "new-", h.pid, "-abcdef"));
  const std::string file = parent.File(absl::StrCat(kPrefix, h.pid, "-file00"));
  for (const std::string& d : {older, making}) ASSERT_TRUE(fs::create_directory(d)) << d;
  WriteFile(file, "x");

  std::string log;
  auto f = CreateLogged(parent.path(), &log);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE(fs::exists(h.path)) << h.path;
  ASSERT_EQ((*f)->swept().size(), 1u);
  EXPECT_EQ((*f)->swept()[0].pid, h.pid);
  EXPECT_EQ((*f)->swept()[0].path, h.path);
  EXPECT_EQ((*f)->swept()[0].bytes, bytes);
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("removed the test files of process ", h.pid,
                                                  " (gone) in ", h.path, ", freeing 1.0 MiB")))
      << log;
  for (const std::string& kept : {older, making, file}) EXPECT_TRUE(fs::exists(kept)) << kept;
  EXPECT_TRUE(fs::is_directory((*f)->path()));
}

TEST(PrivateFolderTest, AFolderWhoseProcessLivesStaysWhateverItsName) {
  TempDir parent;
  Holder h = StartHolder(parent.path());
  ASSERT_FALSE(h.path.empty()) << "the child could not make its folder";
  auto first = PrivateFolder::Create(parent.path(), kPrefix, kWhat);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(fs::exists(h.path + "/data")) << "a live process's folder was removed";
  EXPECT_TRUE((*first)->swept().empty());

  // Named for a process id that means nothing here (a process in another PID namespace sharing
  // the parent): the lock its live holder keeps is what counts.
  const std::string renamed = parent.File(absl::StrCat(kPrefix, GonePid(), "-other0"));
  ASSERT_EQ(std::rename(h.path.c_str(), renamed.c_str()), 0) << std::strerror(errno);
  auto second = PrivateFolder::Create(parent.path(), kPrefix, kWhat);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(fs::exists(renamed + "/data")) << "a live process's folder was removed";
  EXPECT_TRUE((*second)->swept().empty());
  // Each of this process's folders is live too.
  EXPECT_TRUE(fs::is_directory((*first)->path()));

  // The holder exits without removing its folder: its lock goes with it, and so does the folder
  // with the next Create.
  ::close(h.release);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(h.pid, &wstatus, 0), h.pid);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  ASSERT_TRUE(fs::exists(renamed + "/data"));
  auto third = PrivateFolder::Create(parent.path(), kPrefix, kWhat);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_FALSE(fs::exists(renamed)) << renamed;
  ASSERT_EQ((*third)->swept().size(), 1u);
  EXPECT_EQ((*third)->swept()[0].path, renamed);
  EXPECT_TRUE(fs::is_directory((*first)->path()));
  EXPECT_TRUE(fs::is_directory((*second)->path()));
}

TEST(PrivateFolderTest, TheDestructorRemovesTheFolderAndItsLockIsHeldUntilThen) {
  TempDir parent;
  WriteFile(parent.File("other"), "stays");
  auto f = PrivateFolder::Create(parent.path(), kPrefix, kWhat);
  ASSERT_TRUE(f.ok()) << f.status();
  const std::string path = (*f)->path();
  const std::string named = parent.File(absl::StrCat(kPrefix, ::getpid(), "-"));
  EXPECT_TRUE(absl::StartsWith(path, named)) << path;
  EXPECT_EQ(path.size(), named.size() + 6) << path;
  ASSERT_TRUE(fs::create_directory(path + "/sub"));
  WriteFile(path + "/sub/data", std::string(10000, 'y'));

  // Another process cannot take its lock.
  const pid_t probe = ::fork();
  ASSERT_GE(probe, 0);
  if (probe == 0) {
    const int fd = ::open((path + "/lock").c_str(), O_RDWR | O_CLOEXEC);
    ::_exit(fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(probe, &wstatus, 0), probe);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "the folder's lock is not held";

  f->reset();
  EXPECT_FALSE(fs::exists(path)) << path;
  EXPECT_EQ(ReadFile(parent.File("other")), "stays");
  EXPECT_EQ(std::distance(fs::directory_iterator(parent.path()), fs::directory_iterator()), 1);
}

TEST(PrivateFolderTest, ABadParentIsRefusedSayingWhatToDo) {
  TempDir parent;
  const std::string missing = parent.File("missing");
  const std::string file = parent.File("a-file");
  WriteFile(file, "x");
  struct Bad {
    std::string parent;
    const char* errno_text;
  };
  for (const Bad& bad : {Bad{missing, "No such file or directory"}, Bad{file, "Not a directory"}}) {
    auto f = PrivateFolder::Create(bad.parent, kPrefix, kWhat);
    ASSERT_FALSE(f.ok()) << bad.parent;
    EXPECT_TRUE(absl::IsPermissionDenied(f.status())) << f.status();
    for (const std::string& says :
         {absl::StrCat("cannot create a folder for ", kWhat, " in '", bad.parent, "'"),
          std::string(bad.errno_text), std::string("storage.ssd_dir"), std::string("TMPDIR")}) {
      EXPECT_TRUE(absl::StrContains(f.status().message(), says))
          << f.status() << "\n does not say: " << says;
    }
  }
  EXPECT_FALSE(fs::exists(missing));
  auto empty = PrivateFolder::Create("", kPrefix, kWhat);
  ASSERT_FALSE(empty.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(empty.status())) << empty.status();
  EXPECT_TRUE(absl::StrContains(empty.status().message(), "parent folder")) << empty.status();
  EXPECT_EQ(std::distance(fs::directory_iterator(parent.path()), fs::directory_iterator()), 1)
      << "a refused Create left something behind";
}

// The temporary SSD-tier folders under `dir` named by a process id (strata-ssd-<pid>-XXXXXX).
std::vector<std::string> SsdFolders(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!absl::StartsWith(name, "strata-ssd-")) continue;
    const size_t dash = name.find('-', 11);
    if (dash != std::string::npos && dash > 11 &&
        std::all_of(name.begin() + 11, name.begin() + dash,
                    [](char c) { return std::isdigit(c); })) {
      out.push_back(e.path().string());
    }
  }
  return out;
}

TEST(PrivateFolderTest, StrataTrainRemovesTheSsdTierOfARunKilledInTheSameTmpdir) {
  TempDir work, tmp;
  WriteFile(work.File("text.txt"), strata::testing::SyntheticText(40000));
  // TIERED without storage.ssd_dir or a checkpoint folder: the SSD tier goes to a temporary
  // folder under $TMPDIR. Enough steps that the first run is still training when it is killed.
  WriteFile(work.File("job.textproto"),
            "seed: 5\n"
            "model { seq_len: 16 d_model: 32 n_layers: 2 n_heads: 2\n"
            "        moe { num_experts: 8 top_k: 2 d_expert: 32 } }\n"
            "data { path: \"text.txt\" }\n"
            "train { steps: 1000000 global_batch: 8 lr: 0.004 eval_every: 0 threads: 2 }\n"
            "storage { mode: TIERED io_block_bytes: 8192 device_budget_bytes: 400000 "
            "host_budget_bytes: 140000 }\n");
  const std::string strata = std::string(STRATA_BIN_DIR) + "/strata";
  const std::string older = tmp.File("strata-ssd-123456");  // an older release's: stays
  ASSERT_TRUE(fs::create_directory(older));
  const std::string log = work.File("killed.log");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string cmd = "cd " + work.path() + " && TMPDIR=" + tmp.path() + " exec " + strata +
                            " train --config job.textproto --quiet > " + log + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Killed once its SSD tier has a data file.
  const std::string folder = tmp.File(absl::StrCat("strata-ssd-", pid, "-"));
  std::string data;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (data.empty()) {
    for (const std::string& d : SsdFolders(tmp.path())) {
      if (absl::StartsWith(d, folder) && fs::exists(d + "/data-00000.bin")) data = d;
    }
    if (!data.empty()) break;
    if (::waitpid(pid, nullptr, WNOHANG) == pid) FAIL() << "strata train ended:\n" << ReadFile(log);
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      FAIL() << "no " << folder << "XXXXXX/data-00000.bin in 120 s:\n" << ReadFile(log);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);
  ASSERT_TRUE(fs::exists(data + "/data-00000.bin")) << "the killed run removed its folder";

  const auto r = RunCommand("cd " + work.path() + " && TMPDIR=" + tmp.path() + " " + strata +
                            " train --config job.textproto --quiet --steps 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(data)) << data << " is still there:\n" << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, absl::StrCat("removed the SSD tier of process ", pid,
                                                       " (gone) in ", data, ", freeing ")))
      << r.output;
  for (const std::string& left : SsdFolders(tmp.path())) {
    ADD_FAILURE() << "left behind: " << left << "\n" << r.output;
  }
  EXPECT_TRUE(fs::is_directory(older)) << older;
}

}  // namespace
}  // namespace strata::storage
