// Plans between layouts as real frameworks lay them out: FSDP2 to vLLM TP, Megatron TP change,
// fused qkv / gate_up, whole experts to TP and to expert-stacked w13, colocated groups, relays.
#include <catch2/catch.hpp>

#include "planner/plan.h"
#include "tests/unit/plan_simulator.h"
#include "tests/unit/test_util.h"

using namespace shardcast;
using namespace shardcast::planner;
using namespace shardcast::testing;

namespace {

struct Planned {
  NodeTable nodes;
  ResolvedLayout src, dst;
  Plan plan;
  SimResult sim;
};

std::unique_ptr<Planned> planAndSimulate(const std::string& src_json, const std::string& dst_json,
                                         PlanOptions opts = {}) {
  auto p = std::make_unique<Planned>();
  const auto sp = layoutFromJson(src_json), dp = layoutFromJson(dst_json);
  auto s = resolveLayout(sp, p->nodes);
  auto d = resolveLayout(dp, p->nodes);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  p->src = *s;
  p->dst = *d;
  auto plan = makePlan(p->src, p->dst, p->nodes, opts);
  INFO((plan.ok() ? "" : std::string(plan.status().message())));
  REQUIRE(plan.ok());
  p->plan = std::move(*plan);
  p->sim = simulate(p->plan, p->src, p->dst, sp, dp);
  INFO(p->sim.first_problem);
  CHECK(p->sim.wrong_elements == 0);
  CHECK(p->sim.duplicate_arrivals == 0);
  CHECK(p->sim.needless_arrivals == 0);
  CHECK(p->sim.missing_arrivals == 0);
  CHECK(p->plan.stats.network_bytes == p->sim.lower_bound_bytes);
  return p;
}

int64_t egressOf(const Planned& p, const std::string& node) {
  for (int32_t n = 0; n < p.nodes.size(); ++n)
    if (p.nodes.name(n) == node) return p.plan.stats.node_egress[n];
  return -1;
}

const char* kFsdpTrainer = R"({"group":"trainer","mesh":{"shape":[4],"dim_names":["fsdp"]},
  "nodes":["t0","t0","t1","t1"],"tensors":[
  {"name":"up","shape":[16,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
  {"name":"down","shape":[8,16],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
  {"name":"norm","shape":[8],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";

}  // namespace

TEST_CASE("FSDP2 trainer to vLLM TP=2 x DP=2: exact, relayed, column and row parallel", "[planner][known]") {
  const char* vllm = R"({"group":"vllm","mesh":{"shape":[2,2],"dim_names":["dp","tp"]},
    "nodes":["i0","i0","i1","i1"],"tensors":[
    {"name":"up","shape":[16,8],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
    {"name":"down","shape":[8,16],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":1}}]},
    {"name":"norm","shape":[8],"dtype":"float32"}]})";
  PlanOptions opts;
  opts.small_bytes = 0;  // no buckets: one transfer per fragment
  auto p = planAndSimulate(kFsdpTrainer, vllm, opts);
  const int64_t model = (16 * 8 + 8 * 16) * 2 + 8 * 4;
  // Each inference node needs the whole model once. Each trainer node holds half of it, so it can
  // send its half to both nodes without sending more than one node receives: no relays.
  CHECK(p->plan.stats.network_bytes == 2 * model);
  CHECK(egressOf(*p, "t0") + egressOf(*p, "t1") == 2 * model);
  CHECK(p->plan.stats.maxEgress() <= p->plan.stats.maxIngress());
  CHECK(p->plan.stats.max_chain == 1);
  // With the trainer on one node it must relay: each byte leaves it once, along a chain of two.
  const std::string one_node = R"({"group":"trainer","mesh":{"shape":[4],"dim_names":["fsdp"]},
    "nodes":["t0","t0","t0","t0"],"tensors":[
    {"name":"up","shape":[16,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"down","shape":[8,16],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"norm","shape":[8],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";
  auto q = planAndSimulate(one_node, vllm, opts);
  CHECK(egressOf(*q, "t0") == model);
  CHECK(q->plan.stats.max_chain == 2);
  CHECK(p->plan.stats.bytes_needed == 2 * model + 2 * 8 * 4);  // norm: every rank
  // The replicated "norm" is copied from where it lands to the node's other rank.
  CHECK(p->plan.stats.local_bytes > 0);
}

TEST_CASE("Row-parallel weights: a fragment spanning several ranks is split so each part lands in its rank",
          "[planner][known]") {
  // "down" on the inference side: each node's two TP ranks need [:, 0:8] and [:, 8:16], while
  // each FSDP rank holds a block of rows. Each row block spans both ranks of a node; split by
  // rank, each part is contiguous in its rank (strided in the source, packed once there).
  const char* vllm = R"({"group":"vllm","mesh":{"shape":[2,2],"dim_names":["dp","tp"]},
    "nodes":["i0","i0","i1","i1"],"tensors":[
    {"name":"down","shape":[8,16],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":1}}]}]})";
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[4],"dim_names":["fsdp"]},
    "nodes":["t0","t0","t1","t1"],"tensors":[
    {"name":"down","shape":[8,16],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}]})";
  PlanOptions opts;
  opts.small_in_place_bytes = 0;  // in-place parts travel alone, whatever their size
  auto p = planAndSimulate(trainer, vllm, opts);
  CHECK(p->plan.stats.fragments == 4 * 2);  // 4 row blocks x 2 ranks' columns
  CHECK(p->plan.stats.buckets == 0);
  CHECK(p->plan.stats.transfers == 8);
  CHECK(p->plan.stats.local_bytes == 0);  // each part lands in its rank: nothing to copy on the node
  for (const auto& f : p->plan.fragments) {
    CHECK(f.box.size(0) == 2);
    CHECK(f.box.size(1) == 8);
  }
  // Parts below the size that travels alone are not split: a row block travels whole (in a
  // bucket here), lands in an arena and is copied into both ranks.
  opts.small_in_place_bytes = int64_t{1} << 20;
  auto q = planAndSimulate(trainer, vllm, opts);
  CHECK(q->plan.stats.fragments == 4);
  CHECK(q->plan.stats.buckets > 0);
  CHECK(q->plan.stats.local_bytes == 2 * 8 * 16 * 2);  // both nodes copy the whole tensor out
  // Overlapping boxes on a node (replicas within it) are never split: the bytes travel once.
  opts.small_in_place_bytes = 0;
  const char* replicas = R"({"group":"vllm","mesh":{"shape":[2,2]},"nodes":["i0","i0","i1","i1"],"tensors":[
    {"name":"down","shape":[8,16],"dtype":"bfloat16","placements":[{"shard":{"dim":1}},{"replicate":{}}]}]})";
  auto r = planAndSimulate(trainer, replicas, opts);
  CHECK(r->plan.stats.network_bytes == 8 * 16 * 2);  // each node needs its half of the columns, once
  CHECK(r->plan.stats.fragments == 4 * 2);           // a row block's half per node, not per rank
}

TEST_CASE("Megatron TP=4 to vLLM TP=2 with fused qkv and gate_up", "[planner][known]") {
  const char* megatron = R"({"group":"megatron","mesh":{"shape":[4],"dim_names":["tp"]},"ranks_per_node":2,
    "node_prefix":"m","tensors":[
    {"name":"q","shape":[16,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"k","shape":[8,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"v","shape":[8,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"gate","shape":[12,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"up","shape":[12,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"o","shape":[8,16],"dtype":"bfloat16","placements":[{"shard":{"dim":1}}]}]})";
  const char* vllm = R"({"group":"vllm","mesh":{"shape":[2],"dim_names":["tp"]},"nodes":["v0","v1"],"tensors":[
    {"name":"q","shape":[16,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"k","shape":[8,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"v","shape":[8,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"gate","shape":[12,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"up","shape":[12,8],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"o","shape":[8,16],"dtype":"bfloat16","placements":[{"shard":{"dim":1}}]}],
    "fused":[{"name":"qkv_proj","dim":0,"tensors":["q","k","v"]},
             {"name":"gate_up_proj","dim":0,"tensors":["gate","up"]}]})";
  auto p = planAndSimulate(megatron, vllm);
  // Every vLLM rank needs exactly half of every tensor: nothing more crosses the network.
  CHECK(p->plan.stats.network_bytes == (16 * 8 + 8 * 8 * 2 + 12 * 8 * 2 + 8 * 16) * 2);
  CHECK(p->plan.stats.bytes_needed == p->plan.stats.network_bytes);
}

TEST_CASE("Whole experts (FlexShard-like, uneven) to vLLM TP=2 and to expert-stacked w13", "[planner][known]") {
  // 6 experts on 4 ranks: ranks 0 and 1 hold two experts, ranks 2 and 3 one each (uneven).
  std::string experts;
  const int owner[6] = {0, 0, 1, 1, 2, 3};
  for (int e = 0; e < 6; ++e)
    for (const char* w : {"w1", "w3"}) {
      if (!experts.empty()) experts += ",";
      experts += "{\"name\":\"e" + std::to_string(e) + "." + w +
                 "\",\"shape\":[6,4],\"dtype\":\"bfloat16\",\"pieces\":[{\"rank\":" + std::to_string(owner[e]) +
                 ",\"offsets\":[0,0],\"sizes\":[6,4]}]}";
    }
  const std::string trainer = R"({"group":"trainer","mesh":{"shape":[4]},"ranks_per_node":2,"node_prefix":"t",
    "tensors":[)" + experts + "]}";
  // vLLM TP=2: every rank holds every expert with the intermediate dim split (w13 shards).
  std::string tp_tensors, fused_members;
  for (int e = 0; e < 6; ++e)
    for (const char* w : {"w1", "w3"}) {
      const std::string name = "e" + std::to_string(e) + "." + w;
      if (!tp_tensors.empty()) tp_tensors += ",", fused_members += ",";
      tp_tensors +=
          "{\"name\":\"" + name + "\",\"shape\":[6,4],\"dtype\":\"bfloat16\",\"placements\":[{\"shard\":{\"dim\":0}}]}";
      fused_members += "\"" + name + "\"";
    }
  const std::string vllm_tp = R"({"group":"vllm","mesh":{"shape":[2]},"nodes":["v0","v1"],"tensors":[)" + tp_tensors +
                              R"(],"fused":[{"name":"w13","dim":0,"tensors":[)" + fused_members + "]}]}";
  auto p = planAndSimulate(trainer, vllm_tp);
  CHECK(p->plan.stats.network_bytes == 12 * 6 * 4 * 2);

  // vLLM EP=3 on one node: each rank holds two whole experts stacked as w13 = [w1_e; w3_e; ...].
  std::string ep_tensors;
  for (int e = 0; e < 6; ++e)
    for (const char* w : {"w1", "w3"}) {
      if (!ep_tensors.empty()) ep_tensors += ",";
      ep_tensors += "{\"name\":\"e" + std::to_string(e) + "." + w +
                    "\",\"shape\":[6,4],\"dtype\":\"bfloat16\",\"pieces\":[{\"rank\":" + std::to_string(e / 2) +
                    ",\"offsets\":[0,0],\"sizes\":[6,4]}]}";
    }
  const std::string vllm_ep = R"({"group":"vllm","mesh":{"shape":[3]},"nodes":["v0","v0","v0"],"tensors":[)" +
                              ep_tensors + R"(],"fused":[{"name":"w13","dim":0,"tensors":[)" + fused_members + "]}]}";
  auto q = planAndSimulate(trainer, vllm_ep);
  CHECK(q->plan.stats.network_bytes == 12 * 6 * 4 * 2);
  // Rank 1 holds experts 2 and 3: e3.w3 is the 4th block of 6 rows in its w13 buffer.
  const auto& t = q->dst.tensors[q->dst.tensor_index.at("e3.w3")];
  CHECK(t.pieces.at(0).rank == 1);
  CHECK(t.pieces.at(0).offset == 3 * 6 * 4);
}

TEST_CASE("Colocated trainer and inference: locally held bytes never cross the network", "[planner][known]") {
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[4]},"nodes":["a","a","b","b"],"tensors":[
    {"name":"w","shape":[8,8],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";
  // Same nodes; each inference rank needs rows its own node's trainer ranks hold, plus some more.
  const char* infer = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["a","b"],"tensors":[
    {"name":"w","shape":[8,8],"dtype":"float32","pieces":[{"rank":0,"offsets":[0,0],"sizes":[5,8]},
                                                      {"rank":1,"offsets":[4,0],"sizes":[4,8]}]}]})";
  auto p = planAndSimulate(trainer, infer);
  // Node a holds rows 0-3; it needs rows 0-4: one row crosses. Node b holds rows 4-7: nothing does.
  CHECK(p->plan.stats.network_bytes == 8 * 4);
  CHECK(p->plan.stats.network_lower_bound == 8 * 4);
  CHECK(!p->plan.local_sources.empty());
}

TEST_CASE("One source, many receivers: relays keep the source's egress near what it holds", "[planner][known]") {
  // 1 trainer node holds a 8 MiB tensor; 24 inference nodes each need all of it.
  std::string nodes;
  for (int i = 0; i < 24; ++i) nodes += std::string(i ? "," : "") + "\"i" + std::to_string(i) + "\"";
  const std::string infer = R"({"group":"infer","mesh":{"shape":[24]},"nodes":[)" + nodes + R"(],"tensors":[
    {"name":"w","shape":[2048,1024],"dtype":"float32"}]})";
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["t","t"],"tensors":[
    {"name":"w","shape":[2048,1024],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";
  NodeTable table;
  auto s = resolveLayout(layoutFromJson(trainer), table);
  auto d = resolveLayout(layoutFromJson(infer), table);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  PlanOptions opts;
  opts.max_chain = 8;
  auto p = makePlan(*s, *d, table, opts);
  REQUIRE(p.ok());
  const int64_t bytes = 2048 * 1024 * 4;
  CHECK(p->stats.network_bytes == 24 * bytes);
  CHECK(p->stats.max_chain == 8);
  // Three chains of 8: the trainer node sends 3 copies instead of 24.
  CHECK(p->stats.node_egress[0] == 3 * bytes);
  CHECK(p->stats.maxEgress() <= 3 * bytes);
  CHECK(p->stats.maxIngress() == bytes);
}

TEST_CASE("Small tensors travel in buckets", "[planner][known]") {
  std::string tensors;
  for (int i = 0; i < 40; ++i)
    tensors +=
        std::string(i ? "," : "") + "{\"name\":\"norm" + std::to_string(i) + "\",\"shape\":[64],\"dtype\":\"float32\"}";
  const std::string trainer =
      R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["t0","t1"],"tensors":[)" + tensors + "]}";
  const std::string infer =
      R"({"group":"infer","mesh":{"shape":[4]},"ranks_per_node":2,"node_prefix":"i","tensors":[)" + tensors + "]}";
  PlanOptions opts;
  opts.bucket_bytes = 1024;  // 4 norms of 256 bytes per bucket
  auto p = planAndSimulate(trainer, infer, opts);
  CHECK(p->plan.stats.fragments == 40);
  CHECK(p->plan.stats.buckets == 10);
  CHECK(p->plan.stats.transfers == 10);
}

TEST_CASE("Chunks: large transfers are cut into chunk-sized operations", "[planner][known]") {
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[1]},"nodes":["t"],"tensors":[
    {"name":"w","shape":[256,1024],"dtype":"float32"}]})";
  const char* infer = R"({"group":"infer","mesh":{"shape":[1]},"nodes":["i"],"tensors":[
    {"name":"w","shape":[256,1024],"dtype":"float32"}]})";
  PlanOptions opts;
  opts.chunk_bytes = 256 << 10;
  auto p = planAndSimulate(trainer, infer, opts);
  REQUIRE(p->plan.transfers.size() == 1);
  CHECK(p->plan.transfers[0].chunks == 4);
  CHECK(p->plan.stats.network_ops == 4);
}

TEST_CASE("A destination declaring bfloat16 for a float32 source: bytes counted in bfloat16, others refused",
          "[planner][known]") {
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["t","t"],"tensors":[
    {"name":"w","shape":[256,128],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";
  const char* infer = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["i0","i1"],"tensors":[
    {"name":"w","shape":[256,128],"dtype":"bfloat16","placements":[{"shard":{"dim":1}}]}]})";
  NodeTable table;
  auto s = resolveLayout(layoutFromJson(trainer), table);
  auto d = resolveLayout(layoutFromJson(infer), table);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  auto p = makePlan(*s, *d, table);
  REQUIRE(p.ok());
  CHECK(p->stats.bytes_needed == 256 * 128 * 2);
  CHECK(p->stats.network_bytes == 256 * 128 * 2);
  CHECK(p->stats.network_lower_bound == 256 * 128 * 2);
  // The other way round (and any pair but float32 -> bfloat16) is no conversion the daemons make.
  NodeTable again;
  auto back_src = resolveLayout(layoutFromJson(infer), again);
  auto back_dst = resolveLayout(layoutFromJson(trainer), again);
  REQUIRE(back_src.ok());
  REQUIRE(back_dst.ok());
  auto refused = makePlan(*back_src, *back_dst, again);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("tensor \"w\"") && Catch::Contains("no conversion between these dtypes"));
  CHECK(convertible(DType::kFloat32, DType::kBFloat16));
  CHECK_FALSE(convertible(DType::kBFloat16, DType::kFloat32));
  CHECK_FALSE(convertible(DType::kFloat32, DType::kFloat16));
  CHECK(convertible(DType::kInt8, DType::kInt8));
}
