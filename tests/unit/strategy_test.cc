// The routings a plan can take (planner::Strategy): the baselines Shardcast is measured against
// deliver every element right, with the traffic their shape implies.
#include <catch2/catch.hpp>
#include <random>

#include "planner/plan.h"
#include "tests/unit/plan_simulator.h"
#include "tests/unit/reference.h"
#include "tests/unit/test_util.h"

using namespace shardcast;
using namespace shardcast::planner;
using namespace shardcast::testing;

namespace {

struct Routed {
  NodeTable nodes;
  ResolvedLayout src, dst;
  Plan plan;
  SimResult sim;
  int32_t node(const std::string& name) const {
    for (int32_t n = 0; n < nodes.size(); ++n)
      if (nodes.name(n) == name) return n;
    FAIL("no node " << name);
    return -1;
  }
};

// Plans with `strategy` and plays the plan on simulated memory: every destination element right,
// none missing, every source read from a rank that holds it.
Routed route(const v1::Layout& sp, const v1::Layout& dp, Strategy strategy, PlanOptions opts = {}) {
  Routed r;
  auto s = resolveLayout(sp, r.nodes);
  auto d = resolveLayout(dp, r.nodes);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  r.src = *s;
  r.dst = *d;
  opts.strategy = strategy;
  auto plan = makePlan(r.src, r.dst, r.nodes, opts);
  INFO((plan.ok() ? "" : std::string(plan.status().message())));
  REQUIRE(plan.ok());
  r.plan = std::move(*plan);
  r.sim = simulate(r.plan, r.src, r.dst, sp, dp);
  INFO(r.sim.first_problem);
  CHECK(r.sim.wrong_elements == 0);
  CHECK(r.sim.missing_arrivals == 0);
  CHECK(r.sim.bad_sources == 0);
  int64_t in = 0, out = 0;
  for (int64_t v : r.plan.stats.node_ingress) in += v;
  for (int64_t v : r.plan.stats.node_egress) out += v;
  CHECK(in == r.plan.stats.network_bytes);
  CHECK(out == r.plan.stats.network_bytes);
  return r;
}

// FSDP over two trainer nodes (2 ranks each) into 3 inference nodes of TP=2 x DP=2 (4 ranks, two
// of them needing the same rows): enough to tell the three routings apart.
const char* kTrainer = R"({"group":"trainer","mesh":{"shape":[4]},"nodes":["t0","t0","t1","t1"],"tensors":[
  {"name":"w","shape":[512,256],"dtype":"float32","placements":[{"shard":{"dim":0}}]},
  {"name":"b","shape":[64],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";
const char* kInference = R"({"group":"infer","mesh":{"shape":[3,2,2],"dim_names":["node","dp","tp"]},
  "ranks_per_node":4,"node_prefix":"i","tensors":[
  {"name":"w","shape":[512,256],"dtype":"float32","placements":[{"replicate":{}},{"replicate":{}},{"shard":{"dim":0}}]},
  {"name":"b","shape":[64],"dtype":"float32"}]})";

}  // namespace

TEST_CASE("Rank pull: every destination rank gets its own copy straight from a source rank", "[planner][strategy]") {
  const auto sp = layoutFromJson(kTrainer), dp = layoutFromJson(kInference);
  const Routed planned = route(sp, dp, Strategy::kPlanned);
  const Routed pull = route(sp, dp, Strategy::kRankPull);
  const int64_t w = 512 * 256 * 4, b = 64 * 4;
  // Planned: each inference node gets w and b once. Pulled: each of its 4 ranks gets its half of w
  // (the two DP ranks the same half) and all of b.
  CHECK(planned.plan.stats.network_bytes == 3 * (w + b));
  CHECK(pull.plan.stats.network_bytes == 3 * (2 * w + 4 * b));
  CHECK(pull.plan.stats.network_bytes == planned.plan.stats.pull_network_bytes);
  CHECK(pull.sim.duplicate_arrivals > 0);  // a node's DP ranks each pull the same rows
  CHECK(pull.sim.needless_arrivals == 0);
  CHECK(pull.plan.stats.max_chain == 1);  // no relays
  for (const auto& g : pull.plan.groups) {
    CHECK(g.rank >= 0);
    CHECK(g.nodes_count == 1);
  }
  // Each landed fragment is unpacked into its own rank only.
  for (int32_t f = 0; f < static_cast<int32_t>(pull.plan.fragments.size()); ++f) {
    const auto& g = pull.plan.groups[static_cast<size_t>(pull.plan.fragments[f].group)];
    const int32_t node = pull.plan.group_nodes[g.nodes_begin];
    for (const auto& [box, region] : destinationRegions(pull.plan, pull.dst, f, node)) CHECK(region.rank == g.rank);
  }
}

TEST_CASE("Gather-broadcast: every byte through source rank 0's node, which sends each node its part",
          "[planner][strategy]") {
  const auto sp = layoutFromJson(kTrainer), dp = layoutFromJson(kInference);
  const Routed gb = route(sp, dp, Strategy::kGatherBroadcast);
  const int32_t root = gb.node("t0"), other = gb.node("t1");
  const int64_t w = 512 * 256 * 4, b = 64 * 4;
  const int64_t held_elsewhere = (w + b) / 2;  // t1's half
  // t1 sends its half once, to the root; the root sends every inference node all of w and b.
  CHECK(gb.plan.stats.node_egress[other] == held_elsewhere);
  CHECK(gb.plan.stats.node_ingress[root] == held_elsewhere);
  CHECK(gb.plan.stats.node_egress[root] == 3 * (w + b));
  CHECK(gb.plan.stats.network_bytes == held_elsewhere + 3 * (w + b));
  CHECK(gb.sim.duplicate_arrivals == 0);
  CHECK(gb.sim.needless_arrivals > 0);  // the root needs none of what passes through it
  CHECK(gb.plan.stats.max_chain == 2);
  for (const auto& ch : gb.plan.chains) {
    if (ch.src_node == root) {
      CHECK(ch.nodes_count == 1);
    } else {
      CHECK(ch.star);
      CHECK(gb.plan.chain_nodes[ch.nodes_begin] == root);
      CHECK(ch.nodes_count == 4);
    }
  }
  // The planned route sends each node's needs once, without the root's detour and its egress.
  const Routed planned = route(sp, dp, Strategy::kPlanned);
  CHECK(planned.plan.stats.maxEgress() < gb.plan.stats.maxEgress());
  const CostModel model;
  CHECK(predictSeconds(planned.plan.stats, model) < predictSeconds(gb.plan.stats, model));
}

TEST_CASE("Gather-broadcast with the root among the destinations: it keeps its part, forwards the rest",
          "[planner][strategy]") {
  // Sources on a and b; destinations on a, b and c; the root (a) needs everything.
  const auto sp = layoutFromJson(R"({"group":"s","mesh":{"shape":[2]},"nodes":["a","b"],"tensors":[
    {"name":"w","shape":[64,64],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})");
  const auto dp = layoutFromJson(R"({"group":"d","mesh":{"shape":[3]},"nodes":["a","b","c"],"tensors":[
    {"name":"w","shape":[64,64],"dtype":"float32"}]})");
  const Routed gb = route(sp, dp, Strategy::kGatherBroadcast);
  const int32_t a = gb.node("a"), b = gb.node("b");
  const int64_t half = 32 * 64 * 4;
  CHECK(gb.sim.needless_arrivals == 0);
  CHECK(gb.sim.duplicate_arrivals == 0);
  CHECK(gb.plan.stats.node_ingress[a] == half);     // b's half, once
  CHECK(gb.plan.stats.node_egress[a] == 3 * half);  // its own half to b and c, b's half to c
  CHECK(gb.plan.stats.node_egress[b] == half);      // only to the root
}

TEST_CASE("random layouts: every routing delivers every element", "[planner][strategy][property]") {
  std::mt19937 rng(20261201);
  for (int it = 0; it < 200; ++it) {
    const auto [src, dst] = randomLayoutPair(rng);
    INFO("src: " << src.ShortDebugString());
    INFO("dst: " << dst.ShortDebugString());
    PlanOptions opts;
    opts.small_bytes = std::vector<int64_t>{0, 64, 1 << 20}[rng() % 3];
    opts.chunk_bytes = std::vector<int64_t>{8, 64, 1 << 20}[rng() % 3];
    opts.max_chain = 1 + static_cast<int32_t>(rng() % 3);
    const Routed planned = route(src, dst, Strategy::kPlanned, opts);
    CHECK(planned.sim.duplicate_arrivals == 0);
    CHECK(planned.sim.needless_arrivals == 0);
    const Routed pull = route(src, dst, Strategy::kRankPull, opts);
    CHECK(pull.plan.stats.network_bytes >= planned.plan.stats.network_bytes);
    // (The root may receive an element twice: once per group of nodes whose needs overlap it.)
    const Routed gb = route(src, dst, Strategy::kGatherBroadcast, opts);
    CHECK(gb.plan.stats.network_bytes >= planned.plan.stats.network_bytes);
  }
}
