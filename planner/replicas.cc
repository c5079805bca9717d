// Replica sets: one replica planned by position, the plan reused for every replica of the set and
// composed into relay chains across replicas (planner/replicas.h, docs/planner.md).
#include "planner/replicas.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>
#include <unordered_set>

#include "common/strings.h"
#include "planner/limits.h"

namespace shardcast::planner {

namespace {

std::string who(const Replica& r) { return strCat("replica ", r.id, " (group ", quote(r.layout.group()), ")"); }

bool reservedNodeName(const std::string& name) { return name.starts_with(kPositionNodePrefix); }

// The node name of every rank of `l`, validated as resolveLayout does (the mesh within the rank
// limit, one node per rank or a positive ranks_per_node).
StatusOr<std::vector<std::string>> rankNodeNames(const v1::Layout& l) {
  if (l.mesh().shape_size() == 0) return absl::InvalidArgumentError("mesh.shape is empty");
  int64_t world = 1;
  for (int m = 0; m < l.mesh().shape_size(); ++m) {
    const int64_t s = l.mesh().shape(m);
    if (s <= 0) return absl::InvalidArgumentError(strCat("mesh.shape[", m, "] = ", s, " must be positive"));
    const auto product = checkedMul(world, s);
    if (!product || *product > limits().max_ranks)
      return absl::InvalidArgumentError(strCat("mesh ", strJoin(l.mesh().shape(), "x"), " has more than ",
                                               limits().max_ranks, " ranks (--max-layout-ranks)"));
    world = *product;
  }
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(world));
  if (l.nodes_size() > 0) {
    if (l.ranks_per_node() != 0) return absl::InvalidArgumentError("give either nodes or ranks_per_node, not both");
    if (l.nodes_size() != world)
      return absl::InvalidArgumentError(
          strCat("nodes has ", l.nodes_size(), " entries but the mesh has ", world, " ranks"));
    for (int r = 0; r < l.nodes_size(); ++r) {
      if (l.nodes(r).empty()) return absl::InvalidArgumentError(strCat("nodes[", r, "] is empty"));
      out.push_back(l.nodes(r));
    }
    return out;
  }
  if (l.ranks_per_node() <= 0)
    return absl::InvalidArgumentError(
        strCat("set nodes (one per rank) or a positive ranks_per_node (got ", l.ranks_per_node(), ")"));
  for (int64_t r = 0; r < world; ++r) out.push_back(strCat(l.node_prefix(), r / l.ranks_per_node()));
  return out;
}

// Positions of ranks: distinct nodes numbered in order of first appearance. `names` gets the node
// of each position.
std::vector<int32_t> positionsOf(const std::vector<std::string>& rank_nodes, std::vector<std::string>* names) {
  std::unordered_map<std::string, int32_t> position;
  std::vector<int32_t> out;
  out.reserve(rank_nodes.size());
  for (const std::string& n : rank_nodes) {
    auto [it, inserted] = position.try_emplace(n, static_cast<int32_t>(position.size()));
    if (inserted && names) names->push_back(n);
    out.push_back(it->second);
  }
  return out;
}

template <typename M>
bool sameMessage(const M& a, const M& b) {
  return a.SerializeAsString() == b.SerializeAsString();
}

std::string meshStr(const v1::Mesh& m) {
  std::string s = "[" + strJoin(m.shape(), ", ") + "]";
  if (m.dim_names_size() > 0) s += " named [" + strJoin(m.dim_names(), ", ") + "]";
  return s;
}

std::string placementsStr(const v1::Tensor& t) {
  std::vector<std::string> parts;
  for (const auto& p : t.placements()) parts.push_back(p.ShortDebugString());
  return "[" + strJoin(parts, ", ") + "]";
}

// The first thing, outside group and nodes, in which two layouts differ.
std::string difference(const v1::Layout& a, const v1::Layout& b) {
  if (!sameMessage(a.mesh(), b.mesh())) return strCat("mesh ", meshStr(a.mesh()), " vs ", meshStr(b.mesh()));
  if (a.tensors_size() != b.tensors_size()) return strCat(a.tensors_size(), " tensors vs ", b.tensors_size());
  for (int i = 0; i < a.tensors_size(); ++i) {
    const v1::Tensor &x = a.tensors(i), &y = b.tensors(i);
    if (sameMessage(x, y)) continue;
    if (x.name() != y.name()) return strCat("tensors[", i, "] is ", quote(x.name()), " vs ", quote(y.name()));
    const std::string t = strCat("tensor ", quote(x.name()), ": ");
    if (!std::equal(x.shape().begin(), x.shape().end(), y.shape().begin(), y.shape().end()))
      return strCat(t, "shape [", strJoin(x.shape(), ", "), "] vs [", strJoin(y.shape(), ", "), "]");
    if (x.dtype() != y.dtype()) return strCat(t, "dtype ", quote(x.dtype()), " vs ", quote(y.dtype()));
    if (x.placements_size() != y.placements_size() ||
        !std::equal(x.placements().begin(), x.placements().end(), y.placements().begin(),
                    [](const auto& p, const auto& q) { return sameMessage(p, q); }))
      return strCat(t, "placements ", placementsStr(x), " vs ", placementsStr(y));
    if (x.pieces_size() != y.pieces_size()) return strCat(t, x.pieces_size(), " pieces vs ", y.pieces_size());
    for (int p = 0; p < x.pieces_size(); ++p)
      if (!sameMessage(x.pieces(p), y.pieces(p))) return strCat(t, "piece ", p, " differs");
    return strCat(t, "differs");
  }
  if (a.fused_size() != b.fused_size()) return strCat(a.fused_size(), " fused buffers vs ", b.fused_size());
  for (int i = 0; i < a.fused_size(); ++i)
    if (!sameMessage(a.fused(i), b.fused(i))) return strCat("fused buffer ", quote(a.fused(i).name()), " differs");
  return "their serialisations differ";
}

// What checkReplicaSet learns on the way: the shared rank -> position pattern and, per replica,
// its node of each position.
struct SetShape {
  std::vector<int32_t> rank_position;
  std::vector<std::vector<std::string>> nodes;
};

StatusOr<SetShape> examine(const std::vector<Replica>& replicas) {
  if (replicas.empty()) return absl::InvalidArgumentError("a replica set needs at least one replica");
  const Replica& first = replicas[0];
  SetShape shape;
  std::string first_bytes;
  std::unordered_map<int32_t, size_t> ids;
  std::unordered_map<std::string, size_t> groups;
  for (size_t i = 0; i < replicas.size(); ++i) {
    const Replica& rep = replicas[i];
    const v1::Layout& l = rep.layout;
    if (rep.id < 0) return absl::InvalidArgumentError(strCat(who(rep), ": id ", rep.id, " must be >= 0"));
    if (l.replica() != rep.id)
      return absl::InvalidArgumentError(strCat(who(rep), ": its layout says replica ", l.replica()));
    if (l.replica_set().empty())
      return absl::InvalidArgumentError(strCat(who(rep), ": its layout has no replica_set (not a replica)"));
    if (l.replica_set() != first.layout.replica_set())
      return absl::InvalidArgumentError(strCat(who(rep), ": replica_set ", quote(l.replica_set()), " but ", who(first),
                                               " has ", quote(first.layout.replica_set())));
    if (auto [it, inserted] = ids.try_emplace(rep.id, i); !inserted)
      return absl::InvalidArgumentError(strCat("replica id ", rep.id, " is given twice (groups ",
                                               quote(replicas[it->second].layout.group()), " and ", quote(l.group()),
                                               ")"));
    if (auto [it, inserted] = groups.try_emplace(l.group(), i); !inserted)
      return absl::InvalidArgumentError(strCat("group ", quote(l.group()), " is given for ", who(replicas[it->second]),
                                               " and replica ", rep.id, ": each replica is a group of its own"));
    // The template bytes themselves, not a digest of them: xxHash64 digests can be made to collide
    // (docs/security.md), and a replica that passed here is written as the first one's layout says.
    std::string bytes = replicaBytes(l);
    if (i == 0) {
      first_bytes = std::move(bytes);
    } else if (bytes != first_bytes) {
      return absl::InvalidArgumentError(strCat(who(rep), ": its layout differs from ", who(first),
                                               "'s beyond group and nodes: ", difference(l, first.layout)));
    }
    auto rank_nodes = rankNodeNames(l);
    if (!rank_nodes.ok()) return absl::InvalidArgumentError(strCat(who(rep), ": ", rank_nodes.status().message()));
    std::vector<std::string> names;
    std::vector<int32_t> positions = positionsOf(*rank_nodes, &names);
    if (i == 0) {
      shape.rank_position = std::move(positions);
    } else {
      for (size_t r = 0; r < positions.size(); ++r)
        if (positions[r] != shape.rank_position[r])
          return absl::InvalidArgumentError(strCat(who(rep), ": rank ", r, " is on node ", quote((*rank_nodes)[r]),
                                                   " (position ", positions[r], ") but ", who(first), " has rank ", r,
                                                   " at position ", shape.rank_position[r],
                                                   ": every replica must spread its ranks over its nodes alike"));
    }
    // Replicas may share nodes (data-parallel engines on one machine): composeReplicas lands
    // each byte once on a shared node and fans it out to every replica's ranks there.
    for (const std::string& n : names)
      if (reservedNodeName(n))
        return absl::InvalidArgumentError(
            strCat(who(rep), ": node ", quote(n), " has a name reserved for replica positions"));
    shape.nodes.push_back(std::move(names));
  }
  const auto world =
      checkedMul(static_cast<int64_t>(replicas.size()), static_cast<int64_t>(shape.rank_position.size()));
  if (!world || *world > limits().max_ranks)
    return absl::InvalidArgumentError(strCat("replica set ", quote(first.layout.replica_set()), ": ", replicas.size(),
                                             " replicas of ", shape.rank_position.size(), " ranks are more than ",
                                             limits().max_ranks, " ranks (--max-layout-ranks)"));
  return shape;
}

bool sameOptions(const PlanOptions& a, const PlanOptions& b) {
  return a.chunk_bytes == b.chunk_bytes && a.small_bytes == b.small_bytes &&
         a.small_in_place_bytes == b.small_in_place_bytes && a.bucket_bytes == b.bucket_bytes &&
         a.max_chain == b.max_chain;
}

// `replica` names the replica (and its set) whose node `node` is.
Status colocated(const std::string& node, int32_t src_rank, const std::string& src_group, const std::string& replica) {
  return absl::FailedPreconditionError(
      strCat("node ", quote(node), " hosts rank ", src_rank, " of layout ", quote(src_group), " and ", replica,
             ": a replica set is composed from one replica's plan only when no replica node hosts a source rank "
             "(colocation changes that replica's plan); plan the stacked layout with makePlan instead"));
}

}  // namespace

std::string replicaDigest(const v1::Layout& layout) { return layoutDigestOf(replicaBytes(layout)); }

std::string replicaBytes(const v1::Layout& layout) {
  // The bytes a copy with those fields cleared serialises to (mesh = 2, tensors = 6, fused = 7, in
  // field order), written without the copy: copying a 10^5-tensor layout costs ten times what
  // serialising it does, and a set's check digests every replica.
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);
    auto field = [&](int number, const google::protobuf::Message& m) {
      coded.WriteTag(static_cast<uint32_t>(number) << 3 | 2);  // length-delimited
      coded.WriteVarint32(static_cast<uint32_t>(m.ByteSizeLong()));
      m.SerializeWithCachedSizes(&coded);
    };
    if (layout.has_mesh()) field(v1::Layout::kMeshFieldNumber, layout.mesh());
    for (const v1::Tensor& t : layout.tensors()) field(v1::Layout::kTensorsFieldNumber, t);
    for (const v1::FusedBuffer& f : layout.fused()) field(v1::Layout::kFusedFieldNumber, f);
  }
  return bytes;
}

Status checkReplicaSet(const std::vector<Replica>& replicas) { return examine(replicas).status(); }

StatusOr<std::vector<int32_t>> rankPositions(const v1::Layout& layout) {
  auto names = rankNodeNames(layout);
  if (!names.ok())
    return absl::InvalidArgumentError(strCat("layout ", quote(layout.group()), ": ", names.status().message()));
  return positionsOf(*names, nullptr);
}

v1::Layout positionLayout(const v1::Layout& replica) {
  v1::Layout out = replica;
  if (!replica.replica_set().empty()) out.set_group(replica.replica_set());
  out.clear_replica_set();
  out.clear_replica();
  auto positions = rankPositions(replica);
  if (!positions.ok()) return out;
  out.clear_nodes();
  out.clear_ranks_per_node();
  out.clear_node_prefix();
  std::vector<std::string> names;
  out.mutable_nodes()->Reserve(static_cast<int>(positions->size()));
  for (int32_t p : *positions) {
    while (names.size() <= static_cast<size_t>(p)) names.push_back(strCat(kPositionNodePrefix, names.size()));
    out.add_nodes(names[p]);
  }
  return out;
}

v1::Layout stackReplicas(const std::vector<Replica>& replicas) {
  if (replicas.empty()) return {};
  const v1::Layout& first = replicas[0].layout;
  v1::Layout out = first;
  out.set_group(first.replica_set().empty() ? first.group() : first.replica_set());
  out.clear_replica_set();
  out.clear_replica();
  out.clear_nodes();
  out.clear_ranks_per_node();
  out.clear_node_prefix();
  const int64_t count = static_cast<int64_t>(replicas.size());
  int64_t world = 1;
  for (int64_t s : first.mesh().shape()) world *= s;

  v1::Mesh* mesh = out.mutable_mesh();
  mesh->clear_shape();
  mesh->add_shape(count);
  for (int64_t s : first.mesh().shape()) mesh->add_shape(s);
  if (first.mesh().dim_names_size() > 0) {
    mesh->clear_dim_names();
    mesh->add_dim_names("replica");
    for (const auto& n : first.mesh().dim_names()) mesh->add_dim_names(n);
  }
  for (const Replica& rep : replicas) {
    auto names = rankNodeNames(rep.layout);
    if (names.ok())
      for (std::string& n : *names) out.add_nodes(std::move(n));
  }
  for (v1::Tensor& t : *out.mutable_tensors()) {
    if (t.placements_size() > 0) {
      auto* placements = t.mutable_placements();
      placements->Add()->mutable_replicate();
      for (int i = placements->size() - 1; i > 0; --i) placements->SwapElements(i, i - 1);
    }
    for (v1::Piece& p : *t.mutable_pieces()) {
      std::vector<int32_t> own(p.ranks().begin(), p.ranks().end());
      if (own.empty()) own.push_back(p.rank());
      p.clear_rank();
      p.clear_ranks();
      if (count == 1 && own.size() == 1) {
        p.set_rank(own[0]);
        continue;
      }
      for (int64_t k = 0; k < count; ++k)
        for (int32_t r : own) p.add_ranks(static_cast<int32_t>(k * world + r));
    }
  }
  return out;
}

StatusOr<PositionPlan> planPositions(const ResolvedLayout& src, const NodeTable& nodes, const v1::Layout& replica,
                                     const PlanOptions& options) {
  SC_ASSIGN_OR_RETURN(std::vector<int32_t> rank_position, rankPositions(replica));
  std::vector<char> seen(nodes.size(), 0);
  for (int32_t n : src.rank_node) {
    if (seen[n]) continue;
    seen[n] = 1;
    if (reservedNodeName(nodes.name(n)))
      return absl::InvalidArgumentError(strCat("layout ", quote(src.group), ": node ", quote(nodes.name(n)),
                                               " has a name reserved for replica positions"));
  }
  PositionPlan out;
  out.nodes = nodes;
  SC_ASSIGN_OR_RETURN(ResolvedLayout dst, resolveLayout(positionLayout(replica), out.nodes));
  const int32_t positions = 1 + *std::max_element(rank_position.begin(), rank_position.end());
  out.position_node.assign(positions, -1);
  for (size_t r = 0; r < rank_position.size(); ++r) out.position_node[rank_position[r]] = dst.rank_node[r];
  SC_ASSIGN_OR_RETURN(out.plan, makePlan(src, dst, out.nodes, options));
  out.rank_position = std::move(rank_position);
  out.src_rank_node = src.rank_node;
  out.src_tensors = static_cast<int32_t>(src.tensors.size());
  out.dst_tensors = static_cast<int32_t>(dst.tensors.size());
  out.replica_digest = replicaDigest(replica);
  return out;
}

namespace {

// Where the replicas of a stacked layout sit, by position (composeReplicas).
struct Placement {
  int32_t W = 0, P = 0, R = 0;  // ranks per replica, positions, replicas
  // Replica k's node of position p ([k * P + p]); the first replica on each node, and the position
  // it holds there; how many replicas each node holds.
  std::vector<int32_t> replica_node, owner, node_position, sharing;
  // The position of each of the position plan's destination nodes (-1: none).
  std::vector<int32_t> position_of;
  int32_t nodeOf(int32_t k, int32_t template_node) const {
    return replica_node[static_cast<size_t>(k) * P + position_of[template_node]];
  }
};

// The layouts are those the position plan was made for.
Status checkComposable(const PositionPlan& pp, const ResolvedLayout& src, const ResolvedLayout& dst) {
  const int32_t W = pp.replicaWorld();
  if (W == 0 || dst.world() == 0 || dst.world() % W != 0)
    return absl::FailedPreconditionError(strCat("layout ", quote(dst.group), " has ", dst.world(),
                                                " ranks: not a whole number of replicas of ", W, " ranks"));
  if (src.world() != static_cast<int32_t>(pp.src_rank_node.size()) ||
      static_cast<int32_t>(src.tensors.size()) != pp.src_tensors ||
      static_cast<int32_t>(dst.tensors.size()) != pp.dst_tensors)
    return absl::FailedPreconditionError(
        strCat("layouts ", quote(src.group), " (", src.world(), " ranks, ", src.tensors.size(), " tensors) and ",
               quote(dst.group), " (", dst.tensors.size(), " tensors) are not those of the position plan (",
               pp.src_rank_node.size(), " source ranks, ", pp.src_tensors, " and ", pp.dst_tensors, " tensors)"));
  if (!pp.plan.local_sources.empty())
    return absl::FailedPreconditionError("the position plan has local sources: it was not made by planPositions");
  return absl::OkStatus();
}

// Source nodes: the position plan's id -> the id in `nodes`, read through the ranks.
StatusOr<std::vector<int32_t>> sourceNodes(const PositionPlan& pp, const ResolvedLayout& src, const NodeTable& nodes) {
  std::vector<int32_t> src_map(pp.nodes.size(), -1);
  for (int32_t r = 0; r < src.world(); ++r) {
    const int32_t a = pp.src_rank_node[r], b = src.rank_node[r];
    if (src_map[a] < 0 && pp.nodes.name(a) == nodes.name(b)) src_map[a] = b;
    if (src_map[a] != b)
      return absl::FailedPreconditionError(strCat("layout ", quote(src.group), ": rank ", r, " is on node ",
                                                  quote(nodes.name(b)), " but the position plan has it on ",
                                                  quote(pp.nodes.name(a))));
  }
  return src_map;
}

// Each replica's node of each position. Replicas may share a node at the same position (it then
// lands each byte once and fans it out to all of their ranks); a node at two positions would need
// the union of both positions' boxes, which the position plan does not have (the caller plans
// the stacked layout). No replica shares a node with a source rank.
StatusOr<Placement> placeReplicas(const PositionPlan& pp, const ResolvedLayout& src, const ResolvedLayout& dst,
                                  const NodeTable& nodes) {
  Placement at;
  at.W = pp.replicaWorld();
  at.P = pp.positions();
  at.R = dst.world() / at.W;
  const int32_t W = at.W, P = at.P, R = at.R;
  at.owner.assign(nodes.size(), -1);
  at.node_position.assign(nodes.size(), -1);
  at.replica_node.assign(static_cast<size_t>(R) * P, -1);
  at.sharing.assign(nodes.size(), 0);
  for (int32_t k = 0; k < R; ++k)
    for (int32_t r = 0; r < W; ++r) {
      const int32_t n = dst.rank_node[k * W + r], p = pp.rank_position[r];
      int32_t& slot = at.replica_node[static_cast<size_t>(k) * P + p];
      if (slot == n) continue;
      if (slot >= 0 || (at.owner[n] == k && at.node_position[n] != p))
        return absl::FailedPreconditionError(
            strCat("layout ", quote(dst.group), ": rank ", k * W + r, " (replica ", k, ", rank ", r, ") on node ",
                   quote(nodes.name(n)), " breaks the position pattern of the replica set (ranks spread over ",
                   "each replica's nodes alike): not a stacking of this position plan's replicas"));
      if (at.owner[n] >= 0 && at.node_position[n] != p)
        return absl::FailedPreconditionError(
            strCat("layout ", quote(dst.group), ": node ", quote(nodes.name(n)), " holds position ",
                   at.node_position[n], " of replica ", at.owner[n], " and position ", p, " of replica ", k,
                   ": replicas are composed from one replica's plan only where they share nodes at the same "
                   "positions (plan the stacked layout with makePlan instead)"));
      if (at.owner[n] < 0) {
        at.owner[n] = k;
        at.node_position[n] = p;
      }
      ++at.sharing[n];
      slot = n;
    }
  for (int32_t r = 0; r < src.world(); ++r)
    if (const int32_t k = at.owner[src.rank_node[r]]; k >= 0)
      return colocated(
          nodes.name(src.rank_node[r]), r, src.group,
          strCat("replica ", k, " of layout ", quote(dst.group), " (its ranks ", k * W, "..", (k + 1) * W - 1, ")"));
  return at;
}

// Every destination node of the position plan is a position, and every chain starts at a source node.
StatusOr<std::vector<int32_t>> positionsOf(const PositionPlan& pp, const std::vector<int32_t>& src_map) {
  const Plan& tp = pp.plan;
  std::vector<int32_t> position_of(pp.nodes.size(), -1);
  for (int32_t p = 0; p < pp.positions(); ++p) position_of[pp.position_node[p]] = p;
  for (const auto* list : {&tp.group_nodes, &tp.chain_nodes})
    for (int32_t n : *list)
      if (position_of[n] < 0)
        return absl::FailedPreconditionError(
            strCat("the position plan sends to node ", quote(pp.nodes.name(n)), ", which is no position"));
  for (const Chain& c : tp.chains)
    if (src_map[c.src_node] < 0)
      return absl::FailedPreconditionError(strCat("the position plan sends from node ",
                                                  quote(pp.nodes.name(c.src_node)), ", which holds no source rank"));
  return position_of;
}

// Cells keep their holders; their nodes get this table's ids (re-sorted where the order differs).
void composeCells(const Plan& tp, const ResolvedLayout& src, const std::vector<int32_t>& src_map, Plan* out) {
  out->cell_nodes.reserve(tp.cell_nodes.size());
  for (int32_t n : tp.cell_nodes) out->cell_nodes.push_back(src_map[n]);
  for (const SourceCell& c : out->cells) {
    auto nb = out->cell_nodes.begin() + c.nodes_begin, ne = nb + c.nodes_count;
    if (std::is_sorted(nb, ne)) continue;
    std::sort(nb, ne);
    const TensorLayout& st = src.tensors[out->tensors[c.tensor].src];
    auto hb = out->cell_holders.begin() + c.holders_begin;
    std::sort(hb, hb + c.holders_count, [&](int32_t a, int32_t b) {
      const int32_t ra = st.pieces[a].rank, rb = st.pieces[b].rank;
      const int32_t na = src.rank_node[ra], nb2 = src.rank_node[rb];
      return na != nb2 ? na < nb2 : ra < rb;
    });
  }
}

// Groups: every replica's node of each of the group's positions.
void composeGroups(const Plan& tp, const Placement& at, Plan* out) {
  out->groups = tp.groups;
  out->group_nodes.reserve(tp.group_nodes.size() * at.R);
  for (NodeGroup& g : out->groups) {
    const int32_t begin = static_cast<int32_t>(out->group_nodes.size());
    for (int32_t k = 0; k < at.R; ++k)
      for (int32_t i = g.nodes_begin; i < g.nodes_begin + g.nodes_count; ++i)
        out->group_nodes.push_back(at.nodeOf(k, tp.group_nodes[i]));
    std::sort(out->group_nodes.begin() + begin, out->group_nodes.end());
    out->group_nodes.erase(std::unique(out->group_nodes.begin() + begin, out->group_nodes.end()),
                           out->group_nodes.end());
    g.nodes_begin = begin;
    g.nodes_count = static_cast<int32_t>(out->group_nodes.size()) - begin;
  }
}

// Chains: each template chain over replica after replica, cut greedily at max_chain nodes; the
// nodes' ingress and egress, and the network's bytes and operations, counted as they are made.
void composeChains(const Plan& tp, const Placement& at, const std::vector<int32_t>& src_map, size_t node_count,
                   Plan* out) {
  PlanStats& s = out->stats;
  s.node_ingress.assign(node_count, 0);
  s.node_egress.assign(node_count, 0);
  s.node_local.assign(node_count, 0);
  const int32_t M = tp.options.max_chain;
  out->chain_nodes.reserve(tp.chain_nodes.size() * at.R);
  std::vector<int32_t> sequence;
  std::vector<int32_t> reached(node_count, -1);  // the last transfer each node is on a chain of
  for (Transfer& tr : out->transfers) {
    const int32_t begin = static_cast<int32_t>(out->chains.size());
    const int32_t t = static_cast<int32_t>(&tr - out->transfers.data());
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const Chain& tc = tp.chains[c];
      sequence.clear();
      // A node shared by replicas is on the chain once: its landing serves all of them.
      for (int32_t k = 0; k < at.R; ++k)
        for (int32_t i = tc.nodes_begin; i < tc.nodes_begin + tc.nodes_count; ++i)
          if (const int32_t n = at.nodeOf(k, tp.chain_nodes[i]); reached[n] != t) {
            reached[n] = t;
            sequence.push_back(n);
          }
      for (size_t lo = 0; lo < sequence.size(); lo += M) {
        const size_t hi = std::min(sequence.size(), lo + M);
        Chain ch{src_map[tc.src_node], tc.src_rank, static_cast<int32_t>(out->chain_nodes.size()),
                 static_cast<int32_t>(hi - lo)};
        s.node_egress[ch.src_node] += tr.bytes;
        for (size_t i = lo; i < hi; ++i) {
          out->chain_nodes.push_back(sequence[i]);
          s.node_ingress[sequence[i]] += tr.bytes;
          if (i + 1 < hi) s.node_egress[sequence[i]] += tr.bytes;  // relays to the next node
        }
        s.max_chain = std::max(s.max_chain, ch.nodes_count);
        s.network_bytes += tr.bytes * ch.nodes_count;
        s.network_ops += tr.chunks * ch.nodes_count;
        out->chains.push_back(ch);
      }
    }
    tr.chains_begin = begin;
    tr.chains_count = static_cast<int32_t>(out->chains.size()) - begin;
  }
}

// Per-node figures: a replica node does what its position does in the position plan, and a node
// shared by m replicas writes everything its position's ranks hold into m - 1 more replicas by
// local copies. No node hosts a source rank (placeReplicas), so every node's lower bound is its
// need: each fragment once per node of its group.
void composeFigures(const PositionPlan& pp, const ResolvedLayout& dst, const Placement& at, Plan* out) {
  const PlanStats& ts = pp.plan.stats;
  PlanStats& s = out->stats;
  std::vector<int64_t> position_writes(static_cast<size_t>(at.P), 0);  // bytes one replica's ranks there hold
  for (const TensorPair& t : out->tensors) {
    const TensorLayout& dt = dst.tensors[t.dst];
    for (const PieceRef& piece : dt.pieces) {
      const int64_t bytes = dt.boxes[piece.box].volume() * dt.elemBytes();
      s.bytes_needed += bytes;
      if (piece.rank < at.W) position_writes[pp.rank_position[piece.rank]] += bytes;
    }
  }
  for (int32_t n = 0; n < static_cast<int32_t>(at.sharing.size()); ++n)
    if (at.sharing[n] > 0) {
      const int32_t p = at.node_position[n];
      s.node_local[n] = ts.node_local[pp.position_node[p]] + (at.sharing[n] - 1) * position_writes[p];
    }
  for (int64_t v : s.node_local) s.local_bytes += v;
  int64_t dst_nodes = 0;
  for (int32_t m : at.sharing) dst_nodes += m > 0 ? 1 : 0;
  s.tensors = ts.tensors;
  for (const Fragment& f : out->fragments) s.network_lower_bound += f.bytes * out->groups[f.group].nodes_count;
  s.local_ops = ts.local_ops * at.R;
  s.transfers = static_cast<int64_t>(out->transfers.size());
  s.buckets = ts.buckets;
  s.fragments = static_cast<int64_t>(out->fragments.size());
  s.largest_chunk = ts.largest_chunk;
  s.max_unique_held = ts.max_unique_held;  // source-side: per source node, bytes only it holds
  s.pull_network_bytes = ts.pull_network_bytes * at.R;
  s.pull_max_ingress = ts.pull_max_ingress;       // per destination node: as its position's
  s.pull_max_egress = ts.pull_max_egress * at.R;  // per source node: once per replica
  s.gather_bytes = ts.gather_bytes;
  s.model_bytes = ts.model_bytes;
  s.broadcast_bytes = ts.model_bytes * dst_nodes;
}

}  // namespace

StatusOr<Plan> composeReplicas(const PositionPlan& pp, const ResolvedLayout& src, const ResolvedLayout& dst,
                               const NodeTable& nodes) {
  const auto start = std::chrono::steady_clock::now();
  SC_RETURN_IF_ERROR(checkComposable(pp, src, dst));
  SC_ASSIGN_OR_RETURN(const std::vector<int32_t> src_map, sourceNodes(pp, src, nodes));
  SC_ASSIGN_OR_RETURN(Placement at, placeReplicas(pp, src, dst, nodes));
  SC_ASSIGN_OR_RETURN(at.position_of, positionsOf(pp, src_map));
  const Plan& tp = pp.plan;
  Plan out;
  out.options = tp.options;
  out.tensors = tp.tensors;
  out.cells = tp.cells;
  out.cell_holders = tp.cell_holders;
  out.fragments = tp.fragments;
  out.transfers = tp.transfers;
  out.transfer_fragments = tp.transfer_fragments;
  composeCells(tp, src, src_map, &out);
  composeGroups(tp, at, &out);
  composeChains(tp, at, src_map, nodes.size(), &out);
  composeFigures(pp, dst, at, &out);
  out.stats.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return out;
}

StatusOr<ReplicaSetPlan> planReplicaSet(const v1::Layout& src, const std::vector<Replica>& replicas,
                                        const PlanOptions& options, std::shared_ptr<const PositionPlan> reuse) {
  SC_ASSIGN_OR_RETURN(SetShape shape, examine(replicas));
  ReplicaSetPlan out;
  SC_ASSIGN_OR_RETURN(out.src, resolveLayout(src, out.nodes));
  // Colocation, by name, before anything is planned.
  std::unordered_map<std::string, int32_t> src_rank_on;
  for (int32_t r = 0; r < out.src.world(); ++r) src_rank_on.try_emplace(out.nodes.name(out.src.rank_node[r]), r);
  for (size_t k = 0; k < replicas.size(); ++k)
    for (const std::string& n : shape.nodes[k])
      if (auto it = src_rank_on.find(n); it != src_rank_on.end())
        return colocated(n, it->second, out.src.group,
                         strCat(who(replicas[k]), " of replica set ", quote(replicas[k].layout.replica_set())));

  // Block-scaled fp8: the source's virtual scale tensors, derived from a replica's declarations
  // (every replica's are the same), before the positions are planned: the position plan and the
  // composed one read the same source.
  {
    NodeTable scratch = out.nodes;
    SC_ASSIGN_OR_RETURN(const ResolvedLayout declared, resolveLayout(replicas[0].layout, scratch));
    SC_RETURN_IF_ERROR(addScaleSources(out.src, declared));
  }
  const std::string src_digest = layoutDigest(src);
  if (reuse && reuse->src_digest == src_digest && reuse->replica_digest == replicaDigest(replicas[0].layout) &&
      reuse->rank_position == shape.rank_position && sameOptions(reuse->plan.options, options)) {
    out.positions = std::move(reuse);
    out.reused_positions = true;
  } else {
    SC_ASSIGN_OR_RETURN(PositionPlan planned, planPositions(out.src, out.nodes, replicas[0].layout, options));
    planned.src_digest = src_digest;
    out.positions = std::make_shared<const PositionPlan>(std::move(planned));
  }
  out.stacked = stackReplicas(replicas);
  SC_ASSIGN_OR_RETURN(out.dst, resolveLayout(out.stacked, out.nodes));
  SC_ASSIGN_OR_RETURN(out.plan, composeReplicas(*out.positions, out.src, out.dst, out.nodes));
  return out;
}

}  // namespace shardcast::planner
