// The POSIX Env: mapping, writing, atomic replace, and errors that name the path.
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

}  // namespace
}  // namespace strata::storage
