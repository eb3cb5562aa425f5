// The POSIX Env: mapping, writing, atomic replace, removing, listing and syncing folders, and
// errors that name the path.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "storage/env.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

using strata::testing::ReadFile;
using strata::testing::TempDir;
using strata::testing::WriteFile;

TEST(PosixEnvTest, MapReadsWholeFile) {
  TempDir dir;
  WriteFile(dir.File("a"), "hello world");
  auto r = Env::Default()->MapReadOnly(dir.File("a"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*r)->data()), (*r)->size()), "hello world");
  WriteFile(dir.File("empty"), "");
  auto e = Env::Default()->MapReadOnly(dir.File("empty"));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->size(), 0u);
}

TEST(PosixEnvTest, ErrorsNameThePath) {
  TempDir dir;
  auto r = Env::Default()->MapReadOnly(dir.File("nothing-here"));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsNotFound(r.status()));
  EXPECT_NE(r.status().message().find("nothing-here"), std::string::npos);
  auto w = Env::Default()->OpenWritable(dir.File("no/dir/file"), true);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("no/dir/file"), std::string::npos);
}

TEST(PosixEnvTest, WritableAppendsAndTruncates) {
  TempDir dir;
  const std::string p = dir.File("log");
  {
    auto f = Env::Default()->OpenWritable(p, true);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Append("one\n").ok());
    ASSERT_TRUE((*f)->Flush().ok());
    EXPECT_EQ(ReadFile(p), "one\n");  // visible after Flush, before Close
    ASSERT_TRUE((*f)->Append("two\n").ok());
    ASSERT_TRUE((*f)->Sync().ok());
    ASSERT_TRUE((*f)->Close().ok());
  }
  EXPECT_EQ(ReadFile(p), "one\ntwo\n");
  {
    auto f = Env::Default()->OpenWritable(p, false);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Append("three\n").ok());
  }
  EXPECT_EQ(ReadFile(p), "one\ntwo\nthree\n");
  {
    auto f = Env::Default()->OpenWritable(p, true);
    ASSERT_TRUE(f.ok());
  }
  EXPECT_EQ(ReadFile(p), "");
}

TEST(PosixEnvTest, WriteFileAtomicReplacesAndLeavesNoTemporary) {
  TempDir dir;
  const std::string p = dir.File("state");
  ASSERT_TRUE(Env::Default()->WriteFileAtomic(p, "v1").ok());
  ASSERT_TRUE(Env::Default()->WriteFileAtomic(p, "version 2").ok());
  auto s = Env::Default()->ReadFile(p);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "version 2");
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 1);
  auto size = Env::Default()->FileSize(p);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 9u);
}

TEST(PosixEnvTest, CreateDirsAndExists) {
  TempDir dir;
  EXPECT_FALSE(Env::Default()->FileExists(dir.File("x/y")));
  ASSERT_TRUE(Env::Default()->CreateDirs(dir.File("x/y")).ok());
  EXPECT_TRUE(Env::Default()->FileExists(dir.File("x/y")));
}

TEST(PosixEnvTest, DeleteFileRemovesAndNamesAMissingPath) {
  TempDir dir;
  WriteFile(dir.File("a"), "x");
  ASSERT_TRUE(Env::Default()->DeleteFile(dir.File("a")).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.File("a")));
  const Status again = Env::Default()->DeleteFile(dir.File("a"));
  EXPECT_TRUE(absl::IsNotFound(again)) << again;
  EXPECT_NE(again.message().find("cannot remove '" + dir.File("a") + "'"), std::string::npos)
      << again;
  // A folder is not a file: refused, and left there.
  ASSERT_TRUE(std::filesystem::create_directory(dir.File("sub")));
  EXPECT_FALSE(Env::Default()->DeleteFile(dir.File("sub")).ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("sub")));
}

TEST(PosixEnvTest, ListDirNamesEverythingSortedAndFailsOnWhatIsNoFolder) {
  TempDir dir;
  auto empty = Env::Default()->ListDir(dir.path());
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->empty());  // no "." or ".."
  for (const char* name : {"b.manifest", "LEDGER", "a", "10.manifest"})
    WriteFile(dir.File(name), "");
  ASSERT_TRUE(std::filesystem::create_directory(dir.File("sub")));
  auto names = Env::Default()->ListDir(dir.path());
  ASSERT_TRUE(names.ok()) << names.status();
  // Bytewise order: digits, then upper case, then lower case.
  EXPECT_EQ(*names, (std::vector<std::string>{"10.manifest", "LEDGER", "a", "b.manifest", "sub"}));
  auto missing = Env::Default()->ListDir(dir.File("none"));
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find(dir.File("none")), std::string::npos);
  auto file = Env::Default()->ListDir(dir.File("a"));
  ASSERT_FALSE(file.ok());
  EXPECT_FALSE(absl::IsNotFound(file.status())) << file.status();
  EXPECT_NE(file.status().message().find(dir.File("a")), std::string::npos) << file.status();
}

TEST(PosixEnvTest, SyncDirSyncsAFolderAndNamesAMissingOne) {
  TempDir dir;
  EXPECT_TRUE(Env::Default()->SyncDir(dir.path()).ok());
  const Status missing = Env::Default()->SyncDir(dir.File("none"));
  EXPECT_TRUE(absl::IsNotFound(missing)) << missing;
  EXPECT_NE(missing.message().find(dir.File("none")), std::string::npos) << missing;
  WriteFile(dir.File("a"), "x");
  EXPECT_FALSE(Env::Default()->SyncDir(dir.File("a")).ok());  // a file, not a folder
}

}  // namespace
}  // namespace strata::storage
