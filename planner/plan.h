// The resharding plan: which bytes of every tensor go from which source rank to which destination
// node (directly or relayed along a chain of destination nodes), then to which destination ranks,
// plus the statistics and cost model a user sees in `shardcast plan`.
//
// Vocabulary (docs/planner.md has the full story):
//   cell      a box of a source tensor held by a fixed set of source ranks (the holders)
//   group     destination nodes that need exactly the same boxes of one tensor
//   fragment  need-box of a group intersected with one cell: the unit that crosses the network,
//             exactly once per destination node of the group
//   transfer  one network unit: one large fragment, or a bucket of small ones, with its chains
//   chain     source rank -> node n0 -> n1 -> ... : n0 receives from the source, n_i forwards to
//             n_{i+1} (relay), every node fans the fragment out locally to the ranks that need it
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "planner/box.h"
#include "planner/layout.h"

namespace shardcast::planner {

// How a plan routes bytes. kPlanned is Shardcast's; the other two are the shapes it is measured
// against, executed by the same daemons (v1::SyncStrategy, bench/cluster.sh):
//   kRankPull         every destination rank gets its own copy of each slice it needs straight
//                     from a source rank, as per-rank P2P systems do: a group per rank (no dedup
//                     across a node's ranks), no relays
//   kGatherBroadcast  every byte that crosses the network goes through one root node (source rank
//                     0's): its holder sends it there, the root sends each destination node what it
//                     needs (a star: the parameter-server shape), chunk by chunk
enum class Strategy { kPlanned, kRankPull, kGatherBroadcast };

struct PlanOptions {
  Strategy strategy = Strategy::kPlanned;
  int64_t chunk_bytes = int64_t{64} << 20;  // large transfers are cut into chunks of this size
  int64_t small_bytes = int64_t{1} << 20;   // fragments below this travel in buckets
  // ... except fragments that land whole and contiguously in the one rank of a node that needs
  // them: from this size they travel alone and are written straight into that rank (a bucket
  // lands in an arena and is unpacked on every node).
  int64_t small_in_place_bytes = int64_t{128} << 10;
  int64_t bucket_bytes = int64_t{16} << 20;  // a bucket is filled up to this size
  int32_t max_chain = 16;                    // destination nodes per relay chain
};

struct SourceCell {
  Box box;
  int32_t tensor = 0;         // index into the plan's tensors
  int32_t holders_begin = 0;  // into Plan::cell_holders: src piece indices, sorted by (node, rank)
  int32_t holders_count = 0;
  int32_t nodes_begin = 0;  // into Plan::cell_nodes: distinct holder nodes, sorted
  int32_t nodes_count = 0;
};

struct NodeGroup {
  int32_t tensor = 0;
  int32_t nodes_begin = 0;  // into Plan::group_nodes, sorted
  int32_t nodes_count = 0;
  int32_t rank = -1;  // Strategy::kRankPull: the one destination rank it is for (-1: every rank that needs it)
};

struct Fragment {
  Box box;
  int32_t tensor = 0;
  int32_t cell = 0;
  int32_t group = 0;
  int64_t bytes = 0;
};

struct Chain {
  int32_t src_node = 0;
  int32_t src_rank = 0;     // the rank that reads its memory for the first fragment of the transfer
  int32_t nodes_begin = 0;  // into Plan::chain_nodes
  int32_t nodes_count = 0;
  // The first node forwards to every other node of the chain (Strategy::kGatherBroadcast's root),
  // instead of each node to the next.
  bool star = false;
};

struct Transfer {
  int32_t fragments_begin = 0;  // into Plan::transfer_fragments
  int32_t fragments_count = 0;
  int32_t chains_begin = 0;  // into Plan::chains
  int32_t chains_count = 0;
  int64_t bytes = 0;
  int64_t chunks = 0;  // network operations per hop
};

// A fragment a destination node gets from a source rank on the same node (colocation).
struct LocalSource {
  int32_t fragment = 0;
  int32_t node = 0;
  int32_t src_rank = 0;
};

struct TensorPair {
  int32_t src = 0;  // index in the source layout's tensors
  int32_t dst = 0;  // index in the destination layout's tensors
};

// Raw figures; predictions come from CostModel below.
struct PlanStats {
  int32_t tensors = 0;
  int64_t bytes_needed = 0;         // sum over destination ranks of the bytes they need
  int64_t network_bytes = 0;        // bytes crossing the network, relays included
  int64_t network_lower_bound = 0;  // sum over destination nodes of needed bytes held by no local source
  int64_t local_bytes = 0;          // bytes written by node-local copies
  int64_t network_ops = 0;          // chunk or bucket sends, per hop
  int64_t local_ops = 0;            // node-local copies
  int64_t transfers = 0;
  int64_t buckets = 0;
  int64_t fragments = 0;
  int32_t max_chain = 0;  // longest relay chain in hops (a star: 2)
  int64_t largest_chunk = 0;
  int64_t max_unique_held = 0;  // most bytes some needed data whose only holders are on one node
  std::vector<int64_t> node_ingress, node_egress, node_local;  // indexed by node id
  // Baseline: each destination rank pulls its own slice (no node-level dedup, no relays).
  int64_t pull_network_bytes = 0;
  double pull_max_ingress = 0, pull_max_egress = 0;
  // Baseline: gather everything to source rank 0, then broadcast whole tensors to every node.
  int64_t gather_bytes = 0, broadcast_bytes = 0, model_bytes = 0;
  double plan_ms = 0;

  int64_t maxIngress() const;
  int64_t maxEgress() const;
  int64_t maxLocal() const;
};

struct Plan {
  PlanOptions options;
  std::vector<TensorPair> tensors;
  std::vector<SourceCell> cells;
  std::vector<int32_t> cell_holders;
  std::vector<int32_t> cell_nodes;
  std::vector<NodeGroup> groups;
  std::vector<int32_t> group_nodes;
  std::vector<Fragment> fragments;
  std::vector<Transfer> transfers;
  std::vector<int32_t> transfer_fragments;
  std::vector<Chain> chains;
  std::vector<int32_t> chain_nodes;
  std::vector<LocalSource> local_sources;
  PlanStats stats;
};

// Plans the sync of every tensor `dst` needs from what `src` holds. Both layouts must have been
// resolved with the same NodeTable. Errors name the tensor, rank and element at fault.
StatusOr<Plan> makePlan(const ResolvedLayout& src, const ResolvedLayout& dst, const NodeTable& nodes,
                        const PlanOptions& options = {});

// The source rank that reads fragment `f` for chain `c` (a holder on the chain's source node).
int32_t sourceRank(const Plan& plan, const ResolvedLayout& src, int32_t f, const Chain& c);
// Where fragment `f` (or its sub-box `sub`) sits in source rank `rank`'s memory (rank must hold
// the fragment's cell; an empty Region otherwise).
Region sourceRegion(const Plan& plan, const ResolvedLayout& src, int32_t f, int32_t rank);
Region sourceRegion(const Plan& plan, const ResolvedLayout& src, int32_t f, int32_t rank, const Box& sub);
// Every destination rank on `node` that needs part of fragment `f`, with the part's region (only
// its group's rank when the group is one rank's: Strategy::kRankPull).
std::vector<std::pair<Box, Region>> destinationRegions(const Plan& plan, const ResolvedLayout& dst, int32_t f,
                                                       int32_t node);

// Simple cost model (docs/planner.md): full-duplex NICs of nic_gbps per node, node-local copies at
// local_gbps, chunks pipelined so that relays and local fan-out overlap with the network.
struct CostModel {
  double nic_gbps = 400;     // Gbit/s per node (e.g. 400 = one 400G NIC)
  double local_gbps = 2400;  // Gbit/s of node-local copy bandwidth
  double op_latency_s = 5e-6;
};

double predictSeconds(const PlanStats& s, const CostModel& m);
double predictPullSeconds(const PlanStats& s, const CostModel& m);
double predictGatherBroadcastSeconds(const PlanStats& s, const CostModel& m);

}  // namespace shardcast::planner
