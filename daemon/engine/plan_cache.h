// The daemon's memory of the layout pairs it synced lately: their schedules (a bounded LRU of
// immutable plans, shared by the syncs that repeat them) and the landing arenas and staging
// buffers those syncs leave behind for the next sync of the same plan.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/engine/notification.h"
#include "planner/replicas.h"
#include "planner/schedule.h"
#include "shardcast/v1/layout.pb.h"
#include "shardcast/v1/service.pb.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// In the refusal of a Prepare whose view of this daemon no longer holds (PrepareRequest.expect,
// a plan named by digest that is not cached here): the coordinator then runs the sync again with
// a full gather.
inline constexpr const char* kStaleView = "a stale view";

// The digests (planner::layoutDigest) of a sync's two layouts.
struct LayoutDigests {
  std::string src, dst;
};

// A schedule as the daemon caches it, under the key of its layouts and budgets.
struct CachedPlan : planner::Schedule {
  // The two layout digests, the staging budget, the chunk size (and "/packed": no zero copy;
  // "/rank-pull", "/gather-broadcast": a baseline's routing).
  std::string key;
  // What the source's delta bases of this plan are kept under (DeltaBases, by transfer and chunk):
  // the key, except for a replica set's composed plan, whose transfers are its position plan's
  // whatever the membership: one bases key for every membership, so a replica that joins, leaves
  // or is cut does not make the others' next sync dense (each node's own base decides for it).
  std::string bases_key;
  // SHA-256 of the layouts it was planned from (PlanCache::fingerprintOf): what tells it apart
  // from layouts that merely share its digests (xxHash64, not collision resistant).
  std::string fingerprint;
  // A replica set's composed plan: the source's digest and the members it was planned for, in
  // stacking order, each with its layout's digest: what a Prepare names it by (forSetPrepare).
  struct Member {
    std::string group;
    int32_t replica = 0;
    std::string digest;
    bool operator==(const Member& o) const { return group == o.group && replica == o.replica && digest == o.digest; }
  };
  std::string src_digest;
  std::vector<Member> members;
  // Group -> SHA-256 of the layout it was planned from (the source, and the destination or each
  // member of a set): a daemon's registry refuses a sync of this plan into or out of ranks that
  // registered another layout, whatever its digest (Registry::beginSync).
  std::map<std::string, std::string> layout_fingerprints;
  std::string landedProblem(const LandedChunk& l, int32_t in_wave, int32_t self) const {
    return Schedule::landedProblem(l.transfer, l.chain, l.hop, l.chunk, in_wave, self);
  }
};

// What a sync's plan depends on besides its two layouts: what it is cached under (with the
// layouts' digests, CachedPlan::key) and what every daemon of the sync must agree on (each
// derives it from the same PrepareRequest; the coordinator compares their keys with its own).
struct PlanKey {
  uint64_t staging_bytes = 0;
  uint64_t chunk_bytes = 0;
  // planner::Schedule::zero_copy: transfers sent from and landed in rank buffers directly.
  bool zero_copy = true;
  planner::Strategy strategy = planner::Strategy::kPlanned;

  // The key of a sync's plan. The zero-copy rule lives here and nowhere else: zero copy only for
  // a dense sync (a delta is packed and encoded: a plan of its own) through no buffer that travels
  // only packed (`packed`: device memory some daemon's transport cannot reach, staged through host
  // memory; Describe's RemoteBuffer.staged).
  static PlanKey forSync(uint64_t staging_bytes, uint64_t chunk_bytes, v1::DeltaMode delta, bool packed,
                         planner::Strategy strategy = planner::Strategy::kPlanned);
  // "<src digest>/<dst digest>/<staging>/<chunk>[/packed][/rank-pull|/gather-broadcast]"
  std::string str(const std::string& src_digest, const std::string& dst_digest) const;
};

// The planner's routing for a sync's strategy: INVALID_ARGUMENT for an unknown one, or for a
// baseline asked to run with deltas (baselines are measured dense).
StatusOr<planner::Strategy> strategyOf(int strategy, v1::DeltaMode delta);

// Syncs in flight keep their plan alive by reference, so an eviction never pulls a plan from
// under one. A plan is handed out by its layouts only to those very layouts (CachedPlan::
// fingerprint): layouts that share its digests without being its own (a crafted collision) are
// planned anew and take its place; by digests alone (a repeated sync), only to the groups it was
// planned for. Thread-safe.
class PlanCache {
 public:
  // One SHA-256 of the layouts' deterministic serialisations (sha256OfParts: over each one's
  // length and SHA-256).
  static std::string fingerprintOf(const std::vector<const v1::Layout*>& layouts);
  // SHA-256 over byte strings (sha256OfParts); each one's SHA-256 into `each` when given.
  static std::string fingerprintOfBytes(const std::vector<std::string>& parts,
                                        std::vector<std::string>* each = nullptr);

  explicit PlanCache(size_t capacity = 16) : capacity_(capacity == 0 ? 1 : capacity) {}
  // The plans kept at most (the daemon's --plan-cache-entries; at least 1); the least recently
  // used beyond it are evicted now (reported by takeEvicted).
  void setCapacity(size_t capacity);
  // The plan of these layouts under `key`; *hit says whether it was cached.
  StatusOr<std::shared_ptr<const CachedPlan>> get(const v1::Layout& src, const v1::Layout& dst, const PlanKey& key,
                                                  bool* hit);
  // The same, given the layouts' digests (planner::layoutDigest) already computed.
  StatusOr<std::shared_ptr<const CachedPlan>> get(const v1::Layout& src, const v1::Layout& dst,
                                                  const LayoutDigests& digests, const PlanKey& key, bool* hit);
  // A repeated sync's plan on its coordinator (the layouts and digests its kept view holds): the
  // plan cached under the digests when it was planned for these layouts' groups, as a daemon's
  // Prepare by digest takes it, without serialising the layouts again; else get().
  StatusOr<std::shared_ptr<const CachedPlan>> getRepeated(const v1::Layout& src, const v1::Layout& dst,
                                                          const LayoutDigests& digests, const PlanKey& key, bool* hit);
  // The plan cached under these digests and `key`, without the layouts; NOT_FOUND when none is
  // (never planned here, or evicted).
  StatusOr<std::shared_ptr<const CachedPlan>> cached(const LayoutDigests& digests, const PlanKey& key, bool* hit);
  // The plan a plain sync's Prepare names: by its layouts, or by their digests alone
  // (PrepareRequest.src_digest, dst_digest: a repeated sync), which only a plan cached here
  // answers (else FAILED_PRECONDITION, kStaleView, naming `node`). *digests: the two digests.
  StatusOr<std::shared_ptr<const CachedPlan>> forPrepare(const v1::PrepareRequest& req, const PlanKey& key,
                                                         const std::string& node, bool* hit, LayoutDigests* digests);
  // The plan a replica set's Prepare names by digest (PrepareRequest.src_digest and
  // replica_digests: a set's sync whose source, members and daemons are its last one's), which
  // only a composed plan cached here for these very groups answers (else FAILED_PRECONDITION,
  // kStaleView, naming `node`); INVALID_ARGUMENT for a malformed request.
  StatusOr<std::shared_ptr<const CachedPlan>> forSetPrepare(const v1::PrepareRequest& req, const PlanKey& key,
                                                            const std::string& node, bool* hit);
  // The plan of a sync from `src` into the replica set `replicas` (planner/replicas.h), whose
  // destination is stackReplicas(replicas) (CachedPlan::dst). Plans are cached per membership;
  // the set's position plan apart from them, so a replica that joins or leaves costs a
  // composition, not a planning, and leaves the other replicas' routes as they were.
  // Only the planned strategy routes a set (INVALID_ARGUMENT for a baseline).
  StatusOr<std::shared_ptr<const CachedPlan>> getReplicaSet(const v1::Layout& src,
                                                            const std::vector<planner::Replica>& replicas,
                                                            const PlanKey& key, bool* hit);
  // Position plans made so far (each replica set's once per source layout and chunk size).
  uint64_t positionPlansMade() const;
  uint64_t hits() const;
  uint64_t misses() const;  // lookups that planned
  size_t size() const;
  bool contains(const std::string& key) const;
  // The keys evicted since the last call (their spare memory should go too: SpareMemory::drop),
  // and the bases keys no cached plan uses any more (their delta bases should go: DeltaBases::drop).
  std::vector<std::string> takeEvicted();

 private:
  struct Entry {
    std::shared_ptr<const CachedPlan> plan;
    std::list<std::string>::iterator age;
  };
  // The cached plan under `key`, counted as a hit; null when there is none.
  std::shared_ptr<const CachedPlan> lookup(const std::string& key, bool* hit);
  // The cached plan under `key` when it was planned from the layouts of `fingerprint`, counted
  // as a hit; null when there is none, or when layouts of another fingerprint share its key.
  std::shared_ptr<const CachedPlan> lookup(const std::string& key, const std::string& fingerprint, bool* hit);
  // What a plan is made from, as CachedPlan keeps it.
  struct PlanOrigin {
    std::string fingerprint;
    std::map<std::string, std::string> layout_fingerprints;
    std::string src_digest;                   // a replica set's
    std::vector<CachedPlan::Member> members;  // a replica set's
  };
  // Caches a plan just made (or returns the one another caller made of the same layouts
  // meanwhile; one of other layouts under the same key is replaced and reported evicted),
  // evicting the least recently used beyond capacity. `bases_key` empty: the key.
  std::shared_ptr<const CachedPlan> insert(const std::string& key, PlanOrigin origin, planner::Schedule schedule,
                                           std::string bases_key = {});
  // With mu_ held: drops `it`, reporting its key evicted, and its bases key unless another cached
  // plan (of another membership of its set) shares it.
  void evictLocked(std::map<std::string, Entry>::iterator it);

  size_t capacity_;  // (mu_)
  mutable std::mutex mu_;
  std::map<std::string, Entry> plans_;
  // Position plans by (source digest, replica digest, chunk size, the fingerprint of the source
  // and replica layouts), at most `capacity_`, the oldest made first out.
  std::map<std::string, std::shared_ptr<const planner::PositionPlan>> positions_;
  std::list<std::string> positions_age_;
  uint64_t positions_made_ = 0;
  std::list<std::string> lru_;  // most recently used first
  std::vector<std::string> evicted_;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

// Arenas and staging buffers of committed syncs, by plan key: allocating and first touching large
// registered buffers costs more than the copies, so the next sync of the same plan reuses them.
// At most one of each per plan; dropped with the plan. Thread-safe.
class SpareMemory {
 public:
  enum class Use { kArena, kStaging };
  // A spare region of `use` for the plan `key` holding at least `bytes`, taken out of the pool;
  // null when there is none. A smaller one is dropped: two plans share a key only when their
  // layouts' digests collide, and none may be handed a region it would write past.
  std::shared_ptr<transport::MemoryRegion> take(const std::string& key, Use use, uint64_t bytes);
  void keep(const std::string& key, Use use, std::shared_ptr<transport::MemoryRegion> region);
  void drop(const std::string& key);
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, Use>, std::shared_ptr<transport::MemoryRegion>> spare_;
};

}  // namespace shardcast::daemon
