// TokenDataset: the step -> samples function, the held-out split, and bad data files.
#include <gtest/gtest.h>

#include <set>

#include "runtime/data/dataset.h"
#include "tests/test_util.h"

namespace strata::data {
namespace {

using strata::testing::TempDir;
using strata::testing::WriteFile;

TEST(PermuteIndexTest, IsABijectionForManySizesAndKeys) {
  for (uint64_t n : {1ull, 2ull, 3ull, 7ull, 64ull, 100ull, 1000ull, 4099ull}) {
    for (uint64_t key : {1ull, 99ull}) {
      std::vector<bool> seen(n, false);
      for (uint64_t i = 0; i < n; ++i) {
        uint64_t p = PermuteIndex(i, n, key);
        ASSERT_LT(p, n);
        ASSERT_FALSE(seen[p]) << "n=" << n << " key=" << key << " collision at " << i;
        seen[p] = true;
      }
    }
  }
  // Different keys give different orders.
  int same = 0;
  for (uint64_t i = 0; i < 1000; ++i) same += PermuteIndex(i, 1000, 1) == PermuteIndex(i, 1000, 2);
  EXPECT_LT(same, 20);
}

class DatasetTest : public ::testing::Test {
 protected:
  StatusOr<std::unique_ptr<TokenDataset>> Open(
      const std::string& bytes, int vocab = 256, int seq_len = 4, float eval_fraction = 0.25f,
      config::DataConfig::Format format = config::DataConfig::BYTES) {
    const std::string path = dir_.File("data.bin");
    WriteFile(path, bytes);
    config::DataConfig cfg;
    cfg.set_path(path);
    cfg.set_format(format);
    cfg.set_eval_fraction(eval_fraction);
    return TokenDataset::Open(cfg, vocab, seq_len, storage::Env::Default());
  }
  TempDir dir_;
};

TEST_F(DatasetTest, WindowsSplitAndTargetsAreShiftedInputs) {
  std::string bytes;
  for (int i = 0; i < 100; ++i) bytes.push_back(static_cast<char>(i));
  auto d = Open(bytes, 256, 4, 0.25f);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->num_tokens(), 100);
  EXPECT_EQ((*d)->train_tokens(), 75);
  EXPECT_EQ((*d)->train_windows(), 18);  // (75 - 1) / 4
  EXPECT_EQ((*d)->eval_windows(), 6);    // (25 - 1) / 4
  std::vector<int32_t> in(8), tgt(8);
  (*d)->TrainBatch(3, 0, 2, in.data(), tgt.data());
  for (int s = 0; s < 2; ++s) {
    const int64_t start = (*d)->TrainWindow(3, s) * 4;
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(in[s * 4 + j], start + j);
      EXPECT_EQ(tgt[s * 4 + j], start + j + 1);
      EXPECT_LT(start + j + 1, 75) << "a training target reaches into the held-out split";
    }
  }
  (*d)->EvalBatch(1, 2, in.data(), tgt.data());
  EXPECT_EQ(in[0], 75 + 2 * 4);  // eval window 2 of the held-out tail
  EXPECT_EQ(tgt[7], 75 + 3 * 4 + 4);
}

// `strata eval`'s view: the whole file held out. Its held-out tail opened that way has exactly the
// windows Open gives the tail inside the whole file.
TEST_F(DatasetTest, AllHeldOutServesEveryWindowOfTheFileAsTheTailsAreServed) {
  std::string bytes;
  for (int i = 0; i < 100; ++i) bytes.push_back(static_cast<char>(i));
  auto whole = Open(bytes, 256, 4, 0.25f);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::string tail_path = dir_.File("tail.bin");
  WriteFile(tail_path, bytes.substr(static_cast<size_t>((*whole)->train_tokens())));
  config::DataConfig cfg;
  cfg.set_path(tail_path);
  auto tail = TokenDataset::OpenAllHeldOut(cfg, 256, 4, storage::Env::Default());
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_EQ((*tail)->train_windows(), 0);
  EXPECT_EQ((*tail)->eval_windows(), 6);  // (25 - 1) / 4, as the whole file's held-out split
  std::vector<int32_t> a(24), at(24), b(24), bt(24);
  (*whole)->EvalBatch(0, 6, a.data(), at.data());
  (*tail)->EvalBatch(0, 6, b.data(), bt.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(at, bt);
  EXPECT_EQ(b[0], 75);
  // A file without one whole window is refused, naming it.
  WriteFile(tail_path, "abcd");
  auto shorter = TokenDataset::OpenAllHeldOut(cfg, 256, 4, storage::Env::Default());
  ASSERT_FALSE(shorter.ok());
  EXPECT_NE(shorter.status().message().find("too few for one window of seq_len + 1 = 5 tokens"),
            std::string::npos)
      << shorter.status();
  EXPECT_NE(shorter.status().message().find(tail_path), std::string::npos) << shorter.status();
}

TEST_F(DatasetTest, EveryWindowOncePerEpochAndStepsArePureFunctions) {
  std::string bytes(4001, 'a');
  auto d = Open(bytes, 256, 8, 0.1f);
  ASSERT_TRUE(d.ok()) << d.status();
  const int64_t n = (*d)->train_windows();
  const int64_t B = 7;
  std::set<int64_t> epoch0;
  for (int64_t g = 0; g < n; ++g) epoch0.insert((*d)->TrainWindow(42, g));
  EXPECT_EQ(static_cast<int64_t>(epoch0.size()), n);
  // The samples of step s do not depend on anything but (seed, s, global batch): splitting them
  // between 1, 2 or 3 readers gives the same windows.
  for (int64_t step : {0, 5, 100}) {
    std::vector<int64_t> whole;
    for (int64_t i = 0; i < B; ++i) {
      whole.push_back((*d)->TrainWindow(42, TokenDataset::FirstSample(step, B) + i));
    }
    for (int readers : {2, 3}) {
      std::vector<int64_t> joined;
      for (int r = 0; r < readers; ++r) {
        for (int64_t i = B * r / readers; i < B * (r + 1) / readers; ++i) {
          joined.push_back((*d)->TrainWindow(42, TokenDataset::FirstSample(step, B) + i));
        }
      }
      EXPECT_EQ(joined, whole);
    }
  }
  // A different seed gives a different order.
  int same = 0;
  for (int64_t g = 0; g < n; ++g) same += (*d)->TrainWindow(42, g) == (*d)->TrainWindow(43, g);
  EXPECT_LT(same, n / 4);
}

TEST_F(DatasetTest, Uint16Tokens) {
  std::string bytes;
  for (int i = 0; i < 64; ++i) {
    const int tok = 300 + i;
    bytes.push_back(static_cast<char>(tok & 0xff));
    bytes.push_back(static_cast<char>(tok >> 8));
  }
  auto d = Open(bytes, 1000, 4, 0.25f, config::DataConfig::UINT16);
  ASSERT_TRUE(d.ok()) << d.status();
  std::vector<int32_t> in(4), tgt(4);
  (*d)->EvalBatch(0, 1, in.data(), tgt.data());
  EXPECT_EQ(in[0], 300 + 48);
  EXPECT_EQ(tgt[3], 300 + 52);
}

TEST_F(DatasetTest, BadFilesAreClearErrors) {
  config::DataConfig cfg;
  cfg.set_path(dir_.File("missing.txt"));
  auto missing = TokenDataset::Open(cfg, 256, 4, storage::Env::Default());
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_NE(missing.status().message().find("missing.txt"), std::string::npos);
  EXPECT_NE(missing.status().message().find("data.path"), std::string::npos);

  auto odd = Open(std::string(101, 'x'), 1000, 4, 0.25f, config::DataConfig::UINT16);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("101 bytes"), std::string::npos);

  std::string big = {1, 0, 2, 0, static_cast<char>(0xff), static_cast<char>(0xff), 3, 0};
  auto out_of_vocab = Open(big + big + big + big, 1000, 2, 0.25f, config::DataConfig::UINT16);
  ASSERT_FALSE(out_of_vocab.ok());
  EXPECT_NE(out_of_vocab.status().message().find("token 65535 at byte offset 4"), std::string::npos)
      << out_of_vocab.status();

  auto tiny = Open("abcdefg", 256, 4, 0.25f);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("too few"), std::string::npos);
}

}  // namespace
}  // namespace strata::data
