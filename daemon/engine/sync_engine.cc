#include "daemon/engine/sync_engine.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <utility>

#include "common/refusal.h"
#include "common/strings.h"
#include "daemon/engine/execution.h"
#include "transport/resident.h"

namespace shardcast::daemon {

using Clock = std::chrono::steady_clock;

SyncEngine::SyncEngine(std::string node, Registry& registry, transport::Context& transport, Metrics& metrics,
                       uint64_t window_bytes, std::unique_ptr<Stage> stage, uint64_t delta_cache_bytes,
                       uint64_t delta_device_bytes, PeerLimits limits)
    : node_(std::move(node)),
      registry_(registry),
      transport_(transport),
      metrics_(metrics),
      window_bytes_(window_bytes),
      limits_(limits),
      bases_(delta_cache_bytes, delta_device_bytes),
      stage_(stage ? std::move(stage) : makeStandardStage()),
      copies_(transport::makeHostCopyEngine()),
      attempts_(node_) {
  transport_.setNotificationHandler(
      [this](std::string payload, const transport::WriteKey& key) { onNotification(payload, key); });
  reaper_ = std::thread([this] { reap(); });
}

SyncEngine::~SyncEngine() {
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    stopping_ = true;
  }
  reaper_cv_.notify_all();
  reaper_.join();
  std::vector<std::shared_future<void>> closers;
  {
    std::lock_guard<std::mutex> lock(closers_mu_);
    closers.swap(closers_);
  }
  for (auto& f : closers) f.wait();
  transport_.setNotificationHandler(nullptr);
}

void SyncEngine::abortAll(const std::string& reason) {
  for (const auto& a : attempts_.takeAll()) close(a, Registry::SyncEnd::kDirty, reason).status().IgnoreError();
}

// Runs on the transport's progress thread: queue the chunks a notification announces for the
// executing thread (which checks each against the plan), never block. Peers are untrusted here:
// what does not parse, or names no attempt open here, is dropped with a warning.
void SyncEngine::onNotification(const std::string& payload, const transport::WriteKey& key) {
  auto n = parseNotification(payload);
  if (!n.ok()) {
    spdlog::warn("sync: dropped a notification: {}", std::string(n.status().message()));
    return;
  }
  auto a = attempts_.find(n->sync_id, n->fence);
  // The transport delivers only notifications under a key open here; it must be this attempt's
  // (a daemon of another attempt cannot speak for this one).
  if (!a || a->key != key) {
    // A folded attempt's readiness word routinely comes before this node published the attempt,
    // or after it ended (its sender says so again, or needs it no more): no warning for those.
    if (n->chunks.empty())
      spdlog::debug("sync {}: a readiness word for an attempt not open here", n->sync_id);
    else
      spdlog::warn("sync {}: notification for an attempt not open here (ended, or another attempt)", n->sync_id);
    return;
  }
  if (n->chunks.empty()) {  // a folded attempt's readiness word: from a node of its plan, not this one
    if (a->plan && n->ready_node < a->plan->nodes.size() && n->ready_node != a->self)
      a->peerReady(n->ready_node, n->answer);
    else
      spdlog::warn("sync {}: a readiness word naming node {}, not another node of its plan", n->sync_id, n->ready_node);
    return;
  }
  a->announce(n->chunks);
}

namespace {

// How long a Prepare waits for the close of the earlier attempt it supersedes before going on.
constexpr std::chrono::seconds kSupersededCloseWait{1};

// The request's write key, once every field a peer controls is bounded (before it is used).
StatusOr<transport::WriteKey> checkedWriteKey(const v1::PrepareRequest& req, const PeerLimits& limits,
                                              const std::string& node) {
  if (req.sync_id().empty()) return absl::InvalidArgumentError("prepare: sync_id is empty");
  auto write_key = transport::WriteKey::fromBytes(req.write_key());
  if (!write_key.ok())
    return absl::InvalidArgumentError(strCat("prepare of sync ", req.sync_id(), ": ", write_key.status().message()));
  if (req.lease_ms() != 0 && (req.lease_ms() < limits.min_lease.count() || req.lease_ms() > limits.max_lease.count()))
    return absl::InvalidArgumentError(strCat(
        "prepare of sync ", req.sync_id(), ": a lease of ", req.lease_ms(), " ms is outside [",
        limits.min_lease.count(), ", ", limits.max_lease.count(), "] ms on node \"", node, "\" (--max-sync-lease-ms)"));
  if (req.chunk_bytes() < limits.min_chunk_bytes)
    return absl::InvalidArgumentError(strCat("prepare of sync ", req.sync_id(), ": chunks of ", req.chunk_bytes(),
                                             " bytes (at least ", limits.min_chunk_bytes, ")"));
  return write_key;
}

// A sync that skipped the gather: this node's registrations (its daemon's `instance`, at
// `generation`) must be those its coordinator saw (execute() refuses any change of the sync's
// own groups after this point, as for every sync: SyncAttempt::stamps).
Status checkExpected(const v1::PrepareRequest& req, const std::string& node, const std::string& instance,
                     uint64_t generation) {
  if (req.expect_size() == 0) return absl::OkStatus();
  const auto mine =
      std::find_if(req.expect().begin(), req.expect().end(), [&](const v1::NodeStamp& s) { return s.node() == node; });
  if (mine == req.expect().end() || mine->instance() != instance || mine->generation() != generation)
    return absl::FailedPreconditionError(strCat("prepare of sync ", req.sync_id(), ": registrations on node ",
                                                quote(node), " changed since its coordinator last gathered them (",
                                                kStaleView, ")"));
  return absl::OkStatus();
}

// The groups a sync writes: a replica set's replicas (each a planner::Replica in `replicas`, its
// group in `a.dst_members`), or the destination group alone; each one's digest is left for its
// plan to give (the plan digested them once, or was found by them). None may be the sync's source.
Status readDestinations(const v1::PrepareRequest& req, SyncAttempt& a, Registry::Destination& destination,
                        std::vector<planner::Replica>& replicas) {
  for (const auto& r : req.replicas()) {
    if (r.replica_set() != a.dst_group)
      return absl::InvalidArgumentError(strCat("prepare of sync ", a.id, ": group \"", r.group(),
                                               "\" is not a replica of set \"", a.dst_group, "\""));
    replicas.push_back({r.replica(), r});
    a.dst_members.push_back(r.group());
    destination.emplace_back(r.group(), std::string());
  }
  if (destination.empty()) destination.emplace_back(a.dst_group, std::string());
  for (const auto& [group, digest] : destination)  // a catch-up's seed is read, never written
    if (group == a.src_group)
      return absl::InvalidArgumentError(
          strCat("prepare of sync ", a.id, ": group \"", group, "\" is both its source and a destination"));
  return absl::OkStatus();
}

// (rank, buffer) of the destination plan -> the address its bytes start at on this node.
using DirectBases = std::map<std::pair<int32_t, int32_t>, uint64_t>;

// The rank buffers of this node (a.self) that peers write into directly, into `resp`'s targets
// (each registration's descriptor once) and, where a double-buffered rank's next landing is
// elsewhere, its next_targets; each buffer's memory is pinned for the attempt.
StatusOr<DirectBases> directTargets(Registry& registry, const std::string& node, SyncAttempt& a,
                                    v1::PrepareResponse& resp) {
  auto* targets = resp.mutable_targets();
  v1::LandingTargets next = *targets;  // the same, with each buffer's next landing (nextLanding)
  std::map<const transport::MemoryRegion*, uint32_t> index, next_index;
  DirectBases direct;
  for (const auto& [rank, b] : a.plan->node(a.self).direct_targets) {
    const std::string& name = a.plan->dst.buffer_names[static_cast<size_t>(b)];
    const auto [group, member_rank] = a.dstRank(rank);
    SC_ASSIGN_OR_RETURN(auto lb, registry.localBuffer(group, member_rank, name));
    if (!lb.region)
      return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", member_rank, " buffer \"", name,
                                                  "\" is not registered with the transport on node \"", node, "\""));
    const auto [it, added] = index.emplace(lb.region.get(), static_cast<uint32_t>(targets->regions_size()));
    if (added) targets->add_regions(lb.region->remote().serialize());
    auto* out = targets->add_buffers();
    out->set_rank(rank);
    out->set_buffer(name);
    out->set_region(it->second);
    out->set_offset(lb.region_offset);
    a.pin(lb.keep_alive);
    direct[{rank, b}] = lb.region->remote().base + lb.region_offset;
    SC_ASSIGN_OR_RETURN(const auto later, registry.nextLanding(group, member_rank, name));
    if (!later.first)
      return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", member_rank, " buffer \"", name,
                                                  "\" is not registered with the transport on node \"", node,
                                                  "\" (its other set)"));
    const auto [at, fresh] = next_index.emplace(later.first.get(), static_cast<uint32_t>(next.regions_size()));
    if (fresh) next.add_regions(later.first->remote().serialize());
    auto* nb = next.add_buffers();
    nb->set_rank(rank);
    nb->set_buffer(name);
    nb->set_region(at->second);
    nb->set_offset(later.second);
  }
  if (next.SerializeAsString() != targets->SerializeAsString()) *resp.mutable_next_targets() = std::move(next);
  return direct;
}

// The byte ranges of this node's landings: in its arena, or in the rank buffers of `direct`.
std::vector<transport::LandingRange> landingRanges(const SyncAttempt& a, const DirectBases& direct) {
  std::vector<transport::LandingRange> ranges;
  for (const auto& ts : a.plan->transfers) {
    const auto* landing = ts.landingOn(a.self);
    if (landing == nullptr || ts.chunks.empty()) continue;
    const uint64_t bytes = ts.chunks.back().offset + ts.chunks.back().bytes;
    if (!landing->direct()) {
      if (a.arena) ranges.push_back({a.arena->remote().base + landing->arena_offset, bytes});
      continue;
    }
    auto it = direct.find({landing->rank, landing->buffer});
    if (it != direct.end()) ranges.push_back({it->second + landing->buffer_offset, bytes});
  }
  return ranges;
}

}  // namespace

StatusOr<v1::PrepareResponse> SyncEngine::prepare(const v1::PrepareRequest& req) {
  SC_ASSIGN_OR_RETURN(const transport::WriteKey write_key, checkedWriteKey(req, limits_, node_));
  auto a = std::make_shared<SyncAttempt>();
  a->id = req.sync_id();
  a->stamped = {req.src().group()};  // the groups it reads and writes, as its request names them
  if (req.replicas().empty()) a->stamped.push_back(req.dst().group());
  for (const auto& r : req.replicas()) a->stamped.push_back(r.group());
  a->stamps = registry_.stamps(a->stamped);
  a->generation = registry_.generation();
  SC_RETURN_IF_ERROR(checkExpected(req, node_, registry_.instance(), a->generation));
  a->src_group = req.src().group();
  a->dst_group = req.dst().group();
  a->version = req.version();
  a->window_bytes = window_bytes_;
  if (req.lease_ms() > 0) a->lease = std::chrono::milliseconds(req.lease_ms());
  a->fence = req.fence() ? req.fence() : (XXH64(a->id.data(), a->id.size(), 0) | 1);
  a->key = write_key;
  a->delta = req.delta();
  a->tree_hash = req.delta_tree_hash();
  // One attempt per id at a time here, and never one its coordinator already gave up (a Prepare
  // that arrives after the Finish that gave it up). An earlier attempt of the same Sync call
  // still open here (its coordinator gave it up, and the abort did not get here in time: this
  // daemon busy, say) is ended now, as that abort would have ended it, rather than refusing the
  // retry: refused, the coordinator would cut this node's replicas, healthy as they are.
  const std::vector<uint64_t> supersedes(req.supersedes().begin(), req.supersedes().end());
  SC_ASSIGN_OR_RETURN(const auto superseded, attempts_.begin(a, supersedes));
  if (superseded) {
    // Its close waits for its writes. Given a moment, it usually ends before this attempt fences
    // the ranks; a peer frozen mid-write can hold it much longer, and this Prepare does not wait
    // for that (the coordinator would find this node silent): the single-buffered ranks it still
    // writes are taken over (Registry::beginSync's rules for a superseding attempt), and a
    // double-buffered one refuses, cutting its replica, as before. Reverted when its coordinator
    // says it never executed, as its abort would have; else dirty.
    spdlog::warn(
        "sync {}: its attempt with fence {} was still open on node \"{}\" when the next attempt came: ending it", a->id,
        superseded->fence, node_);
    const bool unexecuted = std::find(req.supersedes_unexecuted().begin(), req.supersedes_unexecuted().end(),
                                      superseded->fence) != req.supersedes_unexecuted().end();
    auto closing = closeInBackground(superseded, unexecuted ? Registry::SyncEnd::kRevert : Registry::SyncEnd::kDirty,
                                     strCat("its coordinator gave this attempt up and runs the sync again (fence ",
                                            superseded->fence, " superseded)"));
    // One that never executed has no write to wait for: its close is quick, and waited for.
    if (unexecuted)
      closing.wait();
    else
      closing.wait_for(kSupersededCloseWait);
  }
  struct Abandon {  // every way out before publish takes it out of the table again
    AttemptTable& table;
    const std::shared_ptr<SyncAttempt>& a;
    ~Abandon() {
      if (a->phase() == SyncAttempt::Phase::kPreparing) table.abandon(a);
    }
  } abandon{attempts_, a};
  SC_ASSIGN_OR_RETURN(const auto strategy, strategyOf(req.strategy(), req.delta()));
  const auto plan_key = PlanKey::forSync(req.staging_bytes(), req.chunk_bytes(), req.delta(), req.packed(), strategy);
  // A replica set: its replicas' groups, each written under its own layout's digest.
  Registry::Destination destination;
  std::vector<planner::Replica> replicas;
  SC_RETURN_IF_ERROR(readDestinations(req, *a, destination, replicas));
  const bool plain = replicas.empty();  // its digest: its plan's, below
  // A zero-copy plan would hand this node's transport memory it must not touch directly: a
  // coordinator that planned without this node's Describe (or ignored it) is refused here.
  if (plan_key.zero_copy)
    if (const std::string which = registry_.packedOnly(a->src_group, a->dstGroups()); !which.empty())
      return absl::FailedPreconditionError(strCat("sync ", a->id, ": planned zero-copy, but ", which,
                                                  " travels only packed: its coordinator must plan it packed"));
  // A plain sync's plan by its layouts, or a repeated sync's by their digests alone (each layout
  // digested once per Prepare, or not at all).
  bool hit = false;
  LayoutDigests digests;
  if (plain) {
    SC_ASSIGN_OR_RETURN(a->plan, plans_.forPrepare(req, plan_key, node_, &hit, &digests));
    destination.front().second = digests.dst;
  } else {  // a replica set: by its layouts, or by their digests (PrepareRequest.replica_digests)
    const bool by_digest = !req.src_digest().empty() || req.replica_digests_size() > 0;
    SC_ASSIGN_OR_RETURN(a->plan, by_digest ? plans_.forSetPrepare(req, plan_key, node_, &hit)
                                           : plans_.getReplicaSet(req.src(), replicas, plan_key, &hit));
    digests.src = a->plan->src_digest;
    // Its members are the request's replicas, in their order (forSetPrepare compares them;
    // getReplicaSet made them from them).
    if (a->plan->members.size() != destination.size())
      return absl::InternalError(strCat("prepare of sync ", a->id, ": the set's plan has ", a->plan->members.size(),
                                        " members for ", destination.size(), " replicas"));
    for (size_t i = 0; i < destination.size(); ++i) destination[i].second = a->plan->members[i].digest;
    a->member_world = a->plan->dst.world() / static_cast<int32_t>(replicas.size());
  }
  for (const auto& key : plans_.takeEvicted()) {  // spare memory and delta bases go with their plan
    spares_.drop(key);
    bases_.drop(key);
  }
  // The fences: source ranks here published exactly this version, destination ranks here accept
  // it. From here on, every way out ends the sync in the registry.
  std::map<std::string, uint32_t> owners;  // the coordinator's word on whose groups these are
  for (const auto& o : req.owners()) owners.emplace(o.group(), o.owner_uid());
  SC_RETURN_IF_ERROR(registry_.beginSync(a->id, a->src_group, destination, a->version, digests.src, a->fence, &a->base,
                                         req.seed(), {req.supersedes().begin(), req.supersedes().end()}, owners,
                                         a->plan->layout_fingerprints));
  // The coordinator checked that every source rank published this version: the newest this
  // daemon knows of the destination's source (its lag gauge).
  for (const auto& [group, digest] : destination) metrics_.sourceVersionSeen(group, a->src_group, a->version);
  // Another attempt of the same plan using them (it cannot commit: the destination refuses a
  // second writer): this one keeps none, and packs dense.
  if (a->delta != v1::DELTA_OFF) a->bases = bases_.claim(a->plan->bases_key, a->fence);
  if (a->delta == v1::DELTA_OFF) a->base = {};  // no delta may land here
  auto prepared = prepareTargets(a, hit);
  if (prepared.ok()) prepared->set_expect_checked(req.expect_size() > 0);
  if (!prepared.ok()) {
    if (a->bases) bases_.finish(a->plan->bases_key, a->fence, false);
    if (a->key_open) transport_.closeFence(a->key, std::chrono::seconds(0));
    registry_.endSync(a->id, a->fence, a->src_group, a->dstGroups(), Registry::SyncEnd::kRevert);
    return prepared.status();
  }
  return prepared;
}

StatusOr<v1::PrepareResponse> SyncEngine::prepareTargets(const std::shared_ptr<SyncAttempt>& a, bool hit) {
  for (int32_t n = 0; n < a->plan->nodes.size(); ++n)
    if (a->plan->nodes.name(n) == node_) a->self = n;
  v1::PrepareResponse resp;
  if (a->self >= 0) {  // before any peer can write: nothing here changes the fenced source ranks
    SC_ASSIGN_OR_RETURN(a->own_amax, partialAmaxes(a->plan->src, a->self,
                                                   [&](const planner::TensorLayout& w, const planner::Region& part) {
                                                     return amaxOf(a->plan->src, a->src_group, w, part);
                                                   }));
    writeAmaxes(a->own_amax, resp.mutable_split_amax());
  }
  const uint64_t arena_bytes = a->self >= 0 ? a->plan->node(a->self).arena_bytes : 0;
  if (arena_bytes > 0) {
    a->arena = spares_.take(a->plan->key, SpareMemory::Use::kArena, arena_bytes);
    if (!a->arena) {
      SC_ASSIGN_OR_RETURN(a->arena, transport::allocateHostStaging(transport_, arena_bytes, registry_.deviceRuntime(),
                                                                   "a landing arena"));
    }
    resp.mutable_targets()->set_arena_region(a->arena->remote().serialize());
    resp.set_arena_bytes(arena_bytes);
  }
  resp.set_plan_key(a->plan->key);
  if (a->delta != v1::DELTA_OFF) {
    resp.set_base_version(a->base.version);
    resp.set_base_fence(a->base.fence);
  }
  // The rank buffers peers write into directly, each registration's descriptor once, and exactly
  // the byte ranges of this node's landings: the only places a write under this attempt's key
  // may land here.
  std::vector<transport::LandingRange> ranges;
  if (a->self >= 0) {
    SC_ASSIGN_OR_RETURN(const auto direct, directTargets(registry_, node_, *a, resp));
    ranges = landingRanges(*a, direct);
  }
  // Open before any peer learns where to write (the response below).
  if (!transport_.openFence(a->key, std::move(ranges)))
    return absl::InvalidArgumentError(
        strCat("prepare of sync ", a->id, ": its write key is another attempt's, open on node \"", node_, "\""));
  a->key_open = true;
  SC_RETURN_IF_ERROR(attempts_.publish(a));
  spdlog::debug("sync {}: prepared ({} arena bytes, {} buffers landed in directly, plan {})", a->id, resp.arena_bytes(),
                resp.targets().buffers_size(), hit ? "cached" : "new");
  return resp;
}

// A source rank's part of a split block: read in place from host memory, through a host copy
// from a GPU's.
StatusOr<float> SyncEngine::amaxOf(const planner::ResolvedLayout& src, const std::string& group,
                                   const planner::TensorLayout& weight, const planner::Region& part) {
  SC_ASSIGN_OR_RETURN(const auto b,
                      registry_.localBuffer(group, part.rank, src.buffer_names[static_cast<size_t>(part.buffer)]));
  const transport::StridedView view{b.data, b.kind, part.offset, part.strides};
  if (b.kind == transport::MemoryKind::kHost) return amaxBox(view, weight.dtype, part.extent);
  int64_t count = 1;
  for (int64_t e : part.extent) count *= e;
  std::vector<std::byte> host(static_cast<size_t>(count * weight.elemBytes()));
  const transport::StridedView copy{host.data(), transport::MemoryKind::kHost, 0, transport::denseStrides(part.extent)};
  SC_RETURN_IF_ERROR(copyBox(*copies_, b.outgoing, copy, view, part.extent, weight.elemBytes()));
  return amaxBox(copy, weight.dtype, part.extent);
}

StatusOr<v1::FinishResponse> SyncEngine::finish(const v1::FinishRequest& req,
                                                std::chrono::system_clock::time_point deadline) {
  auto a = attempts_.takeForClose(req.sync_id(), req.fence(), req.commit());
  if (!a) {
    // A Finish repeated for an attempt one already took here gets that one's answer.
    if (req.fence() != 0)
      if (auto before = attempts_.closedBefore(
              req.sync_id(), req.fence(), req.commit(),
              std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::min(deadline, std::chrono::system_clock::now() + std::chrono::seconds(10)) -
                             std::chrono::system_clock::now()),
                         std::chrono::milliseconds(0), std::chrono::milliseconds(10000))))
        return *std::move(before);
    // Its Prepare may still be running here: answer once it has ended (refused, its ranks
    // released), so that the coordinator's next attempt does not find them being written.
    if (req.fence() != 0 && !attempts_.awaitPrepare(req.sync_id(), req.fence(), std::chrono::seconds(10)))
      spdlog::warn("sync {}: given up, but its Prepare still runs here 10 s later", req.sync_id());
    return absl::NotFoundError(strCat("sync ", req.sync_id(), " is not active on node \"", node_, "\""));
  }
  Registry::SyncEnd end = Registry::SyncEnd::kCommit;
  if (!req.commit()) end = req.executed() ? Registry::SyncEnd::kDirty : Registry::SyncEnd::kRevert;
  auto outcome = close(a, end, req.reason().empty() ? "aborted by its coordinator" : req.reason());
  attempts_.closed(req.sync_id(), req.fence(), outcome);
  return outcome;
}

StatusOr<v1::FinishResponse> SyncEngine::close(const std::shared_ptr<SyncAttempt>& a, Registry::SyncEnd end,
                                               const std::string& reason) {
  const bool commit = end == Registry::SyncEnd::kCommit;
  end = a->beginClose(end, node_, reason);
  // Peers write into rank buffers directly: before the group may take another sync, every write
  // this node started has to complete or fail (the transport bounds each by its op timeout), and
  // this node's own execute calls (local copies into its ranks) have to return.
  const bool quiet = a->quiesce(own_work_wait_);
  // Peers' writes into the rank buffers are all done: a segment truncated under them fails the
  // commit here, naming the rank, rather than committing the zero pages that replaced it.
  if (end == Registry::SyncEnd::kCommit)
    if (Status st = registry_.checkSync("", a->dstGroups()); !st.ok()) {
      a->fail(absl::FailedPreconditionError(strCat("commit refused on node \"", node_, "\": ", st.message())));
      spdlog::warn("sync {}: {}", a->id, std::string(a->failure().message()));
      end = Registry::SyncEnd::kDirty;
    }
  // What this node sent is a base for the next delta only if the sync committed here. An execute
  // still running (stuck past the wait above) may still write into the bases: they stay claimed
  // by this attempt for good (later syncs of the plan pack dense) rather than shared with it.
  if (a->bases && !a->executing()) bases_.finish(a->plan->bases_key, a->fence, end == Registry::SyncEnd::kCommit);
  // No write of this sync lands here any more: later ones are refused, those landing now are waited
  // for (bounded by the transport's op timeout on the sender's side).
  const bool landed = transport_.closeFence(a->key, quiet ? std::chrono::seconds(10) : std::chrono::seconds(0));
  if (!landed || !quiet) {
    // A peer frozen mid-write, or an execute of this node stuck (a device wait) or a write of its
    // own still pending: the ranks stay held (dirty) until those are done or failed, so a later
    // sync cannot commit bytes they would then overwrite; the reaper polls both. Its own work
    // still reads the source's ranks here: they stay read, so their writer cannot acquire them
    // and write the next version into what a stuck copy would then land (in ranks a retry of
    // this sync took over and committed: Registry::beginSync).
    const std::string what =
        !quiet ? "its own writes or executes still running" : strCat("writes into node \"", node_, "\" still landing");
    spdlog::error("sync {}: {} {:.1f} s after it ended: its ranks stay held until they are done", a->id, what,
                  quiet ? 10.0 : static_cast<double>(own_work_wait_.count()) / 1000);
    registry_.endSync(a->id, a->fence, quiet ? a->src_group : std::string(), a->dstGroups(),
                      Registry::SyncEnd::kDraining, reason);
    a->drain(!quiet);
    attempts_.addDraining(a);
    return Status(absl::StatusCode::kUnavailable, strCat("sync ", a->id, " on node \"", node_, "\": ", what));
  }
  if (end == Registry::SyncEnd::kDirty && commit) {
    const Status failure = a->failure();
    registry_.endSync(a->id, a->fence, a->src_group, a->dstGroups(), end, std::string(failure.message()));
    a->endClose();
    return Status(failure.code(), strCat("sync ", a->id, " on node \"", node_, "\": ", failure.message()));
  }
  v1::FinishResponse out;
  for (auto& st : registry_.endSync(a->id, a->fence, a->src_group, a->dstGroups(), end, reason))
    *out.add_ranks() = std::move(st);
  if (commit) {  // kept for the next sync of the plan, once nothing can still touch them
    auto [arena, staging] = a->takeMemory();
    spares_.keep(a->plan->key, SpareMemory::Use::kArena, std::move(arena));
    spares_.keep(a->plan->key, SpareMemory::Use::kStaging, std::move(staging));
  }
  // Spares of a plan evicted meanwhile go with it: checked after keeping them, so an eviction
  // (whose drop may have run before the keep) never leaves them behind.
  if (!plans_.contains(a->plan->key)) spares_.drop(a->plan->key);
  a->endClose();
  return out;
}

std::shared_future<void> SyncEngine::closeInBackground(std::shared_ptr<SyncAttempt> a, Registry::SyncEnd end,
                                                       std::string why) {
  auto closing = std::async(std::launch::async, [this, a = std::move(a), end, why = std::move(why)] {
                   close(a, end, why).status().IgnoreError();
                 }).share();
  std::lock_guard<std::mutex> lock(closers_mu_);
  closers_.push_back(closing);
  return closing;
}

void SyncEngine::reap() {
  std::unique_lock<std::mutex> lock(reaper_mu_);
  while (!reaper_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; })) {
    const auto expired = attempts_.takeExpired(Clock::now());
    const auto drained = attempts_.takeDrained(
        [&](const SyncAttempt& a) { return a.quiet() && transport_.closeFence(a.key, std::chrono::milliseconds(0)); });
    lock.unlock();
    for (const auto& a : drained) {
      // Bases its close left claimed (an execute still ran then) are let go: not committed.
      if (a->bases) bases_.finish(a->plan->bases_key, a->fence, false);
      registry_.drained(a->id, a->fence, a->drainsReading() ? a->src_group : std::string(), a->dstGroups());
      a->endClose();
    }
    for (const auto& a : expired) {
      const std::string why =
          strCat("its coordinator went silent (no word for ", a->lease.count(), " ms, the sync's lease)");
      spdlog::warn("sync {} aborted on node \"{}\": {}", a->id, node_, why);
      ++metrics_.syncs_expired;
      closeInBackground(a, Registry::SyncEnd::kDirty, why);
    }
    {
      std::lock_guard<std::mutex> closing(closers_mu_);
      closers_.erase(std::remove_if(closers_.begin(), closers_.end(),
                                    [](const std::shared_future<void>& f) {
                                      return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
                                    }),
                     closers_.end());
    }
    lock.lock();
  }
}

StatusOr<v1::ProgressResponse> SyncEngine::progress(const std::string& sync_id, uint64_t fence) {
  auto a = attempts_.find(sync_id, fence);
  if (!a) return absl::NotFoundError(strCat("sync ", sync_id, " is not active on node \"", node_, "\""));
  a->renew();
  v1::ProgressResponse out;
  const SyncCounters moved = a->moved.load();
  out.set_bytes_received(moved.bytes_received);
  out.set_bytes_sent(moved.bytes_sent);
  out.set_local_bytes(moved.local_bytes);
  out.set_bytes_landed_direct(moved.bytes_landed_direct);
  return out;
}

Status SyncEngine::prepareFolded(const v1::ExecuteRequest& req) {
  const v1::PrepareRequest& p = req.prepare();
  if (p.sync_id() != req.sync_id() || p.fence() != req.fence() || p.fence() == 0 || req.wave() != 0 ||
      p.expect_size() == 0 || p.delta() != v1::DELTA_OFF || p.replicas_size() > 0 || p.seed())
    return absl::InvalidArgumentError(strCat("execute of sync ", req.sync_id(), " on node ", quote(node_),
                                             ": a Prepare rides only on wave 0 of its own attempt (same id and "
                                             "fence), of a repeated dense plain sync"));
  SC_ASSIGN_OR_RETURN(const v1::PrepareResponse prepared, prepare(p));
  // Its peers were told to write where the coordinator's kept view says: the attempt may open
  // only if that is where this node lands them now, with the plan they all execute.
  std::string why;
  if (prepared.plan_key() != req.plan_key())
    why = strCat("it planned \"", prepared.plan_key(), "\", not \"", req.plan_key(), "\"");
  else if (prepared.targets().SerializeAsString() != req.self().targets().SerializeAsString())
    why = "its landing targets are not those of the kept view";
  else if (prepared.base_version() != req.self().base_version() || prepared.base_fence() != req.self().base_fence())
    why = "its destination ranks' base is not that of the kept view";
  else if (prepared.split_amax_size() > 0)
    why = "its source ranks hold parts of split fp8 blocks (their amaxes are combined between Prepare and Execute)";
  if (why.empty()) return absl::OkStatus();
  // No peer wrote here yet: they write only after this node's readiness word, which it never sent.
  if (auto a = attempts_.takeForClose(p.sync_id(), p.fence()))
    close(a, Registry::SyncEnd::kRevert, why).status().IgnoreError();
  return absl::FailedPreconditionError(strCat("sync ", req.sync_id(), ": node ", quote(node_),
                                              " cannot take the Prepare folded into its first wave: ", why, " (",
                                              kStaleView, ")"));
}

StatusOr<v1::ExecuteResponse> SyncEngine::execute(const v1::ExecuteRequest& req) {
  if (req.has_prepare()) SC_RETURN_IF_ERROR(prepareFolded(req));
  auto a = attempts_.find(req.sync_id(), req.fence());
  if (!a) return absl::NotFoundError(strCat("sync ", req.sync_id(), " was not prepared on node \"", node_, "\""));
  SC_RETURN_IF_ERROR(a->beginExecute(node_));
  bool ok = false;
  struct Leave {  // executing -> prepared on every way out
    SyncAttempt& a;
    int32_t wave;
    const bool& ok;
    ~Leave() { a.endExecute(wave, ok); }
  } leave{*a, static_cast<int32_t>(req.wave()), ok};
  a->renew();
  v1::ExecuteResponse resp;
  if (a->self < 0) {
    ok = true;
    return resp;
  }
  SC_RETURN_IF_ERROR(registry_.checkSync(a->src_group, a->dstGroups()));
  // This wave's figures are what the sync's counters (read by progress()) gain during it.
  const SyncCounters before = a->moved.load();
  SC_RETURN_IF_ERROR(
      Execution({node_, registry_, transport_, *stage_, *copies_, spares_, bases_.device_capacity() > 0}, a, req)
          .run());
  // A client that truncated its segment while this wave read or wrote it: the daemon survived the
  // fault (transport/shm.h), the bytes it moved are not the rank's.
  SC_RETURN_IF_ERROR(registry_.checkSync(a->src_group, a->dstGroups()));
  if (const auto now = registry_.stamps(a->stamped); now != a->stamps) {
    std::vector<std::string> changed, names, what;
    for (size_t i = 0; i < now.size(); ++i)
      if (now[i] != a->stamps[i]) {
        changed.push_back(a->stamped[i]);
        names.push_back(quote(a->stamped[i]));
        what.push_back(strCat(quote(a->stamped[i]), ": ", registry_.changesSince(a->stamped[i], a->stamps[i])));
      }
    // (Not ABORTED: the coordinator reads that as a node stopped because another failed.) The
    // first group named is the refusing one: a replica's is cut alone, its node being healthy.
    return refusedBy(absl::FailedPreconditionError(strCat("sync ", a->id, ": registrations of group(s) ",
                                                          strJoin(names, ", "), " on node \"", node_,
                                                          "\" changed during the sync (", strJoin(what, "; "), ")")),
                     changed.front());
  }
  ok = true;  // the wave counts as done here
  const SyncCounters wave = a->moved.load() - before;
  wave.writeTo(resp);
  metrics_.moved.add(wave);
  return resp;
}

}  // namespace shardcast::daemon
