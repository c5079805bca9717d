// Blocks split between source ranks (daemon/engine/split_amax.h): each node's parts of their
// amaxes, read from its ranks' own memory; the coordinator's check and combination; a node's
// check of what it is handed; the wire form.
#include "daemon/engine/split_amax.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "planner/layout.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

constexpr int64_t kRows = 1000, kCols = 320;

// FSDP world 3 over 1000 x 320 float32 (334-row shards) on nodes a, b, b, into one fp8 rank.
planner::ResolvedLayout worldThree(planner::NodeTable& nodes) {
  auto src = planner::parseLayoutJson(R"({"group":"s","mesh":{"shape":[3]},"nodes":["a","b","b"],"tensors":[
    {"name":"w","shape":[1000,320],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})",
                                      "s");
  auto dst = planner::parseLayoutJson(R"({"group":"d","mesh":{"shape":[1]},"nodes":["c"],"tensors":[
    {"name":"w","shape":[1000,320],"dtype":"float8_e4m3fn","block_scale":{"scale":"w_scale_inv"}}]})",
                                      "d");
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  auto s = planner::resolveLayout(*src, nodes);
  auto d = planner::resolveLayout(*dst, nodes);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  REQUIRE(planner::addScaleSources(*s, *d).ok());
  return *s;
}

}  // namespace

TEST_CASE("split amaxes: each node's parts, combined, are the whole blocks' amaxes", "[daemon][fp8]") {
  planner::NodeTable nodes;
  const auto src = worldThree(nodes);
  std::vector<float> whole(static_cast<size_t>(kRows * kCols));
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(static_cast<int64_t>(i % 97) - 48) / 100.0f;
  whole[300 * kCols + 5] = 70.0f;                                      // block (2, 0): on rank 0 (node a)
  whole[340 * kCols + 200] = -80.0f;                                   // block (2, 1): on rank 1 (node b)
  whole[650 * kCols + 300] = std::numeric_limits<float>::quiet_NaN();  // block (5, 2): on rank 1
  // Each rank's memory is its rows; a region indexes into it.
  const int64_t first_row[3] = {0, 334, 668};
  const auto read = [&](const planner::TensorLayout& w, const planner::Region& part) -> StatusOr<float> {
    CHECK(w.name == "w");
    float amax = 0;
    bool nan = false;
    for (int64_t i = 0; i < part.extent[0]; ++i)
      for (int64_t j = 0; j < part.extent[1]; ++j) {
        const int64_t at = part.offset + i * part.strides[0] + j * part.strides[1] + first_row[part.rank] * kCols;
        const float v = std::fabs(whole[static_cast<size_t>(at)]);
        nan = nan || std::isnan(v);
        amax = std::max(amax, v);
      }
    return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
  };
  const int32_t a = nodes.intern("a"), b = nodes.intern("b");
  auto on_a = partialAmaxes(src, a, read);
  auto on_b = partialAmaxes(src, b, read);
  REQUIRE(on_a.ok());
  REQUIRE(on_b.ok());
  // Node a (rank 0, rows 0-333) touches split block row 2; node b (ranks 1, 2) rows 2 and 5.
  CHECK(on_a->at("w").blocks == std::vector<int64_t>{6, 7, 8});
  CHECK(on_b->at("w").blocks == std::vector<int64_t>{6, 7, 8, 15, 16, 17});
  CHECK(on_a->at("w").amax[0] == 70.0f);
  CHECK(on_b->at("w").amax[0] < 70.0f);  // b's part of block (2, 0) has not got its largest
  CHECK(std::isnan(on_b->at("w").amax[5]));

  // The wire form, both ways.
  v1::PrepareResponse wire;
  writeAmaxes(*on_b, wire.mutable_split_amax());
  auto read_back = readAmaxes(wire.split_amax());
  REQUIRE(read_back.ok());
  CHECK(read_back->at("w").blocks == on_b->at("w").blocks);

  const std::vector<std::string> names{"a", "b", "c"};
  const std::vector<int32_t> ids{a, b, nodes.intern("c")};
  auto combined = combineAmaxes(src, ids, names, {*on_a, *read_back, {}});
  REQUIRE(combined.ok());
  REQUIRE(combined->size() == 3);
  CHECK((*combined)[2].empty());  // the destination's node holds no source rank
  // Against the definition, per split block.
  for (int n = 0; n < 2; ++n) {
    const SplitAmax& got = (*combined)[static_cast<size_t>(n)].at("w");
    for (size_t k = 0; k < got.blocks.size(); ++k) {
      const int64_t row = got.blocks[k] / 3, col = got.blocks[k] % 3;
      float amax = 0;
      bool nan = false;
      for (int64_t i = row * 128; i < std::min<int64_t>(row * 128 + 128, kRows); ++i)
        for (int64_t j = col * 128; j < std::min<int64_t>(col * 128 + 128, kCols); ++j) {
          nan = nan || std::isnan(whole[static_cast<size_t>(i * kCols + j)]);
          amax = std::max(amax, std::fabs(whole[static_cast<size_t>(i * kCols + j)]));
        }
      INFO("node " << names[n] << " block " << got.blocks[k]);
      if (nan)
        CHECK(std::isnan(got.amax[k]));
      else
        CHECK(got.amax[k] == amax);
    }
    CHECK(checkCombined(n == 0 ? *on_a : *on_b, (*combined)[static_cast<size_t>(n)]).ok());
  }
  CHECK((*combined)[1].at("w").amax[1] == 80.0f);

  SECTION("a node whose report lacks a block its ranks touch is named") {
    auto short_b = *on_b;
    short_b["w"].blocks.pop_back();
    short_b["w"].amax.pop_back();
    const auto st = combineAmaxes(src, ids, names, {*on_a, short_b, {}}).status();
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(st.message()), Catch::Contains("node \"b\" reported other amaxes of tensor \"w\""));
    const auto none = combineAmaxes(src, ids, names, {{}, *on_b, {}}).status();
    CHECK_THAT(std::string(none.message()), Catch::Contains("node \"a\" reported no amaxes of tensor \"w\""));
    auto extra = *on_a;
    CHECK_FALSE(combineAmaxes(src, ids, names, {*on_a, *on_b, extra}).ok());  // c holds no source rank
  }
  SECTION("a node refuses amaxes below its own part's, or not NaN where its part holds NaN") {
    auto low = (*combined)[1];
    low["w"].amax[1] = 79.0f;
    CHECK_THAT(std::string(checkCombined(*on_b, low).message()), Catch::Contains("block 7: the coordinator's amax 79"));
    auto not_nan = (*combined)[1];
    not_nan["w"].amax[5] = 1000.0f;
    CHECK_FALSE(checkCombined(*on_b, not_nan).ok());
    CHECK_FALSE(checkCombined(*on_b, {}).ok());
    CHECK_FALSE(checkCombined({}, (*combined)[1]).ok());
  }
  SECTION("malformed wire forms are refused") {
    v1::ExecuteRequest req;
    auto* m = req.add_split_amax();
    m->set_tensor("w");
    m->add_blocks(7);
    m->add_blocks(6);
    m->add_amax(1);
    m->add_amax(2);
    CHECK_THAT(std::string(readAmaxes(req.split_amax()).status().message()), Catch::Contains("not sorted"));
    m->add_amax(3);
    CHECK_THAT(std::string(readAmaxes(req.split_amax()).status().message()), Catch::Contains("2 blocks but 3"));
  }
}
