// The schedule of random plans (planner/schedule.h): the staging budget rule per wave and node,
// offsets that never overlap, chunks that cover each transfer exactly, and the notification check
// that accepts exactly what the schedule sends.
#include "planner/schedule.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <random>
#include <set>

#include "tests/unit/reference.h"
#include "tests/unit/test_util.h"

using namespace shardcast;
using namespace shardcast::planner;
using namespace shardcast::testing;

namespace {

uint64_t aligned(int64_t bytes) { return (static_cast<uint64_t>(bytes) + 63) & ~uint64_t{63}; }

// [offset, offset + size) per user, in one (wave, node) space: none overlap, all inside `limit`;
// more than one only while the sum stays within `budget` (one alone may exceed it).
void checkSpace(const std::vector<std::pair<uint64_t, uint64_t>>& used, uint64_t budget, uint64_t limit) {
  uint64_t sum = 0;
  for (size_t i = 0; i < used.size(); ++i) {
    sum += used[i].second;
    CHECK(used[i].first + used[i].second <= limit);
    for (size_t j = i + 1; j < used.size(); ++j)
      CHECK((used[i].first + used[i].second <= used[j].first || used[j].first + used[j].second <= used[i].first));
  }
  if (used.size() > 1) CHECK(sum <= budget);
}

}  // namespace

TEST_CASE("schedule: waves keep every node within the staging budget, offsets never overlap", "[planner][schedule]") {
  std::mt19937 rng(20261201);
  for (int it = 0; it < 300; ++it) {
    const auto [src, dst] = randomLayoutPair(rng);
    const uint64_t budget = std::vector<uint64_t>{64, 256, 4096, 1 << 20}[rng() % 4];
    const uint64_t chunk = std::vector<uint64_t>{8, 64, 1 << 20}[rng() % 3];
    INFO("src: " << src.ShortDebugString() << "\ndst: " << dst.ShortDebugString() << "\nbudget " << budget << " chunk "
                 << chunk);
    auto s = makeSchedule(src, dst, budget, chunk);
    REQUIRE(s.ok());
    const auto& plan = s->plan;
    const size_t transfers = plan.transfers.size();
    // Waves follow plan order.
    for (size_t t = 1; t < transfers; ++t) CHECK(s->transfers[t - 1].wave <= s->transfers[t].wave);
    if (transfers > 0) CHECK(s->waves == s->transfers.back().wave + 1);
    REQUIRE(s->transfers.size() == transfers);
    REQUIRE(s->per_node.size() == static_cast<size_t>(s->nodes.size()));
    std::map<std::pair<int32_t, int32_t>, int64_t> landings;  // (wave, node) -> chunks landing
    std::map<std::pair<int32_t, int32_t>, std::vector<std::pair<uint64_t, uint64_t>>> arena, staging;
    for (size_t t = 0; t < transfers; ++t) {
      const auto& tr = plan.transfers[t];
      const auto& ts = s->transfers[t];
      const int32_t w = ts.wave;
      for (const auto& l : ts.landings) {
        if (!l.direct()) arena[{w, l.node}].emplace_back(l.arena_offset, aligned(tr.bytes));
        landings[{w, l.node}] += static_cast<int64_t>(ts.chunks.size());
        CHECK(ts.landingOn(l.node) == &l);
      }
      for (const auto& h : ts.heading) {
        staging[{w, h.node}].emplace_back(h.staging_offset, aligned(tr.bytes));
        CHECK(ts.stagingOffset(h.node) == h.staging_offset);
      }
      // Chunks: one after another, covering the transfer exactly.
      uint64_t at = 0;
      for (const auto& c : ts.chunks) {
        CHECK(c.offset == at);
        at += c.bytes;
      }
      CHECK(at == static_cast<uint64_t>(tr.bytes));
      // The receiver accepts what the schedule sends, in its wave only.
      for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
        const auto& chain = plan.chains[static_cast<size_t>(ch)];
        for (int32_t hop = 1; hop < chain.nodes_count; ++hop) {
          const int32_t node = plan.chain_nodes[static_cast<size_t>(chain.nodes_begin + hop)];
          CHECK(s->landedProblem(static_cast<int32_t>(t), ch, hop, 0, w, node).empty());
          CHECK_FALSE(s->landedProblem(static_cast<int32_t>(t), ch, hop, 0, w + 1, node).empty());
          CHECK_FALSE(
              s->landedProblem(static_cast<int32_t>(t), ch, hop, static_cast<int32_t>(ts.chunks.size()), w, node)
                  .empty());
        }
      }
    }
    for (const auto& [key, used] : arena) checkSpace(used, budget, s->node(key.second).arena_bytes);
    for (const auto& [key, used] : staging) checkSpace(used, budget, s->node(key.second).staging_bytes);
    // Each node expects, per wave, exactly the chunks that land on it; direct targets once each.
    for (int32_t n = 0; n < s->nodes.size(); ++n) {
      const auto& ns = s->node(n);
      REQUIRE(ns.incoming.size() == static_cast<size_t>(s->waves));
      for (int32_t w = 0; w < s->waves; ++w) CHECK(ns.incoming[static_cast<size_t>(w)] == landings[{w, n}]);
      CHECK(std::is_sorted(ns.direct_targets.begin(), ns.direct_targets.end()));
      CHECK(std::adjacent_find(ns.direct_targets.begin(), ns.direct_targets.end()) == ns.direct_targets.end());
    }
  }
}

TEST_CASE("schedule: budgets and chunk sizes must be positive", "[planner][schedule]") {
  const v1::Layout l = layoutFromJson(R"({"group":"g","mesh":{"shape":[1]},"nodes":["a"],"tensors":[]})");
  CHECK_FALSE(makeSchedule(l, l, 0, 1).ok());
  CHECK_FALSE(makeSchedule(l, l, 1, 0).ok());
}

TEST_CASE("schedule: each node's peers are exactly the nodes it writes to and the landings of what it heads",
          "[planner][schedule]") {
  std::mt19937 rng(20261202);
  for (int it = 0; it < 200; ++it) {
    const auto [src, dst] = randomLayoutPair(rng);
    const auto strategy =
        std::vector<Strategy>{Strategy::kPlanned, Strategy::kRankPull, Strategy::kGatherBroadcast}[rng() % 3];
    INFO("src: " << src.ShortDebugString() << "\ndst: " << dst.ShortDebugString());
    auto s = makeSchedule(src, dst, 1 << 20, 64, true, strategy);
    REQUIRE(s.ok());
    const auto& plan = s->plan;
    // Brute force: replay every send the executor makes (heads, then forwards hop by hop).
    std::vector<std::set<int32_t>> want(static_cast<size_t>(s->nodes.size()));
    for (size_t t = 0; t < plan.transfers.size(); ++t) {
      const auto& tr = plan.transfers[t];
      for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
        const auto& ch = plan.chains[c];
        for (const auto& l : s->transfers[t].landings) want[static_cast<size_t>(ch.src_node)].insert(l.node);
        for (int32_t hop = 0; hop < ch.nodes_count; ++hop) {
          const int32_t here = plan.chain_nodes[ch.nodes_begin + hop];
          const int32_t last = ch.star ? (hop == 0 ? ch.nodes_count - 1 : hop) : std::min(hop + 1, ch.nodes_count - 1);
          for (int32_t next = hop + 1; next <= last; ++next)
            want[static_cast<size_t>(here)].insert(plan.chain_nodes[ch.nodes_begin + next]);
        }
      }
    }
    for (int32_t n = 0; n < s->nodes.size(); ++n) {
      const auto& peers = s->node(n).peers;
      CHECK(std::set<int32_t>(peers.begin(), peers.end()) == want[static_cast<size_t>(n)]);
      CHECK(std::is_sorted(peers.begin(), peers.end()));
      CHECK(std::adjacent_find(peers.begin(), peers.end()) == peers.end());
    }
  }
}
