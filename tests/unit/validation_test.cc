// Every validation error: one clear message naming the tensor, rank and values; never a crash.
#include <catch2/catch.hpp>

#include "planner/layout.h"
#include "planner/limits.h"
#include "planner/plan.h"

using namespace shardcast;
using namespace shardcast::planner;

namespace {

// The error of parsing + resolving `json` (empty when it resolves).
std::string layoutError(const std::string& json) {
  auto parsed = parseLayoutJson(json, "layout.json");
  if (!parsed.ok()) return std::string(parsed.status().message());
  NodeTable nodes;
  auto r = resolveLayout(*parsed, nodes);
  return r.ok() ? "" : std::string(r.status().message());
}

// The error of planning src -> dst (empty when it plans).
std::string planError(const std::string& src, const std::string& dst) {
  NodeTable nodes;
  auto s = resolveLayout(*parseLayoutJson(src, "src"), nodes);
  auto d = resolveLayout(*parseLayoutJson(dst, "dst"), nodes);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  auto p = makePlan(*s, *d, nodes);
  return p.ok() ? "" : std::string(p.status().message());
}

std::string oneTensor(const std::string& tensor, const std::string& mesh = R"({"shape":[2]})",
                      const std::string& extra = R"("ranks_per_node":2)") {
  return R"({"group":"trainer","mesh":)" + mesh + "," + extra + R"(,"tensors":[)" + tensor + "]}";
}

}  // namespace

TEST_CASE("valid layouts resolve", "[validation]") {
  CHECK(layoutError(oneTensor(R"({"name":"w","shape":[4,4],"dtype":"bfloat16","placements":[{"shard":{"dim":1}}]})")) ==
        "");
  CHECK(layoutError(oneTensor(R"({"name":"w","shape":[4],"dtype":"bool"})")) == "");
}

TEST_CASE("unknown dtype", "[validation]") {
  const auto e = layoutError(oneTensor(R"({"name":"w","shape":[4],"dtype":"bf16"})"));
  CHECK_THAT(
      e, Catch::Contains("tensor \"w\"") && Catch::Contains("unknown dtype \"bf16\"") && Catch::Contains("bfloat16"));
}

TEST_CASE("placement count differs from mesh dims", "[validation]") {
  const auto e = layoutError(
      oneTensor(R"({"name":"w","shape":[4],"dtype":"float32","placements":[{"replicate":{}},{"shard":{"dim":0}}]})"));
  CHECK_THAT(e, Catch::Contains("tensor \"w\"") && Catch::Contains("2 placements for a mesh of 1 dims"));
}

TEST_CASE("shard dim out of range", "[validation]") {
  const auto e =
      layoutError(oneTensor(R"({"name":"w","shape":[4,4],"dtype":"float32","placements":[{"shard":{"dim":2}}]})"));
  CHECK_THAT(e, Catch::Contains("tensor \"w\"") && Catch::Contains("shards dim 2 but the tensor has 2 dims"));
  const auto e2 = layoutError(oneTensor(
      R"({"name":"w","shape":[4,4],"dtype":"float32","placements":[{"strided_shard":{"dim":-1,"split_factor":2}}]})"));
  CHECK_THAT(e2, Catch::Contains("shards dim -1"));
  const auto e3 = layoutError(oneTensor(
      R"({"name":"w","shape":[4,4],"dtype":"float32","placements":[{"strided_shard":{"dim":0,"split_factor":0}}]})"));
  CHECK_THAT(e3, Catch::Contains("split_factor 0 must be in [1, 4096]"));
  const auto e4 = layoutError(oneTensor(R"({"name":"w","shape":[4],"dtype":"float32","placements":[{}]})"));
  CHECK_THAT(e4, Catch::Contains("placement 0 is empty"));
}

TEST_CASE("piece outside the shape", "[validation]") {
  const auto e = layoutError(oneTensor(
      R"({"name":"layers.3.mlp.up_proj.weight","shape":[4096,4096],"dtype":"bfloat16",
          "pieces":[{"rank":1,"offsets":[0,0],"sizes":[512,4097]}]})"));
  CHECK_THAT(e, Catch::Contains("tensor \"layers.3.mlp.up_proj.weight\"") && Catch::Contains("rank 1") &&
                    Catch::Contains("[0:512, 0:4097] exceeds shape [4096, 4096]"));
  const auto e2 = layoutError(
      oneTensor(R"({"name":"w","shape":[4,4],"dtype":"bfloat16","pieces":[{"rank":0,"offsets":[0],"sizes":[4]}]})"));
  CHECK_THAT(e2, Catch::Contains("1 offsets and 1 sizes but the tensor has 2 dims"));
  const auto e3 = layoutError(
      oneTensor(R"({"name":"w","shape":[4],"dtype":"bfloat16","pieces":[{"rank":0,"offsets":[-1],"sizes":[2]}]})"));
  CHECK_THAT(e3, Catch::Contains("exceeds shape [4]"));
}

TEST_CASE("rank out of range", "[validation]") {
  const auto e = layoutError(oneTensor(
      R"({"name":"experts.w13","shape":[12,4],"dtype":"bfloat16","pieces":[{"rank":2,"offsets":[0,0],"sizes":[3,4]}]})"));
  CHECK_THAT(e, Catch::Contains("tensor \"experts.w13\"") && Catch::Contains("rank 2 is out of range [0, 2)"));
  const auto e2 = layoutError(oneTensor(
      R"({"name":"w","shape":[4],"dtype":"bfloat16","pieces":[{"ranks":[0,-3],"offsets":[0],"sizes":[4]}]})"));
  CHECK_THAT(e2, Catch::Contains("rank -3 is out of range"));
}

TEST_CASE("node list of the wrong length", "[validation]") {
  const auto e = layoutError(oneTensor(R"({"name":"w","shape":[4],"dtype":"float32"})", R"({"shape":[2,4]})",
                                       R"("nodes":["a","a","a","b","b","b","b"])"));
  CHECK_THAT(e, Catch::Contains("nodes has 7 entries but the mesh [2, 4] has 8 ranks"));
  const auto e2 =
      layoutError(oneTensor(R"({"name":"w","shape":[4],"dtype":"float32"})", R"({"shape":[2]})", R"("group2":1)"));
  CHECK_THAT(e2, Catch::Contains("group2"));  // unknown field: protobuf's JSON parser names it
  const auto e3 = layoutError(R"({"group":"g","mesh":{"shape":[2]},"tensors":[]})");
  CHECK_THAT(e3, Catch::Contains("set nodes (one per rank) or a positive ranks_per_node"));
}

TEST_CASE("mesh and naming mistakes", "[validation]") {
  CHECK_THAT(layoutError(R"({"group":"g","mesh":{"shape":[2,0]},"ranks_per_node":1})"),
             Catch::Contains("mesh.shape[1] = 0 must be positive"));
  CHECK_THAT(layoutError(R"({"group":"g","mesh":{"shape":[2],"dim_names":["a","b"]},"ranks_per_node":1})"),
             Catch::Contains("dim_names has 2 names but mesh.shape has 1 dims"));
  CHECK_THAT(layoutError(R"({"mesh":{"shape":[2]},"ranks_per_node":1})"), Catch::Contains("\"group\" is empty"));
  // Group and set names reach logs, metrics and terminals: no control characters, UTF-8 only.
  CHECK_THAT(layoutError(R"({"group":"g\nset vllm: 8 replicas","mesh":{"shape":[2]},"ranks_per_node":1})"),
             Catch::Contains("layout: \"group\" \"g\\x0aset vllm: 8 replicas\" holds a control character"));
  CHECK_THAT(
      layoutError(R"({"group":"g","replica_set":"s\u001b]52;c;eA==\u0007","mesh":{"shape":[2]},"ranks_per_node":1})"),
      Catch::Contains("layout: \"replica_set\" \"s\\x1b]52;c;eA==\\x07\" holds a control character"));
  CHECK_THAT(layoutError(R"({"group":"g\u009b2J","mesh":{"shape":[2]},"ranks_per_node":1})"),
             Catch::Contains("holds a control character or is not UTF-8 text"));
  CHECK(layoutError(R"({"group":"模型-rollout","mesh":{"shape":[1]},"ranks_per_node":1})").find("group") ==
        std::string::npos);
  CHECK_THAT(layoutError(
                 oneTensor(R"({"name":"w","shape":[4],"dtype":"float32"},{"name":"w","shape":[4],"dtype":"float32"})")),
             Catch::Contains("tensor \"w\": listed twice"));
  CHECK_THAT(layoutError(oneTensor(R"({"name":"w","shape":[4],"dtype":"float32","placements":[{"replicate":{}}],
                                      "pieces":[{"rank":0,"offsets":[0],"sizes":[4]}]})")),
             Catch::Contains("give placements or pieces, not both"));
  CHECK_THAT(layoutError(R"({"group":"g","mesh":{"shape":[2]},"ranks_per_node":1,"tensors":"x"})"),
             Catch::Contains("layout.json: not a valid shardcast.v1.Layout"));
}

TEST_CASE("fused buffer mistakes", "[validation]") {
  const std::string tensors =
      R"({"name":"q","shape":[8,4],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
         {"name":"k","shape":[4,6],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
         {"name":"v","shape":[4,4],"dtype":"float32","placements":[{"shard":{"dim":0}}]})";
  auto with = [&](const std::string& fused) {
    return R"({"group":"vllm","mesh":{"shape":[2]},"ranks_per_node":2,"tensors":[)" + tensors + R"(],"fused":[)" +
           fused + "]}";
  };
  CHECK_THAT(layoutError(with(R"({"name":"qkv","dim":0,"tensors":["q","x"]})")),
             Catch::Contains("names unknown tensor \"x\""));
  CHECK_THAT(layoutError(with(R"({"name":"qk","dim":0,"tensors":["q","k"]})")),
             Catch::Contains("tensor \"k\" has local shape [2, 6] which does not match \"q\" outside dim 0"));
  CHECK_THAT(layoutError(with(R"({"name":"qv","dim":0,"tensors":["q","v"]})")),
             Catch::Contains("tensor \"v\" is float32 but \"q\" is bfloat16"));
  CHECK_THAT(layoutError(with(R"({"name":"a","dim":0,"tensors":["q"]},{"name":"b","dim":0,"tensors":["q"]})")),
             Catch::Contains("tensor \"q\": belongs to more than one fused buffer"));
  CHECK_THAT(layoutError(with(R"({"name":"q","dim":0,"tensors":["k"]})")), Catch::Contains("has the name of a tensor"));
  CHECK_THAT(layoutError(with(R"({"name":"qq","dim":2,"tensors":["q"]})")),
             Catch::Contains("dim 2 is invalid for tensor \"q\""));
}

TEST_CASE("plan errors: mismatched shape or dtype, missing tensor, uncovered element", "[validation]") {
  const std::string src = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["a","b"],"tensors":[
      {"name":"w","shape":[4,4],"dtype":"bfloat16","pieces":[{"rank":0,"offsets":[0,0],"sizes":[2,4]},
                                                         {"rank":1,"offsets":[3,0],"sizes":[1,4]}]}]})";
  const std::string dst_ok = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["c","d"],"tensors":[
      {"name":"w","shape":[4,4],"dtype":"bfloat16","pieces":[{"rank":0,"offsets":[0,0],"sizes":[2,4]}]}]})";
  CHECK(planError(src, dst_ok) == "");
  const std::string dst_gap = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["c","d"],"tensors":[
      {"name":"w","shape":[4,4],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}]})";
  CHECK_THAT(planError(src, dst_gap),
             Catch::Contains("tensor \"w\": rank 1 of layout \"infer\" (node \"d\") needs element [2, 0]") &&
                 Catch::Contains("no rank of layout \"trainer\" holds it"));
  const std::string dst_shape = R"({"group":"infer","mesh":{"shape":[1]},"nodes":["c"],"tensors":[
      {"name":"w","shape":[4,5],"dtype":"bfloat16"}]})";
  CHECK_THAT(planError(src, dst_shape), Catch::Contains("tensor \"w\": layout \"trainer\" has bfloat16 [4, 4] but "
                                                        "layout \"infer\" has bfloat16 [4, 5]"));
  const std::string dst_dtype = R"({"group":"infer","mesh":{"shape":[1]},"nodes":["c"],"tensors":[
      {"name":"w","shape":[4,4],"dtype":"float16"}]})";
  CHECK_THAT(planError(src, dst_dtype), Catch::Contains("has float16 [4, 4]"));
  const std::string dst_missing = R"({"group":"infer","mesh":{"shape":[1]},"nodes":["c"],"tensors":[
      {"name":"bias","shape":[4],"dtype":"float16"}]})";
  CHECK_THAT(planError(src, dst_missing), Catch::Contains("tensor \"bias\": layout \"infer\" needs it but layout "
                                                          "\"trainer\" has no such tensor"));
}

TEST_CASE("limits: tiny layouts that would cost huge memory, CPU or overflow are refused", "[validation][limits]") {
  // A mesh whose product wraps int64 past the rank cap, and one merely too large.
  CHECK_THAT(layoutError(R"({"group":"g","mesh":{"shape":[4294967296,4294967296]},"ranks_per_node":1,"tensors":[]})"),
             Catch::Contains("more than 65536 ranks"));
  CHECK_THAT(layoutError(R"({"group":"g","mesh":{"shape":[4194304]},"ranks_per_node":1,"tensors":[]})"),
             Catch::Contains("--max-layout-ranks"));
  // A split factor costing seconds of CPU per rank.
  CHECK_THAT(
      layoutError(oneTensor(
          R"({"name":"w","shape":[4,4],"dtype":"float32","placements":[{"strided_shard":{"dim":0,"split_factor":2147483647}}]})")),
      Catch::Contains("must be in [1, 4096]"));
  // Shapes whose element count or byte count leaves int64, one by one or summed over the layout.
  CHECK_THAT(
      layoutError(oneTensor(R"({"name":"w","shape":[4611686018427387904,4],"dtype":"float32","placements":[{}]})")),
      Catch::Contains("takes the layout past"));
  CHECK_THAT(layoutError(R"({"group":"g","mesh":{"shape":[1]},"nodes":["n"],"tensors":[
               {"name":"a","shape":[8796093022208],"dtype":"float64","placements":[{"replicate":{}}]},
               {"name":"b","shape":[1],"dtype":"float64","placements":[{"replicate":{}}]}]})"),
             Catch::Contains("tensor \"b\"") && Catch::Contains("takes the layout past"));
  // A piece whose offset + size wraps.
  CHECK_THAT(
      layoutError(oneTensor(
          R"({"name":"w","shape":[4],"dtype":"float32","pieces":[{"rank":0,"offsets":[2],"sizes":[9223372036854775807]}]})")),
      Catch::Contains("[2:2+9223372036854775807] exceeds shape [4]"));
  // Names are bounded, and an error quotes at most a few hundred bytes of one.
  const std::string huge(10 << 20, 'x');
  const auto e = layoutError(R"({"group":")" + huge + R"(","mesh":{"shape":[1]},"nodes":["n"],"tensors":[]})");
  CHECK_THAT(e, Catch::Contains("group is 10485760 bytes (at most 512)"));
  CHECK(e.size() < 400);
  const auto prefix = layoutError(R"({"group":"g","mesh":{"shape":[1000]},"ranks_per_node":1,"node_prefix":")" + huge +
                                  R"(","tensors":[]})");
  CHECK_THAT(prefix, Catch::Contains("node_prefix is 10485760 bytes"));
  CHECK(prefix.size() < 400);
}

TEST_CASE("limits: counts follow setLimits", "[validation][limits]") {
  const Limits saved = limits();
  Limits small = saved;
  small.max_tensors = 2;
  small.max_pieces = 5;
  setLimits(small);
  const std::string three = R"({"group":"g","mesh":{"shape":[1]},"nodes":["n"],"tensors":[
      {"name":"a","shape":[2],"dtype":"float32","placements":[{"replicate":{}}]},
      {"name":"b","shape":[2],"dtype":"float32","placements":[{"replicate":{}}]},
      {"name":"c","shape":[2],"dtype":"float32","placements":[{"replicate":{}}]}]})";
  CHECK_THAT(layoutError(three), Catch::Contains("3 tensors") && Catch::Contains("at most 2"));
  const std::string pieces = R"({"group":"g","mesh":{"shape":[6]},"ranks_per_node":6,"tensors":[
      {"name":"a","shape":[2],"dtype":"float32","placements":[{"replicate":{}}]}]})";
  CHECK_THAT(layoutError(pieces), Catch::Contains("more than 5 pieces"));
  setLimits(saved);
  CHECK(layoutError(three).empty());
}

TEST_CASE("limits: pieces are counted before they are made", "[validation][limits]") {
  // Two strided shards of 4096 on a 2x2 mesh: 16.7 M boxes per rank (~10 GB) from 300 bytes.
  CHECK_THAT(layoutError(oneTensor(
                 R"({"name":"w","shape":[8192,8192],"dtype":"float32","placements":[
                     {"strided_shard":{"dim":0,"split_factor":4096}},{"strided_shard":{"dim":1,"split_factor":4096}}]})",
                 R"({"shape":[2,2]})", R"("ranks_per_node":4)")),
             Catch::Contains("cut it into more than 8388608 pieces"));
  const Limits saved = limits();
  Limits small = saved;
  small.max_explicit_pieces = 4;
  small.max_grid_cells = 10;
  setLimits(small);
  // Every rank of a piece's ranks list is a piece.
  CHECK_THAT(
      layoutError(oneTensor(
          R"({"name":"w","shape":[4],"dtype":"float32","pieces":[{"ranks":[0,1,0,1,0],"offsets":[0],"sizes":[4]}]})")),
      Catch::Contains("lists 5 pieces (at most 4)"));
  // Overlapping pieces: the grid their boundaries cut the tensor into is bounded (4 diagonal
  // 2x2 pieces overlapping by one: 5 x 5 = 25 cells).
  CHECK_THAT(layoutError(oneTensor(
                 R"({"name":"w","shape":[8,8],"dtype":"float32","pieces":[
                     {"rank":0,"offsets":[0,0],"sizes":[2,2]},{"rank":0,"offsets":[1,1],"sizes":[2,2]},
                     {"rank":1,"offsets":[2,2],"sizes":[2,2]},{"rank":1,"offsets":[3,3],"sizes":[2,2]}]})")),
             Catch::Contains("4 overlapping pieces cut it into 25 cells (at most 10)"));
  setLimits(saved);
}
