#include "scheduler/replan.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "runtime/common/logging.h"

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

}  // namespace strata::scheduler
