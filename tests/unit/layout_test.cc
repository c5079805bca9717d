// Layout resolution: DTensor placements, explicit pieces and fused buffers, checked element by
// element against the brute-force reference, plus hand-computed DTensor cases.
#include "planner/layout.h"

#include <catch2/catch.hpp>

#include "tests/unit/reference.h"
#include "tests/unit/test_util.h"

using namespace shardcast;
using namespace shardcast::planner;
using shardcast::testing::layoutFromJson;

namespace {

// The boxes rank `r` holds of tensor 0, as strings, in local order.
std::vector<std::string> boxesOf(const ResolvedLayout& l, int32_t r) {
  std::vector<std::string> out;
  for (const auto& p : l.tensors[0].pieces)
    if (p.rank == r) out.push_back(l.tensors[0].boxes[p.box].str());
  return out;
}

ResolvedLayout resolve(const std::string& json) {
  NodeTable nodes;
  auto r = resolveLayout(layoutFromJson(json), nodes);
  if (!r.ok()) FAIL(std::string(r.status().message()));
  return *r;
}

}  // namespace

TEST_CASE("Shard follows torch.chunk: uneven and empty trailing chunks", "[layout]") {
  auto l = resolve(R"({"group":"g","mesh":{"shape":[4]},"ranks_per_node":4,
    "tensors":[{"name":"w","shape":[5,3],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})");
  CHECK(boxesOf(l, 0) == std::vector<std::string>{"[0:2, 0:3]"});
  CHECK(boxesOf(l, 1) == std::vector<std::string>{"[2:4, 0:3]"});
  CHECK(boxesOf(l, 2) == std::vector<std::string>{"[4:5, 0:3]"});
  CHECK(boxesOf(l, 3).empty());
}

TEST_CASE("Nested Shard on one tensor dim splits left to right", "[layout]") {
  auto l = resolve(R"({"group":"g","mesh":{"shape":[2,2]},"ranks_per_node":2,
    "tensors":[{"name":"w","shape":[7],"dtype":"float32","placements":[{"shard":{"dim":0}},{"shard":{"dim":0}}]}]})");
  CHECK(boxesOf(l, 0) == std::vector<std::string>{"[0:2]"});
  CHECK(boxesOf(l, 1) == std::vector<std::string>{"[2:4]"});
  CHECK(boxesOf(l, 2) == std::vector<std::string>{"[4:6]"});
  CHECK(boxesOf(l, 3) == std::vector<std::string>{"[6:7]"});
}

TEST_CASE("StridedShard matches DTensor's FSDP2+TP example", "[layout]") {
  // PyTorch's _StridedShard docstring: mesh (dp=2, tp=2), placements (_S(0, sf=2), S(0)), 8 rows:
  // rank 0 rows 0-1, rank 1 rows 4-5, rank 2 rows 2-3, rank 3 rows 6-7.
  auto l = resolve(R"({"group":"g","mesh":{"shape":[2,2],"dim_names":["dp","tp"]},"ranks_per_node":4,
    "tensors":[{"name":"w","shape":[8,2],"dtype":"bfloat16",
      "placements":[{"strided_shard":{"dim":0,"split_factor":2}},{"shard":{"dim":0}}]}]})");
  CHECK(boxesOf(l, 0) == std::vector<std::string>{"[0:2, 0:2]"});
  CHECK(boxesOf(l, 1) == std::vector<std::string>{"[4:6, 0:2]"});
  CHECK(boxesOf(l, 2) == std::vector<std::string>{"[2:4, 0:2]"});
  CHECK(boxesOf(l, 3) == std::vector<std::string>{"[6:8, 0:2]"});
}

TEST_CASE("A StridedShard alone holds non-contiguous rows, concatenated locally", "[layout]") {
  auto l = resolve(R"({"group":"g","mesh":{"shape":[2]},"ranks_per_node":2,
    "tensors":[{"name":"w","shape":[8,3],"dtype":"float32",
      "placements":[{"strided_shard":{"dim":0,"split_factor":2}}]}]})");
  CHECK(boxesOf(l, 0) == std::vector<std::string>{"[0:2, 0:3]", "[4:6, 0:3]"});
  const auto& p = l.tensors[0].pieces;
  REQUIRE(p.size() == 4);
  CHECK(p[0].offset == 0);
  CHECK(p[1].offset == 6);  // second box starts after 2 rows of 3
}

TEST_CASE("Node of each rank from ranks_per_node and node_prefix", "[layout]") {
  NodeTable nodes;
  auto r = resolveLayout(layoutFromJson(R"({"group":"g","mesh":{"shape":[5]},"ranks_per_node":2,
    "node_prefix":"host-","tensors":[]})"),
                         nodes);
  REQUIRE(r.ok());
  std::vector<std::string> names;
  for (int32_t n : r->rank_node) names.push_back(nodes.name(n));
  CHECK(names == std::vector<std::string>{"host-0", "host-0", "host-1", "host-1", "host-2"});
}

TEST_CASE("Fused qkv: the local buffer is q, k and v stacked of the rank's shards", "[layout]") {
  auto l = resolve(R"({"group":"vllm","mesh":{"shape":[2]},"ranks_per_node":2,
    "tensors":[
      {"name":"q","shape":[8,4],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
      {"name":"k","shape":[4,4],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
      {"name":"v","shape":[4,4],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}],
    "fused":[{"name":"qkv","dim":0,"tensors":["q","k","v"]}]})");
  // Rank 1: q rows 4-7 at rows 0-3 of its qkv buffer, k rows 2-3 at rows 4-5, v rows 2-3 at 6-7.
  auto find = [&](const std::string& name) {
    for (const auto& p : l.tensors[l.tensor_index.at(name)].pieces)
      if (p.rank == 1) return p;
    FAIL("no piece");
    return PieceRef{};
  };
  CHECK(l.buffer_names[find("q").buffer] == "qkv");
  CHECK(find("q").offset == 0);
  CHECK(find("k").offset == 16);
  CHECK(find("v").offset == 24);
  CHECK(l.strides[find("v").strides] == std::vector<int64_t>{4, 1});
  // Rank 1's only buffer is qkv: 8 rows x 4 columns of bfloat16.
  CHECK(l.rankBuffers(1) == std::vector<std::pair<int32_t, int64_t>>{{find("q").buffer, 32 * 2}});
}

TEST_CASE("Resolution matches the brute-force reference on random layouts", "[layout][property]") {
  std::mt19937 rng(1234);
  for (int it = 0; it < 400; ++it) {
    v1::Layout l = shardcast::testing::randomLayoutShell(rng, "g");
    for (const auto& spec : shardcast::testing::randomTensorSpecs(rng))
      shardcast::testing::addRandomTensor(rng, l, spec, it % 2 == 0);
    NodeTable nodes;
    auto r = resolveLayout(l, nodes);
    INFO(l.DebugString());
    REQUIRE(r.ok());
    std::string dup;
    const auto got = shardcast::testing::resolvedElements(*r, &dup);
    CHECK(dup.empty());
    CHECK(got == shardcast::testing::referenceElements(l));
  }
}

TEST_CASE("Fused buffers match the reference on random TP layouts", "[layout][property]") {
  std::mt19937 rng(99);
  for (int it = 0; it < 200; ++it) {
    const int tp = 1 + static_cast<int>(rng() % 4);
    const int cols = 1 + static_cast<int>(rng() % 3);
    const int members = 2 + static_cast<int>(rng() % 3);
    v1::Layout l;
    l.set_group("vllm");
    l.mutable_mesh()->add_shape(tp);
    l.set_ranks_per_node(2);
    auto* f = l.add_fused();
    f->set_name("fused");
    f->set_dim(0);
    for (int m = 0; m < members; ++m) {
      auto* t = l.add_tensors();
      t->set_name("m" + std::to_string(m));
      t->add_shape(tp * (1 + static_cast<int>(rng() % 3)));  // divisible: every rank has rows
      t->add_shape(cols);
      t->set_dtype("float16");
      t->add_placements()->mutable_shard()->set_dim(0);
      f->add_tensors(t->name());
    }
    NodeTable nodes;
    auto r = resolveLayout(l, nodes);
    REQUIRE(r.ok());
    std::string dup;
    CHECK(shardcast::testing::resolvedElements(*r, &dup) == shardcast::testing::referenceElements(l));
    CHECK(dup.empty());
  }
}

TEST_CASE("Resolving one rank gives that rank exactly what the whole resolve gives it", "[layout]") {
  // Placements (strided and nested), explicit pieces shared by several ranks, and a fused buffer.
  const std::string json = R"({"group":"g","mesh":{"shape":[2,3]},"ranks_per_node":3,"node_prefix":"n","tensors":[
    {"name":"q","shape":[12,8],"dtype":"float32","placements":[{"strided_shard":{"dim":0,"split_factor":3}},{"shard":{"dim":0}}]},
    {"name":"k","shape":[6,8],"dtype":"float32","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
    {"name":"e","shape":[5,4],"dtype":"float32","pieces":[{"ranks":[0,3],"offsets":[0,0],"sizes":[2,4]},
      {"ranks":[1,2,4,5],"offsets":[2,0],"sizes":[3,4]}]},
    {"name":"n","shape":[7],"dtype":"float32"}],
    "fused":[{"name":"qk","dim":0,"tensors":["q","k"]}]})";
  const v1::Layout layout = layoutFromJson(json);
  NodeTable all_nodes;
  const auto all = resolveLayout(layout, all_nodes);
  REQUIRE(all.ok());
  for (int32_t r = 0; r < all->world(); ++r) {
    NodeTable nodes;
    const auto one = resolveLayout(layout, nodes, r);
    REQUIRE(one.ok());
    CHECK(one->rankBuffers(r) == all->rankBuffers(r));
    for (size_t t = 0; t < all->tensors.size(); ++t) {
      std::vector<std::string> want, got;
      for (const auto& p : all->tensors[t].pieces)
        if (p.rank == r)
          want.push_back(all->tensors[t].boxes[p.box].str() + "@" + std::to_string(p.buffer) + "+" +
                         std::to_string(p.offset));
      for (const auto& p : one->tensors[t].pieces) {
        CHECK(p.rank == r);  // nobody else's
        got.push_back(one->tensors[t].boxes[p.box].str() + "@" + std::to_string(p.buffer) + "+" +
                      std::to_string(p.offset));
      }
      INFO("rank " << r << " tensor " << all->tensors[t].name);
      CHECK(got == want);
    }
  }
  NodeTable nodes;
  CHECK_THAT(std::string(resolveLayout(layout, nodes, 6).status().message()),
             Catch::Contains("rank out of range [0, 6)"));
}
