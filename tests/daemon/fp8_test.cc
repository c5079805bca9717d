// Block-scaled fp8 (v1::BlockScale): e4m3 rounding against a brute-force nearest-value reference
// for every bfloat16 and many float32 values; block scales; quantising boxes that cut blocks
// (a TP slice, a chunk) gives the bytes of quantising the whole tensor; the layouts derive the
// scale tensors and the blocks sources cut; a shard quantises with the given amaxes of its split blocks.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "daemon/stage/convert.h"
#include "planner/layout.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

// The nearest finite e4m3 value to clamp(x, +-448), ties to the even code; NaN to NaN.
uint8_t nearestE4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const float a = std::min(std::fabs(x), 448.0f);
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const float dc = std::fabs(floatFromE4m3(static_cast<uint8_t>(c)) - a);
    const float db = std::fabs(floatFromE4m3(static_cast<uint8_t>(best)) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

// The 2-D box [r0, r1) x [c0, c1).
planner::Box box(int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  planner::Box b;
  b.ndim = 2;
  b.lo = {r0, c0};
  b.hi = {r1, c1};
  return b;
}

}  // namespace

TEST_CASE("fp8: e4m3 rounds to nearest even like the brute-force reference, saturating at 448", "[daemon][fp8]") {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      CHECK(std::isnan(floatFromE4m3(static_cast<uint8_t>(c))));
      continue;
    }
    CHECK(e4m3FromFloat(floatFromE4m3(static_cast<uint8_t>(c))) == c);  // every code round-trips
  }
  for (uint32_t b = 0; b < 0x10000; ++b) {  // every bfloat16
    const float x = floatFromBfloat16(static_cast<uint16_t>(b));
    if (std::isnan(x)) continue;
    INFO("bfloat16 0x" << std::hex << b);
    REQUIRE(e4m3FromFloat(x) == nearestE4m3(x));
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> exponent(-12.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x =
        std::ldexp(1.0f + static_cast<float>(rng() % 8388608) / 8388608.0f, static_cast<int>(exponent(rng))) *
        (rng() % 2 ? -1.0f : 1.0f);
    INFO(x);
    REQUIRE(e4m3FromFloat(x) == nearestE4m3(x));
  }
  // Midpoints round to the even code: 1.0625 is halfway between 1 (0x38) and 1.125 (0x39).
  CHECK(e4m3FromFloat(1.0625f) == 0x38);
  CHECK(e4m3FromFloat(1.1875f) == 0x3a);
  CHECK(e4m3FromFloat(1000.0f) == 0x7e);
  CHECK(e4m3FromFloat(-std::numeric_limits<float>::infinity()) == 0xfe);
  CHECK(e4m3FromFloat(-0.0f) == 0x80);
}

TEST_CASE("fp8: block scales are amax / 448, a power of two when asked, 1 for an all-zero block", "[daemon][fp8]") {
  CHECK(blockScale(448.0f, false) == 1.0f);
  CHECK(blockScale(0.0f, false) == 1.0f);
  CHECK(blockScale(3.0f, false) == 3.0f / 448.0f);
  CHECK(blockScale(3.0f, true) == 0.0078125f);        // 3/448 = 0.0067 -> 2^-7
  CHECK(blockScale(448.0f / 64, true) == 1.0f / 64);  // already a power of two: kept
  CHECK(std::isnan(blockScale(std::nanf(""), false)));
}

TEST_CASE("fp8: quantising boxes that cut blocks gives the bytes of the whole tensor, and one scale per block",
          "[daemon][fp8]") {
  // A 2-D float32 tensor of 10 x 13 in blocks of 4 x 5 (edge blocks 2 x 3), quantised whole, then
  // in three boxes that cut blocks (a TP slice, chunk rows): the same bytes either way.
  const std::vector<int64_t> shape{10, 13};
  std::vector<float> x(130);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(rng);
  x[7] = 40.0f;  // one block with a large value
  planner::TensorLayout w;
  w.name = "w";
  w.shape = shape;
  w.dtype = planner::DType::kFloat8E4M3;
  w.block = {4, 5};
  const std::vector<int64_t> strides{13, 1};
  std::vector<uint8_t> whole(130), parts(130, 0xaa);
  const auto quantize = [&](std::vector<uint8_t>& out, const planner::Box& b) {
    const int64_t origin = b.lo[0] * 13 + b.lo[1];
    return quantizeBox({reinterpret_cast<std::byte*>(out.data()), transport::MemoryKind::kHost, origin, strides},
                       {reinterpret_cast<std::byte*>(x.data()), transport::MemoryKind::kHost, origin, strides},
                       planner::DType::kFloat32, b, w);
  };
  REQUIRE(quantize(whole, box(0, 10, 0, 13)).ok());
  REQUIRE(quantize(parts, box(0, 10, 0, 7)).ok());
  REQUIRE(quantize(parts, box(0, 3, 7, 13)).ok());
  REQUIRE(quantize(parts, box(3, 10, 7, 13)).ok());
  CHECK(parts == whole);
  // Against the definition, element by element.
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t c = 0; c < 13; ++c) {
      float amax = 0;
      for (int64_t i = r / 4 * 4; i < std::min<int64_t>(r / 4 * 4 + 4, 10); ++i)
        for (int64_t j = c / 5 * 5; j < std::min<int64_t>(c / 5 * 5 + 5, 13); ++j)
          amax = std::max(amax, std::fabs(x[i * 13 + j]));
      const float q = std::clamp(x[r * 13 + c] / (amax / 448.0f), -448.0f, 448.0f);
      INFO(r << "," << c);
      REQUIRE(whole[r * 13 + c] == e4m3FromFloat(q));
    }
  // The scales of blocks [1:3, 1:3] through a view whose element i is block i's first element.
  planner::TensorLayout s;
  s.name = "w_scale";
  s.dtype = planner::DType::kFloat32;
  s.block = w.block;
  s.scale_of = 0;
  s.scaled_shape = shape;
  std::vector<float> scales(4);
  const std::vector<int64_t> block_strides{13 * 4, 5}, dense{2, 1};
  REQUIRE(scaleBox({reinterpret_cast<std::byte*>(scales.data()), transport::MemoryKind::kHost, 0, dense},
                   {reinterpret_cast<std::byte*>(x.data()), transport::MemoryKind::kHost, 4 * 13 + 5, block_strides},
                   planner::DType::kFloat32, box(1, 3, 1, 3), s)
              .ok());
  for (int bi = 1; bi < 3; ++bi)
    for (int bj = 1; bj < 3; ++bj) {
      float amax = 0;
      for (int64_t i = bi * 4; i < std::min(bi * 4 + 4, 10); ++i)
        for (int64_t j = bj * 5; j < std::min(bj * 5 + 5, 13); ++j) amax = std::max(amax, std::fabs(x[i * 13 + j]));
      CHECK(scales[(bi - 1) * 2 + (bj - 1)] == amax / 448.0f);
    }
  CHECK_FALSE(quantizeBox({nullptr, transport::MemoryKind::kHost, 0, strides},
                          {nullptr, transport::MemoryKind::kHost, 0, strides}, planner::DType::kInt32, box(0, 1, 0, 1),
                          w)
                  .ok());
}

TEST_CASE("fp8: a weight's values and its scale tensor read each block once, with the same bytes", "[daemon][fp8]") {
  // 10 x 13 bf16 in blocks of 4 x 5: a 3 x 3 grid. The values are quantised in two boxes that cut
  // blocks, then the scale tensor of all nine blocks, sharing one BlockAmaxes.
  const std::vector<int64_t> shape{10, 13}, strides{13, 1};
  std::vector<uint16_t> x(130);
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (auto& v : x) v = bfloat16FromFloat(normal(rng));
  planner::TensorLayout w;
  w.name = "w";
  w.shape = shape;
  w.dtype = planner::DType::kFloat8E4M3;
  w.block = {4, 5};
  planner::TensorLayout s;
  s.name = "w_scale";
  s.shape = {3, 3};
  s.dtype = planner::DType::kFloat32;
  s.block = w.block;
  s.scale_of = 0;
  s.scaled_shape = shape;
  const auto run = [&](BlockAmaxes* amaxes, std::vector<uint8_t>& values, std::vector<float>& scales) {
    for (const auto& b : {box(0, 10, 0, 7), box(0, 10, 7, 13)}) {
      const int64_t origin = b.lo[0] * 13 + b.lo[1];
      REQUIRE(quantizeBox({reinterpret_cast<std::byte*>(values.data()), transport::MemoryKind::kHost, origin, strides},
                          {reinterpret_cast<std::byte*>(x.data()), transport::MemoryKind::kHost, origin, strides},
                          planner::DType::kBFloat16, b, w, nullptr, amaxes)
                  .ok());
    }
    REQUIRE(scaleBox({reinterpret_cast<std::byte*>(scales.data()), transport::MemoryKind::kHost, 0, {3, 1}},
                     {reinterpret_cast<std::byte*>(x.data()), transport::MemoryKind::kHost, 0, {13 * 4, 5}},
                     planner::DType::kBFloat16, box(0, 3, 0, 3), s, nullptr, amaxes)
                .ok());
  };
  std::vector<uint8_t> want(130), got(130);
  std::vector<float> want_scales(9), got_scales(9);
  run(nullptr, want, want_scales);
  BlockAmaxes amaxes(9);
  run(&amaxes, got, got_scales);
  CHECK(got == want);
  CHECK(got_scales == want_scales);
  // Nine blocks, each read once: the two boxes share the blocks they cut, the scales read none.
  CHECK(amaxes.reads() == 9);
  // The scales come from what the values were quantised with, not from a second read: changed
  // memory under a later scale pack leaves them as they were.
  std::fill(x.begin(), x.end(), bfloat16FromFloat(1000.0f));
  std::vector<float> again(9);
  REQUIRE(scaleBox({reinterpret_cast<std::byte*>(again.data()), transport::MemoryKind::kHost, 0, {3, 1}},
                   {reinterpret_cast<std::byte*>(x.data()), transport::MemoryKind::kHost, 0, {13 * 4, 5}},
                   planner::DType::kBFloat16, box(0, 3, 0, 3), s, nullptr, &amaxes)
              .ok());
  CHECK(again == want_scales);
  CHECK(amaxes.reads() == 9);
}

TEST_CASE("fp8 layouts: the scale tensor of each rank's blocks, and the blocks sources cut", "[daemon][fp8]") {
  auto dst = planner::parseLayoutJson(R"({"group":"d","mesh":{"shape":[2]},"nodes":["a","a"],"tensors":[
    {"name":"w","shape":[256,320],"dtype":"float8_e4m3fn","placements":[{"shard":{"dim":1}}],
     "block_scale":{"scale":"w_scale_inv"}}]})",
                                      "d");
  REQUIRE(dst.ok());
  planner::NodeTable nodes;
  auto d = planner::resolveLayout(*dst, nodes);
  REQUIRE(d.ok());
  const auto* s = d->find("w_scale_inv");
  REQUIRE(s != nullptr);
  CHECK(s->shape == std::vector<int64_t>{2, 3});
  CHECK(s->scale_of == 0);
  REQUIRE(s->pieces.size() == 2);  // rank 0: columns 0:160 -> blocks 0:2; rank 1: 160:320 -> 1:3
  CHECK(s->boxes[s->pieces[0].box].str() == "[0:2, 0:2]");
  CHECK(s->boxes[s->pieces[1].box].str() == "[0:2, 1:3]");
  CHECK(d->rankBuffers(1).size() == 2);  // w and w_scale_inv

  const auto source = [&](int ranks) {
    return planner::parseLayoutJson(R"({"group":"s","mesh":{"shape":[)" + std::to_string(ranks) +
                                        R"(]},"nodes":["b","b","b","b"],"tensors":[
      {"name":"w","shape":[256,320],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}]})",
                                    "s");
  };
  auto two = source(2);  // 128 rows each: whole blocks
  REQUIRE(two.ok());
  two->mutable_nodes()->DeleteSubrange(2, 2);
  auto s2 = planner::resolveLayout(*two, nodes);
  REQUIRE(s2.ok());
  REQUIRE(planner::addScaleSources(*s2, *d).ok());
  const auto* v = s2->find("w_scale_inv");
  REQUIRE(v != nullptr);
  CHECK(v->dtype == planner::DType::kBFloat16);  // read from the weight's memory
  CHECK(s2->strides[v->pieces[0].strides] == std::vector<int64_t>{320 * 128, 128});
  CHECK(v->split_blocks.empty());
  auto four = source(4);  // 64 rows each: every block of 128 rows cut in two
  REQUIRE(four.ok());
  auto s4 = planner::resolveLayout(*four, nodes);
  REQUIRE(s4.ok());
  REQUIRE(planner::addScaleSources(*s4, *d).ok());
  const auto* v4 = s4->find("w_scale_inv");
  REQUIRE(v4 != nullptr);
  CHECK(v4->split_blocks == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
  // A block's scale is sent by the rank holding its first element: ranks 0 and 2, rows 0 and 128.
  REQUIRE(v4->pieces.size() == 2);
  CHECK(v4->pieces[0].rank == 0);
  CHECK(v4->boxes[v4->pieces[0].box].str() == "[0:1, 0:3]");
  CHECK(v4->pieces[1].rank == 2);
  CHECK(v4->boxes[v4->pieces[1].box].str() == "[1:2, 0:3]");
  CHECK(v4->pieces[1].offset == 0);

  // A source with its own tensor of the scale's name: refused (scales are computed, never taken).
  auto own = *two;
  auto* t = own.add_tensors();
  t->set_name("w_scale_inv");
  t->add_shape(2);
  t->add_shape(3);
  t->set_dtype("float32");
  auto so = planner::resolveLayout(own, nodes);
  REQUIRE(so.ok());
  const Status named = planner::addScaleSources(*so, *d);
  CHECK(named.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(named.message()), Catch::Contains("has a tensor of that name"));

  auto bad = *dst;
  bad.mutable_tensors(0)->mutable_block_scale()->add_block(128);  // one size for two dims
  CHECK_FALSE(planner::resolveLayout(bad, nodes).ok());
}

TEST_CASE("fp8 layouts: FSDP world 3 and 6 on 1000 rows split exactly the blocks their shard boundaries cross",
          "[daemon][fp8]") {
  auto dst = planner::parseLayoutJson(R"({"group":"d","mesh":{"shape":[1]},"nodes":["i"],"tensors":[
    {"name":"w","shape":[1000,320],"dtype":"float8_e4m3fn","block_scale":{"scale":"w_scale_inv"}}]})",
                                      "d");
  REQUIRE(dst.ok());
  planner::NodeTable nodes;
  auto d = planner::resolveLayout(*dst, nodes);
  REQUIRE(d.ok());
  const auto split_rows = [&](int world) {
    std::string json = R"({"group":"s","mesh":{"shape":[)" + std::to_string(world) + R"(]},"nodes":[)";
    for (int r = 0; r < world; ++r) json += std::string(r ? "," : "") + "\"t\"";
    json += R"(],"tensors":[{"name":"w","shape":[1000,320],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}]})";
    auto src = planner::parseLayoutJson(json, "s");
    REQUIRE(src.ok());
    auto s = planner::resolveLayout(*src, nodes);
    REQUIRE(s.ok());
    REQUIRE(planner::addScaleSources(*s, *d).ok());
    const auto* v = s->find("w_scale_inv");
    REQUIRE(v != nullptr);
    std::vector<int64_t> rows;
    for (const int64_t b : v->split_blocks) {
      if (rows.empty() || rows.back() != b / 3) rows.push_back(b / 3);
      CHECK(std::count(v->split_blocks.begin(), v->split_blocks.end(), b / 3 * 3 + 2) == 1);  // every column
    }
    return std::make_pair(rows, *s);
  };
  // torch.chunk: 334 rows each (boundaries 334, 668: block rows 2 and 5), or 167 (167, 334, 501,
  // 668, 835: block rows 1, 2, 3, 5, 6).
  const auto [three, s3] = split_rows(3);
  CHECK(three == std::vector<int64_t>{2, 5});
  CHECK(split_rows(6).first == std::vector<int64_t>{1, 2, 3, 5, 6});
  // World 3: rank 1 (rows 334-667) sends the scales of block rows 3-5, from row 384 of its shard.
  const auto* v = s3.find("w_scale_inv");
  REQUIRE(v->pieces.size() == 3);
  CHECK(v->boxes[v->pieces[1].box].str() == "[3:6, 0:3]");
  CHECK(v->pieces[1].offset == (384 - 334) * 320);
}

TEST_CASE("fp8: a shard that cuts blocks quantises with the given amaxes of its split blocks, reading only itself",
          "[daemon][fp8]") {
  // Rows 334-667 of a 1000 x 320 bfloat16 tensor (FSDP world 3's rank 1), in memory of their own;
  // blocks of 128 x 128. Its fp8 bytes and the scales of the blocks it sends (block rows 3-5) must
  // be the whole tensor's when the amaxes of block rows 2 and 5 (split) are given.
  const int64_t rows = 1000, cols = 320, lo = 334, hi = 668;
  std::vector<uint16_t> whole(static_cast<size_t>(rows * cols));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& x : whole) x = bfloat16FromFloat(normal(rng));
  whole[300 * cols + 10] = bfloat16FromFloat(40.0f);   // block (2, 0)'s amax: on rank 0
  whole[700 * cols + 300] = bfloat16FromFloat(-9.0f);  // block (5, 2)'s: on rank 2
  const std::vector<int64_t> strides{cols, 1}, grid{8, 3};
  planner::TensorLayout w;
  w.name = "w";
  w.shape = {rows, cols};
  w.dtype = planner::DType::kFloat8E4M3;
  w.block = {128, 128};
  planner::Box all, mine;
  all.ndim = mine.ndim = 2;
  all.hi = {rows, cols};
  mine.lo = {lo, 0};
  mine.hi = {hi, cols};
  std::vector<uint8_t> want(whole.size());
  REQUIRE(quantizeBox({reinterpret_cast<std::byte*>(want.data()), transport::MemoryKind::kHost, 0, strides},
                      {reinterpret_cast<std::byte*>(whole.data()), transport::MemoryKind::kHost, 0, strides},
                      planner::DType::kBFloat16, all, w)
              .ok());
  // The split blocks' amaxes over the whole tensor.
  SplitAmax split;
  for (const int64_t row : {2, 5})
    for (int64_t col = 0; col < 3; ++col) {
      float amax = 0;
      for (int64_t i = row * 128; i < std::min<int64_t>(row * 128 + 128, rows); ++i)
        for (int64_t j = col * 128; j < std::min<int64_t>(col * 128 + 128, cols); ++j)
          amax = std::max(amax, std::fabs(floatFromBfloat16(whole[static_cast<size_t>(i * cols + j)])));
      split.blocks.push_back(row * 3 + col);
      split.amax.push_back(amax);
    }
  // The shard alone: a read outside it would be outside this vector (ASan) and give other bytes.
  std::vector<uint16_t> shard(whole.begin() + lo * cols, whole.begin() + hi * cols);
  std::vector<uint8_t> got(shard.size(), 0xaa);
  REQUIRE(quantizeBox({reinterpret_cast<std::byte*>(got.data()), transport::MemoryKind::kHost, 0, strides},
                      {reinterpret_cast<std::byte*>(shard.data()), transport::MemoryKind::kHost, 0, strides},
                      planner::DType::kBFloat16, mine, w, &split)
              .ok());
  CHECK(std::equal(got.begin(), got.end(), want.begin() + lo * cols));
  // Without the amaxes, the shard's own parts of blocks 2 and 5 would give other scales.
  planner::TensorLayout s;
  s.name = "w_scale_inv";
  s.shape = grid;
  s.dtype = planner::DType::kFloat32;
  s.block = w.block;
  s.scale_of = 0;
  s.scaled_shape = w.shape;
  planner::Box blocks, sent;
  blocks.ndim = sent.ndim = 2;
  blocks.hi = {8, 3};
  sent.lo = {3, 0};
  sent.hi = {6, 3};
  std::vector<float> want_scales(24), got_scales(9, -1.0f);
  REQUIRE(scaleBox({reinterpret_cast<std::byte*>(want_scales.data()), transport::MemoryKind::kHost, 0, {3, 1}},
                   {reinterpret_cast<std::byte*>(whole.data()), transport::MemoryKind::kHost, 0, {cols * 128, 128}},
                   planner::DType::kBFloat16, blocks, s)
              .ok());
  REQUIRE(scaleBox({reinterpret_cast<std::byte*>(got_scales.data()), transport::MemoryKind::kHost, 0, {3, 1}},
                   {reinterpret_cast<std::byte*>(shard.data()),
                    transport::MemoryKind::kHost,
                    (384 - lo) * cols,
                    {cols * 128, 128}},
                   planner::DType::kBFloat16, sent, s, &split)
              .ok());
  CHECK(std::memcmp(got_scales.data(), want_scales.data() + 9, 9 * 4) == 0);
  CHECK(want_scales[15 + 2] == 9.0f / 448.0f);  // block (5, 2): the amax on rank 2
  CHECK(split.find(4) == nullptr);
  REQUIRE(split.find(17) != nullptr);
  CHECK(*split.find(17) == 9.0f);
}
