// The daemon's plan cache: a bounded LRU of immutable plans, and what it evicted.
#include <catch2/catch.hpp>

#include "daemon/sync_engine.h"
#include "planner/layout.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

v1::Layout layout(const std::string& group, const std::string& node, int rows) {
  return *planner::parseLayoutJson(R"({"group":")" + group + R"(","mesh":{"shape":[1]},"nodes":[")" + node +
                                       R"("],"tensors":[{"name":"w","shape":[)" + std::to_string(rows) +
                                       R"(,4],"dtype":"float32","placements":[{"replicate":{}}]}]})",
                                   group);
}

}  // namespace

TEST_CASE("plan cache: least recently used plans are evicted, and reported once", "[daemon][plan-cache]") {
  PlanCache cache(2);
  bool hit = false;
  const auto get = [&](int rows) {
    auto p = cache.get(layout("s", "a", rows), layout("d", "b", rows), 1 << 20, 1 << 20, &hit);
    REQUIRE(p.ok());
    return *p;
  };
  const auto first = get(4);
  CHECK_FALSE(hit);
  get(4);
  CHECK(hit);
  get(8);
  get(4);  // 4 is now the most recent
  CHECK(hit);
  CHECK(cache.takeEvicted().empty());
  get(16);  // evicts 8
  CHECK(cache.size() == 2);
  const auto evicted = cache.takeEvicted();
  REQUIRE(evicted.size() == 1);
  CHECK_FALSE(cache.contains(evicted[0]));
  CHECK(cache.contains(first->key));
  CHECK(cache.takeEvicted().empty());
  get(8);
  CHECK_FALSE(hit);  // planned again
  // A plan evicted while a sync still uses it stays valid for that sync.
  get(32);
  get(64);
  CHECK_FALSE(cache.contains(first->key));
  CHECK(first->plan.stats.network_bytes > 0);
}
