// The daemon's plan cache: a bounded LRU of immutable plans, what it evicted, and replica sets
// whose position plan outlives their memberships.
#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "common/grpc_status.h"
#include "daemon/engine/sync_engine.h"
#include "planner/layout.h"
#include "tests/daemon/in_process_node.h"
#include "tests/daemon/rank_memory.h"
#include "transport/device_staging.h"

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
    auto p = cache.get(layout("s", "a", rows), layout("d", "b", rows), PlanKey{1 << 20, 1 << 20}, &hit);
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

TEST_CASE(
    "plan cache: layouts sharing a cached plan's digests without being its layouts are planned anew - a "
    "repeated sync naming them by digest is sent back to a full one",
    "[daemon][plan-cache][security]") {
  PlanCache cache(4);
  bool hit = false;
  const PlanKey key{1 << 20, 1 << 20};
  // As if both pairs' digests collided (xxHash64 is not collision resistant: docs/security.md).
  const LayoutDigests same{"00000000000000aa", "00000000000000bb"};
  const auto get = [&](const std::string& prefix, int rows) {
    auto p = cache.get(layout(prefix + "s", "a", rows), layout(prefix + "d", "b", rows), same, key, &hit);
    REQUIRE(p.ok());
    return *p;
  };
  const auto mine = get("", 4);
  CHECK_FALSE(hit);
  // Another uid's groups, other layouts, the same digests: not handed the cached plan.
  const auto theirs = get("evil-", 8);
  CHECK_FALSE(hit);
  CHECK(theirs->dst.group == "evil-d");
  CHECK(theirs->key == mine->key);
  CHECK(cache.size() == 1);                                           // it took the other's place,
  CHECK(cache.takeEvicted() == std::vector<std::string>{mine->key});  // and that one's spares go
  get("evil-", 8);
  CHECK(hit);  // the same layouts again: their own plan

  // A repeated sync of the first groups, by digest: refused as a stale view, never given theirs.
  v1::PrepareRequest req;
  req.set_sync_id("repeated");
  req.mutable_src()->set_group("s");
  req.mutable_dst()->set_group("d");
  req.set_src_digest(same.src);
  req.set_dst_digest(same.dst);
  req.add_expect()->set_node("a");
  LayoutDigests digests;
  const auto repeated = cache.forPrepare(req, key, "a", &hit, &digests);
  REQUIRE_FALSE(repeated.ok());
  CHECK(repeated.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(repeated.status().message()), Catch::Contains(kStaleView));
  CHECK_THAT(std::string(repeated.status().message()), Catch::Contains("for groups \"evil-s\" -> \"evil-d\""));
  // Run in full, with its layouts: planned anew, its own again.
  const auto again = get("", 4);
  CHECK_FALSE(hit);
  CHECK(again->dst.group == "d");
  CHECK(again->plan.stats.network_bytes == mine->plan.stats.network_bytes);
}

TEST_CASE(
    "a rank registered under a cached plan's digests with another layout is refused before a byte moves - the plan "
    "would move that layout's bytes",
    "[daemon][plan-cache][security]") {
  // The plan node b caches under the digests of (s, d as registered) was made from another layout
  // of d, as after its owner re-registered d with a layout crafted to collide (xxHash64 digests
  // can be: docs/security.md). Its buffers differ (one fused buffer instead of two).
  const std::string tensors = R"("tensors":[{"name":"w","shape":[16,4],"dtype":"float32"},
                                            {"name":"v","shape":[16,4],"dtype":"float32"}])";
  const auto parse = [](const std::string& json, const std::string& group) {
    return *planner::parseLayoutJson(json, group);
  };
  const v1::Layout src = parse(R"({"group":"s","mesh":{"shape":[1]},"nodes":["a"],)" + tensors + "}", "s");
  const v1::Layout registered = parse(R"({"group":"d","mesh":{"shape":[1]},"nodes":["b"],)" + tensors + "}", "d");
  const v1::Layout other = parse(R"({"group":"d","mesh":{"shape":[1]},"nodes":["b"],)" + tensors +
                                     R"(,"fused":[{"name":"wv","dim":0,"tensors":["w","v"]}]})",
                                 "d");
  testing::InProcessNode b("b");
  planner::NodeTable nodes;
  const auto resolved = *planner::resolveLayout(registered, nodes);
  testing::RankMemory memory = testing::allocateRank(resolved, 0, "collide-d0");
  REQUIRE(
      b.registry.registerRank(testing::registerRequest(registered, 0, 1, memory), MemoryCaller{0, true, true}).ok());

  v1::PrepareRequest full = testing::prepareRequest("collide", src, registered, 1, 5);
  const PlanKey key = PlanKey::forSync(full.staging_bytes(), full.chunk_bytes(), full.delta(), full.packed());
  bool hit = false;
  const LayoutDigests digests{planner::layoutDigest(src), planner::layoutDigest(registered)};
  REQUIRE(b.engine.plans().get(src, other, digests, key, &hit).ok());  // other's plan, under registered's digests

  // A repeated sync names the layouts by digest: the cached plan matches them and the groups.
  v1::PrepareRequest by_digest = full;
  by_digest.mutable_src()->Clear();
  by_digest.mutable_src()->set_group("s");
  by_digest.mutable_dst()->Clear();
  by_digest.mutable_dst()->set_group("d");
  by_digest.set_src_digest(digests.src);
  by_digest.set_dst_digest(digests.dst);
  auto* stamp = by_digest.add_expect();
  stamp->set_node("b");
  stamp->set_instance(b.registry.instance());
  stamp->set_generation(b.registry.generation());
  const auto refused = b.engine.prepare(by_digest);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("group \"d\" rank 0 on node \"b\" registered a layout other than the one the sync was "
                             "planned for, under the same digest " +
                             digests.dst));
  // Nothing was taken: the same sync with its layouts plans them (their fingerprint is not the
  // cached plan's) and prepares.
  full.set_fence(6);
  const auto prepared = b.engine.prepare(full);
  INFO((prepared.ok() ? "" : std::string(prepared.status().message())));
  CHECK(prepared.ok());
  v1::FinishRequest abort;
  abort.set_sync_id("collide");
  abort.set_fence(6);
  abort.set_commit(false);
  CHECK(b.engine.finish(abort).ok());
}

TEST_CASE("spare memory: a region smaller than the plan asks for is never handed out", "[daemon][plan-cache]") {
  transport::TransportOptions options;
  options.backend = "loopback";
  options.name = "spares";
  auto context = transport::createContext(options);
  REQUIRE(context.ok());
  auto small = transport::allocateHostStaging(**context, 4096, nullptr, "a test region");
  REQUIRE(small.ok());
  SpareMemory spares;
  spares.keep("k", SpareMemory::Use::kArena, *small);
  CHECK(spares.take("k", SpareMemory::Use::kStaging, 1) == nullptr);  // (another use)
  CHECK(spares.take("k", SpareMemory::Use::kArena, 8192) == nullptr);
  CHECK(spares.size() == 0);  // dropped, not kept
  spares.keep("k", SpareMemory::Use::kArena, *small);
  CHECK(spares.take("k", SpareMemory::Use::kArena, 4096) == *small);
}

namespace {

// Replica `k` of the set "rollout": two ranks on nodes r<k>a and r<k>b, rows sharded.
planner::Replica replica(int k, int rows = 64) {
  const std::string n = "r" + std::to_string(k);
  planner::Replica r;
  r.id = k;
  r.layout = *planner::parseLayoutJson(R"({"group":"rollout.)" + n + R"(","replica_set":"rollout","replica":)" +
                                           std::to_string(k) + R"(,"mesh":{"shape":[2]},"nodes":[")" + n + R"(a",")" +
                                           n + R"(b"],"tensors":[{"name":"w","shape":[)" + std::to_string(rows) +
                                           R"(,32],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})",
                                       n);
  return r;
}

// Per node name: the (transfer, node it receives from) pairs of a plan.
std::map<std::string, std::set<std::pair<int32_t, std::string>>> upstreams(const CachedPlan& p) {
  std::map<std::string, std::set<std::pair<int32_t, std::string>>> out;
  for (int32_t t = 0; t < static_cast<int32_t>(p.plan.transfers.size()); ++t) {
    const auto& tr = p.plan.transfers[static_cast<size_t>(t)];
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const auto& ch = p.plan.chains[static_cast<size_t>(c)];
      std::string from = p.nodes.name(ch.src_node);
      for (int32_t h = 0; h < ch.nodes_count; ++h) {
        const std::string& node = p.nodes.name(p.plan.chain_nodes[static_cast<size_t>(ch.nodes_begin + h)]);
        out[node].insert({t, from});
        from = node;
      }
    }
  }
  return out;
}

}  // namespace

// A dense sync's key: 1 MiB of staging, `chunk` bytes per chunk.
PlanKey key(uint64_t chunk) { return PlanKey::forSync(1 << 20, chunk, v1::DELTA_OFF, false); }

// The source the replica sets here sync from: one rank on t0 holding w [64, 32].
v1::Layout trainSource() {
  return *planner::parseLayoutJson(
      R"({"group":"train","mesh":{"shape":[1]},"nodes":["t0"],"tensors":[{"name":"w","shape":[64,32],"dtype":"float32"}]})",
      "train");
}

TEST_CASE("plan cache: a replica set's position plan is planned once and reused as replicas join and leave",
          "[daemon][plan-cache][replicas]") {
  PlanCache cache(4);
  const v1::Layout src = trainSource();
  bool hit = false;
  auto two = cache.getReplicaSet(src, {replica(0), replica(1)}, key(1 << 20), &hit);
  INFO((two.ok() ? "" : std::string(two.status().message())));
  REQUIRE(two.ok());
  CHECK_FALSE(hit);
  CHECK(cache.positionPlansMade() == 1);
  CHECK((*two)->dst.world() == 4);  // the stacked destination the engines execute against
  auto again = cache.getReplicaSet(src, {replica(0), replica(1)}, key(1 << 20), &hit);
  REQUIRE(again.ok());
  CHECK(hit);
  CHECK(again->get() == two->get());

  // A replica joins: composed anew from the same position plan; every node of the new replica
  // receives, and the earlier replicas' nodes receive the same transfers from the same nodes.
  auto three = cache.getReplicaSet(src, {replica(0), replica(1), replica(2)}, key(1 << 20), &hit);
  REQUIRE(three.ok());
  CHECK_FALSE(hit);
  CHECK(cache.positionPlansMade() == 1);
  CHECK((*three)->dst.world() == 6);
  const auto before = upstreams(**two), after = upstreams(**three);
  for (const char* node : {"r0a", "r0b", "r1a", "r1b"}) CHECK(after.at(node) == before.at(node));
  CHECK(after.count("r2a"));
  CHECK(after.count("r2b"));
  for (int32_t n = 0; n < (*three)->nodes.size(); ++n)
    if ((*three)->nodes.name(n)[0] == 'r') CHECK((*three)->node(n).incoming[0] > 0);

  // A replica leaves: still no planning.
  auto without_one = cache.getReplicaSet(src, {replica(0), replica(2)}, key(1 << 20), &hit);
  REQUIRE(without_one.ok());
  CHECK(cache.positionPlansMade() == 1);
  CHECK((*without_one)->dst.world() == 4);

  // Another chunk size is another position plan; a replica of another shape is refused by name.
  REQUIRE(cache.getReplicaSet(src, {replica(0)}, key(1 << 10), &hit).ok());
  CHECK(cache.positionPlansMade() == 2);
  auto odd = cache.getReplicaSet(src, {replica(0), replica(1, 32)}, key(1 << 20), &hit);
  REQUIRE_FALSE(odd.ok());
  CHECK(odd.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(odd.status().message()), Catch::Contains("rollout.r1"));
  // Packed (no zero copy) is a plan of its own; a baseline strategy is refused for a set.
  auto packed =
      cache.getReplicaSet(src, {replica(0), replica(1)}, PlanKey::forSync(1 << 20, 1 << 20, v1::DELTA_OFF, true), &hit);
  REQUIRE(packed.ok());
  CHECK_FALSE(hit);
  CHECK(packed->get() != two->get());
  CHECK_FALSE((*packed)->zero_copy);
  auto baseline = cache.getReplicaSet(
      src, {replica(0)}, PlanKey::forSync(1 << 20, 1 << 20, v1::DELTA_OFF, false, planner::Strategy::kRankPull), &hit);
  CHECK(baseline.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("plan cache: a replica set's delta bases are kept under one key for every membership",
          "[daemon][plan-cache][replicas][delta]") {
  PlanCache cache(2);
  const v1::Layout src = trainSource();
  const PlanKey delta = PlanKey::forSync(1 << 20, 1 << 10, v1::DELTA_AUTO, false);
  bool hit = false;
  const auto get = [&](std::vector<planner::Replica> members) {
    auto p = cache.getReplicaSet(src, members, delta, &hit);
    INFO((p.ok() ? "" : std::string(p.status().message())));
    REQUIRE(p.ok());
    return *p;
  };
  const auto two = get({replica(0), replica(1)}), three = get({replica(0), replica(1), replica(2)});
  // Plans per membership, with the same transfers (the position plan's), so the same bases.
  CHECK(two->key != three->key);
  CHECK(two->bases_key == three->bases_key);
  CHECK(two->bases_key != two->key);
  REQUIRE(two->plan.transfers.size() == three->plan.transfers.size());
  for (size_t t = 0; t < two->plan.transfers.size(); ++t) {
    CHECK(two->plan.transfers[t].bytes == three->plan.transfers[t].bytes);
    CHECK(two->plan.transfers[t].chunks == three->plan.transfers[t].chunks);
  }
  // One membership's plan evicted while another's is cached: its bases stay.
  const auto one = get({replica(0)});
  CHECK(one->bases_key == two->bases_key);
  CHECK(cache.takeEvicted() == std::vector<std::string>{two->key});
  // Every membership gone: the bases go too (reported once, after the last plan's key).
  const auto plain = [&](int rows) {
    auto p = cache.get(layout("s", "a", rows), layout("d", "b", rows), PlanKey{1 << 20, 1 << 20}, &hit);
    REQUIRE(p.ok());
    return *p;
  };
  plain(4);
  CHECK(cache.takeEvicted() == std::vector<std::string>{three->key});
  const auto last = plain(8);
  CHECK(cache.takeEvicted() == std::vector<std::string>{one->key, two->bases_key});
  CHECK(last->bases_key == last->key);  // a plain group's bases are its plan's
}

TEST_CASE(
    "plan cache: a replica set's Prepare by digest takes the composed plan of those very groups - else a stale "
    "view",
    "[daemon][plan-cache][replicas]") {
  PlanCache cache(2);
  const v1::Layout src = trainSource();
  bool hit = false;
  auto full = cache.getReplicaSet(src, {replica(0), replica(1)}, key(1 << 20), &hit);
  REQUIRE(full.ok());
  CHECK((*full)->src_digest == planner::layoutDigest(src));
  REQUIRE((*full)->members.size() == 2);
  CHECK((*full)->members[1] ==
        CachedPlan::Member{"rollout.r1", 1, planner::layoutDigest(replica(1).layout)});  // stacking order

  // What a coordinator sends once every daemon planned the set: groups and digests only.
  const auto byDigest = [&](const std::vector<CachedPlan::Member>& members) {
    v1::PrepareRequest req;
    req.set_sync_id("again");
    req.mutable_src()->set_group("train");
    req.set_src_digest((*full)->src_digest);
    req.mutable_dst()->set_group("rollout");
    for (const auto& m : members) {
      v1::Layout* named = req.add_replicas();
      named->set_group(m.group);
      named->set_replica_set("rollout");
      named->set_replica(m.replica);
      req.add_replica_digests(m.digest);
    }
    return req;
  };
  const auto members = (*full)->members;
  auto again = cache.forSetPrepare(byDigest(members), key(1 << 20), "r0a", &hit);
  REQUIRE(again.ok());
  CHECK(hit);
  CHECK(again->get() == full->get());

  const auto refused = [&](const v1::PrepareRequest& req, absl::StatusCode code, const std::string& says) {
    auto plan = cache.forSetPrepare(req, key(1 << 20), "r0a", &hit);
    REQUIRE_FALSE(plan.ok());
    CHECK(plan.status().code() == code);
    CHECK_THAT(std::string(plan.status().message()), Catch::Contains(says));
    // A stale view is marked as one, across gRPC too (what the coordinator runs again with the
    // layouts); a malformed request is not.
    const bool stale = code == absl::StatusCode::kFailedPrecondition;
    CHECK(isMarkedStale(plan.status()) == stale);
    CHECK(isMarkedStale(toGrpcNamingGroup(plan.status())) == stale);
  };
  // Not cached: another membership, another chunk size, a source digest never planned here.
  refused(byDigest({members[0]}), absl::StatusCode::kFailedPrecondition, kStaleView);
  {
    auto plan = cache.forSetPrepare(byDigest(members), key(1 << 10), "r0a", &hit);
    CHECK_THAT(std::string(plan.status().message()), Catch::Contains(kStaleView));
  }
  auto other_source = byDigest(members);
  other_source.set_src_digest("0123456789abcdef");
  refused(other_source, absl::StatusCode::kFailedPrecondition, "no longer caches the plan of layout 0123456789abcdef");
  // The same ids and digests under other groups (a replica re-registered under another name, or
  // layouts crafted to collide): not this sync's plan, whatever the digests say.
  auto renamed = members;
  renamed[1].group = "rollout.other";
  refused(byDigest(renamed), absl::StatusCode::kFailedPrecondition, "[rollout.r0, rollout.other] (a stale view)");
  auto other_src_group = byDigest(members);
  other_src_group.mutable_src()->set_group("evil");
  refused(other_src_group, absl::StatusCode::kFailedPrecondition, kStaleView);
  // Malformed: a digest missing or not a digest, a destination digest, a seed.
  auto missing = byDigest(members);
  missing.mutable_replica_digests()->RemoveLast();
  refused(missing, absl::StatusCode::kInvalidArgument, "one digest per replica");
  auto not_hex = byDigest(members);
  not_hex.set_replica_digests(0, "not a digest....");
  refused(not_hex, absl::StatusCode::kInvalidArgument, "16 hex digits");
  auto with_dst = byDigest(members);
  with_dst.set_dst_digest((*full)->src_digest);
  refused(with_dst, absl::StatusCode::kInvalidArgument, "no destination digest");
  auto seed = byDigest(members);
  seed.set_seed(true);
  refused(seed, absl::StatusCode::kInvalidArgument, "no seed");
  auto other_set = byDigest(members);
  other_set.mutable_replicas(0)->set_replica_set("elsewhere");
  refused(other_set, absl::StatusCode::kInvalidArgument, "one digest per replica of the set");
}

TEST_CASE("plan key: zero copy only for a dense sync through no packed-only buffer", "[daemon][plan]") {
  using shardcast::v1::DELTA_AUTO;
  using shardcast::v1::DELTA_OFF;
  CHECK(PlanKey::forSync(1 << 20, 1 << 20, DELTA_OFF, false).zero_copy);
  CHECK_FALSE(PlanKey::forSync(1 << 20, 1 << 20, DELTA_AUTO, false).zero_copy);  // deltas travel packed
  CHECK_FALSE(PlanKey::forSync(1 << 20, 1 << 20, DELTA_OFF, true).zero_copy);    // a staged buffer somewhere
  // Each is a plan of its own: the keys differ where the plans do.
  const auto dense = PlanKey::forSync(1 << 20, 1 << 20, DELTA_OFF, false);
  CHECK(dense.str("a", "b") == "a/b/1048576/1048576");
  CHECK(PlanKey::forSync(1 << 20, 1 << 20, DELTA_OFF, true).str("a", "b") == "a/b/1048576/1048576/packed");
  CHECK(PlanKey::forSync(1 << 20, 1 << 20, DELTA_OFF, false, shardcast::planner::Strategy::kRankPull).str("a", "b") ==
        "a/b/1048576/1048576/rank-pull");
}
