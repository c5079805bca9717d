#include "daemon/engine/plan_cache.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/refusal.h"
#include "common/strings.h"
#include "daemon/registry/fingerprint.h"
#include "planner/layout.h"

namespace shardcast::daemon {

namespace {

bool digestLike(const std::string& d) {
  return d.size() == 16 && d.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// PlanKey::str with a replica set's membership in place of one destination digest.
std::string setKey(const PlanKey& key, const std::string& src_digest, const std::string& set_name,
                   const std::vector<CachedPlan::Member>& members) {
  std::string listed;
  for (const auto& m : members) listed += strCat(m.replica, ":", m.digest, ",");
  return key.str(src_digest, strCat("set:", set_name, "[", listed, "]"));
}

}  // namespace

StatusOr<planner::Strategy> strategyOf(int strategy, v1::DeltaMode delta) {
  if (!v1::SyncStrategy_IsValid(strategy))
    return absl::InvalidArgumentError(strCat("sync strategy ", strategy,
                                             " is not one of STRATEGY_PLANNED, "
                                             "STRATEGY_RANK_PULL, STRATEGY_GATHER_BROADCAST"));
  if (!v1::DeltaMode_IsValid(delta))
    return absl::InvalidArgumentError(strCat("delta mode ", static_cast<int>(delta),
                                             " is not one of DELTA_OFF, DELTA_AUTO, DELTA_DENSE, DELTA_ALWAYS"));
  if (strategy == v1::STRATEGY_PLANNED) return planner::Strategy::kPlanned;
  if (delta != v1::DELTA_OFF)
    return absl::InvalidArgumentError(strCat("sync strategy ", v1::SyncStrategy_Name(strategy),
                                             " is a baseline, measured dense: it takes no deltas (delta: DELTA_OFF)"));
  return strategy == v1::STRATEGY_RANK_PULL ? planner::Strategy::kRankPull : planner::Strategy::kGatherBroadcast;
}

std::string PlanCache::fingerprintOf(const std::vector<const v1::Layout*>& layouts) {
  std::vector<std::string> parts;
  for (const v1::Layout* layout : layouts) parts.push_back(planner::serializedLayout(*layout));
  return fingerprintOfBytes(parts);
}

std::string PlanCache::fingerprintOfBytes(const std::vector<std::string>& parts, std::vector<std::string>* each) {
  return sha256OfParts(parts, each);
}

std::shared_ptr<const CachedPlan> PlanCache::lookup(const std::string& key, bool* hit) {
  return lookup(key, std::string(), hit);
}

std::shared_ptr<const CachedPlan> PlanCache::lookup(const std::string& key, const std::string& fingerprint, bool* hit) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  *hit = it != plans_.end() && (fingerprint.empty() || it->second.plan->fingerprint == fingerprint);
  if (!*hit) {
    if (it != plans_.end())
      spdlog::warn(
          "plan {}: layouts sharing its digests with those it was planned for (groups \"{}\" -> \"{}\") "
          "are not those layouts: planned anew (a digest collision)",
          key, it->second.plan->src.group, it->second.plan->dst.group);
    ++misses_;
    return nullptr;
  }
  ++hits_;
  lru_.splice(lru_.begin(), lru_, it->second.age);
  return it->second.plan;
}

std::shared_ptr<const CachedPlan> PlanCache::insert(const std::string& key, PlanOrigin origin,
                                                    planner::Schedule schedule, std::string bases_key) {
  auto c = std::make_shared<CachedPlan>();
  static_cast<planner::Schedule&>(*c) = std::move(schedule);
  c->key = key;
  c->bases_key = bases_key.empty() ? key : std::move(bases_key);
  c->fingerprint = std::move(origin.fingerprint);
  c->layout_fingerprints = std::move(origin.layout_fingerprints);
  c->src_digest = std::move(origin.src_digest);
  c->members = std::move(origin.members);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto raced = plans_.find(key); raced != plans_.end()) {
    if (raced->second.plan->fingerprint == c->fingerprint) return raced->second.plan;  // planned twice at once
    // Other layouts under the same key (their digests collide): this plan takes its place, and
    // what was kept for the one replaced (spare memory, delta bases) goes with it.
    evictLocked(raced);
  }
  lru_.push_front(key);
  plans_[key] = Entry{c, lru_.begin()};
  while (plans_.size() > capacity_) evictLocked(plans_.find(lru_.back()));
  return c;
}

void PlanCache::setCapacity(size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  capacity_ = capacity == 0 ? 1 : capacity;
  while (plans_.size() > capacity_) evictLocked(plans_.find(lru_.back()));
}

void PlanCache::evictLocked(std::map<std::string, Entry>::iterator it) {
  const std::string gone = it->first, gone_bases = it->second.plan->bases_key;
  evicted_.push_back(gone);
  lru_.erase(it->second.age);
  plans_.erase(it);
  // A set's bases outlive one membership's plan while another membership's is cached.
  const bool shared = gone_bases != gone && std::any_of(plans_.begin(), plans_.end(), [&](const auto& e) {
                        return e.second.plan->bases_key == gone_bases;
                      });
  if (gone_bases != gone && !shared) evicted_.push_back(gone_bases);
}

PlanKey PlanKey::forSync(uint64_t staging_bytes, uint64_t chunk_bytes, v1::DeltaMode delta, bool packed,
                         planner::Strategy strategy) {
  return {staging_bytes, chunk_bytes, delta == v1::DELTA_OFF && !packed, strategy};
}

std::string PlanKey::str(const std::string& src_digest, const std::string& dst_digest) const {
  const char* routing = strategy == planner::Strategy::kRankPull          ? "/rank-pull"
                        : strategy == planner::Strategy::kGatherBroadcast ? "/gather-broadcast"
                                                                          : "";
  return strCat(src_digest, "/", dst_digest, "/", staging_bytes, "/", chunk_bytes, zero_copy ? "" : "/packed", routing);
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::get(const v1::Layout& src, const v1::Layout& dst,
                                                           const PlanKey& key, bool* hit) {
  return get(src, dst, {planner::layoutDigest(src), planner::layoutDigest(dst)}, key, hit);
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::get(const v1::Layout& src, const v1::Layout& dst,
                                                           const LayoutDigests& digests, const PlanKey& key,
                                                           bool* hit) {
  if (key.staging_bytes == 0 || key.chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  const std::string name = key.str(digests.src, digests.dst);
  std::vector<std::string> each;
  std::string fingerprint = fingerprintOfBytes({planner::serializedLayout(src), planner::serializedLayout(dst)}, &each);
  if (auto cached = lookup(name, fingerprint, hit)) return cached;
  SC_ASSIGN_OR_RETURN(auto schedule,
                      planner::makeSchedule(src, dst, key.staging_bytes, key.chunk_bytes, key.zero_copy, key.strategy));
  return insert(name, {std::move(fingerprint), {{src.group(), each[0]}, {dst.group(), each[1]}}, {}, {}},
                std::move(schedule));
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::getRepeated(const v1::Layout& src, const v1::Layout& dst,
                                                                   const LayoutDigests& digests, const PlanKey& key,
                                                                   bool* hit) {
  // (A plan of other groups under these digests replaced this one: layouts whose digests collide.)
  if (auto plan = lookup(key.str(digests.src, digests.dst), hit))
    if (plan->src.group == src.group() && plan->dst.group == dst.group()) return plan;
  return get(src, dst, digests, key, hit);
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::cached(const LayoutDigests& digests, const PlanKey& key,
                                                              bool* hit) {
  if (auto cached = lookup(key.str(digests.src, digests.dst), hit)) return cached;
  return absl::NotFoundError(strCat("no plan of layouts ", digests.src, " -> ", digests.dst, " is cached"));
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::forPrepare(const v1::PrepareRequest& req, const PlanKey& key,
                                                                  const std::string& node, bool* hit,
                                                                  LayoutDigests* digests) {
  const bool by_digest = !req.src_digest().empty() || !req.dst_digest().empty();
  if (!by_digest) {
    *digests = {planner::layoutDigest(req.src()), planner::layoutDigest(req.dst())};
    return get(req.src(), req.dst(), *digests, key, hit);
  }
  if (!digestLike(req.src_digest()) || !digestLike(req.dst_digest()) || req.replicas_size() > 0 || req.seed() ||
      req.expect_size() == 0)
    return absl::InvalidArgumentError(
        strCat("prepare of sync ", req.sync_id(),
               ": layouts named by digest need both digests (16 hex digits each) and a repeated plain sync "
               "(expect set; no replicas, no seed)"));
  *digests = {req.src_digest(), req.dst_digest()};
  auto plan = cached(*digests, key, hit);
  if (plan.status().code() == absl::StatusCode::kNotFound)
    return absl::FailedPreconditionError(strCat("prepare of sync ", req.sync_id(), ": node ", quote(node),
                                                " no longer caches the plan of layouts ", digests->src, " -> ",
                                                digests->dst, " (", kStaleView, ")"));
  // The groups the sync fences are the request's; the bytes it moves are the plan's layouts'
  // groups: they must be the same (else a Prepare could fence one group and read another). A plan
  // of other groups under these digests (layouts whose digests collide, planned here since) is
  // not this sync's: the sync runs again in full, with its layouts.
  if (plan.ok() && ((*plan)->src.group != req.src().group() || (*plan)->dst.group != req.dst().group()))
    return absl::FailedPreconditionError(
        strCat("prepare of sync ", req.sync_id(), ": node ", quote(node), " caches the plan of layouts ", digests->src,
               " -> ", digests->dst, " for groups ", quote((*plan)->src.group), " -> ", quote((*plan)->dst.group),
               ", not ", quote(req.src().group()), " -> ", quote(req.dst().group()), " (", kStaleView, ")"));
  return plan;
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::getReplicaSet(const v1::Layout& src,
                                                                     const std::vector<planner::Replica>& replicas,
                                                                     const PlanKey& plan_key, bool* hit) {
  const uint64_t staging_budget = plan_key.staging_bytes, chunk_bytes = plan_key.chunk_bytes;
  if (staging_budget == 0 || chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  if (replicas.empty()) return absl::InvalidArgumentError("a replica set needs at least one replica");
  if (plan_key.strategy != planner::Strategy::kPlanned)
    return absl::InvalidArgumentError(strCat("replica set \"", replicas.front().layout.replica_set(),
                                             "\": only the planned strategy syncs replica sets (the baselines are "
                                             "measured on single groups)"));
  // Each layout serialised once, for its digest and the fingerprint both (a set gathers and
  // digests its members at every sync).
  std::vector<std::string> planned_from{planner::serializedLayout(src)};
  std::string src_digest = planner::layoutDigestOf(planned_from.front());
  std::vector<CachedPlan::Member> members;
  for (const auto& r : replicas) {
    planned_from.push_back(planner::serializedLayout(r.layout));
    members.push_back({r.layout.group(), r.id, planner::layoutDigestOf(planned_from.back())});
  }
  const std::string& set_name = replicas.front().layout.replica_set();
  const std::string key = setKey(plan_key, src_digest, set_name, members);
  std::vector<std::string> each;
  std::string fingerprint = fingerprintOfBytes(planned_from, &each);
  if (auto cached = lookup(key, fingerprint, hit)) return cached;
  PlanOrigin origin{std::move(fingerprint), {{src.group(), each[0]}}, src_digest, members};
  for (size_t i = 0; i < members.size(); ++i) origin.layout_fingerprints.emplace(members[i].group, each[i + 1]);
  const std::string template_bytes = planner::replicaBytes(replicas.front().layout);
  const std::string replica_digest = planner::layoutDigestOf(template_bytes);
  // (A position plan is reused only for these very layouts: digests alone may collide.)
  const std::string positioned_from = fingerprintOfBytes({planned_from.front(), template_bytes});
  const std::string positions_key = strCat(src_digest, "/", replica_digest, "/", chunk_bytes, "/", positioned_from);
  std::shared_ptr<const planner::PositionPlan> reuse;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = positions_.find(positions_key); it != positions_.end()) reuse = it->second;
  }
  planner::PlanOptions options;
  options.chunk_bytes = static_cast<int64_t>(chunk_bytes);
  // planReplicaSet takes `reuse` only where it was planned for this very source, replica layout,
  // rank -> position pattern and options; else it plans the positions again.
  auto planned = planner::planReplicaSet(src, replicas, options, reuse);
  if (!planned.ok() && planned.status().code() == absl::StatusCode::kFailedPrecondition) {
    // A replica on a source rank's node (colocation) has no position plan: the whole set is
    // planned as its stacked layout, anew for each membership (docs/planner.md, "Colocation").
    SC_RETURN_IF_ERROR(planner::checkReplicaSet(replicas));
    SC_ASSIGN_OR_RETURN(auto schedule, planner::makeSchedule(src, planner::stackReplicas(replicas), staging_budget,
                                                             chunk_bytes, plan_key.zero_copy));
    return insert(key, std::move(origin), std::move(schedule));
  }
  SC_ASSIGN_OR_RETURN(auto set, std::move(planned));
  if (!set.reused_positions) {
    std::lock_guard<std::mutex> lock(mu_);
    ++positions_made_;
    if (positions_.insert_or_assign(positions_key, set.positions).second) positions_age_.push_back(positions_key);
    while (positions_.size() > capacity_) {
      positions_.erase(positions_age_.front());
      positions_age_.pop_front();
    }
  }
  // Composed: its transfers are the position plan's (planner::composeReplicas copies them), so
  // chunk k of transfer t is the same source bytes in every membership of the set. The position
  // plan's inputs name them: source, replica layout (their SHA-256, not only their digests: a
  // template crafted to collide shares no bases), rank -> position pattern, chunk size.
  std::string pattern;
  for (const int32_t p : set.positions->rank_position) pattern += strCat(p, ",");
  std::string bases_key =
      plan_key.str(src_digest, strCat("set:", set_name, "/", replica_digest, "/", pattern, "/", positioned_from));
  SC_ASSIGN_OR_RETURN(auto schedule, planner::scheduleOf(std::move(set.nodes), std::move(set.src), std::move(set.dst),
                                                         std::move(set.plan), staging_budget, plan_key.zero_copy));
  return insert(key, std::move(origin), std::move(schedule), std::move(bases_key));
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::forSetPrepare(const v1::PrepareRequest& req, const PlanKey& key,
                                                                     const std::string& node, bool* hit) {
  const std::string& set_name = req.dst().group();
  bool well_formed = digestLike(req.src_digest()) && req.dst_digest().empty() && !req.seed() &&
                     req.replicas_size() > 0 && req.replica_digests_size() == req.replicas_size();
  std::vector<CachedPlan::Member> members;
  for (int i = 0; well_formed && i < req.replicas_size(); ++i) {
    const v1::Layout& r = req.replicas(i);
    well_formed = digestLike(req.replica_digests(i)) && r.replica_set() == set_name;
    members.push_back({r.group(), r.replica(), req.replica_digests(i)});
  }
  if (!well_formed)
    return absl::InvalidArgumentError(
        strCat("prepare of sync ", req.sync_id(),
               ": a replica set's layouts named by digest need the source's digest and one digest per replica of "
               "the set (16 hex digits each), and no destination digest and no seed"));
  auto plan = lookup(setKey(key, req.src_digest(), set_name, members), hit);
  if (!plan)
    return markedStale(absl::FailedPreconditionError(
        strCat("prepare of sync ", req.sync_id(), ": node ", quote(node), " no longer caches the plan of layout ",
               req.src_digest(), " into replica set ", quote(set_name), " (", kStaleView, ")")));
  // As forPrepare: the groups it fences must be those whose bytes the plan moves; a plan of
  // other groups under these digests (ids and digests alike, groups not) is not this sync's.
  if (plan->src.group != req.src().group() || plan->dst.group != set_name || plan->members != members) {
    std::vector<std::string> cached, asked;
    for (const auto& m : plan->members) cached.push_back(m.group);
    for (const auto& m : members) asked.push_back(m.group);
    return markedStale(absl::FailedPreconditionError(
        strCat("prepare of sync ", req.sync_id(), ": node ", quote(node), " caches the plan of these digests for ",
               quote(plan->src.group), " -> ", quote(plan->dst.group), " [", strJoin(cached, ", "), "], not ",
               quote(req.src().group()), " -> ", quote(set_name), " [", strJoin(asked, ", "), "] (", kStaleView, ")")));
  }
  return plan;
}

uint64_t PlanCache::positionPlansMade() const {
  std::lock_guard<std::mutex> lock(mu_);
  return positions_made_;
}

uint64_t PlanCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

uint64_t PlanCache::misses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

bool PlanCache::contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.count(key) > 0;
}

size_t PlanCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

std::vector<std::string> PlanCache::takeEvicted() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(evicted_, {});
}

std::shared_ptr<transport::MemoryRegion> SpareMemory::take(const std::string& key, Use use, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = spare_.find({key, use});
  if (it == spare_.end()) return nullptr;
  auto region = std::move(it->second);
  spare_.erase(it);
  return region->size() >= bytes ? region : nullptr;
}

void SpareMemory::keep(const std::string& key, Use use, std::shared_ptr<transport::MemoryRegion> region) {
  if (!region) return;
  std::lock_guard<std::mutex> lock(mu_);
  spare_[{key, use}] = std::move(region);
}

void SpareMemory::drop(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  spare_.erase({key, Use::kArena});
  spare_.erase({key, Use::kStaging});
}

size_t SpareMemory::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spare_.size();
}

}  // namespace shardcast::daemon
