#include "daemon/sync_engine.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <atomic>
#include <cstdio>
#include <sstream>

#include "common/strings.h"

namespace shardcast::daemon {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t alignUp(uint64_t v) { return (v + 63) & ~uint64_t{63}; }

std::vector<int64_t> denseFor(const planner::Box& b) { return transport::denseStrides(b.sizes()); }


}  // namespace

uint64_t CachedPlan::offsetOf(const std::vector<std::pair<int32_t, uint64_t>>& list, int32_t node) {
  for (const auto& [n, off] : list)
    if (n == node) return off;
  return UINT64_MAX;
}

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::get(const v1::Layout& src, const v1::Layout& dst,
                                                           uint64_t staging_budget, uint64_t chunk_bytes, bool* hit) {
  if (staging_budget == 0 || chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  const std::string key = strCat(layoutDigest(src), "/", layoutDigest(dst), "/", staging_budget, "/", chunk_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      ++hits_;
      *hit = true;
      return it->second;
    }
  }
  *hit = false;
  auto c = std::make_shared<CachedPlan>();
  c->key = key;
  c->staging_budget = staging_budget;
  SC_ASSIGN_OR_RETURN(c->src, planner::resolveLayout(src, c->nodes));
  SC_ASSIGN_OR_RETURN(c->dst, planner::resolveLayout(dst, c->nodes));
  planner::PlanOptions options;
  options.chunk_bytes = static_cast<int64_t>(chunk_bytes);
  SC_ASSIGN_OR_RETURN(c->plan, planner::makePlan(c->src, c->dst, c->nodes, options));
  const auto& plan = c->plan;
  const size_t n_nodes = static_cast<size_t>(c->nodes.size());
  c->arena_bytes.assign(n_nodes, 0);
  c->staging_bytes.assign(n_nodes, 0);
  c->fragment_offset.assign(plan.fragments.size(), 0);
  c->landing.resize(plan.transfers.size());
  c->heading.resize(plan.transfers.size());
  c->direct.resize(plan.transfers.size());
  c->wave.assign(plan.transfers.size(), 0);
  c->chunks.resize(plan.transfers.size());
  c->incoming.assign(1, std::vector<int64_t>(n_nodes, 0));
  std::vector<uint64_t> land(n_nodes, 0), stage(n_nodes, 0);  // this wave's use
  bool wave_empty = true;
  for (int32_t t = 0; t < static_cast<int32_t>(plan.transfers.size()); ++t) {
    const auto& tr = plan.transfers[t];
    const uint64_t bytes = alignUp(static_cast<uint64_t>(tr.bytes));
    uint64_t off = 0;
    for (int32_t i = 0; i < tr.fragments_count; ++i) {
      const int32_t f = plan.transfer_fragments[tr.fragments_begin + i];
      c->fragment_offset[f] = off;
      off += static_cast<uint64_t>(plan.fragments[f].bytes);
    }
    auto& chunks = c->chunks[t];
    if (tr.fragments_count == 1) {
      const auto& frag = plan.fragments[plan.transfer_fragments[tr.fragments_begin]];
      const int64_t elem = c->dst.tensors[plan.tensors[frag.tensor].dst].elemBytes();
      uint64_t at = 0;
      for (const planner::Box& b : planner::splitIntoChunks(frag.box, elem, plan.options.chunk_bytes)) {
        const uint64_t n = static_cast<uint64_t>(b.volume() * elem);
        chunks.push_back({b, at, n});
        at += n;
      }
    } else {
      chunks.push_back({planner::Box{}, 0, static_cast<uint64_t>(tr.bytes)});
    }
    auto& direct = c->direct[t];
    direct.assign(static_cast<size_t>(tr.chains_count), 0);
    if (tr.fragments_count == 1) {
      const int32_t f = plan.transfer_fragments[tr.fragments_begin];
      for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
        const auto sr = planner::sourceRegion(plan, c->src, f, planner::sourceRank(plan, c->src, f, plan.chains[ch]));
        direct[static_cast<size_t>(ch - tr.chains_begin)] = planner::isContiguous(sr.strides, plan.fragments[f].box) ? 1 : 0;
      }
    }
    // Staging is needed on a head node only for its chains that are not sent directly.
    auto needs_staging = [&](int32_t node) {
      for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch)
        if (plan.chains[ch].src_node == node && !direct[static_cast<size_t>(ch - tr.chains_begin)]) return true;
      return false;
    };
    // Does this transfer still fit in the current wave on every node it touches?
    bool fits = true;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const auto& chain = plan.chains[ch];
      fits = fits && (!needs_staging(chain.src_node) || stage[chain.src_node] + bytes <= staging_budget);
      for (int32_t k = 0; k < chain.nodes_count; ++k)
        fits = fits && land[plan.chain_nodes[chain.nodes_begin + k]] + bytes <= staging_budget;
    }
    if (!fits && !wave_empty) {
      ++c->waves;
      c->incoming.emplace_back(n_nodes, 0);
      std::fill(land.begin(), land.end(), 0);
      std::fill(stage.begin(), stage.end(), 0);
    }
    wave_empty = false;
    c->wave[t] = c->waves - 1;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const auto& chain = plan.chains[ch];
      if (needs_staging(chain.src_node) && CachedPlan::offsetOf(c->heading[t], chain.src_node) == UINT64_MAX) {
        c->heading[t].emplace_back(chain.src_node, stage[chain.src_node]);
        stage[chain.src_node] += bytes;
        c->staging_bytes[chain.src_node] = std::max(c->staging_bytes[chain.src_node], stage[chain.src_node]);
      }
      for (int32_t k = 0; k < chain.nodes_count; ++k) {
        const int32_t n = plan.chain_nodes[chain.nodes_begin + k];
        c->landing[t].emplace_back(n, land[n]);
        land[n] += bytes;
        c->arena_bytes[n] = std::max(c->arena_bytes[n], land[n]);
        c->incoming.back()[n] += static_cast<int64_t>(chunks.size());
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  plans_[key] = c;
  return std::shared_ptr<const CachedPlan>(c);
}

uint64_t PlanCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

// A sync between prepare and finish on this daemon.
struct SyncEngine::Active {
  std::string id;
  std::string dst_group;
  uint64_t version = 0;
  uint64_t generation = 0;
  std::shared_ptr<const CachedPlan> plan;
  int32_t self = -1;  // this node's id in the plan, -1 when it takes no part
  std::shared_ptr<transport::MemoryRegion> arena;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Landed> landed;
  Status failure;  // set by abort or by a failed write
  int64_t writes_pending = 0;
  // Where this node packs the transfers it heads: freed with the sync (or kept for the next one
  // of the same plan on commit), after every completion has run.
  std::shared_ptr<transport::MemoryRegion> staging;
  // Rank buffers sent from directly (no packing): kept mapped until the sync is gone.
  std::vector<std::shared_ptr<void>> pinned;
  // Progress over all waves, read by progress() while execute() runs.
  std::atomic<uint64_t> bytes_received{0}, bytes_sent{0}, local_bytes{0};
};

SyncEngine::SyncEngine(std::string node, Registry& registry, transport::Context& transport, Metrics& metrics)
    : node_(std::move(node)), registry_(registry), transport_(transport), metrics_(metrics),
      copies_(transport::makeHostCopyEngine()) {
  transport_.setNotificationHandler([this](std::string payload) { onNotification(payload); });
}

SyncEngine::~SyncEngine() { transport_.setNotificationHandler(nullptr); }

Status SyncEngine::copy(const transport::StridedView& dst, const transport::StridedView& src, const std::vector<int64_t>& extent,
                        int64_t elem, transport::CopyEngine* device_copies) {
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost)
    return copies_->copy(dst, src, extent, elem);
  if (device_copies == nullptr) return absl::FailedPreconditionError("device memory to copy but no CUDA copy engine");
  SC_RETURN_IF_ERROR(device_copies->copy(dst, src, extent, elem));
  return device_copies->synchronize();
}

std::shared_ptr<SyncEngine::Active> SyncEngine::find(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(id);
  return it == active_.end() ? nullptr : it->second;
}

// Runs on the transport's progress thread: queue it for the executing thread, never block.
void SyncEngine::onNotification(const std::string& payload) {
  std::istringstream in(payload);
  std::string id;
  Landed l{};
  if (!(in >> id >> l.transfer >> l.chain >> l.hop >> l.chunk >> l.checksum)) {
    spdlog::warn("sync: malformed notification \"{}\"", payload);
    return;
  }
  auto a = find(id);
  if (!a) {
    spdlog::warn("sync {}: notification after the sync ended", id);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(a->mu);
    a->landed.push_back(l);
  }
  a->cv.notify_all();
}

StatusOr<v1::PrepareResponse> SyncEngine::prepare(const v1::PrepareRequest& req) {
  if (req.sync_id().empty()) return absl::InvalidArgumentError("prepare: sync_id is empty");
  auto a = std::make_shared<Active>();
  a->id = req.sync_id();
  a->dst_group = req.dst().group();
  a->version = req.version();
  a->generation = registry_.generation();
  if (registry_.hasGroup(a->dst_group) && registry_.version(a->dst_group) >= a->version)
    return absl::FailedPreconditionError(strCat("group \"", a->dst_group, "\" is at version ", registry_.version(a->dst_group),
                                                " on node \"", node_, "\": version ", a->version, " is not newer"));
  bool hit = false;
  SC_ASSIGN_OR_RETURN(a->plan, plans_.get(req.src(), req.dst(), req.staging_bytes(), req.chunk_bytes(), &hit));
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
    }
    resp.set_arena_region(a->arena->remote().serialize());
    resp.set_arena_bytes(a->plan->arena_bytes[a->self]);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto busy = busy_groups_.find(a->dst_group);
  if (busy != busy_groups_.end())
    return absl::FailedPreconditionError(strCat("a sync into group \"", a->dst_group, "\" (", busy->second,
                                                ") is in progress on node \"", node_, "\""));
  busy_groups_[a->dst_group] = a->id;
  active_[a->id] = a;
  spdlog::debug("sync {}: prepared ({} arena bytes, plan {})", a->id, resp.arena_bytes(), hit ? "cached" : "new");
  return resp;
}

Status SyncEngine::finish(const v1::FinishRequest& req) {
  std::shared_ptr<Active> a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = active_.find(req.sync_id());
    if (it == active_.end()) return absl::NotFoundError(strCat("sync ", req.sync_id(), " is not active on node \"", node_, "\""));
    a = it->second;
    active_.erase(it);
    if (busy_groups_[a->dst_group] == a->id) busy_groups_.erase(a->dst_group);
  }
  {
    std::lock_guard<std::mutex> lock(a->mu);
    if (a->failure.ok() && !req.commit()) a->failure = absl::AbortedError(strCat("sync ", a->id, " aborted"));
  }
  a->cv.notify_all();
  if (req.commit()) {
    if (registry_.hasGroup(a->dst_group)) registry_.commitVersion(a->dst_group, a->version);
    std::lock_guard<std::mutex> lock(mu_);
    std::lock_guard<std::mutex> alock(a->mu);
    if (a->writes_pending == 0) {  // nothing can still touch them
      if (a->arena) spare_arenas_[a->plan->key] = std::move(a->arena);
      if (a->staging) spare_staging_[a->plan->key] = std::move(a->staging);
    }
  }
  return absl::OkStatus();
}

StatusOr<v1::ProgressResponse> SyncEngine::progress(const std::string& sync_id) {
  auto a = find(sync_id);
  if (!a) return absl::NotFoundError(strCat("sync ", sync_id, " is not active on node \"", node_, "\""));
  v1::ProgressResponse out;
  out.set_bytes_received(a->bytes_received);
  out.set_bytes_sent(a->bytes_sent);
  out.set_local_bytes(a->local_bytes);
  return out;
}

StatusOr<v1::ExecuteResponse> SyncEngine::execute(const v1::ExecuteRequest& req) {
  auto a = find(req.sync_id());
  if (!a) return absl::NotFoundError(strCat("sync ", req.sync_id(), " was not prepared on node \"", node_, "\""));
  const CachedPlan& cp = *a->plan;
  const planner::Plan& plan = cp.plan;
  v1::ExecuteResponse resp;
  if (a->self < 0) return resp;
  const int32_t self = a->self;
  // This wave's figures are what the sync's counters (read by progress()) gain during it.
  const uint64_t sent_before = a->bytes_sent, received_before = a->bytes_received, local_before = a->local_bytes;
  const auto deadline = Clock::now() + std::chrono::milliseconds(req.timeout_ms() ? req.timeout_ms() : 300000);

  // Directory: transport address and arena of every node.
  std::map<int32_t, std::pair<std::string, transport::RemoteRegion>> dir;
  for (const auto& n : req.nodes()) {
    int32_t id = -1;
    for (int32_t i = 0; i < cp.nodes.size(); ++i)
      if (cp.nodes.name(i) == n.node()) id = i;
    if (id < 0) continue;
    transport::RemoteRegion arena;
    if (!n.arena_region().empty()) {
      SC_ASSIGN_OR_RETURN(arena, transport::RemoteRegion::parse(n.arena_region()));
    }
    dir[id] = {n.transport_address(), arena};
  }
  auto endpoint = [&](int32_t node) -> StatusOr<std::shared_ptr<transport::Endpoint>> {
    auto it = dir.find(node);
    if (it == dir.end()) return absl::FailedPreconditionError(strCat("no daemon for node \"", cp.nodes.name(node), "\""));
    return transport_.connect(it->second.first, cp.nodes.name(node));
  };
  auto buffer = [&](const planner::ResolvedLayout& l, const planner::Region& r) {
    return registry_.localBuffer(l.group, r.rank, l.buffer_names[r.buffer]);
  };
  // Sends chunk k of transfer t (at `off` in `src`) to `node`'s arena, then the notification.
  auto send = [&](const std::shared_ptr<transport::MemoryRegion>& src, uint64_t off, int32_t t, int32_t chain, int32_t hop,
                  int32_t k, int32_t node, uint64_t checksum) -> Status {
    SC_ASSIGN_OR_RETURN(auto ep, endpoint(node));
    const auto& chunk = cp.chunks[t][k];
    const uint64_t n = chunk.bytes;
    const uint64_t at = CachedPlan::offsetOf(cp.landing[t], node) + chunk.offset;
    off += chunk.offset;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      a->writes_pending += 2;
    }
    auto done = [a](Status st) {
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(a->mu);
        if (a->failure.ok()) a->failure = st;
      }
      {
        std::lock_guard<std::mutex> lock(a->mu);
        --a->writes_pending;
      }
      a->cv.notify_all();
    };
    ep->write({src, off, dir[node].second, at, n}, done);
    ep->notify(strCat(a->id, " ", t, " ", chain, " ", hop, " ", k, " ", checksum), done);
    a->bytes_sent += n;
    return absl::OkStatus();
  };

  const int32_t w = static_cast<int32_t>(req.wave());
  if (w < 0 || w >= cp.waves)
    return absl::InvalidArgumentError(strCat("sync ", a->id, ": wave ", w, " of ", cp.waves));
  // 1. Colocated fragments (first wave): straight from local source ranks into local destination ranks.
  if (w == 0) {
    for (const auto& ls : plan.local_sources) {
      if (ls.node != self) continue;
      const auto& frag = plan.fragments[ls.fragment];
      const int64_t elem = cp.dst.tensors[plan.tensors[frag.tensor].dst].elemBytes();
      for (const auto& [sub, dr] : planner::destinationRegions(plan, cp.dst, ls.fragment, self)) {
        const auto sr = planner::sourceRegion(plan, cp.src, ls.fragment, ls.src_rank, sub);
        SC_ASSIGN_OR_RETURN(auto sb, buffer(cp.src, sr));
        SC_ASSIGN_OR_RETURN(auto db, buffer(cp.dst, dr));
        SC_RETURN_IF_ERROR(copy({db.data, db.kind, dr.offset, dr.strides}, {sb.data, sb.kind, sr.offset, sr.strides}, dr.extent,
                                elem, db.copies ? db.copies : sb.copies));
        a->local_bytes += static_cast<uint64_t>(sub.volume() * elem);
      }
    }
  }

  // 2. This wave's transfers that this node's source ranks head. Chains the plan marks direct are
  //    sent straight from the source rank's registered buffer; the others are packed into the
  //    staging region (at the transfer's fixed offset) chunk by chunk, each chunk sent as soon as
  //    it is packed so the network starts before the packing ends.
  for (int32_t t = 0; t < static_cast<int32_t>(plan.transfers.size()); ++t) {
    if (cp.wave[t] != w) continue;
    const auto& tr = plan.transfers[t];
    std::vector<int32_t> staged;
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const auto& ch = plan.chains[c];
      if (ch.src_node != self) continue;
      if (!cp.direct[t][static_cast<size_t>(c - tr.chains_begin)]) {
        staged.push_back(c);
        continue;
      }
      const int32_t f = plan.transfer_fragments[tr.fragments_begin];
      const int64_t elem = cp.src.tensors[plan.tensors[plan.fragments[f].tensor].src].elemBytes();
      const auto sr = planner::sourceRegion(plan, cp.src, f, planner::sourceRank(plan, cp.src, f, ch));
      SC_ASSIGN_OR_RETURN(auto sb, buffer(cp.src, sr));
      if (!sb.region) return absl::InternalError(strCat("sync ", a->id, ": a source buffer of transfer ", t, " is not registered"));
      {
        std::lock_guard<std::mutex> lock(a->mu);
        a->pinned.push_back(sb.keep_alive);
      }
      const uint64_t start = static_cast<uint64_t>(sr.offset * elem);
      for (size_t k = 0; k < cp.chunks[t].size(); ++k) {
        const auto& chunk = cp.chunks[t][k];
        if (sb.transfer) SC_RETURN_IF_ERROR(sb.transfer->stageOut(start + chunk.offset, chunk.bytes));  // device -> mirror
        uint64_t sum = 0;
        if (req.verify()) {
          const std::byte* bytes = sb.data + start + chunk.offset;
          std::vector<std::byte> host;  // device memory the transport reads directly: hash a host copy
          if (sb.kind != transport::MemoryKind::kHost) {
            if (sb.transfer && sb.transfer->staged()) {
              bytes = static_cast<const std::byte*>(sb.region->data()) + start + chunk.offset;
            } else {
              host.resize(chunk.bytes);
              const std::vector<int64_t> unit{1};
              SC_RETURN_IF_ERROR(copy({host.data(), transport::MemoryKind::kHost, 0, unit},
                                      {sb.data + start + chunk.offset, sb.kind, 0, unit},
                                      {static_cast<int64_t>(chunk.bytes)}, 1, sb.copies));
              bytes = host.data();
            }
          }
          sum = XXH64(bytes, static_cast<size_t>(chunk.bytes), 0);
        }
        SC_RETURN_IF_ERROR(send(sb.region, sb.region_offset + start, t, c, 0, static_cast<int32_t>(k),
                                plan.chain_nodes[ch.nodes_begin], sum));
      }
    }
    if (staged.empty()) continue;
    const uint64_t at = CachedPlan::offsetOf(cp.heading[t], self);
    if (at == UINT64_MAX) return absl::InternalError(strCat("sync ", a->id, ": no staging planned for transfer ", t));
    if (!a->staging) {
      std::shared_ptr<transport::MemoryRegion> staging;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto spare = spare_staging_.find(cp.key);
        if (spare != spare_staging_.end()) {
          staging = std::move(spare->second);
          spare_staging_.erase(spare);
        }
      }
      if (!staging) {
        SC_ASSIGN_OR_RETURN(staging, transport_.allocateMemory(cp.staging_bytes[self]));
      }
      std::lock_guard<std::mutex> lock(a->mu);
      a->staging = staging;
    }
    const auto& packer = plan.chains[staged.front()];  // whose source ranks the bytes are read from
    auto* out = static_cast<std::byte*>(a->staging->data()) + at;
    for (size_t k = 0; k < cp.chunks[t].size(); ++k) {
      const auto& chunk = cp.chunks[t][k];
      for (int32_t i = 0; i < tr.fragments_count; ++i) {
        const int32_t f = plan.transfer_fragments[tr.fragments_begin + i];
        const auto& frag = plan.fragments[f];
        const int64_t elem = cp.src.tensors[plan.tensors[frag.tensor].src].elemBytes();
        const int32_t rank = planner::sourceRank(plan, cp.src, f, packer);
        // A chunk is a row-major slab of its (single) fragment: dense at chunk.offset.
        const planner::Box& part = chunk.box.ndim == 0 ? frag.box : chunk.box;
        const auto sr = chunk.box.ndim == 0 ? planner::sourceRegion(plan, cp.src, f, rank)
                                            : planner::sourceRegion(plan, cp.src, f, rank, chunk.box);
        SC_ASSIGN_OR_RETURN(auto sb, buffer(cp.src, sr));
        SC_RETURN_IF_ERROR(copy({out + cp.fragment_offset[f] + chunk.offset, transport::MemoryKind::kHost, 0, denseFor(part)},
                                {sb.data, sb.kind, sr.offset, sr.strides}, sr.extent, elem, sb.copies));
      }
      const uint64_t sum = req.verify() ? XXH64(out + chunk.offset, static_cast<size_t>(chunk.bytes), 0) : 0;
      for (const int32_t c : staged)
        SC_RETURN_IF_ERROR(send(a->staging, at, t, c, 0, static_cast<int32_t>(k), plan.chain_nodes[plan.chains[c].nodes_begin], sum));
    }
  }

  // 3. Everything that lands here: verify, fan out to local ranks, forward along the chain.
  int64_t processed = 0;
  const int64_t expected = cp.incoming[w][self];
  while (true) {
    Landed l{};
    {
      std::unique_lock<std::mutex> lock(a->mu);
      const bool woke = a->cv.wait_until(lock, deadline, [&] {
        return !a->failure.ok() || !a->landed.empty() || (processed == expected && a->writes_pending == 0);
      });
      if (!a->failure.ok()) return a->failure;
      if (!woke) {
        return absl::DeadlineExceededError(strCat("sync ", a->id, " on node \"", node_, "\": ", processed, " of ", expected,
                                                  " chunks landed before the timeout"));
      }
      if (a->landed.empty()) break;  // all landed, processed and forwarded
      l = a->landed.front();
      a->landed.pop_front();
    }
    const auto& tr = plan.transfers[l.transfer];
    if (l.chunk < 0 || static_cast<size_t>(l.chunk) >= cp.chunks[l.transfer].size())
      return absl::InternalError(strCat("sync ", a->id, ": notification for chunk ", l.chunk, " of transfer ", l.transfer));
    const auto& chunk = cp.chunks[l.transfer][l.chunk];
    const uint64_t base = CachedPlan::offsetOf(cp.landing[l.transfer], self);
    auto* landed = static_cast<std::byte*>(a->arena->data()) + base;
    if (req.verify() && XXH64(landed + chunk.offset, static_cast<size_t>(chunk.bytes), 0) != l.checksum) {
      return absl::DataLossError(strCat("sync ", a->id, ": chunk ", l.chunk, " of transfer ", l.transfer, " arrived at node \"",
                                        node_, "\" with a wrong checksum"));
    }
    // Forward the chunk along its relay chain first: the next node's transfer then overlaps the
    // local fan-out below (the arena keeps the bytes until the sync ends).
    const auto& ch = plan.chains[l.chain];
    if (l.hop + 1 < ch.nodes_count)
      SC_RETURN_IF_ERROR(send(a->arena, base, l.transfer, l.chain, l.hop + 1, l.chunk,
                              plan.chain_nodes[ch.nodes_begin + l.hop + 1], l.checksum));
    // Fan the chunk out to the local ranks that need part of it.
    for (int32_t i = 0; i < tr.fragments_count; ++i) {
      const int32_t f = plan.transfer_fragments[tr.fragments_begin + i];
      const auto& frag = plan.fragments[f];
      const int64_t elem = cp.dst.tensors[plan.tensors[frag.tensor].dst].elemBytes();
      const auto dense = denseFor(frag.box);
      for (const auto& [sub, dr] : planner::destinationRegions(plan, cp.dst, f, self)) {
        const planner::Box part = chunk.box.ndim == 0 ? sub : planner::intersect(sub, chunk.box);
        if (part.empty()) continue;
        int64_t src_off = 0, dst_off = dr.offset;
        for (int d = 0; d < part.ndim; ++d) {
          src_off += (part.lo[d] - frag.box.lo[d]) * dense[d];
          dst_off += (part.lo[d] - sub.lo[d]) * dr.strides[d];
        }
        SC_ASSIGN_OR_RETURN(auto db, buffer(cp.dst, dr));
        SC_RETURN_IF_ERROR(copy({db.data, db.kind, dst_off, dr.strides},
                                {landed + cp.fragment_offset[f], transport::MemoryKind::kHost, src_off, dense}, part.sizes(), elem,
                                db.copies));
        a->local_bytes += static_cast<uint64_t>(part.volume() * elem);
      }
    }
    a->bytes_received += chunk.bytes;
    ++processed;
  }
  if (registry_.generation() != a->generation)
    return absl::AbortedError(strCat("sync ", a->id, ": registrations on node \"", node_, "\" changed during the sync"));
  resp.set_bytes_sent(a->bytes_sent - sent_before);
  resp.set_bytes_received(a->bytes_received - received_before);
  resp.set_local_bytes(a->local_bytes - local_before);
  metrics_.bytes_sent += resp.bytes_sent();
  metrics_.bytes_received += resp.bytes_received();
  metrics_.local_bytes += resp.local_bytes();
  return resp;
}

}  // namespace shardcast::daemon
