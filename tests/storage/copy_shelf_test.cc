// CopyShelf on real io_uring and real O_DIRECT files: pieces read back bitwise, a version is
// listed only once every piece of it is written, dropping frees exactly the dropped pieces'
// space (keeping the newest whole versions drops partial ones), a rewrite replaces a piece in
// place of the old one, a byte flipped on disk is DATA_LOSS naming the file, a full disk fails a
// write without touching earlier versions, bad options are refused with a message saying what to
// fix, the shelf's folder goes with it, and the folder of a process that is gone goes with the
// next shelf made beside it.
#include "storage/copy_shelf.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace strata::storage {
namespace {

using strata::testing::TempDir;

// 2500 floats: not a multiple of the 4 KiB granule, so each piece occupies three granules.
constexpr uint64_t kPieceBytes = 10000;
constexpr size_t kFloats = kPieceBytes / sizeof(float);
constexpr uint64_t kPieceSpace = 3 * 4096;
constexpr int kPieces = 3;

// Distinct pseudo-random floats for each (version, item, piece).
std::vector<float> Source(int64_t version, int64_t item, int piece, int salt = 0) {
  std::mt19937_64 gen(static_cast<uint64_t>(version) * 1000003u +
                      static_cast<uint64_t>(item) * 7919u + static_cast<uint64_t>(piece) * 31u +
                      static_cast<uint64_t>(salt) * 1299709u);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> v(kFloats);
  for (float& x : v) x = dist(gen);
  return v;
}

Status WriteBlob(CopyShelf& shelf, int64_t version, int64_t item) {
  for (int p = 0; p < shelf.pieces(); ++p) {
    RETURN_IF_ERROR(shelf.Write(version, item, p, Source(version, item, p).data()));
  }
  return absl::OkStatus();
}

// Whether piece `piece` of (version, item) reads back bit for bit as `expect`.
::testing::AssertionResult ReadsAs(CopyShelf& shelf, int64_t version, int64_t item, int piece,
                                   const std::vector<float>& expect) {
  std::vector<float> out(kFloats, -123.0f);
  Status s = shelf.Read(version, item, piece, out.data());
  if (!s.ok()) return ::testing::AssertionFailure() << s;
  if (std::memcmp(out.data(), expect.data(), kPieceBytes) != 0) {
    return ::testing::AssertionFailure()
           << "item " << item << " piece " << piece << " v" << version << " differs";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult BlobReads(CopyShelf& shelf, int64_t version, int64_t item) {
  for (int p = 0; p < shelf.pieces(); ++p) {
    auto r = ReadsAs(shelf, version, item, p, Source(version, item, p));
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

// Whether every piece of (version, item) is NOT_FOUND.
::testing::AssertionResult BlobGone(CopyShelf& shelf, int64_t version, int64_t item) {
  std::vector<float> out(kFloats);
  for (int p = 0; p < shelf.pieces(); ++p) {
    Status s = shelf.Read(version, item, p, out.data());
    if (!absl::IsNotFound(s)) {
      return ::testing::AssertionFailure()
             << "item " << item << " piece " << p << " v" << version << ": " << s;
    }
  }
  return ::testing::AssertionSuccess();
}

class CopyShelfTest : public ::testing::Test {
 protected:
  CopyShelf::Options Defaults() const {
    CopyShelf::Options o;
    o.parent_dir = parent_.path();
    o.piece_bytes = kPieceBytes;
    o.pieces = kPieces;
    o.io.queue_depth = 4;
    o.io.block_bytes = 8192;  // a piece is two requests in flight
    return o;
  }
  void SetUp() override {
    auto s = CopyShelf::Create(Defaults());
    if (absl::IsUnavailable(s.status())) GTEST_SKIP() << "no io_uring here: " << s.status();
    ASSERT_TRUE(s.ok()) << s.status();
    shelf_ = *std::move(s);
  }

  TempDir parent_;
  std::unique_ptr<CopyShelf> shelf_;
};

TEST_F(CopyShelfTest, EveryPieceReadsBackBitwise) {
  const std::vector<int64_t> items = {0, 7, 42}, versions = {3, 5};
  for (int64_t v : versions) {
    for (int64_t item : items) ASSERT_TRUE(WriteBlob(*shelf_, v, item).ok());
  }
  EXPECT_EQ(shelf_->used_bytes(), versions.size() * items.size() * kPieces * kPieceSpace);
  // Read in another order than written.
  for (int64_t item : {42, 0, 7}) {
    for (int64_t v : {5, 3}) EXPECT_TRUE(BlobReads(*shelf_, v, item)) << item << " v" << v;
  }
  std::vector<float> out(kFloats);
  Status s = shelf_->Read(4, 7, 0, out.data());
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  s = shelf_->Read(3, 8, 0, out.data());
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("item 8 piece 0 v3"), std::string::npos) << s;
  s = shelf_->Write(3, 7, kPieces, Source(3, 7, 0).data());
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("3 pieces"), std::string::npos) << s;
}

TEST_F(CopyShelfTest, VersionsListsOnlyWholeVersionsNewestFirst) {
  ASSERT_TRUE(WriteBlob(*shelf_, 10, 1).ok());
  ASSERT_TRUE(WriteBlob(*shelf_, 30, 1).ok());
  ASSERT_TRUE(WriteBlob(*shelf_, 5, 1).ok());
  for (int p : {0, 1}) ASSERT_TRUE(shelf_->Write(20, 1, p, Source(20, 1, p).data()).ok());
  // Piece 0 of v40 twice and piece 1 once: still one piece short.
  for (int p : {0, 0, 1}) ASSERT_TRUE(shelf_->Write(40, 1, p, Source(40, 1, p).data()).ok());
  EXPECT_EQ(shelf_->Versions(1), (std::vector<int64_t>{30, 10, 5}));
  EXPECT_TRUE(shelf_->Versions(2).empty());
  ASSERT_TRUE(shelf_->Write(20, 1, 2, Source(20, 1, 2).data()).ok());
  EXPECT_EQ(shelf_->Versions(1), (std::vector<int64_t>{30, 20, 10, 5}));
  ASSERT_TRUE(shelf_->Write(40, 1, 2, Source(40, 1, 2).data()).ok());
  EXPECT_EQ(shelf_->Versions(1), (std::vector<int64_t>{40, 30, 20, 10, 5}));
  EXPECT_TRUE(BlobReads(*shelf_, 20, 1));
  EXPECT_TRUE(BlobReads(*shelf_, 40, 1));
}

TEST_F(CopyShelfTest, KeepNewestKeepOnlyAndClearDropTheRestAndTheirSpace) {
  const uint64_t blob = kPieces * kPieceSpace;
  for (int64_t v : {1, 2, 3}) ASSERT_TRUE(WriteBlob(*shelf_, v, 1).ok());
  for (int64_t v : {1, 2}) ASSERT_TRUE(WriteBlob(*shelf_, v, 2).ok());
  EXPECT_EQ(shelf_->used_bytes(), 5 * blob);

  shelf_->KeepNewest(1, 1);
  EXPECT_EQ(shelf_->used_bytes(), 3 * blob);
  EXPECT_TRUE(BlobGone(*shelf_, 1, 1));
  EXPECT_TRUE(BlobGone(*shelf_, 2, 1));
  EXPECT_TRUE(BlobReads(*shelf_, 3, 1));
  EXPECT_EQ(shelf_->Versions(1), (std::vector<int64_t>{3}));
  EXPECT_EQ(shelf_->Versions(2), (std::vector<int64_t>{2, 1})) << "another item was touched";

  shelf_->KeepOnly(2, 1);
  EXPECT_EQ(shelf_->used_bytes(), 2 * blob);
  EXPECT_TRUE(BlobGone(*shelf_, 2, 2));
  EXPECT_TRUE(BlobReads(*shelf_, 1, 2));
  EXPECT_EQ(shelf_->Versions(2), (std::vector<int64_t>{1}));

  // Only whole versions count among the newest kept: a partial newer version is dropped, its
  // written piece freed with it, and the whole older one stays.
  ASSERT_TRUE(WriteBlob(*shelf_, 1, 3).ok());
  ASSERT_TRUE(shelf_->Write(2, 3, 1, Source(2, 3, 1).data()).ok());
  EXPECT_EQ(shelf_->used_bytes(), 3 * blob + kPieceSpace);
  shelf_->KeepNewest(3, 1);
  EXPECT_EQ(shelf_->used_bytes(), 3 * blob) << "exactly the partial version's piece is freed";
  EXPECT_TRUE(BlobReads(*shelf_, 1, 3));
  EXPECT_TRUE(BlobGone(*shelf_, 2, 3));
  EXPECT_EQ(shelf_->Versions(3), (std::vector<int64_t>{1}));
  shelf_->KeepOnly(3, 7);  // a version it does not hold: everything of item 3 goes
  EXPECT_EQ(shelf_->used_bytes(), 2 * blob);
  EXPECT_TRUE(BlobGone(*shelf_, 1, 3));

  shelf_->Clear();
  EXPECT_EQ(shelf_->used_bytes(), 0u);
  for (int64_t item : {1, 2, 3}) EXPECT_TRUE(shelf_->Versions(item).empty()) << item;
  EXPECT_TRUE(BlobGone(*shelf_, 3, 1));
  EXPECT_TRUE(BlobGone(*shelf_, 1, 2));
  // The freed space takes new pieces.
  ASSERT_TRUE(WriteBlob(*shelf_, 9, 1).ok());
  EXPECT_EQ(shelf_->used_bytes(), blob);
  EXPECT_TRUE(BlobReads(*shelf_, 9, 1));
}

TEST_F(CopyShelfTest, RewritingAPieceReplacesIt) {
  ASSERT_TRUE(WriteBlob(*shelf_, 4, 2).ok());
  const uint64_t used = shelf_->used_bytes();
  const std::vector<float> fresh = Source(4, 2, 1, /*salt=*/1);
  ASSERT_NE(std::memcmp(fresh.data(), Source(4, 2, 1).data(), kPieceBytes), 0);
  ASSERT_TRUE(shelf_->Write(4, 2, 1, fresh.data()).ok());
  EXPECT_TRUE(ReadsAs(*shelf_, 4, 2, 1, fresh));
  EXPECT_TRUE(ReadsAs(*shelf_, 4, 2, 0, Source(4, 2, 0)));
  EXPECT_TRUE(ReadsAs(*shelf_, 4, 2, 2, Source(4, 2, 2)));
  EXPECT_EQ(shelf_->used_bytes(), used);
  EXPECT_EQ(shelf_->Versions(2), (std::vector<int64_t>{4}));
}

TEST_F(CopyShelfTest, AByteFlippedOnDiskIsDataLossNamingTheFile) {
  // The first piece lands at offset 0 of the first data file, the second right after it.
  const std::vector<float> first = Source(1, 0, 0), second = Source(1, 0, 1);
  ASSERT_TRUE(shelf_->Write(1, 0, 0, first.data()).ok());
  ASSERT_TRUE(shelf_->Write(1, 0, 1, second.data()).ok());
  const std::string file = shelf_->dir() + "/data-00000.bin";
  ASSERT_TRUE(std::filesystem::exists(file)) << file;
  const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << file;
  constexpr off_t kAt = 1234;
  char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, kAt), 1);
  ASSERT_EQ(byte, reinterpret_cast<const char*>(first.data())[kAt]) << "the piece is not at 0";
  byte ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &byte, 1, kAt), 1);
  ::close(fd);

  std::vector<float> out(kFloats);
  Status s = shelf_->Read(1, 0, 0, out.data());
  ASSERT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), "reading a buddy copy: ")) << s;
  EXPECT_NE(s.message().find(file), std::string::npos) << s;
  EXPECT_NE(s.message().find("item 0 piece 0 v1"), std::string::npos) << s;
  // A copy that cannot be read is no copy: that version of the item is dropped with its space,
  // while another item's copy stays.
  const std::vector<float> other = Source(1, 5, 0);
  ASSERT_TRUE(shelf_->Write(1, 5, 0, other.data()).ok());
  EXPECT_TRUE(absl::IsNotFound(shelf_->Read(1, 0, 1, out.data())));
  EXPECT_TRUE(shelf_->Versions(0).empty());
  EXPECT_TRUE(ReadsAs(*shelf_, 1, 5, 0, other));
}

TEST_F(CopyShelfTest, SeveralPiecesMoveInOneCallAndReadBackBitwise) {
  // Pieces 1 and 2 of a blob written in one call, read in one call and one by one.
  std::vector<float> both = Source(2, 7, 1);
  const std::vector<float> third = Source(2, 7, 2);
  both.insert(both.end(), third.begin(), third.end());
  ASSERT_TRUE(shelf_->Write(2, 7, 1, 2, both.data()).ok());
  ASSERT_TRUE(shelf_->Write(2, 7, 0, Source(2, 7, 0).data()).ok());
  EXPECT_EQ(shelf_->Versions(7), (std::vector<int64_t>{2}));
  std::vector<float> out(2 * kFloats);
  ASSERT_TRUE(shelf_->Read(2, 7, 1, 2, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), both.data(), 2 * kPieceBytes), 0);
  EXPECT_TRUE(ReadsAs(*shelf_, 2, 7, 2, third));
  EXPECT_TRUE(absl::IsInvalidArgument(shelf_->Write(2, 7, 2, 2, both.data())))
      << "pieces past the blob";
  // DropNewerThan keeps the versions up to the one given.
  ASSERT_TRUE(shelf_->Write(3, 7, 0, Source(3, 7, 0).data()).ok());
  shelf_->DropNewerThan(7, 2);
  EXPECT_EQ(shelf_->Versions(7), (std::vector<int64_t>{2}));
  EXPECT_TRUE(absl::IsNotFound(shelf_->Read(3, 7, 0, out.data())));
}

TEST_F(CopyShelfTest, AFullDiskFailsTheWriteAndKeepsEarlierVersions) {
  FaultInjectingIo* fault = nullptr;
  CopyShelf::Options o = Defaults();
  o.wrap_io = [&fault](std::unique_ptr<BlockIo> base) -> std::unique_ptr<BlockIo> {
    auto f = std::make_unique<FaultInjectingIo>(std::move(base));
    fault = f.get();
    return f;
  };
  auto made = CopyShelf::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  CopyShelf& shelf = **made;
  ASSERT_NE(fault, nullptr);
  ASSERT_TRUE(WriteBlob(shelf, 1, 5).ok());
  const uint64_t used = shelf.used_bytes();

  // The disk fills after one more piece: v2 gets piece 0, not piece 1.
  fault->set_write_budget(fault->bytes_written() + static_cast<int64_t>(kPieceSpace));
  ASSERT_TRUE(shelf.Write(2, 5, 0, Source(2, 5, 0).data()).ok());
  Status s = shelf.Write(2, 5, 1, Source(2, 5, 1).data());
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("full"), std::string::npos) << s;
  EXPECT_EQ(shelf.used_bytes(), used + kPieceSpace) << "the failed piece's space was kept";
  EXPECT_EQ(shelf.Versions(5), (std::vector<int64_t>{1}));
  EXPECT_TRUE(BlobReads(shelf, 1, 5));
  std::vector<float> out(kFloats);
  EXPECT_TRUE(absl::IsNotFound(shelf.Read(2, 5, 1, out.data())));

  // A failed rewrite leaves the piece as it was.
  s = shelf.Write(1, 5, 0, Source(1, 5, 0, /*salt=*/1).data());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(ReadsAs(shelf, 1, 5, 0, Source(1, 5, 0)));

  // Space again: v2 completes.
  fault->set_write_budget(-1);
  ASSERT_TRUE(WriteBlob(shelf, 2, 5).ok());
  EXPECT_EQ(shelf.Versions(5), (std::vector<int64_t>{2, 1}));
  EXPECT_TRUE(BlobReads(shelf, 2, 5));
}

TEST_F(CopyShelfTest, BadOptionsAreRefusedAndTheFolderGoesWithTheShelf) {
  struct Bad {
    uint64_t piece_bytes;
    int pieces;
    const char* says;
  };
  for (const Bad& bad : {Bad{0, 3, "got 0 bytes"}, Bad{10, 3, "got 10 bytes"},
                         Bad{kPieceBytes, 0, "0 pieces"}, Bad{kPieceBytes, -2, "-2 pieces"}}) {
    CopyShelf::Options o = Defaults();
    o.piece_bytes = bad.piece_bytes;
    o.pieces = bad.pieces;
    auto s = CopyShelf::Create(o);
    ASSERT_FALSE(s.ok()) << bad.says;
    EXPECT_TRUE(absl::IsInvalidArgument(s.status())) << s.status();
    EXPECT_NE(s.status().message().find(bad.says), std::string::npos) << s.status();
    EXPECT_NE(s.status().message().find("positive number of floats"), std::string::npos)
        << s.status();
  }
  CopyShelf::Options o = Defaults();
  o.parent_dir = "";
  auto no_parent = CopyShelf::Create(o);
  ASSERT_FALSE(no_parent.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(no_parent.status())) << no_parent.status();
  EXPECT_NE(no_parent.status().message().find("parent folder"), std::string::npos)
      << no_parent.status();
  o.parent_dir = parent_.File("missing");
  auto s = CopyShelf::Create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(s.status())) << s.status();
  EXPECT_NE(s.status().message().find(o.parent_dir), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("storage.ssd_dir"), std::string::npos) << s.status();
  EXPECT_FALSE(std::filesystem::exists(o.parent_dir));

  // The shelf made in SetUp is the only thing under the parent; a second one gets its own folder.
  const std::string dir = shelf_->dir();
  EXPECT_EQ(std::filesystem::path(dir).parent_path(), std::filesystem::path(parent_.path()));
  EXPECT_TRUE(std::filesystem::is_directory(dir)) << dir;
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(parent_.path()),
                          std::filesystem::directory_iterator()),
            1)
      << "a refused Create left something behind";
  auto other = CopyShelf::Create(Defaults());
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->dir(), dir);
  ASSERT_TRUE(WriteBlob(*shelf_, 1, 1).ok());
  ASSERT_TRUE(std::filesystem::exists(dir + "/data-00000.bin"));
  shelf_.reset();
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
  EXPECT_TRUE(std::filesystem::is_directory((*other)->dir())) << "the other shelf's folder stays";
}

TEST_F(CopyShelfTest, CreateRemovesTheFoldersOfProcessesThatAreGone) {
  // A child that exits at once and is reaped: its pid names no process any more.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) ::_exit(0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  ASSERT_EQ(::kill(child, 0), -1);
  ASSERT_EQ(errno, ESRCH) << "pid " << child << " was reused already";

  namespace fs = std::filesystem;
  const std::string dead = parent_.File(absl::StrCat("strata-copies-", child, "-abcdef"));
  const std::string mine = parent_.File(absl::StrCat("strata-copies-", ::getpid(), "-keepme"));
  const std::string not_a_pid = parent_.File("strata-copies-notapid");
  for (const std::string& d : {dead, mine, not_a_pid}) ASSERT_TRUE(fs::create_directory(d)) << d;
  strata::testing::WriteFile(dead + "/data-00000.bin", std::string(4096, 'x'));
  ASSERT_TRUE(fs::exists(dead + "/data-00000.bin"));

  auto made = CopyShelf::Create(Defaults());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_FALSE(fs::exists(dead)) << dead;
  EXPECT_TRUE(fs::is_directory(mine)) << mine << ": its process (this one) is alive";
  EXPECT_TRUE(fs::is_directory(not_a_pid)) << not_a_pid;
  EXPECT_TRUE(fs::is_directory(shelf_->dir())) << "the living shelf's folder stays";
  const std::string prefix = parent_.File(absl::StrCat("strata-copies-", ::getpid(), "-"));
  EXPECT_TRUE(absl::StartsWith((*made)->dir(), prefix)) << (*made)->dir();
  EXPECT_EQ((*made)->dir().size(), prefix.size() + 6) << (*made)->dir();
  EXPECT_TRUE(absl::StartsWith(shelf_->dir(), prefix)) << shelf_->dir();
  // Nothing else came or went: the two kept folders and the two shelves'.
  EXPECT_EQ(std::distance(fs::directory_iterator(parent_.path()), fs::directory_iterator()), 4);
}

TEST_F(CopyShelfTest, AFolderWhoseLockIsHeldStaysWhateverItsName) {
  // A process in another PID namespace sharing the folder: its pid means nothing here, but it
  // holds its shelf's lock. One whose lock nobody holds is gone.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  namespace fs = std::filesystem;
  const std::string held = parent_.File(absl::StrCat("strata-copies-", child, "-held00"));
  const std::string loose = parent_.File(absl::StrCat("strata-copies-", child, "-loose0"));
  for (const std::string& d : {held, loose}) {
    ASSERT_TRUE(fs::create_directory(d)) << d;
    strata::testing::WriteFile(d + "/lock", "");
  }
  const int fd = ::open((held + "/lock").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  auto made = CopyShelf::Create(Defaults());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_TRUE(fs::is_directory(held)) << "a live shelf's folder was removed";
  EXPECT_FALSE(fs::exists(loose)) << loose;
  // And a shelf's own lock is held: another process (a child here) cannot take it.
  const std::string own = (*made)->dir() + "/lock";
  const pid_t probe = ::fork();
  ASSERT_GE(probe, 0);
  if (probe == 0) {
    const int f = ::open(own.c_str(), O_RDWR | O_CLOEXEC);
    ::_exit(f >= 0 && ::flock(f, LOCK_EX | LOCK_NB) != 0 ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(probe, &wstatus, 0), probe);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "the shelf's lock is not held";
  ::close(fd);
}

}  // namespace
}  // namespace strata::storage
