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

}  // namespace strata::scheduler
