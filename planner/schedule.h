// The schedule of a plan (planner/plan.h): what the daemons need to execute it, computed once and
// shared by the syncs that repeat it. Bounded staging: transfers are cut into waves in plan order
// so that in every wave each node lands at most `staging_budget` bytes in its arena and packs at
// most as much for the transfers it heads (a single transfer larger than the budget gets a wave
// of its own); where each transfer lands on each node (straight into a destination rank's buffer
// when one holds it whole and contiguously, else at an arena offset); which chains are sent
// straight from a source rank's buffer; and the chunks each transfer travels in.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "planner/layout.h"
#include "planner/plan.h"
#include "shardcast/v1/layout.pb.h"

namespace shardcast::planner {

// A plan with everything needed to execute it: one TransferSchedule per transfer of the plan and
// one NodeSchedule per node of its NodeTable.
//
// Bounded staging: transfers are cut into waves (in plan order) so that in every wave each node
// lands at most `staging_budget` bytes and packs at most as much for the transfers it heads; a
// wave's arena and staging offsets start again at zero. A single transfer larger than the budget
// gets a wave of its own. The coordinator runs the waves one after another on every daemon.
struct Schedule {
  // Where a transfer lands on one node: straight into a destination rank's buffer when the
  // transfer is a single fragment that one rank there holds whole and contiguously (no arena, no
  // unpack copy; the node's other ranks copy from there), else at an offset in the node's arena.
  struct Landing {
    int32_t node = -1;
    uint64_t arena_offset = 0;
    int32_t rank = -1;           // direct: the destination rank
    int32_t buffer = -1;         // direct: index into dst.buffer_names
    uint64_t buffer_offset = 0;  // direct: bytes from the buffer's start
    bool direct() const { return rank >= 0; }
  };
  // A piece a transfer travels in. A single-fragment transfer is cut into the plan's chunks
  // (row-major slabs, contiguous in the packed bytes), so relays forward chunk k while chunk k+1
  // is on the wire and fan-out overlaps the network; a bucket is one chunk.
  struct Chunk {
    Box box;  // ndim 0: the whole transfer
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  // A node that heads some of a transfer's chains with packed bytes, and where it packs them.
  struct Heading {
    int32_t node = -1;
    uint64_t staging_offset = 0;
  };
  // Everything about one transfer of the plan (same index as plan.transfers).
  struct TransferSchedule {
    int32_t wave = 0;
    std::vector<Landing> landings;  // one per node it lands on
    std::vector<Heading> heading;
    // Per chain (from the transfer's chains_begin): sent straight from its source rank's
    // registered buffer (a single fragment, contiguous there), so its head needs no staging for it.
    std::vector<char> direct;
    std::vector<Chunk> chunks;
    const Landing* landingOn(int32_t node) const;
    // Where `node` packs this transfer; UINT64_MAX when it packs none of it.
    uint64_t stagingOffset(int32_t node) const;
  };
  // What one node needs for the whole schedule (same index as the NodeTable).
  struct NodeSchedule {
    uint64_t arena_bytes = 0, staging_bytes = 0;  // the largest wave's need
    // The (destination rank, buffer) pairs transfers land in directly, sorted, each once.
    std::vector<std::pair<int32_t, int32_t>> direct_targets;
    std::vector<int64_t> incoming;  // per wave: chunk landings to process
    // The nodes whose landing directory this node needs to execute (sorted, each once): every node
    // it writes to (its chains' heads, the hops it forwards to) and every node the transfers it
    // heads land on (a delta is encoded only when all of them hold its base). Small and bounded
    // by what the node does, so no node is told where every other node lands.
    std::vector<int32_t> peers;
  };

  uint64_t staging_budget = 0;
  // Sends straight from source rank buffers and landings straight into destination rank buffers
  // where the layouts allow (above). Off for delta syncs: every chunk is packed where it can be
  // encoded, and lands where it can be decoded before it reaches a rank (daemon/engine/delta.h).
  bool zero_copy = true;
  NodeTable nodes;
  ResolvedLayout src, dst;
  Plan plan;
  int32_t waves = 1;
  std::vector<TransferSchedule> transfers;
  std::vector<NodeSchedule> per_node;
  std::vector<uint64_t> fragment_offset;  // per fragment: offset inside its transfer's packed bytes

  const TransferSchedule& transfer(int32_t t) const { return transfers[static_cast<size_t>(t)]; }
  const NodeSchedule& node(int32_t n) const { return per_node[static_cast<size_t>(n)]; }
  // What is wrong with a peer's word that chunk `chunk` of `transfer` landed on node `self`, hop
  // `hop` of chain `chain`, in wave `wave`: "" when the transfer and chunk exist and belong to the
  // wave, the chain is one of the transfer's and its hop is `self`; else what is not (every index
  // a peer sends is checked here).
  std::string landedProblem(int32_t transfer, int32_t chain, int32_t hop, int32_t chunk, int32_t wave,
                            int32_t self) const;
};

// Resolves both layouts, plans src -> dst with chunks of `chunk_bytes` (routed by `strategy`), and
// schedules the plan for `staging_budget` bytes per node and wave (`zero_copy`: Schedule::zero_copy).
StatusOr<Schedule> makeSchedule(const v1::Layout& src, const v1::Layout& dst, uint64_t staging_budget,
                                uint64_t chunk_bytes, bool zero_copy = true, Strategy strategy = Strategy::kPlanned);
// Schedules a plan already made over these resolved layouts and node table (a replica set's
// composed plan, say) for `staging_budget` bytes per node and wave.
StatusOr<Schedule> scheduleOf(NodeTable nodes, ResolvedLayout src, ResolvedLayout dst, Plan plan,
                              uint64_t staging_budget, bool zero_copy = true);

}  // namespace shardcast::planner
