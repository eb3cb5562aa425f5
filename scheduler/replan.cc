#include "scheduler/replan.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

#include "core/common/logging.h"

namespace strata::scheduler {

ReplanResult Replan(const std::vector<int>& current, const std::vector<double>& load,
                    const std::vector<int>& workers, double tolerance) {
  CHECK(!workers.empty()) << "replanning for no workers";
  CHECK_EQ(current.size(), load.size());
  const int E = static_cast<int>(current.size());
  const int W = static_cast<int>(workers.size());
  const int cap = (E + W - 1) / W;
  std::map<int, int> slot;  // worker id -> index in `workers`
  for (int i = 0; i < W; ++i) {
    const bool fresh = slot.emplace(workers[i], i).second;
    CHECK(fresh) << "worker " << workers[i] << " listed twice";
  }
  std::vector<double> wload(W, 0.0);
  std::vector<int> count(W, 0);
  std::vector<int> at(E, -1);  // expert -> worker index
  ReplanResult r;
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  r.mean_load = total / W;
  const double bound = r.mean_load * (1.0 + tolerance);

  // 1. Keep every expert whose owner is still there.
  std::vector<int> orphans;
  for (int e = 0; e < E; ++e) {
    auto it = slot.find(current[e]);
    if (it == slot.end()) {
      orphans.push_back(e);
      continue;
    }
    at[e] = it->second;
    wload[it->second] += load[e];
    ++count[it->second];
  }
  // 2. Orphans, heaviest first, onto the least-loaded worker with room.
  std::stable_sort(orphans.begin(), orphans.end(), [&](int a, int b) { return load[a] > load[b]; });
  auto lightest_with_room = [&](int except) {
    int best = -1;
    for (int w = 0; w < W; ++w) {
      if (w == except || count[w] >= cap) continue;
      if (best < 0 || wload[w] < wload[best]) best = w;
    }
    return best;
  };
  for (int e : orphans) {
    int w = lightest_with_room(-1);
    if (w < 0) w = static_cast<int>(std::min_element(count.begin(), count.end()) - count.begin());
    at[e] = w;
    wload[w] += load[e];
    ++count[w];
  }
  // 3. Rebalance: the worker most over the count cap, else the heaviest over the load bound, gives
  // one expert to the lightest worker with room; stop when neither is over or no move helps.
  for (int guard = 0; guard < 4 * E + 4; ++guard) {
    int from = -1;
    for (int w = 0; w < W; ++w) {
      if (count[w] > cap && (from < 0 || count[w] > count[from])) from = w;
    }
    const bool over_count = from >= 0;
    if (!over_count) {
      const int heavy =
          static_cast<int>(std::max_element(wload.begin(), wload.end()) - wload.begin());
      if (wload[heavy] <= bound) break;
      from = heavy;
    }
    const int to = lightest_with_room(from);
    // The expert whose move leaves the pair closest to the mean (largest drop in their max).
    int pick = -1;
    double best = over_count ? 1e300 : (to >= 0 ? std::max(wload[from], wload[to]) : 0.0);
    for (int e = 0; to >= 0 && e < E; ++e) {
      if (at[e] != from) continue;
      const double after = std::max(wload[from] - load[e], wload[to] + load[e]);
      if (after < best) {
        best = after;
        pick = e;
      }
    }
    if (pick >= 0) {
      at[pick] = to;
      wload[from] -= load[pick];
      wload[to] += load[pick];
      --count[from];
      ++count[to];
      continue;
    }
    if (over_count) break;
    // No single move helps (or no worker has room): the swap of a heavier expert of `from` with a
    // lighter one elsewhere that lowers the pair's maximum the most (two moves, counts unchanged).
    int swap_a = -1, swap_b = -1;
    double swap_best = wload[from];
    for (int a = 0; a < E; ++a) {
      if (at[a] != from) continue;
      for (int b = 0; b < E; ++b) {
        if (at[b] == from || load[b] >= load[a]) continue;
        const int w = at[b];
        const double after =
            std::max(wload[from] - load[a] + load[b], wload[w] - load[b] + load[a]);
        if (after < swap_best - 1e-12) {
          swap_best = after;
          swap_a = a;
          swap_b = b;
        }
      }
    }
    if (swap_a < 0) break;  // as balanced as whole experts allow
    const int w = at[swap_b];
    at[swap_a] = w;
    at[swap_b] = from;
    wload[from] += load[swap_b] - load[swap_a];
    wload[w] += load[swap_a] - load[swap_b];
  }
  r.owner.resize(E);
  for (int e = 0; e < E; ++e) {
    r.owner[e] = workers[at[e]];
    if (r.owner[e] != current[e]) ++r.moved;
  }
  r.max_load = *std::max_element(wload.begin(), wload.end());
  return r;
}

RangePlan ReplanRanges(const std::vector<int>& current_owner, const std::vector<double>& load,
                       int workers, double tolerance) {
  CHECK_GE(workers, 1) << "replanning ranges for no workers";
  CHECK_EQ(current_owner.size(), load.size());
  CHECK_GE(tolerance, 0.0);
  const int E = static_cast<int>(current_owner.size());
  const int W = workers;
  const int cap = (E + W - 1) / W;  // ceil(E / W)
  const int least = E >= W ? 1 : 0;
  bool measured = false;
  for (int e = 0; e < E; ++e) {
    CHECK(load[e] >= 0.0) << "expert " << e << " has load " << load[e];
    CHECK(current_owner[e] >= -1 && current_owner[e] < W)
        << "expert " << e << " owned by rank " << current_owner[e] << " of " << W;
    if (load[e] > 0.0) measured = true;
  }
  // Loads the plan balances: the measured ones, or 1 per expert when none was measured. Prefix
  // sums of non-negative terms never decrease, so a range's load grows with its length.
  std::vector<double> prefix(E + 1, 0.0);
  for (int e = 0; e < E; ++e) prefix[e + 1] = prefix[e] + (measured ? load[e] : 1.0);
  auto range_load = [&](int begin, int end) { return prefix[end] - prefix[begin]; };

  // 1. L*: best[j] = the lowest heaviest range over partitions of experts [0, j) among the workers
  // placed so far.
  constexpr double kNone = std::numeric_limits<double>::infinity();
  std::vector<double> best(E + 1, kNone), next(E + 1);
  best[0] = 0.0;
  for (int w = 0; w < W; ++w) {
    std::fill(next.begin(), next.end(), kNone);
    for (int j = 0; j <= E; ++j) {
      if (best[j] == kNone) continue;
      for (int c = least; c <= cap && j + c <= E; ++c) {
        next[j + c] = std::min(next[j + c], std::max(best[j], range_load(j, j + c)));
      }
    }
    best.swap(next);
  }
  CHECK(best[E] != kNone) << E << " experts do not fit " << W << " workers";
  const double bound = best[E] * (1.0 + tolerance) + 1e-9 * prefix[E];

  // 2. fewest[w][j]: the fewest moved experts among [j, E) placed on workers [w, W), every range
  // within the bound.
  constexpr int kNever = std::numeric_limits<int>::max();
  std::vector<std::vector<int>> fewest(W + 1, std::vector<int>(E + 1, kNever));
  fewest[W][E] = 0;
  // Calls take(c, moved) for each count c worker w may take from expert j under the bound, in
  // increasing c, `moved` being how many of those experts it does not own now; stops when take
  // returns true.
  auto for_each_count = [&](int w, int j, auto&& take) {
    int moved = 0;
    for (int c = 0; c <= cap && j + c <= E; ++c) {
      if (c > 0 && current_owner[j + c - 1] != w) ++moved;
      if (c < least) continue;
      if (range_load(j, j + c) > bound) return;
      if (take(c, moved)) return;
    }
  };
  for (int w = W - 1; w >= 0; --w) {
    for (int j = 0; j <= E; ++j) {
      for_each_count(w, j, [&](int c, int moved) {
        if (fewest[w + 1][j + c] != kNever) {
          fewest[w][j] = std::min(fewest[w][j], moved + fewest[w + 1][j + c]);
        }
        return false;
      });
    }
  }
  CHECK(fewest[0][0] != kNever) << "no partition within the bound";

  // 3. Walk forward taking the smallest count that still reaches the optimum.
  RangePlan plan;
  plan.moved = fewest[0][0];
  plan.counts.reserve(W);
  double total = 0.0;
  for (int e = 0; e < E; ++e) total += load[e];
  plan.mean_load = total / W;
  int j = 0;
  for (int w = 0; w < W; ++w) {
    int pick = -1;
    for_each_count(w, j, [&](int c, int moved) {
      if (fewest[w + 1][j + c] == kNever || moved + fewest[w + 1][j + c] != fewest[w][j]) {
        return false;
      }
      pick = c;
      return true;
    });
    CHECK_GE(pick, 0);
    double mine = 0.0;
    for (int e = j; e < j + pick; ++e) mine += load[e];
    plan.max_load = std::max(plan.max_load, mine);
    plan.counts.push_back(pick);
    j += pick;
  }
  CHECK_EQ(j, E);
  return plan;
}

}  // namespace strata::scheduler
