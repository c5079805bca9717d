// Replica sets (planner/replicas.h): one replica planned by position and composed for 1-5 replicas
// of random layouts, executed on simulated memory against the brute-force reference; the position
// plan reused as one object across memberships; a join leaving earlier replicas' part untouched;
// stacking against a hand-written flat layout; and every error a set can have.
#include "planner/replicas.h"

#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "common/strings.h"
#include "planner/plan.h"
#include "planner/schedule.h"
#include "tests/unit/plan_simulator.h"
#include "tests/unit/reference.h"
#include "tests/unit/test_util.h"

using namespace shardcast;
using namespace shardcast::planner;
using namespace shardcast::testing;

namespace {

// Replica k of `base`: its own group and nodes ("r<k>-" + the base's node names), sometimes given
// as an explicit node list where the base has ranks_per_node (the same rank -> node pattern).
Replica makeReplica(const v1::Layout& base, int32_t k, std::mt19937& rng) {
  Replica rep{k, base};
  v1::Layout& l = rep.layout;
  l.set_group(strCat(base.replica_set().empty() ? base.group() : base.replica_set(), ".r", k));
  if (l.replica_set().empty()) l.set_replica_set(base.group());
  l.set_replica(k);
  const std::string prefix = strCat("r", k, "-");
  if (l.nodes_size() > 0) {
    for (auto& n : *l.mutable_nodes()) n = prefix + n;
  } else if (rng() % 2) {
    for (int64_t r = 0; r < worldOf(base); ++r)
      l.add_nodes(strCat(prefix, base.node_prefix(), r / base.ranks_per_node()));
    l.clear_ranks_per_node();
    l.clear_node_prefix();
  } else {
    l.set_node_prefix(prefix + base.node_prefix());
  }
  return rep;
}

std::vector<Replica> makeReplicas(const v1::Layout& base, int32_t count, std::mt19937& rng) {
  std::vector<Replica> out;
  for (int32_t k = 0; k < count; ++k) out.push_back(makeReplica(base, k, rng));
  return out;
}

PlanOptions randomOptions(std::mt19937& rng) {
  PlanOptions o;
  o.small_bytes = std::vector<int64_t>{0, 16, 64, 1 << 20}[rng() % 4];
  o.bucket_bytes = std::vector<int64_t>{1, 32, 256}[rng() % 3];
  o.chunk_bytes = std::vector<int64_t>{8, 64, 1 << 20}[rng() % 3];
  o.small_in_place_bytes = std::vector<int64_t>{0, 32, 128 << 10}[rng() % 3];
  o.max_chain = std::vector<int32_t>{1, 2, 3, 5, 64}[rng() % 5];
  return o;
}

int32_t nodeId(const NodeTable& t, const std::string& name) {
  for (int32_t i = 0; i < t.size(); ++i)
    if (t.name(i) == name) return i;
  return -1;
}

// Bytes each destination node needs (the distinct elements its ranks need), brute force.
std::map<std::string, int64_t> nodeNeeds(const v1::Layout& dst, const ResolvedLayout& r, const NodeTable& nodes) {
  std::map<std::string, int64_t> elem;
  for (const auto& t : r.tensors) elem[t.name] = t.elemBytes();
  std::set<std::tuple<int32_t, std::string, int64_t>> needed;
  for (const auto& [key, val] : referenceElements(dst))
    needed.insert({r.rank_node[std::get<0>(key)], val.first, val.second});
  std::map<std::string, int64_t> out;
  for (const auto& [node, tensor, flat] : needed) out[nodes.name(node)] += elem[tensor];
  return out;
}

// Tensors, fragments and transfers (without their chains), as text: node-free.
std::string fragmentsAndTransfers(const Plan& p) {
  std::string s;
  for (const auto& t : p.tensors) s += strCat("T", t.src, ",", t.dst, ";");
  for (const auto& f : p.fragments)
    s += strCat("F", f.box.str(), f.tensor, ",", f.cell, ",", f.group, ",", f.bytes, ";");
  for (const auto& t : p.transfers)
    s += strCat("X", t.fragments_begin, ",", t.fragments_count, ",", t.bytes, ",", t.chunks, ";");
  s += "TF" + strJoin(p.transfer_fragments, ",") + ";";
  for (const auto& g : p.groups) s += strCat("G", g.tensor, ";");
  return s;
}

// The parts of a plan that composition reuses unchanged where the source's nodes keep their
// order: the above, cells and their holders.
std::string reusedParts(const Plan& p) {
  std::string s = fragmentsAndTransfers(p);
  for (const auto& c : p.cells)
    s += strCat("C", c.box.str(), c.tensor, ",", c.holders_begin, ",", c.holders_count, ",", c.nodes_begin, ",",
                c.nodes_count, ";");
  return s + "H" + strJoin(p.cell_holders, ",") + ";";
}

// Everything in a plan, as text (to see that an object was left as it was).
std::string wholePlan(const Plan& p) {
  std::string s = reusedParts(p);
  s += "CN" + strJoin(p.cell_nodes, ",") + ";GN" + strJoin(p.group_nodes, ",") + ";CH" + strJoin(p.chain_nodes, ",");
  for (const auto& c : p.chains) s += strCat(";c", c.src_node, ",", c.src_rank, ",", c.nodes_begin, ",", c.nodes_count);
  for (const auto& g : p.groups) s += strCat(";g", g.nodes_begin, ",", g.nodes_count);
  for (const auto& t : p.transfers) s += strCat(";x", t.chains_begin, ",", t.chains_count);
  const PlanStats& st = p.stats;
  s += strCat(";S", st.bytes_needed, ",", st.network_bytes, ",", st.network_lower_bound, ",", st.local_bytes, ",",
              st.network_ops, ",", st.local_ops, ",", st.max_chain, ",", strJoin(st.node_ingress, " "), ",",
              strJoin(st.node_egress, " "), ",", strJoin(st.node_local, " "));
  return s;
}

// Per node name and transfer: where the node receives the transfer from ("src:<node>/<rank>" or
// the previous node of its chain).
std::map<std::pair<std::string, int32_t>, std::string> upstreams(const Plan& p, const NodeTable& nodes) {
  std::map<std::pair<std::string, int32_t>, std::string> out;
  for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
    const Transfer& tr = p.transfers[t];
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const Chain& ch = p.chains[c];
      std::string from = strCat("src:", nodes.name(ch.src_node), "/", ch.src_rank);
      for (int32_t i = 0; i < ch.nodes_count; ++i) {
        const std::string& n = nodes.name(p.chain_nodes[ch.nodes_begin + i]);
        out[{n, t}] = from;
        from = n;
      }
    }
  }
  return out;
}

int64_t sourceEgress(const Plan& p, const ResolvedLayout& src) {
  std::set<int32_t> src_nodes(src.rank_node.begin(), src.rank_node.end());
  int64_t out = 0;
  for (int32_t n : src_nodes) out += p.stats.node_egress[n];
  return out;
}

// Group and cell node lists sorted, cell holders sorted by (node, rank): what plan.h promises.
void checkSorted(const Plan& p, const ResolvedLayout& src) {
  for (const NodeGroup& g : p.groups) {
    const auto b = p.group_nodes.begin() + g.nodes_begin;
    CHECK(std::is_sorted(b, b + g.nodes_count));
  }
  for (const SourceCell& c : p.cells) {
    const auto b = p.cell_nodes.begin() + c.nodes_begin;
    CHECK(std::adjacent_find(b, b + c.nodes_count, std::greater_equal<int32_t>()) == b + c.nodes_count);
    const TensorLayout& st = src.tensors[p.tensors[c.tensor].src];
    std::vector<std::pair<int32_t, int32_t>> holders;
    for (int32_t i = 0; i < c.holders_count; ++i) {
      const int32_t rank = st.pieces[p.cell_holders[c.holders_begin + i]].rank;
      holders.emplace_back(src.rank_node[rank], rank);
    }
    CHECK(std::is_sorted(holders.begin(), holders.end()));
  }
}

// Every check of one composed plan: exact delivery on simulated memory, per-node ingress equal to
// each node's need, relays never sending more than they receive, the source's egress as the
// composition rule says, reuse of the position plan's parts, and the figures a flat plan of the
// stacked layout has.
void checkComposed(const v1::Layout& src_proto, const ReplicaSetPlan& set, int32_t replicas) {
  const Plan& plan = set.plan;
  const PositionPlan& pp = *set.positions;
  INFO("replicas: " << replicas << ", max_chain " << plan.options.max_chain);
  const SimResult r = simulate(plan, set.src, set.dst, src_proto, set.stacked);
  INFO(r.first_problem);
  CHECK(r.wrong_elements == 0);
  CHECK(r.duplicate_arrivals == 0);
  CHECK(r.needless_arrivals == 0);
  CHECK(r.missing_arrivals == 0);
  CHECK(r.bad_sources == 0);
  CHECK(plan.stats.network_bytes == r.lower_bound_bytes);
  CHECK(plan.stats.network_lower_bound == r.lower_bound_bytes);
  CHECK(plan.stats.bytes_needed == r.bytes_needed);
  CHECK(plan.local_sources.empty());

  const auto needs = nodeNeeds(set.stacked, set.dst, set.nodes);
  std::set<int32_t> src_nodes(set.src.rank_node.begin(), set.src.rank_node.end());
  int64_t in = 0, out = 0;
  for (int32_t n = 0; n < set.nodes.size(); ++n) {
    const int64_t ingress = plan.stats.node_ingress[n], egress = plan.stats.node_egress[n];
    in += ingress;
    out += egress;
    if (src_nodes.count(n)) {
      CHECK(ingress == 0);
      continue;
    }
    INFO("node " << set.nodes.name(n));
    const auto it = needs.find(set.nodes.name(n));
    CHECK(ingress == (it == needs.end() ? 0 : it->second));
    CHECK(egress <= ingress);
  }
  CHECK(in == plan.stats.network_bytes);
  CHECK(out == plan.stats.network_bytes);

  // The source sends each template chain once per max_chain distinct nodes of its R copies (a
  // node that replicas share at a position is on it once).
  const int32_t W = pp.replicaWorld();
  std::map<std::pair<int32_t, int32_t>, int32_t> node_of;  // (replica, position) -> node
  for (int32_t k = 0; k < replicas; ++k)
    for (int32_t rank = 0; rank < W; ++rank) node_of[{k, pp.rank_position[rank]}] = set.dst.rank_node[k * W + rank];
  std::map<int32_t, int32_t> position_of;  // the position plan's node -> position
  for (int32_t p = 0; p < pp.positions(); ++p) position_of[pp.position_node[p]] = p;
  const bool shared =
      static_cast<int32_t>(std::set<int32_t>(set.dst.rank_node.begin(), set.dst.rank_node.end()).size()) <
      replicas * pp.positions();
  int64_t expected_source = 0;
  for (const Transfer& tr : pp.plan.transfers)
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const Chain& tc = pp.plan.chains[c];
      std::set<int32_t> distinct;
      for (int32_t k = 0; k < replicas; ++k)
        for (int32_t i = tc.nodes_begin; i < tc.nodes_begin + tc.nodes_count; ++i)
          distinct.insert(node_of[{k, position_of[pp.plan.chain_nodes[i]]}]);
      const int64_t len = static_cast<int64_t>(distinct.size());
      expected_source += (len + plan.options.max_chain - 1) / plan.options.max_chain * tr.bytes;
    }
  CHECK(sourceEgress(plan, set.src) == expected_source);
  CHECK(plan.stats.max_chain <= plan.options.max_chain);
  if (!shared && plan.options.max_chain >= replicas * pp.positions()) {
    // Every template chain fits one composed chain: the source sends what it sends for one replica.
    for (int32_t n : src_nodes) {
      const int32_t pn = nodeId(pp.nodes, set.nodes.name(n));
      CHECK(plan.stats.node_egress[n] == pp.plan.stats.node_egress[pn]);
    }
  }

  CHECK(reusedParts(plan) == reusedParts(pp.plan));
  CHECK(plan.chains.size() >= pp.plan.chains.size());
  checkSorted(plan, set.src);

  // A flat plan of the stacked layout: the same figures wherever they do not depend on routing
  // (where replicas share nodes, a flat plan cuts fragments by all of a node's ranks, so only the
  // network's and the model's figures compare).
  auto flat = makePlan(set.src, set.dst, set.nodes, plan.options);
  REQUIRE(flat.ok());
  const PlanStats &a = plan.stats, &b = flat->stats;
  CHECK(a.network_bytes == b.network_bytes);
  CHECK(a.network_lower_bound == b.network_lower_bound);
  CHECK(a.bytes_needed == b.bytes_needed);
  CHECK(a.model_bytes == b.model_bytes);
  CHECK(a.broadcast_bytes == b.broadcast_bytes);
  if (shared) return;
  CHECK(a.local_bytes == b.local_bytes);
  CHECK(a.local_ops == b.local_ops);
  CHECK(a.node_local == b.node_local);
  CHECK(a.fragments == b.fragments);
  CHECK(a.transfers == b.transfers);
  CHECK(a.pull_network_bytes == b.pull_network_bytes);
  CHECK(std::abs(a.pull_max_ingress - b.pull_max_ingress) <= 1e-6 * (1 + b.pull_max_ingress));
  CHECK(std::abs(a.pull_max_egress - b.pull_max_egress) <= 1e-6 * (1 + b.pull_max_egress));
  CHECK(a.model_bytes == b.model_bytes);
  CHECK(a.gather_bytes == b.gather_bytes);
  CHECK(a.broadcast_bytes == b.broadcast_bytes);
  CHECK(a.max_unique_held == b.max_unique_held);
  CHECK(a.largest_chunk == b.largest_chunk);
}

// For R = 1..5: plans the set (the position plan taken from the previous membership), checks it,
// and checks that replica R joining left replicas 0..R-1's part of the plan as it was.
void checkMemberships(const v1::Layout& src, const v1::Layout& base, const PlanOptions& opts, std::mt19937& rng) {
  INFO("src: " << src.ShortDebugString());
  INFO("replica: " << base.ShortDebugString());
  const std::vector<Replica> all = makeReplicas(base, 5, rng);
  std::shared_ptr<const PositionPlan> positions;
  std::string snapshot;
  std::optional<ReplicaSetPlan> previous;
  for (int32_t count = 1; count <= 5; ++count) {
    const std::vector<Replica> replicas(all.begin(), all.begin() + count);
    auto set = planReplicaSet(src, replicas, opts, positions);
    INFO((set.ok() ? "" : std::string(set.status().message())));
    REQUIRE(set.ok());
    if (positions) {
      CHECK(set->reused_positions);
      CHECK(set->positions.get() == positions.get());  // one object, not a copy
      CHECK(wholePlan(positions->plan) == snapshot);   // and composing left it as it was
    } else {
      positions = set->positions;
      snapshot = wholePlan(positions->plan);
    }
    checkComposed(src, *set, count);
    if (previous) {
      // Replica count-1 joined: every node of replicas 0..count-2 receives every transfer from the
      // same upstream as before, and ingress and local work of those nodes are unchanged.
      const auto before = upstreams(previous->plan, previous->nodes), after = upstreams(set->plan, set->nodes);
      for (const auto& [key, from] : before) {
        INFO("node " << key.first << ", transfer " << key.second);
        const auto it = after.find(key);
        REQUIRE(it != after.end());
        CHECK(it->second == from);
      }
      for (int32_t n = 0; n < previous->nodes.size(); ++n) {
        const int32_t m = nodeId(set->nodes, previous->nodes.name(n));
        REQUIRE(m >= 0);
        CHECK(set->plan.stats.node_ingress[m] == previous->plan.stats.node_ingress[n]);
        CHECK(set->plan.stats.node_local[m] == previous->plan.stats.node_local[n]);
      }
    }
    previous = std::move(*set);
  }
}

Replica fromJson(int32_t id, const std::string& json) { return {id, layoutFromJson(json)}; }

const char* kSmallSource = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["t0","t1"],"tensors":[
  {"name":"w","shape":[4,2],"dtype":"bfloat16","placements":[{"shard":{"dim":1}}]},
  {"name":"e","shape":[4,2],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";

std::string smallReplica(int32_t id, const std::string& nodes, const std::string& extra = "") {
  return strCat(R"({"group":"rollout.r)", id, R"(","replica_set":"rollout","replica":)", id,
                R"(,"mesh":{"shape":[2]},)", nodes, R"(,"tensors":[
  {"name":"w","shape":[4,2],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
  {"name":"e","shape":[4,2],"dtype":"float32"}])",
                extra, "}");
}

std::string setError(const std::vector<Replica>& replicas) { return std::string(checkReplicaSet(replicas).message()); }

}  // namespace

TEST_CASE("replica sets of random layouts: composed plans are exact for 1 to 5 replicas", "[planner][replicas]") {
  std::mt19937 rng(20261207);
  for (int it = 0; it < 250; ++it) {
    const auto [src, base] = randomLayoutPair(rng);
    checkMemberships(src, base, randomOptions(rng), rng);
  }
}

TEST_CASE("replica sets with fused buffers: composed plans are exact", "[planner][replicas]") {
  std::mt19937 rng(41);
  for (int it = 0; it < 80; ++it) {
    const auto [src, base] = randomFusedLayoutPair(rng);
    checkMemberships(src, base, randomOptions(rng), rng);
  }
}

TEST_CASE("replica sets sharing nodes at the same positions: composed plans are exact", "[planner][replicas]") {
  // Data-parallel engines on one machine: replica k takes, position by position, the node of an
  // earlier replica or a node of its own. Each shared node must receive every byte once and write
  // it to every replica's ranks there.
  std::mt19937 rng(20261203);
  int sharing_sets = 0;
  for (int it = 0; it < 200; ++it) {
    const auto [src, base] = randomLayoutPair(rng);
    const PlanOptions opts = randomOptions(rng);
    INFO("src: " << src.ShortDebugString());
    INFO("replica: " << base.ShortDebugString());
    auto positions_of = rankPositions(base);
    REQUIRE(positions_of.ok());
    const int32_t positions = *std::max_element(positions_of->begin(), positions_of->end()) + 1;
    std::vector<std::vector<std::string>> node_names;  // per replica, per position
    std::vector<Replica> replicas;
    for (int32_t k = 0; k < 4; ++k) {
      std::vector<std::string> names;
      for (int32_t p = 0; p < positions; ++p)
        names.push_back(k > 0 && rng() % 3 ? node_names[rng() % k][p] : strCat("r", k, "-p", p));
      Replica rep = makeReplica(base, k, rng);
      rep.layout.clear_nodes();
      rep.layout.clear_ranks_per_node();
      rep.layout.clear_node_prefix();
      for (int32_t p : *positions_of) rep.layout.add_nodes(names[p]);
      node_names.push_back(std::move(names));
      replicas.push_back(std::move(rep));
    }
    std::shared_ptr<const PositionPlan> reuse;
    for (int32_t count = 1; count <= 4; ++count) {
      auto set = planReplicaSet(src, std::vector<Replica>(replicas.begin(), replicas.begin() + count), opts, reuse);
      INFO((set.ok() ? "" : std::string(set.status().message())));
      REQUIRE(set.ok());
      reuse = set->positions;
      checkComposed(src, *set, count);
      std::set<int32_t> distinct(set->dst.rank_node.begin(), set->dst.rank_node.end());
      if (static_cast<int32_t>(distinct.size()) < count * positions) ++sharing_sets;
      // Each node at most once per transfer.
      for (const Transfer& tr : set->plan.transfers) {
        std::set<int32_t> reached;
        for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c)
          for (int32_t i = 0; i < set->plan.chains[c].nodes_count; ++i)
            CHECK(reached.insert(set->plan.chain_nodes[set->plan.chains[c].nodes_begin + i]).second);
      }
    }
  }
  CHECK(sharing_sets > 200);  // most sets shared a node
}

TEST_CASE("replica sets: with long enough chains source egress does not grow with the replicas",
          "[planner][replicas]") {
  std::mt19937 rng(9);
  for (int it = 0; it < 150; ++it) {
    const auto [src, base] = randomLayoutPair(rng);
    PlanOptions opts = randomOptions(rng);
    opts.max_chain = 64;  // >= 5 replicas x 12 positions
    const std::vector<Replica> all = makeReplicas(base, 5, rng);
    int64_t one = -1;
    for (int32_t count = 1; count <= 5; ++count) {
      auto set = planReplicaSet(src, std::vector<Replica>(all.begin(), all.begin() + count), opts);
      REQUIRE(set.ok());
      const int64_t egress = sourceEgress(set->plan, set->src);
      if (one < 0) one = egress;
      CHECK(egress == one);
      CHECK(set->plan.stats.network_bytes == count * set->positions->plan.stats.network_bytes);
    }
  }
}

TEST_CASE("replica sets: one position plan composed twice, for 2 and for 3 replicas", "[planner][replicas]") {
  std::mt19937 rng(3);
  for (int it = 0; it < 40; ++it) {
    const auto [src_proto, base] = randomLayoutPair(rng);
    INFO("src: " << src_proto.ShortDebugString());
    INFO("replica: " << base.ShortDebugString());
    const std::vector<Replica> all = makeReplicas(base, 3, rng);
    NodeTable nodes;
    auto src = resolveLayout(src_proto, nodes);
    REQUIRE(src.ok());
    auto positions = planPositions(*src, nodes, all[1].layout, randomOptions(rng));  // any replica plans the same
    REQUIRE(positions.ok());
    const std::string before = wholePlan(positions->plan);
    for (int32_t count : {2, 3}) {
      // Composed once into the position plan's own table's order, once into a table that has the
      // source's nodes in reverse order (cells' node lists are then re-sorted).
      for (bool reversed : {false, true}) {
        NodeTable table = reversed ? NodeTable{} : nodes;
        if (reversed)
          for (int n = 3; n >= 0; --n) table.intern(strCat("n", n));
        auto s = resolveLayout(src_proto, table);
        const v1::Layout stacked = stackReplicas(std::vector<Replica>(all.begin(), all.begin() + count));
        auto dst = resolveLayout(stacked, table);
        REQUIRE(s.ok());
        REQUIRE(dst.ok());
        auto plan = composeReplicas(*positions, *s, *dst, table);
        INFO((plan.ok() ? "" : std::string(plan.status().message())));
        REQUIRE(plan.ok());
        const SimResult r = simulate(*plan, *s, *dst, src_proto, stacked);
        INFO(r.first_problem);
        CHECK(r.wrong_elements + r.duplicate_arrivals + r.needless_arrivals + r.missing_arrivals + r.bad_sources == 0);
        CHECK(plan->stats.network_bytes == r.lower_bound_bytes);
        checkSorted(*plan, *s);
        CHECK(fragmentsAndTransfers(*plan) == fragmentsAndTransfers(positions->plan));
        if (!reversed) CHECK(reusedParts(*plan) == reusedParts(positions->plan));
      }
    }
    CHECK(wholePlan(positions->plan) == before);  // the one object, composed from four times
    CHECK(positionLayout(all[0].layout).SerializeAsString() == positionLayout(all[2].layout).SerializeAsString());
  }
}

TEST_CASE("replica sets: a leave, then a join, compose from the cached position plan", "[planner][replicas]") {
  std::mt19937 rng(12);
  const auto [src, base] = randomLayoutPair(rng);
  const std::vector<Replica> all = makeReplicas(base, 4, rng);
  auto first = planReplicaSet(src, all);
  REQUIRE(first.ok());
  CHECK_FALSE(first->reused_positions);
  for (const std::vector<int>& ids : {std::vector<int>{0, 2, 3}, std::vector<int>{0, 2, 3, 1}, std::vector<int>{3}}) {
    std::vector<Replica> members;
    for (int id : ids) members.push_back(all[id]);
    auto set = planReplicaSet(src, members, {}, first->positions);
    REQUIRE(set.ok());
    CHECK(set->reused_positions);
    checkComposed(src, *set, static_cast<int32_t>(members.size()));
  }
  // Other options or another source: planned afresh.
  PlanOptions other;
  other.max_chain = 2;
  auto replanned = planReplicaSet(src, all, other, first->positions);
  REQUIRE(replanned.ok());
  CHECK_FALSE(replanned->reused_positions);
}

TEST_CASE("replica sets of block-scaled fp8 replicas compose from one position plan, scales derived",
          "[planner][replicas][fp8]") {
  // A bf16 trainer (rows over two nodes, cutting blocks) into fp8 replicas (TP=2 by columns, the
  // 128-column blocks cut between the ranks): the source gets its virtual scale tensor, the
  // positions are planned once, and every membership moves what the flat plan of the same
  // stacked layout moves.
  const v1::Layout src = layoutFromJson(R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["t0","t1"],"tensors":[
    {"name":"w","shape":[300,320],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}]})");
  const auto replica = [](int32_t k) {
    return fromJson(k, strCat(R"({"group":"rollout.r)", k, R"(","replica_set":"rollout","replica":)", k,
                              R"(,"mesh":{"shape":[2]},"nodes":["r)", k, R"(","r)", k, R"("],"tensors":[
      {"name":"w","shape":[300,320],"dtype":"float8_e4m3fn","placements":[{"shard":{"dim":1}}],
       "block_scale":{"scale":"w_scale_inv"}}]})"));
  };
  auto three = planReplicaSet(src, {replica(0), replica(1), replica(2)});
  INFO((three.ok() ? "" : std::string(three.status().message())));
  REQUIRE(three.ok());
  const TensorLayout* scales = three->src.find("w_scale_inv");
  REQUIRE(scales != nullptr);
  CHECK(scales->scale_of == three->src.tensor_index.at("w"));
  CHECK_FALSE(scales->split_blocks.empty());  // 150-row shards cut the second row of blocks
  for (const std::vector<int32_t>& ids : {std::vector<int32_t>{0, 2}, std::vector<int32_t>{1}}) {
    std::vector<Replica> members;
    for (const int32_t id : ids) members.push_back(replica(id));
    auto set = planReplicaSet(src, members, {}, three->positions);
    REQUIRE(set.ok());
    CHECK(set->reused_positions);
    CHECK(set->plan.transfers.size() == three->plan.transfers.size());
    auto flat = makeSchedule(src, stackReplicas(members), 1 << 20, 1 << 20, true);
    REQUIRE(flat.ok());
    CHECK(set->plan.stats.network_bytes == flat->plan.stats.network_bytes);
    CHECK(set->plan.stats.bytes_needed == flat->plan.stats.bytes_needed);
  }
}

TEST_CASE("a seed replica's fp8 bytes and scales are copied as they are, never quantised again",
          "[planner][replicas][fp8]") {
  // A catch-up reads replica 0 (fp8 in 128 x 128 blocks, its scales beside it) into replica 1.
  const auto replica = [](int32_t k, const std::string& node, const std::string& block) {
    return layoutFromJson(strCat(R"({"group":"rollout.r)", k, R"(","replica_set":"rollout","replica":)", k,
                                 R"(,"mesh":{"shape":[2]},"nodes":[")", node, R"(",")", node, R"("],"tensors":[
      {"name":"w","shape":[300,320],"dtype":"float8_e4m3fn","placements":[{"shard":{"dim":1}}],
       "block_scale":{"block":)",
                                 block, R"(,"scale":"w_scale_inv"}}]})"));
  };
  auto copy = makeSchedule(replica(0, "a", "[128,128]"), replica(1, "b", "[128,128]"), 1 << 20, 1 << 20, true);
  INFO((copy.ok() ? "" : std::string(copy.status().message())));
  REQUIRE(copy.ok());
  const TensorLayout* scales = copy->src.find("w_scale_inv");
  REQUIRE(scales != nullptr);
  CHECK_FALSE(scales->virtual_scale);  // the seed's own buffer, read as it is
  for (const auto& pair : copy->plan.tensors)
    CHECK_FALSE(computedFrom(copy->src.tensors[pair.src], copy->dst.tensors[pair.dst]));
  // The fp8 bytes, and the 3 x 3 scales once to the node (both ranks hold block column 1).
  CHECK(copy->plan.stats.network_bytes == 300 * 320 + 3 * 3 * 4);
  // From a bf16 trainer the same destination is computed.
  const v1::Layout trainer = layoutFromJson(R"({"group":"trainer","mesh":{"shape":[1]},"nodes":["t"],"tensors":[
    {"name":"w","shape":[300,320],"dtype":"bfloat16"}]})");
  auto quantised = makeSchedule(trainer, replica(1, "b", "[128,128]"), 1 << 20, 1 << 20, true);
  REQUIRE(quantised.ok());
  CHECK(quantised->src.find("w_scale_inv")->virtual_scale);
  // Its scales under another name: refused, naming both.
  auto other_name = replica(0, "a", "[128,128]");
  other_name.mutable_tensors(0)->mutable_block_scale()->set_scale("w_scale");
  auto named = makeSchedule(other_name, replica(1, "b", "[128,128]"), 1 << 20, 1 << 20, true);
  REQUIRE_FALSE(named.ok());
  CHECK_THAT(std::string(named.status().message()), Catch::Contains("\"w_scale\"") &&
                                                        Catch::Contains("\"w_scale_inv\"") &&
                                                        Catch::Contains("give both the same scale name"));
  // A seed holding it in other blocks: refused, naming both.
  auto other = makeSchedule(replica(0, "a", "[64,64]"), replica(1, "b", "[128,128]"), 1 << 20, 1 << 20, true);
  REQUIRE_FALSE(other.ok());
  CHECK_THAT(std::string(other.status().message()),
             Catch::Contains("[64, 64]") && Catch::Contains("[128, 128]") && Catch::Contains("copied as they are"));
}

TEST_CASE("replica sets: stackReplicas equals the hand-written flat layout", "[planner][replicas]") {
  const std::string tensors = R"(,"tensors":[
    {"name":"w","shape":[4,2],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"e","shape":[4,2],"dtype":"float32","pieces":[
      {"rank":1,"offsets":[0,0],"sizes":[2,2]},{"ranks":[0,1],"offsets":[2,0],"sizes":[2,2]}]},
    {"name":"n","shape":[3],"dtype":"float32"},
    {"name":"q","shape":[2,2],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"k","shape":[2,2],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}],
    "fused":[{"name":"qk","dim":0,"tensors":["q","k"]}]})";
  const std::vector<Replica> replicas = {
      fromJson(0, R"({"group":"rollout.r0","replica_set":"rollout","replica":0,"mesh":{"shape":[2],"dim_names":["tp"]},
                  "ranks_per_node":2,"node_prefix":"r0-")" +
                      tensors),
      fromJson(1, R"({"group":"rollout.r1","replica_set":"rollout","replica":1,"mesh":{"shape":[2],"dim_names":["tp"]},
                  "nodes":["b","b"])" +
                      tensors)};
  REQUIRE(checkReplicaSet(replicas).ok());
  CHECK(replicaDigest(replicas[0].layout) == replicaDigest(replicas[1].layout));
  CHECK(layoutDigest(replicas[0].layout) != layoutDigest(replicas[1].layout));

  const v1::Layout expected = layoutFromJson(R"({"group":"rollout","mesh":{"shape":[2,2],"dim_names":["replica","tp"]},
    "nodes":["r0-0","r0-0","b","b"],"tensors":[
    {"name":"w","shape":[4,2],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
    {"name":"e","shape":[4,2],"dtype":"float32","pieces":[
      {"ranks":[1,3],"offsets":[0,0],"sizes":[2,2]},{"ranks":[0,1,2,3],"offsets":[2,0],"sizes":[2,2]}]},
    {"name":"n","shape":[3],"dtype":"float32"},
    {"name":"q","shape":[2,2],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
    {"name":"k","shape":[2,2],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":0}}]}],
    "fused":[{"name":"qk","dim":0,"tensors":["q","k"]}]})");
  const v1::Layout stacked = stackReplicas(replicas);
  CHECK(stacked.ShortDebugString() == expected.ShortDebugString());

  // One replica stacks to itself apart from the leading mesh dim.
  const v1::Layout alone = stackReplicas({replicas[1]});
  CHECK(alone.mesh().shape_size() == 2);
  CHECK(alone.tensors(1).pieces(0).rank() == 1);
  CHECK(alone.tensors(1).pieces(0).ranks_size() == 0);

  // Positions: both replicas give the same position layout, its nodes named by position.
  const v1::Layout p0 = positionLayout(replicas[0].layout), p1 = positionLayout(replicas[1].layout);
  CHECK(p0.SerializeAsString() == p1.SerializeAsString());
  CHECK(p0.group() == "rollout");
  REQUIRE(p0.nodes_size() == 2);
  CHECK(p0.nodes(0) == "@replica-position-0");
  CHECK(p0.nodes(1) == "@replica-position-0");
  CHECK(p0.replica_set().empty());

  // The stacked layout holds what each replica holds, rank k x W + r for replica k's rank r.
  const ElementMap flat = referenceElements(stacked);
  ElementMap shifted;
  for (int32_t k = 0; k < 2; ++k)
    for (const auto& [key, val] : referenceElements(replicas[k].layout))
      shifted[{std::get<0>(key) + 2 * k, std::get<1>(key), std::get<2>(key)}] = val;
  CHECK(flat == shifted);

  // And the plan for the set delivers it.
  const v1::Layout src = layoutFromJson(R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["t0","t1"],"tensors":[
    {"name":"w","shape":[4,2],"dtype":"bfloat16","placements":[{"shard":{"dim":1}}]},
    {"name":"e","shape":[4,2],"dtype":"float32","placements":[{"shard":{"dim":0}}]},
    {"name":"n","shape":[3],"dtype":"float32"},
    {"name":"q","shape":[2,2],"dtype":"bfloat16"},{"name":"k","shape":[2,2],"dtype":"bfloat16"}]})");
  auto set = planReplicaSet(src, replicas);
  REQUIRE(set.ok());
  checkComposed(src, *set, 2);
}

TEST_CASE("replica sets: the stacked layout of random replicas holds what each replica holds", "[planner][replicas]") {
  std::mt19937 rng(17);
  for (int it = 0; it < 100; ++it) {
    const auto [src, base] = randomLayoutPair(rng);
    const int32_t count = 1 + static_cast<int32_t>(rng() % 4);
    const std::vector<Replica> replicas = makeReplicas(base, count, rng);
    REQUIRE(checkReplicaSet(replicas).ok());
    for (const Replica& rep : replicas) {
      v1::Layout cleared = rep.layout;
      cleared.clear_group();
      cleared.clear_nodes();
      cleared.clear_ranks_per_node();
      cleared.clear_node_prefix();
      cleared.clear_replica_set();
      cleared.clear_replica();
      CHECK(replicaDigest(rep.layout) == layoutDigest(cleared));
    }
    const v1::Layout stacked = stackReplicas(replicas);
    NodeTable nodes;
    auto resolved = resolveLayout(stacked, nodes);
    INFO(stacked.ShortDebugString());
    REQUIRE(resolved.ok());
    const int64_t world = worldOf(base);
    ElementMap shifted;
    for (int32_t k = 0; k < count; ++k)
      for (const auto& [key, val] : referenceElements(replicas[k].layout))
        shifted[{static_cast<int32_t>(std::get<0>(key) + k * world), std::get<1>(key), std::get<2>(key)}] = val;
    CHECK(referenceElements(stacked) == shifted);
    std::string duplicate;
    CHECK(resolvedElements(*resolved, &duplicate) == shifted);
    for (int32_t k = 0; k < count; ++k)
      for (int64_t r = 0; r < world; ++r) {
        NodeTable own;
        auto one = resolveLayout(replicas[k].layout, own);
        REQUIRE(one.ok());
        CHECK(nodes.name(resolved->rank_node[k * world + r]) == own.name(one->rank_node[r]));
      }
  }
}

TEST_CASE("replica sets: mismatched layouts are named with what differs", "[planner][replicas][validation]") {
  const std::string nodes0 = R"("ranks_per_node":2,"node_prefix":"a-")", nodes1 = R"("nodes":["b","b"])";
  const Replica r0 = fromJson(0, smallReplica(0, nodes0));
  {
    Replica r1 = fromJson(1, smallReplica(1, nodes1));
    r1.layout.mutable_tensors(0)->set_shape(0, 8);
    CHECK_THAT(setError({r0, r1}), Catch::Contains("replica 1 (group \"rollout.r1\")") &&
                                       Catch::Contains("differs from replica 0 (group \"rollout.r0\")") &&
                                       Catch::Contains("tensor \"w\": shape [8, 2] vs [4, 2]"));
  }
  {
    Replica r1 = fromJson(1, smallReplica(1, nodes1));
    r1.layout.mutable_tensors(0)->mutable_placements(0)->mutable_replicate();
    CHECK_THAT(setError({r0, r1}), Catch::Contains("tensor \"w\": placements"));
  }
  {
    Replica r1 = fromJson(1, smallReplica(1, nodes1));
    r1.layout.mutable_tensors(1)->set_dtype("bfloat16");
    CHECK_THAT(setError({r0, r1}), Catch::Contains("tensor \"e\": dtype \"bfloat16\" vs \"float32\""));
  }
  {
    Replica r1 = fromJson(1, smallReplica(1, R"("nodes":["b","b","b","b"])"));
    r1.layout.mutable_mesh()->set_shape(0, 4);
    CHECK_THAT(setError({r0, r1}), Catch::Contains("mesh [4] vs [2]"));
  }
  {
    Replica r1 = fromJson(1, smallReplica(1, nodes1));
    r1.layout.mutable_tensors()->RemoveLast();
    CHECK_THAT(setError({r0, r1}), Catch::Contains("1 tensors vs 2"));
  }
  {
    Replica r1 = fromJson(1, smallReplica(1, nodes1, R"(,"fused":[{"name":"we","dim":0,"tensors":["w","e"]}])"));
    CHECK_THAT(setError({r0, r1}), Catch::Contains("1 fused buffers vs 0"));
  }
}

namespace {

// xxHash64's stripe round, and its inverse in the lane: acc' = rotl(acc + lane * P2, 31) * P1 is a
// bijection in `lane` for any acc, which is what makes crafted collisions cheap.
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL;
uint64_t rotl(uint64_t x, int r) { return x << r | x >> (64 - r); }
uint64_t inverseOf(uint64_t odd) {  // mod 2^64, by Newton's iteration
  uint64_t inv = odd;
  for (int i = 0; i < 6; ++i) inv *= 2 - odd * inv;
  return inv;
}
uint64_t laneAt(const std::string& bytes, size_t at) {
  uint64_t v = 0;
  for (int b = 7; b >= 0; --b) v = v << 8 | static_cast<unsigned char>(bytes[at + static_cast<size_t>(b)]);
  return v;
}

// The four accumulators (seed 0) after the first `stripes` 32-byte stripes of `bytes`.
std::array<uint64_t, 4> stateAfter(const std::string& bytes, size_t stripes) {
  std::array<uint64_t, 4> acc = {kP1 + kP2, kP2, 0, 0 - kP1};
  for (size_t s = 0; s < stripes; ++s)
    for (size_t j = 0; j < 4; ++j) acc[j] = rotl(acc[j] + laneAt(bytes, 32 * s + 8 * j) * kP2, 31) * kP1;
  return acc;
}

// `bytes` with stripes k and k + 1 replaced so that xxHash64 gives the same digest: stripe k
// becomes `other` (32 bytes), stripe k + 1 is solved to bring the accumulators back to where
// `bytes` has them after it. The length and everything else stay, so the digests are equal.
std::string collidingBytes(const std::string& bytes, size_t k, const std::string& other) {
  std::string out = bytes;
  out.replace(32 * k, 32, other);
  const std::array<uint64_t, 4> mine = stateAfter(out, k + 1), target = stateAfter(bytes, k + 2);
  for (size_t j = 0; j < 4; ++j) {
    const uint64_t x = target[j] * inverseOf(kP1), unrotated = x >> 31 | x << 33;
    uint64_t lane = (unrotated - mine[j]) * inverseOf(kP2);
    for (size_t b = 0; b < 8; ++b, lane >>= 8) out[32 * (k + 1) + 8 * j + b] = static_cast<char>(lane & 0xff);
  }
  return out;
}

}  // namespace

TEST_CASE("replica sets: a replica crafted to collide with the first's digest is refused (bytes are compared)",
          "[planner][replicas][validation][security]") {
  // Replica 1 differs from replica 0 only in one tensor's name, chosen so that their template
  // digests (xxHash64, docs/security.md) are equal: were the set checked by digest, replica 1
  // would be written as replica 0's layout says.
  const std::string name(160, 'a');
  const auto replica = [&](int32_t id, const std::string& tensor) {
    Replica r = fromJson(id, strCat(R"({"group":"rollout.r)", id, R"(","replica_set":"rollout","replica":)", id,
                                    R"(,"mesh":{"shape":[2]},"nodes":["n)", id, R"(","n)", id, R"("],"tensors":[
                                    {"name":"w","shape":[8,4],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})"));
    v1::Tensor* t = r.layout.add_tensors();
    t->set_name(tensor);
    t->set_dtype("float32");
    t->add_shape(4);
    return r;
  };
  const Replica first = replica(0, name);
  const std::string bytes = replicaBytes(first.layout);
  const size_t at = bytes.find(name);
  REQUIRE(at != std::string::npos);
  const size_t k = (at + 31) / 32;  // the first whole stripe inside the name
  REQUIRE(32 * (k + 2) <= at + name.size());
  const std::string crafted = collidingBytes(bytes, k, std::string(32, 'b'));
  REQUIRE(crafted != bytes);
  const Replica second = replica(1, crafted.substr(at, name.size()));
  REQUIRE(replicaBytes(second.layout) == crafted);
  REQUIRE(replicaDigest(second.layout) == replicaDigest(first.layout));  // the collision is real

  const Status refused = checkReplicaSet({first, second});
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(std::string(refused.message()),
             Catch::Contains("replica 1 (group \"rollout.r1\")") && Catch::Contains("differs from replica 0"));
  CHECK(checkReplicaSet({first, replica(1, name)}).ok());
}

TEST_CASE("replica sets: ids, groups, set names and nodes are checked", "[planner][replicas][validation]") {
  const Replica r0 = fromJson(0, smallReplica(0, R"("ranks_per_node":2,"node_prefix":"a-")"));
  const Replica r1 = fromJson(1, smallReplica(1, R"("nodes":["b","b"])"));
  CHECK(checkReplicaSet({r0, r1}).ok());
  CHECK_THAT(setError({}), Catch::Contains("at least one replica"));
  {
    Replica dup = fromJson(1, smallReplica(1, R"("nodes":["c","c"])"));
    dup.layout.set_group("rollout.other");
    CHECK_THAT(setError({r0, r1, dup}), Catch::Contains("replica id 1 is given twice") &&
                                            Catch::Contains("\"rollout.r1\" and \"rollout.other\""));
  }
  {
    Replica bad = r1;
    bad.id = 2;
    CHECK_THAT(setError({r0, bad}), Catch::Contains("replica 2 (group \"rollout.r1\"): its layout says replica 1"));
  }
  {
    Replica same_group = fromJson(2, smallReplica(2, R"("nodes":["c","c"])"));
    same_group.layout.set_group("rollout.r1");
    CHECK_THAT(setError({r0, r1, same_group}), Catch::Contains("group \"rollout.r1\" is given for replica 1"));
  }
  {
    Replica other_set = r1;
    other_set.layout.set_replica_set("serve");
    CHECK_THAT(setError({r0, other_set}), Catch::Contains("replica_set \"serve\" but replica 0"));
    other_set.layout.clear_replica_set();
    CHECK_THAT(setError({r0, other_set}),
               Catch::Contains("replica 1 (group \"rollout.r1\"): its layout has no replica_set"));
  }
  {
    // Replicas may share nodes (engines on one machine).
    Replica shared = fromJson(1, smallReplica(1, R"("nodes":["a-0","a-0"])"));
    CHECK(checkReplicaSet({r0, shared}).ok());
  }
  {
    // Replica 0 has both ranks on one node, this one spreads them over two: not the same pattern.
    Replica spread = fromJson(1, smallReplica(1, R"("nodes":["b","c"])"));
    CHECK_THAT(setError({r0, spread}),
               Catch::Contains("rank 1 is on node \"c\" (position 1) but replica 0 (group \"rollout.r0\") has rank 1 "
                               "at position 0") &&
                   Catch::Contains("spread its ranks over its nodes alike"));
  }
  {
    Replica reserved = fromJson(1, smallReplica(1, R"("nodes":["@replica-position-0","@replica-position-0"])"));
    CHECK_THAT(setError({r0, reserved}), Catch::Contains("reserved for replica positions"));
  }
  {
    Replica short_nodes = fromJson(1, smallReplica(1, R"("nodes":["b"])"));
    CHECK_THAT(setError({r0, short_nodes}),
               Catch::Contains("replica 1 (group \"rollout.r1\"): nodes has 1 entries but the mesh has 2 ranks"));
  }
}

TEST_CASE("replica sets: a replica node hosting a source rank is refused, naming the node",
          "[planner][replicas][validation]") {
  const v1::Layout src = layoutFromJson(kSmallSource);
  const Replica r0 = fromJson(0, smallReplica(0, R"("ranks_per_node":2,"node_prefix":"a-")"));
  const Replica r1 = fromJson(1, smallReplica(1, R"("nodes":["t1","t1"])"));
  auto set = planReplicaSet(src, {r0, r1});
  REQUIRE_FALSE(set.ok());
  CHECK(set.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(set.status().message()),
             Catch::Contains("node \"t1\" hosts rank 1 of layout \"trainer\" and replica 1 (group \"rollout.r1\")") &&
                 Catch::Contains("colocation") && Catch::Contains("makePlan"));

  // composeReplicas checks it too, given a position plan and a colocated stacking.
  NodeTable nodes;
  auto s = resolveLayout(src, nodes);
  REQUIRE(s.ok());
  auto positions = planPositions(*s, nodes, r0.layout);
  REQUIRE(positions.ok());
  auto dst = resolveLayout(stackReplicas({r0, r1}), nodes);
  REQUIRE(dst.ok());
  auto plan = composeReplicas(*positions, *s, *dst, nodes);
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(plan.status().message()),
             Catch::Contains("node \"t1\" hosts rank 1") && Catch::Contains("replica 1 of layout \"rollout\""));

  // Flat planning of the same stacked layout is the way for colocated replicas.
  CHECK(makePlan(*s, *dst, nodes).ok());
}

TEST_CASE("replica sets: composing against layouts the position plan was not made for fails",
          "[planner][replicas][validation]") {
  const v1::Layout src = layoutFromJson(kSmallSource);
  const Replica r0 = fromJson(0, smallReplica(0, R"("ranks_per_node":2,"node_prefix":"a-")"));
  NodeTable nodes;
  auto s = resolveLayout(src, nodes);
  REQUIRE(s.ok());
  auto positions = planPositions(*s, nodes, r0.layout);
  REQUIRE(positions.ok());
  // Three ranks: not a whole number of two-rank replicas.
  auto odd = resolveLayout(layoutFromJson(R"({"group":"x","mesh":{"shape":[3]},"nodes":["p","p","q"]})"), nodes);
  REQUIRE(odd.ok());
  auto plan = composeReplicas(*positions, *s, *odd, nodes);
  REQUIRE_FALSE(plan.ok());
  CHECK_THAT(std::string(plan.status().message()), Catch::Contains("not a whole number of replicas of 2 ranks"));
  // Two replicas sharing a node at different positions: not composed (the caller plans the
  // stacked layout), named.
  NodeTable two_nodes;
  auto s2 = resolveLayout(src, two_nodes);
  REQUIRE(s2.ok());
  const Replica spread = fromJson(0, smallReplica(0, R"("nodes":["a","b"])"));
  auto spread_positions = planPositions(*s2, two_nodes, spread.layout);
  REQUIRE(spread_positions.ok());
  // `spread` and a second replica on `nodes`, stacked and composed from spread's position plan.
  const auto composeWith = [&](const std::string& nodes_json) {
    auto stacked = resolveLayout(stackReplicas({spread, fromJson(1, smallReplica(1, nodes_json))}), two_nodes);
    REQUIRE(stacked.ok());
    return std::make_pair(*stacked, composeReplicas(*spread_positions, *s2, *stacked, two_nodes));
  };
  auto [crossed, crossed_plan] = composeWith(R"("nodes":["b","c"])");
  REQUIRE_FALSE(crossed_plan.ok());
  CHECK(crossed_plan.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(crossed_plan.status().message()),
             Catch::Contains("node \"b\" holds position 1 of replica 0 and position 0 of replica 1"));
  // ... which planReplicaSet reports too, and which a flat plan of the stacked layout handles.
  auto set = planReplicaSet(src, {spread, fromJson(1, smallReplica(1, R"("nodes":["b","c"])"))});
  REQUIRE_FALSE(set.ok());
  CHECK(set.status().code() == absl::StatusCode::kFailedPrecondition);
  auto flat = makePlan(*s2, crossed, two_nodes);
  CHECK(flat.ok());
  // A replica breaking the position pattern within itself (both ranks on one node where the
  // position plan has them on two).
  const auto self_broken = composeWith(R"("nodes":["c","c"])").second;
  REQUIRE_FALSE(self_broken.ok());
  CHECK_THAT(std::string(self_broken.status().message()), Catch::Contains("breaks the position pattern"));
  // A source with a node named like a position.
  NodeTable other;
  auto reserved = resolveLayout(
      layoutFromJson(R"({"group":"trainer","mesh":{"shape":[1]},"nodes":["@replica-position-0"]})"), other);
  REQUIRE(reserved.ok());
  auto refused = planPositions(*reserved, other, r0.layout);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("reserved for replica positions"));
}

TEST_CASE("layout validation: replica and replica_set", "[planner][replicas][validation]") {
  auto error = [](const std::string& json) {
    NodeTable nodes;
    auto r = resolveLayout(layoutFromJson(json), nodes);
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  CHECK(error(smallReplica(3, R"("nodes":["b","b"])")) == "");
  CHECK_THAT(error(smallReplica(-1, R"("nodes":["b","b"])")),
             Catch::Contains("layout \"rollout.r-1\": replica -1 must be >= 0"));
  CHECK_THAT(error(R"({"group":"g","replica":2,"mesh":{"shape":[1]},"nodes":["b"]})"),
             Catch::Contains("replica 2 is set but replica_set is empty"));
  v1::Layout long_name = layoutFromJson(smallReplica(0, R"("nodes":["b","b"])"));
  long_name.set_replica_set(std::string(513, 's'));
  NodeTable nodes;
  auto r = resolveLayout(long_name, nodes);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(r.status().message()), Catch::Contains("replica_set is 513 bytes (at most 512)"));
}
