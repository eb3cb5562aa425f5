// Replanning expert placement when the workers change: balanced by measured expert load, moving
// as few experts as possible.
//
// Input: the current owner of every expert (a worker id, or -1 for none), each expert's measured
// load (e.g. rows routed to it over recent steps), and the workers of the new generation. Output:
// an owner for every expert, among the new workers, such that
//   - no worker holds more than ceil(E / W) experts (their state must fit where it lands);
//   - experts of workers that are still there stay put unless balance needs them elsewhere;
//   - the heaviest worker's load is within `tolerance` of the average (or as close as moving
//     whole experts allows).
// Three passes: keep what survives; place orphaned experts heaviest first on the least-loaded
// worker with room (LPT); then, while the heaviest worker is over the bound or over the count cap,
// move the one expert that brings it and the lightest worker with room closest to the average, or,
// when no single move helps, swap the pair of experts that lowers the heaviest load the most.
// Deterministic: ties break on the lower worker id and expert index.
//
// Both planners are pure functions of their arguments: any thread may call them, and they return
// values the caller owns.
#pragma once

#include <cstdint>
#include <vector>

namespace strata::scheduler {

struct ReplanResult {
  std::vector<int> owner;  // [E] the new owner of each expert (a worker id)
  int moved = 0;           // experts whose owner changed (orphans count as moved)
  double max_load = 0;     // the heaviest worker's load
  double mean_load = 0;    // total load / workers
};

// `workers` must be non-empty and hold distinct ids; `current` and `load` have E entries, loads
// non-negative. tolerance: allowed relative excess of the heaviest worker (default 10%).
ReplanResult Replan(const std::vector<int>& current, const std::vector<double>& load,
                    const std::vector<int>& workers, double tolerance = 0.1);

// Replanning contiguous expert ranges when the workers change.
//
// The expert exchange needs every worker to own one contiguous range of experts, in rank order
// (ExpertPlacement: worker w owns [first(w), first(w) + count(w))), so rows permuted in expert
// order are grouped by destination and one all-to-all-v moves them. Replan above may scatter a
// worker's experts; ReplanRanges only chooses the counts, i.e. where the W - 1 boundaries fall.
//
// Input: for every expert, the rank in the NEW generation of its current owner, or -1 when that
// owner is gone; each expert's measured load (e.g. rows routed to it over recent steps,
// non-negative; all zero means unknown and is treated as equal loads); the number of workers
// (>= 1). Output: a count for every worker such that
//   - no worker holds more than ceil(E / W) experts (their state must fit where it lands), and
//     none holds 0 unless E < W;
//   - every range's load is within `tolerance` (relative) of L*, the lowest heaviest-range load
//     any such partition achieves (a range over the bound by at most 1e-9 of the total load counts
//     as within it, so float rounding cannot flip a tie);
//   - among those, the fewest experts change owner (an expert without an owner always moves).
// Two dynamic programs over (worker, boundary), O(W * E * ceil(E / W)): the first finds L*, the
// second the fewest moves under the bound, filled from the last worker back so that walking
// forward and taking each worker's smallest count that still reaches the optimum yields the
// lexicographically smallest counts among the optimal partitions. Deterministic.
struct RangePlan {
  std::vector<int64_t> counts;  // [workers] experts of each worker, ranges in rank order
  int moved = 0;                // experts whose owner changes (experts with no current owner count)
  double max_load = 0;          // the heaviest worker's load
  double mean_load = 0;         // total load / workers
};

// current_owner: [E] the NEW rank of each expert's current owner, or -1 when its owner is gone
// (or is not in the new generation). load: [E] non-negative measured load. workers >= 1.
// tolerance >= 0. max_load and mean_load are in the measured loads as given (0 when all are 0).
RangePlan ReplanRanges(const std::vector<int>& current_owner, const std::vector<double>& load,
                       int workers, double tolerance = 0.1);

}  // namespace strata::scheduler
