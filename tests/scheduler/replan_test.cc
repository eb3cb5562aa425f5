// The placement replanner: hand-worked membership changes (nothing moves without reason, only a
// dead worker's experts move, a joiner takes exactly its share), and random skewed loads against a
// brute-force optimum of the same count cap. The contiguous-range replanner: hand-worked deaths,
// joins and skew, and random cases against a brute-force enumeration of every contiguous
// partition under the same cap, tolerance and tie-break rules.
#include "scheduler/replan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

// The experts each rank owns as a current_owner vector: ranks 0.. in order, `counts` each.
std::vector<int> OwnersOf(const std::vector<int>& counts) {
  std::vector<int> owner;
  for (int w = 0; w < static_cast<int>(counts.size()); ++w) owner.insert(owner.end(), counts[w], w);
  return owner;
}

// Experts whose owner differs between current_owner and the ranges `counts`.
int MovedBy(const std::vector<int>& current_owner, const std::vector<int64_t>& counts) {
  int moved = 0, e = 0;
  for (int w = 0; w < static_cast<int>(counts.size()); ++w) {
    for (int64_t i = 0; i < counts[w]; ++i, ++e) moved += current_owner[e] != w;
  }
  return moved;
}

TEST(ReplanRangesTest, ADeadWorkersExpertsGoToItsNeighbours) {
  // 8 experts on 4 workers, [0,2) [2,4) [4,6) [6,8); worker 3 dies, leaving 3 workers, cap
  // ceil(8 / 3) = 3, so the counts are {3,3,2}, {3,2,3} or {2,3,3}, all with max load 3 = L*.
  // Moves: {3,3,2}: expert 2 -> w0, 4,5 -> w1, 6,7 -> w2 = 5; {3,2,3}: 2 -> w0, 4 -> w1, 6,7 -> w2
  // = 4; {2,3,3}: 4 -> w1, 6,7 -> w2 = 3, and the two orphans always move, so 3 is the minimum.
  const std::vector<int> owner = {0, 0, 1, 1, 2, 2, -1, -1};
  const auto r = ReplanRanges(owner, std::vector<double>(8, 1.0), 3);
  EXPECT_EQ(r.counts, (std::vector<int64_t>{2, 3, 3}));
  EXPECT_EQ(r.moved, 3);
  EXPECT_EQ(MovedBy(owner, r.counts), r.moved);
  EXPECT_DOUBLE_EQ(r.max_load, 3.0);
  EXPECT_DOUBLE_EQ(r.mean_load, 8.0 / 3.0);
}

TEST(ReplanRangesTest, AJoinerTakesItsShareFromTheEnd) {
  // 8 experts on 3 workers [0,3) [3,6) [6,8); a 4th joins as rank 3. Cap ceil(8 / 4) = 2 and
  // nobody may be empty, so the only partition is {2,2,2,2}: expert 2 -> w1, 4,5 -> w2, 6,7 -> w3
  // = 5 moves.
  const std::vector<int> owner = {0, 0, 0, 1, 1, 1, 2, 2};
  const auto r = ReplanRanges(owner, std::vector<double>(8, 1.0), 4);
  EXPECT_EQ(r.counts, (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(r.moved, 5);
  EXPECT_DOUBLE_EQ(r.max_load, 2.0);
  EXPECT_DOUBLE_EQ(r.mean_load, 2.0);
}

TEST(ReplanRangesTest, NoChangeMovesNothing) {
  // Same 3 workers, equal loads: {3,3,2} keeps everything; {2,3,3} is lexicographically smaller
  // and as balanced but moves 2, so fewer moves wins over the tie-break.
  const std::vector<int> owner = {0, 0, 0, 1, 1, 1, 2, 2};
  for (const auto& load : {std::vector<double>(8, 1.0), std::vector<double>(8, 0.0)}) {
    const auto r = ReplanRanges(owner, load, 3);
    EXPECT_EQ(r.counts, (std::vector<int64_t>{3, 3, 2}));
    EXPECT_EQ(r.moved, 0);
  }
  // All loads unknown (zero): balanced as equal loads, reported as measured.
  const auto r = ReplanRanges(owner, std::vector<double>(8, 0.0), 3);
  EXPECT_DOUBLE_EQ(r.max_load, 0.0);
  EXPECT_DOUBLE_EQ(r.mean_load, 0.0);
}

TEST(ReplanRangesTest, SkewForcesAMoveOnlyBeyondTheTolerance) {
  // 5 experts on 2 workers [0,3) [3,5), expert 0 three times as hot. Cap 3: {3,2} has loads 5 and
  // 2, {2,3} has 4 and 3, so L* = 4. At 10% the bound is 4.4 and {3,2} is out: expert 2 moves to
  // w1. At 30% the bound is 5.2 and staying put is balanced enough.
  const std::vector<int> owner = {0, 0, 0, 1, 1};
  const std::vector<double> load = {3, 1, 1, 1, 1};
  const auto tight = ReplanRanges(owner, load, 2, 0.1);
  EXPECT_EQ(tight.counts, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(tight.moved, 1);
  EXPECT_DOUBLE_EQ(tight.max_load, 4.0);
  EXPECT_DOUBLE_EQ(tight.mean_load, 3.5);
  const auto loose = ReplanRanges(owner, load, 2, 0.3);
  EXPECT_EQ(loose.counts, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(loose.moved, 0);
  EXPECT_DOUBLE_EQ(loose.max_load, 5.0);
}

TEST(ReplanRangesTest, FewerExpertsThanWorkersLeavesSomeEmpty) {
  // 2 experts on 3 workers, cap 1: each expert stays with its owner, the joiner (rank 1) and the
  // others may be empty.
  const auto r = ReplanRanges({0, 2}, {1.0, 1.0}, 3);
  EXPECT_EQ(r.counts, (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(r.moved, 0);
  const auto none = ReplanRanges({}, {}, 2);
  EXPECT_EQ(none.counts, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(none.moved, 0);
}

TEST(ReplanRangesTest, RandomCasesMatchBruteForce) {
  std::mt19937 gen(20240611);
  std::exponential_distribution<double> skew(1.0);
  const double tolerances[] = {0.0, 0.1, 0.25, 1.0};
  for (int trial = 0; trial < 200; ++trial) {
    const int E = 1 + static_cast<int>(gen() % 12);
    const int W = 1 + static_cast<int>(gen() % 6);
    const double tol = tolerances[gen() % 4];
    // Owners: uniformly random ranks and -1, or an old even split over W - 1, W or W + 1 workers
    // with one worker gone (its experts -1) or one joined at a random rank.
    std::vector<int> owner(E);
    if (gen() % 2 == 0) {
      for (int& o : owner) o = static_cast<int>(gen() % (W + 1)) - 1;
    } else {
      const int change = static_cast<int>(gen() % 3) - 1;  // -1: a joiner, +1: a death
      const int old_w = std::max(1, W + change);
      for (int e = 0; e < E; ++e) owner[e] = static_cast<int>(int64_t{e} * old_w / E);
      const int at = static_cast<int>(gen() % old_w);
      for (int& o : owner) {
        if (old_w > W) o = o == at ? -1 : (o > at ? o - 1 : o);
        if (old_w < W && o >= at) ++o;
      }
    }
    // Loads: continuous skew, small integers (ties, zeros, sometimes all zero), or all zero.
    std::vector<double> load(E, 0.0);
    const int kind = static_cast<int>(gen() % 3);
    for (double& l : load) {
      if (kind == 0) l = skew(gen);
      if (kind == 1) l = static_cast<double>(gen() % 4);
    }
    const auto r = ReplanRanges(owner, load, W, tol);

    // Brute force over every composition of E into W parts of [least, cap], in lexicographic
    // order, with range loads summed directly.
    const int cap = (E + W - 1) / W;
    const int least = E >= W ? 1 : 0;
    const bool measured = std::any_of(load.begin(), load.end(), [](double l) { return l > 0; });
    std::vector<double> eff(E);
    for (int e = 0; e < E; ++e) eff[e] = measured ? load[e] : 1.0;
    std::vector<std::vector<int64_t>> parts;
    std::vector<int64_t> cur;
    std::function<void(int)> rec = [&](int left) {
      if (static_cast<int>(cur.size()) == W) {
        if (left == 0) parts.push_back(cur);
        return;
      }
      for (int c = least; c <= std::min(cap, left); ++c) {
        cur.push_back(c);
        rec(left - c);
        cur.pop_back();
      }
    };
    rec(E);
    ASSERT_FALSE(parts.empty()) << "trial " << trial;
    auto heaviest = [&](const std::vector<int64_t>& counts, const std::vector<double>& l) {
      double top = 0;
      int e = 0;
      for (int64_t c : counts) {
        double sum = 0;
        for (int64_t i = 0; i < c; ++i) sum += l[e++];
        top = std::max(top, sum);
      }
      return top;
    };
    double best = 1e300;
    for (const auto& p : parts) best = std::min(best, heaviest(p, eff));
    double total = 0;
    for (double l : eff) total += l;
    const double bound = best * (1 + tol) + 1e-9 * total;
    const std::vector<int64_t>* pick = nullptr;
    int fewest = 1 << 30;
    for (const auto& p : parts) {
      if (heaviest(p, eff) > bound) continue;
      const int moved = MovedBy(owner, p);
      if (moved < fewest) {
        fewest = moved;
        pick = &p;
      }
    }
    ASSERT_NE(pick, nullptr) << "trial " << trial;
    std::string what = "trial " + std::to_string(trial) + ": E " + std::to_string(E) + " W " +
                       std::to_string(W) + " tol " + std::to_string(tol);
    EXPECT_EQ(r.counts, *pick) << what;
    EXPECT_EQ(r.moved, fewest) << what;
    EXPECT_EQ(MovedBy(owner, r.counts), r.moved) << what;
    EXPECT_NEAR(r.max_load, heaviest(*pick, load), 1e-9) << what;
    double measured_total = 0;
    for (double l : load) measured_total += l;
    EXPECT_NEAR(r.mean_load, measured_total / W, 1e-9) << what;
    // Deterministic.
    EXPECT_EQ(ReplanRanges(owner, load, W, tol).counts, r.counts) << what;
  }
}

TEST(ReplanRangesTest, ALargeJobStaysPutAndThenSurvivesADeath) {
  // 2048 experts on 200 workers (the even split: 48 workers of 11, 152 of 10, cap 11): nothing
  // moves. Then worker 17 dies: its 11 experts move at least, every count stays in [1, 11].
  std::vector<int> counts(200, 10);
  for (int w = 0; w < 48; ++w) counts[w] = 11;
  const std::vector<int> owner = OwnersOf(counts);
  std::mt19937 gen(5);
  std::uniform_real_distribution<double> noise(0.95, 1.05);
  std::vector<double> load(owner.size());
  for (double& l : load) l = noise(gen);
  const auto same = ReplanRanges(owner, load, 200, 0.2);
  EXPECT_EQ(same.counts, std::vector<int64_t>(counts.begin(), counts.end()));
  EXPECT_EQ(same.moved, 0);

  std::vector<int> after = owner;
  for (int& o : after) o = o == 17 ? -1 : (o > 17 ? o - 1 : o);
  const auto r = ReplanRanges(after, load, 199, 0.2);
  ASSERT_EQ(r.counts.size(), 199u);
  int64_t sum = 0;
  for (int64_t c : r.counts) {
    EXPECT_GE(c, 1);
    EXPECT_LE(c, 11);
    sum += c;
  }
  EXPECT_EQ(sum, 2048);
  EXPECT_GE(r.moved, 11);
  EXPECT_EQ(MovedBy(after, r.counts), r.moved);
  EXPECT_LE(r.max_load, r.mean_load * 1.2 * 1.2);
}

}  // namespace
}  // namespace strata::scheduler
