// Hierarchical (two-level) all-to-all-v for jobs laid out as nodes x local ranks.
//
// Expert parallelism sends a piece from every rank to every rank each step; with W ranks on N
// nodes of L, N L^2 (N-1) of those messages cross the slow links between nodes, and they get
// small as W grows. The two-level exchange (Tutel's "2DH" all-to-all) first exchanges among the
// ranks of a node, so that local rank l gathers everything its node sends to local rank l of any
// node, and then exchanges among the ranks with the same local rank, one per node: L times fewer
// and L times larger messages cross the nodes, for a second pass over the data inside each node.
//
// Global rank = node * local_size + local_rank. The result is byte for byte what the flat
// AllToAllV gives (rows in source-rank order); the caller's counts are the flat ones.
#pragma once

#include <memory>

#include "core/common/status.h"
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"

namespace strata::comm {

// A Communicator whose AllToAllV runs in two stages:
//   0. the counts of stage 1 (a fixed-size all-to-all of `nodes` counts per pair on intra_node:
//      a rank does not know what its node's other ranks send to its column);
//   1. intra-node: rank (n, l) sends to local rank l' everything it sends to (any node, l');
//   2. inter-node: rank (n, l') sends to node n' everything its node sends to (n', l').
// AllReduce, AllGather, Broadcast and Barrier go to `world`. Abort aborts all three; a failure of
// any of them aborts the other two as well, so the wrapper is finished as a whole, like any
// Communicator. With one node (or one rank per node) AllToAllV is the intra-node (inter-node)
// one alone.
//
// `world` has nodes * local_size ranks; `intra_node` the local_size ranks of this rank's node,
// ranked by local rank; `inter_node` the `nodes` ranks with this rank's local rank, ranked by
// node. INVALID_ARGUMENT when they do not fit together. The wrapper owns the three; its threading
// rules are any Communicator's (one calling thread at a time, Abort from any thread).
[[nodiscard]] StatusOr<std::unique_ptr<Communicator>> MakeHierarchical(
    std::unique_ptr<Communicator> world, std::unique_ptr<Communicator> intra_node,
    std::unique_ptr<Communicator> inter_node, int local_size);

// Connects the three over Gloo through one store, under its prefixes "world/",
// "intra/<node>/" and "inter/<local_rank>/", and wraps them with MakeHierarchical.
// options.world_size must be a multiple of local_size. Give it a store of its own (a prefix no
// other communicator of the generation uses, e.g. MakePrefixStore(gen_store, "a2a/")).
// Every rank connects the three in the same order, so the rendezvous cannot deadlock. The store is
// used only while connecting.
[[nodiscard]] StatusOr<std::unique_ptr<Communicator>> ConnectHierarchicalGloo(
    std::shared_ptr<Store> store, const CommOptions& options, int local_size);

}  // namespace strata::comm
