// Replica sets: data-parallel inference replicas that share one per-replica layout, on nodes of
// their own or sharing nodes (several engines on one machine). One replica is planned once, with its nodes abstracted
// to positions, and that plan is reused by position for every replica (docs/planner.md, "Replica sets").
//
// The pieces, in the order a caller uses them:
//   checkReplicaSet    the replicas really are one set (same layout, same rank -> node pattern)
//   planPositions      plans positionLayout(replica) once: a PositionPlan, what a cache keeps
//   stackReplicas      the whole set as one flat layout: the destination the engines execute
//   composeReplicas    PositionPlan + the stacked layout -> the plan for the whole set (cheap:
//                      copies and renames, no planning), again for every membership change
//   planReplicaSet     all of the above in one call, optionally reusing a cached PositionPlan
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "planner/layout.h"
#include "planner/plan.h"

namespace shardcast::planner {

// Node names of a position layout: "@replica-position-0", "-1", ... Reserved: no layout of a
// replica set or of its source may name a node so.
inline constexpr std::string_view kPositionNodePrefix = "@replica-position-";

// What every replica of a set has in common: layoutDigest with group, nodes, ranks_per_node,
// node_prefix, replica_set and replica cleared. Equal for every replica of a set.
std::string replicaDigest(const v1::Layout& layout);
// The bytes replicaDigest hashes (the deterministic serialisation of that cleared layout).
std::string replicaBytes(const v1::Layout& layout);

struct Replica {
  int32_t id = 0;  // must equal layout.replica()
  v1::Layout layout;
};

// OK when `replicas` form one valid set: at least one; the same non-empty replica_set; distinct
// ids (>= 0, each equal to its layout's `replica`) and distinct groups; the same replicaBytes (the
// bytes compared, not their digests, which can be made to collide);
// the same rank -> position pattern (a replica's positions are its distinct nodes numbered in
// order of first appearance over ranks 0..W-1, and every replica maps its ranks to positions
// identically); no node with a reserved name; R x W within the rank limit. Replicas may share
// nodes.
// INVALID_ARGUMENT naming the replica (id and group) and what differs otherwise.
Status checkReplicaSet(const std::vector<Replica>& replicas);

// The position of each rank of `layout` (positions numbered by first appearance over the ranks).
StatusOr<std::vector<int32_t>> rankPositions(const v1::Layout& layout);

// `replica` with node p renamed kPositionNodePrefix + p (an explicit node list), group set to its
// replica_set (when given), and replica_set / replica cleared: the same layout for every replica
// of a set, the thing that is planned once. A layout whose nodes do not resolve keeps its own (and
// resolving it reports why).
v1::Layout positionLayout(const v1::Layout& replica);

// One flat layout equivalent to the set, replicas in the given order (callers sort by id, so a
// join of a new highest id appends): rank k x W + r is replica k's rank r; nodes concatenated;
// mesh [R, ...] (dim name "replica" when names are given) with a leading Replicate for tensors
// given by placements; explicit pieces held by rank r in every replica are held by ranks
// r, W + r, ...; fused buffers unchanged. Group = the replica_set. Expects a set that passed
// checkReplicaSet.
v1::Layout stackReplicas(const std::vector<Replica>& replicas);

// One replica planned against the source, nodes abstracted to positions; immutable once made, and
// what a plan cache keeps (composeReplicas only reads it).
struct PositionPlan {
  Plan plan;                           // makePlan(src, positionLayout(replica))
  NodeTable nodes;                     // the plan's node ids: the source's nodes, then the positions
  std::vector<int32_t> position_node;  // node id (in `nodes`) of each position
  std::vector<int32_t> rank_position;  // position of each rank of one replica
  std::vector<int32_t> src_rank_node;  // node id (in `nodes`) of each source rank
  int32_t src_tensors = 0;             // tensors of the source and of one replica
  int32_t dst_tensors = 0;
  std::string replica_digest;  // replicaDigest of the planned replica
  std::string src_digest;      // layoutDigest of the source where planReplicaSet planned it, else ""

  int32_t positions() const { return static_cast<int32_t>(position_node.size()); }
  int32_t replicaWorld() const { return static_cast<int32_t>(rank_position.size()); }
};

// Plans `replica` (one replica of a set, any of them) by position against `src`, which was
// resolved into `nodes` (copied: the position plan keeps its own table). Errors as makePlan's,
// naming nodes "@replica-position-p"; INVALID_ARGUMENT when a source node has a reserved name.
StatusOr<PositionPlan> planPositions(const ResolvedLayout& src, const NodeTable& nodes, const v1::Layout& replica,
                                     const PlanOptions& options = {});

// The plan for the whole set: `stacked_dst` is resolve(stackReplicas(replicas)) and `src` the
// source the position plan was made from, both resolved into `nodes`; each replica's node of each
// position is read from stacked_dst. The composed plan has the position plan's tensors, cells,
// fragments and transfers (same indices, same contents: the reuse) and options; node groups hold
// every replica's node of each of their positions; each template chain over positions
// [p_a, p_b, ...] becomes the sequence [replica 0's p_a, replica 0's p_b, ..., replica 1's p_a,
// ...] cut greedily into chains of at most max_chain nodes with the template's source, so the
// source sends a fragment once per max_chain nodes, not once per replica, and a join only extends
// the tails of chains (no node of an earlier replica gets another upstream). A node that several
// replicas share at the same position is in each group and chain once: it receives each byte
// once and fans it out to all of their ranks. Statistics are those of the composed plan (plan_ms:
// the composition's own time).
// FAILED_PRECONDITION when a node of a replica also hosts a source rank (colocation changes the
// per-replica plan), when replicas share a node at different positions (it needs the union of
// two positions' boxes): plan the stacked layout with makePlan instead; or when src /
// stacked_dst do not match the position plan (ranks, nodes, tensors).
StatusOr<Plan> composeReplicas(const PositionPlan& positions, const ResolvedLayout& src,
                               const ResolvedLayout& stacked_dst, const NodeTable& nodes);

// A replica set planned for one membership, with what a later membership can reuse.
struct ReplicaSetPlan {
  NodeTable nodes;     // the source's nodes, then every replica's
  ResolvedLayout src;  // the source, resolved
  v1::Layout stacked;  // stackReplicas(replicas): the destination the engines execute against
  ResolvedLayout dst;  // `stacked`, resolved
  std::shared_ptr<const PositionPlan> positions;  // keep it to compose another membership cheaply
  bool reused_positions = false;                  // `reuse` was taken instead of planning
  Plan plan;                                      // composeReplicas(*positions, src, dst, nodes)
};

// checkReplicaSet, resolve, plan the position layout once (or take `reuse` when it was planned
// from the same source layout, replica digest, rank -> position pattern and options), compose.
// `reuse` is matched by xxHash64 digests: a caller keeps position plans under a key that names
// their layouts' very bytes (PlanCache keys them by SHA-256), so colliding layouts never meet here.
// FAILED_PRECONDITION, naming the node, when a replica node hosts a source rank or replicas share
// a node at different positions (composeReplicas).
StatusOr<ReplicaSetPlan> planReplicaSet(const v1::Layout& src, const std::vector<Replica>& replicas,
                                        const PlanOptions& options = {},
                                        std::shared_ptr<const PositionPlan> reuse = nullptr);

}  // namespace shardcast::planner
