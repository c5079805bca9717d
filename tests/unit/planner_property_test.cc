// Plans between random layouts, executed on simulated memory: every destination element gets the
// right value, each needed element reaches each node exactly once (or comes from a local source),
// nothing needless crosses the network, and the byte figures equal brute-force counts.
#include <catch2/catch.hpp>

#include "planner/plan.h"
#include "tests/unit/plan_simulator.h"
#include "tests/unit/reference.h"

using namespace shardcast;
using namespace shardcast::planner;
using namespace shardcast::testing;

namespace {

void checkPlan(const v1::Layout& src_proto, const v1::Layout& dst_proto, const PlanOptions& opts) {
  NodeTable nodes;
  auto src = resolveLayout(src_proto, nodes);
  auto dst = resolveLayout(dst_proto, nodes);
  INFO("src: " << src_proto.ShortDebugString());
  INFO("dst: " << dst_proto.ShortDebugString());
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  auto plan = makePlan(*src, *dst, nodes, opts);
  INFO((plan.ok() ? "" : std::string(plan.status().message())));
  REQUIRE(plan.ok());
  const SimResult r = simulate(*plan, *src, *dst, src_proto, dst_proto);
  INFO(r.first_problem);
  CHECK(r.wrong_elements == 0);
  CHECK(r.duplicate_arrivals == 0);
  CHECK(r.needless_arrivals == 0);
  CHECK(r.missing_arrivals == 0);
  CHECK(r.bad_sources == 0);
  CHECK(plan->stats.network_bytes == r.lower_bound_bytes);
  CHECK(plan->stats.network_lower_bound == r.lower_bound_bytes);
  CHECK(plan->stats.bytes_needed == r.bytes_needed);
  int64_t in = 0, out = 0;
  for (int64_t v : plan->stats.node_ingress) in += v;
  for (int64_t v : plan->stats.node_egress) out += v;
  CHECK(in == plan->stats.network_bytes);
  CHECK(out == plan->stats.network_bytes);
}

PlanOptions randomOptions(std::mt19937& rng) {
  PlanOptions o;
  o.small_bytes = std::vector<int64_t>{0, 16, 64, 1 << 20}[rng() % 4];
  o.bucket_bytes = std::vector<int64_t>{1, 32, 256}[rng() % 3];
  o.chunk_bytes = std::vector<int64_t>{8, 64, 1 << 20}[rng() % 3];
  o.max_chain = 1 + static_cast<int32_t>(rng() % 3);
  return o;
}

}  // namespace

TEST_CASE("random placements and pieces: plans are exact", "[planner][property]") {
  std::mt19937 rng(20261129);
  for (int it = 0; it < 600; ++it) {
    const auto [src, dst] = randomLayoutPair(rng);
    checkPlan(src, dst, randomOptions(rng));
  }
}

TEST_CASE("disjoint node pools: network bytes equal every node's need", "[planner][property]") {
  std::mt19937 rng(77);
  for (int it = 0; it < 200; ++it) {
    const auto specs = randomTensorSpecs(rng);
    v1::Layout src = randomLayoutShell(rng, "trainer");
    v1::Layout dst = randomLayoutShell(rng, "inference");
    // Rename destination nodes so that nothing is colocated.
    if (dst.nodes_size() == 0) dst.set_node_prefix("inf-");
    for (auto& n : *dst.mutable_nodes()) n = "inf-" + n;
    for (const auto& s : specs) {
      addRandomTensor(rng, src, s, true);
      addRandomTensor(rng, dst, s, false);
    }
    checkPlan(src, dst, randomOptions(rng));
  }
}

TEST_CASE("fused destination buffers receive the right elements", "[planner][property]") {
  std::mt19937 rng(5);
  for (int it = 0; it < 150; ++it) {
    const auto [src, dst] = randomFusedLayoutPair(rng);
    checkPlan(src, dst, randomOptions(rng));
  }
}
