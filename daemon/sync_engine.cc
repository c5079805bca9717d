#include "daemon/sync_engine.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <utility>

#include "common/strings.h"
#include "transport/resident.h"
#include "transport/shm.h"

namespace shardcast::daemon {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<int64_t> denseFor(const planner::Box& b) { return transport::denseStrides(b.sizes()); }

}  // namespace

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::get(const v1::Layout& src, const v1::Layout& dst,
                                                           uint64_t staging_budget, uint64_t chunk_bytes, bool* hit) {
  if (staging_budget == 0 || chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  const std::string key =
      strCat(planner::layoutDigest(src), "/", planner::layoutDigest(dst), "/", staging_budget, "/", chunk_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      ++hits_;
      *hit = true;
      lru_.splice(lru_.begin(), lru_, it->second.age);
      return it->second.plan;
    }
  }
  *hit = false;
  SC_ASSIGN_OR_RETURN(auto schedule, planner::makeSchedule(src, dst, staging_budget, chunk_bytes));
  auto c = std::make_shared<CachedPlan>();
  static_cast<planner::Schedule&>(*c) = std::move(schedule);
  c->key = key;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto raced = plans_.find(key); raced != plans_.end()) return raced->second.plan;  // planned twice at once
  lru_.push_front(key);
  plans_[key] = Entry{c, lru_.begin()};
  while (plans_.size() > capacity_) {
    evicted_.push_back(lru_.back());
    plans_.erase(lru_.back());
    lru_.pop_back();
  }
  return std::shared_ptr<const CachedPlan>(c);
}

uint64_t PlanCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
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

// A sync between prepare and finish on this daemon.
struct SyncEngine::Active {
  std::string id;
  std::string src_group;
  std::string dst_group;
  // The coordinator's lease: renewed by every call about this sync; when it runs out the reaper
  // aborts the sync here (steady-clock nanoseconds).
  std::chrono::milliseconds lease{10000};
  uint64_t fence = 0;  // WriteOp::fence of this sync's writes, open here from prepare to close
  int executing = 0;   // execute() calls running (under mu): close() waits for them
  std::atomic<int64_t> lease_until{0};
  void renew() { lease_until = (Clock::now() + lease).time_since_epoch().count(); }
  bool expired(Clock::time_point now) const { return now.time_since_epoch().count() > lease_until; }
  uint64_t version = 0;
  uint64_t generation = 0;
  std::shared_ptr<const CachedPlan> plan;
  int32_t self = -1;  // this node's id in the plan, -1 when it takes no part
  std::shared_ptr<transport::MemoryRegion> arena;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Landed> landed;
  Status failure;       // set by abort or by a failed write
  bool closed = false;  // finished: no write may start any more
  int64_t writes_pending = 0;
  // Where this node packs the transfers it heads: freed with the sync (or kept for the next one
  // of the same plan on commit), after every completion has run.
  std::shared_ptr<transport::MemoryRegion> staging;
  // Rank buffers sent from directly or landed in directly: kept mapped until the sync is gone.
  std::vector<std::shared_ptr<void>> pinned;
  // Progress over all waves, read by progress() while execute() runs.
  std::atomic<uint64_t> bytes_received{0}, bytes_sent{0}, local_bytes{0}, bytes_landed_direct{0};

  // Writes to one node wait here while that node's window is full (see pump()).
  struct Outgoing {
    transport::WriteOp op;
    LandedChunk landed;  // announced to the target once the write is visible there
  };
  // Chunks processed here (transfer, chunk): each lands on a node once; a repeat is refused.
  std::set<std::pair<int32_t, int32_t>> seen;
  struct Outbox {
    std::shared_ptr<transport::Endpoint> endpoint;
    std::deque<Outgoing> queued;
    uint64_t bytes_in_flight = 0;
  };
  std::map<int32_t, Outbox> outboxes;  // by destination node, under mu
  uint64_t window_bytes = 0;

  // Drops writes not started yet (after a failure or the end); under mu.
  void dropQueued() {
    for (auto& [node, box] : outboxes) {
      writes_pending -= 2 * static_cast<int64_t>(box.queued.size());
      box.queued.clear();
    }
  }
};

// Starts the writes queued for `node` that fit in its window: at least one is always in flight
// while any is queued. Without the window every chunk would be on the wire at once; the transport
// then completes them all near the end, and relays and fan-out could not start before the last
// byte arrived. The window is refilled once half of it has drained, so writes start in batches
// and one notification (delivered by the transport once every write before it is visible)
// announces a whole batch: a message and a wake-up of the receiving thread per batch, not per
// chunk. A write's completion pumps again.
void SyncEngine::pump(const std::shared_ptr<Active>& a, int32_t node) {
  constexpr size_t kMaxNotification = 32 << 10;  // bytes per batch's notification (the transport takes 64 KiB)
  const size_t max_batch = std::min(kMaxLanded, (kMaxNotification - notificationBytes(a->id.size(), 0)) / kLandedBytes);
  std::vector<Active::Outgoing> start;
  std::shared_ptr<transport::Endpoint> ep;
  {
    std::lock_guard<std::mutex> lock(a->mu);
    if (!a->failure.ok() || a->closed) {
      a->dropQueued();
      a->cv.notify_all();
      return;
    }
    auto& box = a->outboxes[node];
    ep = box.endpoint;
    if (box.bytes_in_flight > a->window_bytes / 2) return;
    while (!box.queued.empty() &&
           (box.bytes_in_flight == 0 || box.bytes_in_flight + box.queued.front().op.length <= a->window_bytes) &&
           start.size() < max_batch) {
      box.bytes_in_flight += box.queued.front().op.length;
      start.push_back(std::move(box.queued.front()));
      box.queued.pop_front();
    }
  }
  if (start.empty()) return;
  // A write's or notification's completion; a write also frees its bytes of the window. Waiters
  // care only about the last one or a failure (waking them per completion costs a context switch
  // per chunk).
  auto finished = [a, node](Status st, uint64_t window_bytes, int64_t ops) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (!st.ok() && a->failure.ok()) a->failure = st;
      a->writes_pending -= ops;
      a->outboxes[node].bytes_in_flight -= window_bytes;
      wake = a->writes_pending == 0 || !st.ok();
    }
    if (wake) a->cv.notify_all();
  };
  Notification notification;
  notification.sync_id = a->id;
  notification.fence = a->fence;
  for (auto& out : start) {
    const uint64_t bytes = out.op.length;
    ep->write(std::move(out.op), [a, node, bytes, finished](Status st) {
      finished(st, bytes, 1);
      pump(a, node);
    });
    notification.chunks.push_back(out.landed);
  }
  const int64_t announced = static_cast<int64_t>(start.size());
  ep->notify(encodeNotification(notification), [finished, announced](Status st) { finished(st, 0, announced); });
}

SyncEngine::SyncEngine(std::string node, Registry& registry, transport::Context& transport, Metrics& metrics,
                       uint64_t window_bytes)
    : node_(std::move(node)),
      registry_(registry),
      transport_(transport),
      metrics_(metrics),
      window_bytes_(window_bytes),
      copies_(transport::makeHostCopyEngine()) {
  transport_.setNotificationHandler([this](std::string payload) { onNotification(payload); });
  reaper_ = std::thread([this] { reap(); });
}

SyncEngine::~SyncEngine() {
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    stopping_ = true;
  }
  reaper_cv_.notify_all();
  reaper_.join();
  for (auto& f : closers_) f.wait();
  transport_.setNotificationHandler(nullptr);
}

void SyncEngine::abortAll(const std::string& reason) {
  std::map<std::string, std::shared_ptr<Active>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(active_);
  }
  for (const auto& [id, a] : all) close(a, Registry::SyncEnd::kDirty, reason).status().IgnoreError();
}

Status SyncEngine::copy(const transport::StridedView& dst, const transport::StridedView& src,
                        const std::vector<int64_t>& extent, int64_t elem, transport::CopyEngine* device_copies) {
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost)
    return copies_->copy(dst, src, extent, elem);
  if (device_copies == nullptr) return absl::FailedPreconditionError("device memory to copy but no CUDA copy engine");
  SC_RETURN_IF_ERROR(device_copies->copy(dst, src, extent, elem));
  return device_copies->synchronize();
}

StatusOr<uint64_t> SyncEngine::checksum(const Registry::LocalBuffer& b, uint64_t offset, uint64_t n) {
  if (b.kind == transport::MemoryKind::kHost) return XXH64(b.data + offset, static_cast<size_t>(n), 0);
  if (b.transfer && b.transfer->staged())
    return XXH64(static_cast<const std::byte*>(b.region->data()) + b.region_offset + offset, static_cast<size_t>(n), 0);
  std::vector<std::byte> host(n);
  const std::vector<int64_t> unit{1};
  SC_RETURN_IF_ERROR(copy({host.data(), transport::MemoryKind::kHost, 0, unit}, {b.data + offset, b.kind, 0, unit},
                          {static_cast<int64_t>(n)}, 1, b.copies));
  return XXH64(host.data(), static_cast<size_t>(n), 0);
}

std::shared_ptr<SyncEngine::Active> SyncEngine::find(const std::string& id, uint64_t fence) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(id);
  if (it == active_.end() || (fence != 0 && it->second->fence != fence)) return nullptr;
  return it->second;
}

// Runs on the transport's progress thread: queue the chunks a notification announces for the
// executing thread (which checks each against the plan), never block. Peers are untrusted here:
// what does not parse, or names no attempt open here, is dropped with a warning.
void SyncEngine::onNotification(const std::string& payload) {
  auto n = parseNotification(payload);
  if (!n.ok()) {
    spdlog::warn("sync: dropped a notification: {}", std::string(n.status().message()));
    return;
  }
  auto a = find(n->sync_id, n->fence);
  if (!a) {
    spdlog::warn("sync {}: notification for an attempt not open here (ended, or another attempt)", n->sync_id);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(a->mu);
    a->landed.insert(a->landed.end(), n->chunks.begin(), n->chunks.end());
  }
  a->cv.notify_all();
}

StatusOr<v1::PrepareResponse> SyncEngine::prepare(const v1::PrepareRequest& req) {
  if (req.sync_id().empty()) return absl::InvalidArgumentError("prepare: sync_id is empty");
  {
    // One attempt per id at a time here, and never one its coordinator already finished (a
    // Prepare that arrives after the Finish that gave it up).
    std::lock_guard<std::mutex> lock(mu_);
    if (active_.count(req.sync_id()) || preparing_.count(req.sync_id()))
      return absl::AlreadyExistsError(strCat("sync ", req.sync_id(), " is already prepared on node \"", node_, "\""));
    if (req.fence() != 0 && finished_.count({req.sync_id(), req.fence()}))
      return absl::AbortedError(
          strCat("sync ", req.sync_id(), " was given up by its coordinator before it was prepared here"));
    preparing_.insert(req.sync_id());
  }
  struct Prepared {
    SyncEngine& e;
    std::string id;
    ~Prepared() {
      std::lock_guard<std::mutex> lock(e.mu_);
      e.preparing_.erase(id);
    }
  } prepared_guard{*this, req.sync_id()};
  auto a = std::make_shared<Active>();
  a->id = req.sync_id();
  a->src_group = req.src().group();
  a->dst_group = req.dst().group();
  a->version = req.version();
  a->generation = registry_.generation();
  a->window_bytes = window_bytes_;
  if (req.lease_ms() > 0) a->lease = std::chrono::milliseconds(req.lease_ms());
  a->fence = req.fence() ? req.fence() : (XXH64(a->id.data(), a->id.size(), 0) | 1);
  a->renew();
  bool hit = false;
  SC_ASSIGN_OR_RETURN(a->plan, plans_.get(req.src(), req.dst(), req.staging_bytes(), req.chunk_bytes(), &hit));
  if (auto evicted = plans_.takeEvicted(); !evicted.empty()) {
    std::lock_guard<std::mutex> lock(mu_);  // spare memory of plans no longer cached goes with them
    for (const auto& key : evicted) {
      spare_arenas_.erase(key);
      spare_staging_.erase(key);
    }
  }
  // The fences: source ranks here published exactly this version, destination ranks here accept
  // it. From here on, every way out ends the sync in the registry.
  SC_RETURN_IF_ERROR(registry_.beginSync(a->id, a->src_group, a->dst_group, a->version,
                                         planner::layoutDigest(req.src()), planner::layoutDigest(req.dst())));
  transport_.openFence(a->fence);  // before any peer learns where to write
  auto prepared = prepareTargets(a, hit);
  if (!prepared.ok()) {
    transport_.closeFence(a->fence, std::chrono::seconds(0));
    registry_.endSync(a->id, a->src_group, a->dst_group, Registry::SyncEnd::kRevert);
    return prepared.status();
  }
  return prepared;
}

StatusOr<v1::PrepareResponse> SyncEngine::prepareTargets(const std::shared_ptr<Active>& a, bool hit) {
  for (int32_t n = 0; n < a->plan->nodes.size(); ++n)
    if (a->plan->nodes.name(n) == node_) a->self = n;
  v1::PrepareResponse resp;
  if (a->self >= 0 && a->plan->arena_bytes[a->self] > 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto spare = spare_arenas_.find(a->plan->key);
      if (spare != spare_arenas_.end()) {
        a->arena = std::move(spare->second);
        spare_arenas_.erase(spare);
      }
    }
    if (!a->arena) {
      SC_ASSIGN_OR_RETURN(a->arena, transport_.allocateMemory(a->plan->arena_bytes[a->self]));
      transport::makeResident(a->arena->data(), a->arena->size(), "a landing arena");
    }
    resp.mutable_targets()->set_arena_region(a->arena->remote().serialize());
    resp.set_arena_bytes(a->plan->arena_bytes[a->self]);
  }
  // The rank buffers peers write into directly, each registration's descriptor once.
  if (a->self >= 0) {
    auto* targets = resp.mutable_targets();
    std::map<const transport::MemoryRegion*, uint32_t> index;
    for (const auto& [rank, b] : a->plan->direct_targets[static_cast<size_t>(a->self)]) {
      const std::string& name = a->plan->dst.buffer_names[static_cast<size_t>(b)];
      SC_ASSIGN_OR_RETURN(auto lb, registry_.localBuffer(a->dst_group, rank, name));
      if (!lb.region)
        return absl::FailedPreconditionError(strCat("group \"", a->dst_group, "\" rank ", rank, " buffer \"", name,
                                                    "\" is not registered with the transport on node \"", node_, "\""));
      const auto [it, added] = index.emplace(lb.region.get(), static_cast<uint32_t>(targets->regions_size()));
      if (added) targets->add_regions(lb.region->remote().serialize());
      auto* out = targets->add_buffers();
      out->set_rank(rank);
      out->set_buffer(name);
      out->set_region(it->second);
      out->set_offset(lb.region_offset);
      a->pinned.push_back(lb.keep_alive);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  a->renew();  // the lease runs from here: planning and allocating do not count against it
  if (!active_.emplace(a->id, a).second)
    return absl::AlreadyExistsError(strCat("sync ", a->id, " is already prepared on node \"", node_, "\""));
  spdlog::debug("sync {}: prepared ({} arena bytes, {} buffers landed in directly, plan {})", a->id, resp.arena_bytes(),
                resp.targets().buffers_size(), hit ? "cached" : "new");
  return resp;
}

StatusOr<v1::FinishResponse> SyncEngine::finish(const v1::FinishRequest& req) {
  std::shared_ptr<Active> a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = active_.find(req.sync_id());
    if (it == active_.end() || (req.fence() != 0 && it->second->fence != req.fence())) {
      if (req.fence() != 0) {  // remembered: a Prepare of this attempt still on its way is refused
        finished_.insert({req.sync_id(), req.fence()});
        finished_order_.push_back({req.sync_id(), req.fence()});
        if (finished_order_.size() > 4096) {
          finished_.erase(finished_order_.front());
          finished_order_.pop_front();
        }
      }
      return absl::NotFoundError(strCat("sync ", req.sync_id(), " is not active on node \"", node_, "\""));
    }
    a = it->second;
    active_.erase(it);
  }
  Registry::SyncEnd end = Registry::SyncEnd::kCommit;
  if (!req.commit()) end = req.executed() ? Registry::SyncEnd::kDirty : Registry::SyncEnd::kRevert;
  return close(a, end, req.reason().empty() ? "aborted by its coordinator" : req.reason());
}

StatusOr<v1::FinishResponse> SyncEngine::close(const std::shared_ptr<Active>& a, Registry::SyncEnd end,
                                               const std::string& reason) {
  const bool commit = end == Registry::SyncEnd::kCommit;
  {
    std::unique_lock<std::mutex> lock(a->mu);
    if (commit && !a->failure.ok()) {
      // A write of this node failed after its execute returned: the bytes are not all there.
      end = Registry::SyncEnd::kDirty;
    }
    a->closed = true;
    if (a->failure.ok() && !commit) a->failure = absl::AbortedError(strCat("sync ", a->id, " aborted: ", reason));
    a->dropQueued();
    a->cv.notify_all();
    // Peers write into rank buffers directly: before the group may take another sync, every write
    // this node started has to complete or fail (the transport bounds each by its op timeout),
    // and this node's own execute calls (local copies into its ranks) have to return.
    if (!a->cv.wait_for(lock, std::chrono::seconds(120), [&] { return a->writes_pending == 0 && a->executing == 0; }))
      spdlog::error("sync {}: {} writes and {} executes still pending two minutes after it ended", a->id,
                    a->writes_pending, a->executing);
  }
  // No write of this sync lands here any more: later ones are refused, those landing now are waited
  // for (bounded by the transport's op timeout on the sender's side).
  if (!transport_.closeFence(a->fence, std::chrono::seconds(10))) {
    // A peer frozen mid-write: its ranks stay held (dirty) until those writes are done or failed;
    // the reaper polls the fence.
    spdlog::error(
        "sync {}: writes into node \"{}\" still landing 10 s after it ended: its ranks stay held until "
        "they are done",
        a->id, node_);
    registry_.endSync(a->id, a->src_group, a->dst_group, Registry::SyncEnd::kDraining, reason);
    std::lock_guard<std::mutex> lock(mu_);
    draining_.push_back(a);
    return Status(absl::StatusCode::kUnavailable,
                  strCat("sync ", a->id, " on node \"", node_, "\": writes still landing"));
  }
  if (end == Registry::SyncEnd::kDirty && commit) {
    registry_.endSync(a->id, a->src_group, a->dst_group, end, std::string(a->failure.message()));
    return Status(a->failure.code(), strCat("sync ", a->id, " on node \"", node_, "\": ", a->failure.message()));
  }
  v1::FinishResponse out;
  for (auto& st : registry_.endSync(a->id, a->src_group, a->dst_group, end, reason)) *out.add_ranks() = std::move(st);
  const bool cached = plans_.contains(a->plan->key);  // spares of a plan evicted meanwhile are dropped
  std::lock_guard<std::mutex> lock(mu_);
  if (commit && a->writes_pending == 0 && cached) {  // nothing can still touch them
    if (a->arena) spare_arenas_[a->plan->key] = std::move(a->arena);
    if (a->staging) spare_staging_[a->plan->key] = std::move(a->staging);
  }
  return out;
}

void SyncEngine::reap() {
  std::unique_lock<std::mutex> lock(reaper_mu_);
  while (!reaper_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; })) {
    std::vector<std::shared_ptr<Active>> expired;
    {
      std::lock_guard<std::mutex> active_lock(mu_);
      const auto now = Clock::now();
      for (auto it = active_.begin(); it != active_.end();) {
        if (it->second->expired(now)) {
          expired.push_back(it->second);
          it = active_.erase(it);
        } else {
          ++it;
        }
      }
    }
    std::vector<std::shared_ptr<Active>> drained;
    {
      std::lock_guard<std::mutex> active_lock(mu_);
      for (auto it = draining_.begin(); it != draining_.end();) {
        if (transport_.closeFence((*it)->fence, std::chrono::milliseconds(0))) {
          drained.push_back(*it);
          it = draining_.erase(it);
        } else {
          ++it;
        }
      }
    }
    lock.unlock();
    for (const auto& a : drained) registry_.drained(a->id, a->dst_group);
    for (const auto& a : expired) {
      const std::string why =
          strCat("its coordinator went silent (no word for ", a->lease.count(), " ms, the sync's lease)");
      spdlog::warn("sync {} aborted on node \"{}\": {}", a->id, node_, why);
      ++metrics_.syncs_expired;
      // Each on its own thread: a close waits for the sync's writes, and one sync's slow peer
      // must not keep the others' ranks held.
      closers_.push_back(std::async(
          std::launch::async, [this, a, why] { close(a, Registry::SyncEnd::kDirty, why).status().IgnoreError(); }));
    }
    closers_.erase(std::remove_if(closers_.begin(), closers_.end(),
                                  [](const std::future<void>& f) {
                                    return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
                                  }),
                   closers_.end());
    lock.lock();
  }
}

StatusOr<v1::ProgressResponse> SyncEngine::progress(const std::string& sync_id, uint64_t fence) {
  auto a = find(sync_id, fence);
  if (!a) return absl::NotFoundError(strCat("sync ", sync_id, " is not active on node \"", node_, "\""));
  a->renew();
  v1::ProgressResponse out;
  out.set_bytes_received(a->bytes_received);
  out.set_bytes_sent(a->bytes_sent);
  out.set_local_bytes(a->local_bytes);
  out.set_bytes_landed_direct(a->bytes_landed_direct);
  return out;
}

// One execute() call: this node's part of one wave.
class SyncEngine::Execution {
 public:
  Execution(SyncEngine& engine, std::shared_ptr<Active> a, const v1::ExecuteRequest& req)
      : e_(engine),
        a_(std::move(a)),
        req_(req),
        cp_(*a_->plan),
        plan_(cp_.plan),
        self_(a_->self),
        wave_(static_cast<int32_t>(req.wave())),
        deadline_(Clock::now() + std::chrono::milliseconds(req.timeout_ms() ? req.timeout_ms() : 300000)) {}

  Status run() {
    if (wave_ < 0 || wave_ >= cp_.waves)
      return absl::InvalidArgumentError(strCat("sync ", a_->id, ": wave ", wave_, " of ", cp_.waves));
    SC_RETURN_IF_ERROR(readDirectory());
    if (wave_ == 0) SC_RETURN_IF_ERROR(copyColocated());
    for (int32_t t = 0; t < static_cast<int32_t>(plan_.transfers.size()); ++t)
      if (cp_.wave[t] == wave_) SC_RETURN_IF_ERROR(sendHeaded(t));
    return receive();
  }

 private:
  // What this node knows of another: its transport address and where to write into it.
  struct Peer {
    std::string address;
    transport::RemoteRegion arena;
    std::vector<transport::RemoteRegion> regions;
    std::map<std::pair<int32_t, std::string>, std::pair<uint32_t, uint64_t>>
        buffers;  // (rank, name) -> (region, offset)
  };

  Status readDirectory() {
    for (const auto& n : req_.nodes()) {
      int32_t id = -1;
      for (int32_t i = 0; i < cp_.nodes.size(); ++i)
        if (cp_.nodes.name(i) == n.node()) id = i;
      if (id < 0) continue;
      Peer& p = peers_[id];
      p.address = n.transport_address();
      const auto& targets = n.targets();
      if (!targets.arena_region().empty()) {
        SC_ASSIGN_OR_RETURN(p.arena, transport::RemoteRegion::parse(targets.arena_region()));
      }
      for (const auto& r : targets.regions()) {
        SC_ASSIGN_OR_RETURN(auto region, transport::RemoteRegion::parse(r));
        p.regions.push_back(std::move(region));
      }
      for (const auto& b : targets.buffers()) {
        if (b.region() >= p.regions.size())
          return absl::InvalidArgumentError(strCat("sync ", a_->id, ": node \"", n.node(), "\" names landing region ",
                                                   b.region(), " of ", p.regions.size()));
        p.buffers[{b.rank(), b.buffer()}] = {b.region(), b.offset()};
      }
    }
    return absl::OkStatus();
  }

  // Before every local copy into or out of rank memory: the sync may have been ended meanwhile
  // (aborted, or its lease ran out); then its ranks are no longer its to touch.
  Status alive() const {
    std::lock_guard<std::mutex> lock(a_->mu);
    if (!a_->failure.ok()) return a_->failure;
    if (a_->closed) return absl::AbortedError(strCat("sync ", a_->id, " ended"));
    return absl::OkStatus();
  }

  StatusOr<Registry::LocalBuffer> buffer(const planner::ResolvedLayout& l, int32_t rank, int32_t b) const {
    return e_.registry_.localBuffer(l.group, rank, l.buffer_names[static_cast<size_t>(b)]);
  }

  // Sends chunk k of transfer t (its first byte at `off` in `src`) to where it lands on `node`,
  // then the notification that announces it.
  Status send(const std::shared_ptr<transport::MemoryRegion>& src, uint64_t off, int32_t t, int32_t chain, int32_t hop,
              int32_t k, int32_t node, uint64_t sum) {
    auto peer = peers_.find(node);
    if (peer == peers_.end())
      return absl::FailedPreconditionError(strCat("no daemon for node \"", cp_.nodes.name(node), "\""));
    const CachedPlan::Landing* landing = cp_.landingOn(t, node);
    if (landing == nullptr)
      return absl::InternalError(strCat("sync ", a_->id, ": transfer ", t, " does not land on node ", node));
    const auto& chunk = cp_.chunks[t][k];
    transport::WriteOp op{src,         off + chunk.offset, peer->second.arena, landing->arena_offset + chunk.offset,
                          chunk.bytes, a_->fence};
    if (landing->direct()) {
      const std::string& name = cp_.dst.buffer_names[static_cast<size_t>(landing->buffer)];
      auto target = peer->second.buffers.find({landing->rank, name});
      if (target == peer->second.buffers.end())
        return absl::FailedPreconditionError(strCat("sync ", a_->id, ": node \"", cp_.nodes.name(node),
                                                    "\" did not offer buffer \"", name, "\" of rank ", landing->rank));
      op.dst = peer->second.regions[target->second.first];
      op.dst_offset = target->second.second + landing->buffer_offset + chunk.offset;
    }
    SC_ASSIGN_OR_RETURN(auto ep, e_.transport_.connect(peer->second.address, cp_.nodes.name(node)));
    {
      std::lock_guard<std::mutex> lock(a_->mu);
      if (!a_->failure.ok()) return a_->failure;
      if (a_->closed) return absl::AbortedError(strCat("sync ", a_->id, " ended"));
      a_->writes_pending += 2;  // the write and its notification
      auto& box = a_->outboxes[node];
      box.endpoint = ep;
      box.queued.push_back({std::move(op), LandedChunk{t, chain, hop, k, sum}});
    }
    pump(a_, node);
    a_->bytes_sent += chunk.bytes;
    return absl::OkStatus();
  }

  // Colocated fragments (first wave): straight from local source ranks into local destination ranks.
  Status copyColocated() {
    for (const auto& ls : plan_.local_sources) {
      if (ls.node != self_) continue;
      const auto& frag = plan_.fragments[ls.fragment];
      const int64_t elem = cp_.dst.tensors[plan_.tensors[frag.tensor].dst].elemBytes();
      for (const auto& [sub, dr] : planner::destinationRegions(plan_, cp_.dst, ls.fragment, self_)) {
        SC_RETURN_IF_ERROR(alive());
        const auto sr = planner::sourceRegion(plan_, cp_.src, ls.fragment, ls.src_rank, sub);
        SC_ASSIGN_OR_RETURN(auto sb, buffer(cp_.src, sr.rank, sr.buffer));
        SC_ASSIGN_OR_RETURN(auto db, buffer(cp_.dst, dr.rank, dr.buffer));
        SC_RETURN_IF_ERROR(e_.copy({db.data, db.kind, dr.offset, dr.strides}, {sb.data, sb.kind, sr.offset, sr.strides},
                                   dr.extent, elem, db.copies ? db.copies : sb.copies));
        a_->local_bytes += static_cast<uint64_t>(sub.volume() * elem);
      }
    }
    return absl::OkStatus();
  }

  // Transfer t's chains that this node's source ranks head. Chains the plan marks direct are sent
  // straight from the source rank's registered buffer; the others are packed into the staging
  // region (at the transfer's fixed offset) chunk by chunk, each chunk sent as soon as it is
  // packed so the network starts before the packing ends.
  Status sendHeaded(int32_t t) {
    const auto& tr = plan_.transfers[t];
    std::vector<int32_t> staged;
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const auto& ch = plan_.chains[c];
      if (ch.src_node != self_) continue;
      if (!cp_.direct[t][static_cast<size_t>(c - tr.chains_begin)]) {
        staged.push_back(c);
        continue;
      }
      const int32_t f = plan_.transfer_fragments[tr.fragments_begin];
      const int64_t elem = cp_.src.tensors[plan_.tensors[plan_.fragments[f].tensor].src].elemBytes();
      const auto sr = planner::sourceRegion(plan_, cp_.src, f, planner::sourceRank(plan_, cp_.src, f, ch));
      SC_ASSIGN_OR_RETURN(auto sb, buffer(cp_.src, sr.rank, sr.buffer));
      if (!sb.region)
        return absl::InternalError(strCat("sync ", a_->id, ": a source buffer of transfer ", t, " is not registered"));
      {
        std::lock_guard<std::mutex> lock(a_->mu);
        a_->pinned.push_back(sb.keep_alive);
      }
      const uint64_t start = static_cast<uint64_t>(sr.offset * elem);
      for (size_t k = 0; k < cp_.chunks[t].size(); ++k) {
        const auto& chunk = cp_.chunks[t][k];
        if (sb.transfer)
          SC_RETURN_IF_ERROR(sb.transfer->stageOut(start + chunk.offset, chunk.bytes));  // device -> mirror
        uint64_t sum = 0;
        if (req_.verify()) {
          SC_ASSIGN_OR_RETURN(sum, e_.checksum(sb, start + chunk.offset, chunk.bytes));
        }
        SC_RETURN_IF_ERROR(send(sb.region, sb.region_offset + start, t, c, 0, static_cast<int32_t>(k),
                                plan_.chain_nodes[ch.nodes_begin], sum));
      }
    }
    if (staged.empty()) return absl::OkStatus();
    const uint64_t at = CachedPlan::offsetOf(cp_.heading[t], self_);
    if (at == UINT64_MAX) return absl::InternalError(strCat("sync ", a_->id, ": no staging planned for transfer ", t));
    SC_RETURN_IF_ERROR(ensureStaging());
    const auto& packer = plan_.chains[staged.front()];  // whose source ranks the bytes are read from
    auto* out = static_cast<std::byte*>(a_->staging->data()) + at;
    for (size_t k = 0; k < cp_.chunks[t].size(); ++k) {
      const auto& chunk = cp_.chunks[t][k];
      for (int32_t i = 0; i < tr.fragments_count; ++i) {
        const int32_t f = plan_.transfer_fragments[tr.fragments_begin + i];
        const auto& frag = plan_.fragments[f];
        const int64_t elem = cp_.src.tensors[plan_.tensors[frag.tensor].src].elemBytes();
        const int32_t rank = planner::sourceRank(plan_, cp_.src, f, packer);
        // A chunk is a row-major slab of its (single) fragment: dense at chunk.offset.
        const planner::Box& part = chunk.box.ndim == 0 ? frag.box : chunk.box;
        const auto sr = chunk.box.ndim == 0 ? planner::sourceRegion(plan_, cp_.src, f, rank)
                                            : planner::sourceRegion(plan_, cp_.src, f, rank, chunk.box);
        SC_ASSIGN_OR_RETURN(auto sb, buffer(cp_.src, sr.rank, sr.buffer));
        SC_RETURN_IF_ERROR(
            e_.copy({out + cp_.fragment_offset[f] + chunk.offset, transport::MemoryKind::kHost, 0, denseFor(part)},
                    {sb.data, sb.kind, sr.offset, sr.strides}, sr.extent, elem, sb.copies));
      }
      const uint64_t sum = req_.verify() ? XXH64(out + chunk.offset, static_cast<size_t>(chunk.bytes), 0) : 0;
      for (const int32_t c : staged)
        SC_RETURN_IF_ERROR(send(a_->staging, at, t, c, 0, static_cast<int32_t>(k),
                                plan_.chain_nodes[plan_.chains[c].nodes_begin], sum));
    }
    return absl::OkStatus();
  }

  // The staging region of this sync: a spare one of the same plan, or a new one.
  Status ensureStaging() {
    if (a_->staging) return absl::OkStatus();
    std::shared_ptr<transport::MemoryRegion> staging;
    {
      std::lock_guard<std::mutex> lock(e_.mu_);
      auto spare = e_.spare_staging_.find(cp_.key);
      if (spare != e_.spare_staging_.end()) {
        staging = std::move(spare->second);
        e_.spare_staging_.erase(spare);
      }
    }
    if (!staging) {
      SC_ASSIGN_OR_RETURN(staging, e_.transport_.allocateMemory(cp_.staging_bytes[self_]));
      transport::makeResident(staging->data(), staging->size(), "a staging buffer");
    }
    std::lock_guard<std::mutex> lock(a_->mu);
    a_->staging = staging;
    return absl::OkStatus();
  }

  // Everything that lands here in this wave, one chunk at a time as notifications arrive.
  Status receive() {
    int64_t processed = 0;
    const int64_t expected = cp_.incoming[wave_][self_];
    while (true) {
      Landed l{};
      {
        std::unique_lock<std::mutex> lock(a_->mu);
        const bool woke = a_->cv.wait_until(lock, deadline_, [&] {
          return !a_->failure.ok() || !a_->landed.empty() || (processed == expected && a_->writes_pending == 0);
        });
        if (!a_->failure.ok()) return a_->failure;
        if (!woke) {
          return absl::DeadlineExceededError(strCat("sync ", a_->id, " on node \"", e_.node_, "\": ", processed, " of ",
                                                    expected, " chunks landed before the timeout"));
        }
        if (a_->landed.empty()) return absl::OkStatus();  // all landed, processed and forwarded
        l = a_->landed.front();
        a_->landed.pop_front();
      }
      SC_RETURN_IF_ERROR(processLanded(l));
      ++processed;
    }
  }

  // A landed chunk: verify it (optional), forward it along its relay chain, fan it out to the
  // local ranks that need part of it.
  Status processLanded(const Landed& l) {
    SC_RETURN_IF_ERROR(alive());
    // Every index a peer sent, against the plan: the transfer and chunk exist and belong to this
    // wave, the chain is one of the transfer's, and its hop is this node; each chunk lands once.
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(strCat("sync ", a_->id, " on node \"", e_.node_, "\": a peer announced ", what,
                                               " (transfer ", l.transfer, ", chain ", l.chain, ", hop ", l.hop,
                                               ", chunk ", l.chunk, ")"));
    };
    if (const std::string problem = cp_.landedProblem(l, wave_, self_); !problem.empty()) return bad(problem);
    {
      std::lock_guard<std::mutex> lock(a_->mu);
      if (!a_->seen.insert({l.transfer, l.chunk}).second) return bad("a chunk that already landed");
    }
    const auto& tr = plan_.transfers[l.transfer];
    const auto& chunk = cp_.chunks[l.transfer][l.chunk];
    const CachedPlan::Landing* landing = cp_.landingOn(l.transfer, self_);
    if (landing == nullptr)
      return absl::InternalError(
          strCat("sync ", a_->id, ": transfer ", l.transfer, " landed on node \"", e_.node_, "\" unplanned"));
    // Where the transfer's bytes are here: the landing rank's buffer, or the arena.
    std::shared_ptr<transport::MemoryRegion> region = a_->arena;
    uint64_t region_offset = landing->arena_offset;
    Registry::LocalBuffer landed;
    if (a_->arena) landed.data = static_cast<std::byte*>(a_->arena->data()) + landing->arena_offset;
    uint64_t sum = 0;
    if (landing->direct()) {
      SC_ASSIGN_OR_RETURN(auto lb, buffer(cp_.dst, landing->rank, landing->buffer));
      if (req_.verify()) {
        SC_ASSIGN_OR_RETURN(sum, e_.checksum(lb, landing->buffer_offset + chunk.offset, chunk.bytes));
      }
      region = lb.region;
      region_offset = lb.region_offset + landing->buffer_offset;
      landed = lb;
      landed.data += landing->buffer_offset;
    } else if (req_.verify()) {
      sum = XXH64(landed.data + chunk.offset, static_cast<size_t>(chunk.bytes), 0);
    }
    if (req_.verify() && sum != l.checksum)
      return absl::DataLossError(strCat("sync ", a_->id, ": chunk ", l.chunk, " of transfer ", l.transfer,
                                        " arrived at node \"", e_.node_, "\" with a wrong checksum"));
    // Forward the chunk along its relay chain first: the next node's transfer then overlaps the
    // local fan-out below (the bytes stay where they landed until the sync ends).
    const auto& ch = plan_.chains[l.chain];
    if (l.hop + 1 < ch.nodes_count)
      SC_RETURN_IF_ERROR(send(region, region_offset, l.transfer, l.chain, l.hop + 1, l.chunk,
                              plan_.chain_nodes[ch.nodes_begin + l.hop + 1], l.checksum));
    if (landing->direct()) {
      // Landed in a device buffer's transport mirror: into the device now.
      if (landed.transfer)
        SC_RETURN_IF_ERROR(landed.transfer->stageIn(landing->buffer_offset + chunk.offset, chunk.bytes));
      a_->bytes_landed_direct += chunk.bytes;
    }
    // Fan the chunk out to the local ranks that need part of it (but the one it landed in).
    for (int32_t i = 0; i < tr.fragments_count; ++i) {
      const int32_t f = plan_.transfer_fragments[tr.fragments_begin + i];
      const auto& frag = plan_.fragments[f];
      const int64_t elem = cp_.dst.tensors[plan_.tensors[frag.tensor].dst].elemBytes();
      const auto dense = denseFor(frag.box);
      for (const auto& [sub, dr] : planner::destinationRegions(plan_, cp_.dst, f, self_)) {
        if (landing->direct() && dr.rank == landing->rank && dr.buffer == landing->buffer &&
            static_cast<uint64_t>(dr.offset * elem) == landing->buffer_offset)
          continue;
        const planner::Box part = chunk.box.ndim == 0 ? sub : planner::intersect(sub, chunk.box);
        if (part.empty()) continue;
        int64_t src_off = 0, dst_off = dr.offset;
        for (int d = 0; d < part.ndim; ++d) {
          src_off += (part.lo[d] - frag.box.lo[d]) * dense[d];
          dst_off += (part.lo[d] - sub.lo[d]) * dr.strides[d];
        }
        SC_ASSIGN_OR_RETURN(auto db, buffer(cp_.dst, dr.rank, dr.buffer));
        SC_RETURN_IF_ERROR(e_.copy({db.data, db.kind, dst_off, dr.strides},
                                   {landed.data + cp_.fragment_offset[f], landed.kind, src_off, dense}, part.sizes(),
                                   elem, db.copies ? db.copies : landed.copies));
        a_->local_bytes += static_cast<uint64_t>(part.volume() * elem);
      }
    }
    a_->bytes_received += chunk.bytes;
    return absl::OkStatus();
  }

  SyncEngine& e_;
  std::shared_ptr<Active> a_;
  const v1::ExecuteRequest& req_;
  const CachedPlan& cp_;
  const planner::Plan& plan_;
  const int32_t self_;
  const int32_t wave_;
  const Clock::time_point deadline_;
  std::map<int32_t, Peer> peers_;
};

StatusOr<v1::ExecuteResponse> SyncEngine::execute(const v1::ExecuteRequest& req) {
  auto a = find(req.sync_id(), req.fence());
  if (!a) return absl::NotFoundError(strCat("sync ", req.sync_id(), " was not prepared on node \"", node_, "\""));
  {
    std::lock_guard<std::mutex> lock(a->mu);
    if (!a->failure.ok()) return a->failure;
    if (a->closed) return absl::AbortedError(strCat("sync ", a->id, " ended"));
    ++a->executing;
  }
  struct Leave {
    Active& a;
    ~Leave() {
      {
        std::lock_guard<std::mutex> lock(a.mu);
        --a.executing;
      }
      a.cv.notify_all();
    }
  } leave{*a};
  a->renew();
  v1::ExecuteResponse resp;
  if (a->self < 0) return resp;
  SC_RETURN_IF_ERROR(registry_.checkSync(a->src_group, a->dst_group));
  // This wave's figures are what the sync's counters (read by progress()) gain during it.
  const uint64_t sent = a->bytes_sent, received = a->bytes_received, local = a->local_bytes,
                 direct = a->bytes_landed_direct;
  SC_RETURN_IF_ERROR(Execution(*this, a, req).run());
  if (registry_.generation() != a->generation)
    return absl::AbortedError(
        strCat("sync ", a->id, ": registrations on node \"", node_, "\" changed during the sync"));
  resp.set_bytes_sent(a->bytes_sent - sent);
  resp.set_bytes_received(a->bytes_received - received);
  resp.set_local_bytes(a->local_bytes - local);
  resp.set_bytes_landed_direct(a->bytes_landed_direct - direct);
  metrics_.bytes_sent += resp.bytes_sent();
  metrics_.bytes_received += resp.bytes_received();
  metrics_.local_bytes += resp.local_bytes();
  metrics_.bytes_landed_direct += resp.bytes_landed_direct();
  return resp;
}

}  // namespace shardcast::daemon
