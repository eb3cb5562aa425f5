// The placement replanner: hand-worked membership changes (nothing moves without reason, only a
// dead worker's experts move, a joiner takes exactly its share), and random skewed loads against a
// brute-force optimum of the same count cap.
#include "scheduler/replan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>

namespace strata::scheduler {
namespace {

std::vector<int> Counts(const std::vector<int>& owner, const std::vector<int>& workers) {
  std::vector<int> c;
  for (int w : workers) c.push_back(static_cast<int>(std::count(owner.begin(), owner.end(), w)));
  return c;
}

TEST(ReplanTest, SameWorkersAndBalancedLoadMoveNothing) {
  const std::vector<int> owner = {7, 7, 9, 9, 11, 11};
  const auto r = Replan(owner, std::vector<double>(6, 1.0), {7, 9, 11});
  EXPECT_EQ(r.owner, owner);
  EXPECT_EQ(r.moved, 0);
  EXPECT_DOUBLE_EQ(r.max_load, 2.0);
}

TEST(ReplanTest, ADeadWorkersExpertsAreTheOnlyOnesThatMove) {
  // 16 experts on workers 0..3, worker 2 dies.
  std::vector<int> owner(16);
  for (int e = 0; e < 16; ++e) owner[e] = e / 4;
  const auto r = Replan(owner, std::vector<double>(16, 1.0), {0, 1, 3});
  EXPECT_EQ(r.moved, 4);
  for (int e = 0; e < 16; ++e) {
    if (owner[e] != 2) {
      EXPECT_EQ(r.owner[e], owner[e]) << "expert " << e << " moved for nothing";
    }
    EXPECT_NE(r.owner[e], 2);
  }
  const auto c = Counts(r.owner, {0, 1, 3});
  EXPECT_EQ(*std::max_element(c.begin(), c.end()), 6);  // ceil(16 / 3)
  EXPECT_EQ(*std::min_element(c.begin(), c.end()), 5);
}

TEST(ReplanTest, AJoinerTakesExactlyItsShare) {
  std::vector<int> owner(12);
  for (int e = 0; e < 12; ++e) owner[e] = e % 3;
  const auto r = Replan(owner, std::vector<double>(12, 1.0), {0, 1, 2, 5});
  EXPECT_EQ(r.moved, 3);
  EXPECT_EQ(Counts(r.owner, {0, 1, 2, 5}), (std::vector<int>{3, 3, 3, 3}));
  EXPECT_DOUBLE_EQ(r.max_load, 3.0);
}

TEST(ReplanTest, SkewedLoadsCloseToTheBruteForceOptimum) {
  std::mt19937 gen(11);
  std::exponential_distribution<double> skew(1.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = 8, W = 3, cap = 3;
    std::vector<double> load(E);
    for (double& l : load) l = skew(gen);
    // Start from a random old placement over 4 workers, one of which is gone.
    std::vector<int> old(E);
    for (int& o : old) o = static_cast<int>(gen() % 4);
    const std::vector<int> workers = {0, 1, 2};
    const auto r = Replan(old, load, workers, 0.1);
    const auto c = Counts(r.owner, workers);
    for (int n : c) EXPECT_LE(n, cap) << "trial " << trial;
    // Brute force: the best possible heaviest worker under the same cap.
    double best = 1e300;
    std::vector<int> a(E, 0);
    std::function<void(int)> rec = [&](int e) {
      if (e == E) {
        std::vector<double> wl(W, 0);
        std::vector<int> wc(W, 0);
        for (int i = 0; i < E; ++i) {
          wl[a[i]] += load[i];
          ++wc[a[i]];
        }
        if (*std::max_element(wc.begin(), wc.end()) <= cap) {
          best = std::min(best, *std::max_element(wl.begin(), wl.end()));
        }
        return;
      }
      for (int w = 0; w < W; ++w) {
        a[e] = w;
        rec(e + 1);
      }
    };
    rec(0);
    // Within the tolerance of the mean, or within LPT's 4/3 of the optimum.
    EXPECT_LE(r.max_load, std::max(r.mean_load * 1.1, best * 4.0 / 3.0) + 1e-12)
        << "trial " << trial << ": optimum " << best;
    // Deterministic.
    EXPECT_EQ(Replan(old, load, workers, 0.1).owner, r.owner);
  }
}

}  // namespace
}  // namespace strata::scheduler
