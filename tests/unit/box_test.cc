// Box algebra against brute-force element enumeration.
#include "planner/box.h"

#include <catch2/catch.hpp>
#include <random>
#include <set>

using namespace shardcast::planner;

namespace {

Box box2(int64_t a0, int64_t a1, int64_t b0, int64_t b1) { return Box::fromOffsetsSizes({a0, b0}, {a1 - a0, b1 - b0}); }

std::set<std::pair<int64_t, int64_t>> elements(const std::vector<Box>& boxes) {
  std::set<std::pair<int64_t, int64_t>> s;
  for (const Box& b : boxes)
    for (int64_t i = b.lo[0]; i < b.hi[0]; ++i)
      for (int64_t j = b.lo[1]; j < b.hi[1]; ++j) s.emplace(i, j);
  return s;
}

Box randomBox(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int64_t> u(0, n);
  int64_t a = u(rng), b = u(rng), c = u(rng), d = u(rng);
  return box2(std::min(a, b), std::max(a, b), std::min(c, d), std::max(c, d));
}

}  // namespace

TEST_CASE("intersect and overlaps agree with element sets", "[box]") {
  std::mt19937 rng(7);
  for (int it = 0; it < 500; ++it) {
    const Box a = randomBox(rng, 9), b = randomBox(rng, 9);
    const auto ea = elements({a}), eb = elements({b}), ei = elements({intersect(a, b)});
    std::set<std::pair<int64_t, int64_t>> expect;
    for (const auto& e : ea)
      if (eb.count(e)) expect.insert(e);
    REQUIRE(ei == expect);
    REQUIRE(overlaps(a, b) == !expect.empty());
  }
}

TEST_CASE("disjointUnion covers exactly the union, without overlap", "[box]") {
  std::mt19937 rng(11);
  for (int it = 0; it < 300; ++it) {
    std::vector<Box> boxes;
    const int n = 1 + it % 6;
    for (int i = 0; i < n; ++i) boxes.push_back(randomBox(rng, 12));
    const auto parts = disjointUnion(boxes);
    int64_t sum = 0;
    for (const Box& p : parts) sum += p.volume();
    const auto expect = elements(boxes);
    REQUIRE(elements(parts) == expect);
    REQUIRE(sum == static_cast<int64_t>(expect.size()));
    REQUIRE(unionVolume(boxes) == static_cast<int64_t>(expect.size()));
    REQUIRE(pairwiseDisjoint(parts));
  }
}

TEST_CASE("pairwiseDisjoint detects any overlap", "[box]") {
  REQUIRE(pairwiseDisjoint({box2(0, 2, 0, 4), box2(2, 4, 0, 4), box2(0, 4, 4, 8)}));
  REQUIRE_FALSE(pairwiseDisjoint({box2(0, 2, 0, 4), box2(2, 4, 0, 4), box2(1, 3, 3, 5)}));
  REQUIRE_FALSE(pairwiseDisjoint({box2(0, 4, 0, 4), box2(0, 4, 0, 4)}));
}

TEST_CASE("splitIntoChunks tiles the box with row-major slabs under the limit", "[box]") {
  const Box b = Box::fromOffsetsSizes({1, 2, 3}, {5, 7, 9});
  for (int64_t max_bytes : {1, 7, 18, 36, 63, 64, 200, 1000, 4000, 100000}) {
    const auto chunks = splitIntoChunks(b, 2, max_bytes);
    REQUIRE(static_cast<int64_t>(chunks.size()) == chunkCount(b, 2, max_bytes));
    int64_t sum = 0;
    for (const Box& c : chunks) {
      REQUIRE(b.contains(c));
      REQUIRE((c.volume() * 2 <= max_bytes || c.volume() == 1));
      sum += c.volume();
    }
    REQUIRE(sum == b.volume());
    REQUIRE(pairwiseDisjoint(chunks));
  }
  REQUIRE(splitIntoChunks(b, 2, 1 << 20).size() == 1);
}

TEST_CASE("isContiguous: dense boxes, sub-boxes and size-1 dims", "[box]") {
  const Box b = Box::fromOffsetsSizes({0, 0}, {3, 4});
  CHECK(isContiguous({4, 1}, b));        // dense 3x4
  CHECK_FALSE(isContiguous({8, 1}, b));  // rows of a wider buffer
  const Box row = Box::fromOffsetsSizes({2, 0}, {1, 4});
  CHECK(isContiguous({8, 1}, row));  // one row is contiguous whatever the row stride
  const Box col = Box::fromOffsetsSizes({0, 1}, {3, 1});
  CHECK_FALSE(isContiguous({4, 1}, col));  // a column is strided
}
