#include "daemon/engine/execution.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "common/strings.h"
#include "transport/cuda/delta_plan.h"
#include "transport/resident.h"

namespace shardcast::daemon {

namespace {

std::vector<int64_t> denseFor(const planner::Box& b) { return transport::denseStrides(b.sizes()); }

}  // namespace

Execution::Execution(ExecutionEnv env, std::shared_ptr<SyncAttempt> attempt, const v1::ExecuteRequest& req)
    : env_(env),
      a_(std::move(attempt)),
      req_(req),
      cp_(*a_->plan),
      plan_(cp_.plan),
      self_(a_->self),
      wave_(static_cast<int32_t>(req.wave())),
      deadline_(Clock::now() + std::chrono::milliseconds(req.timeout_ms() ? req.timeout_ms() : 300000)) {}

Status Execution::run() {
  if (wave_ < 0 || wave_ >= cp_.waves)
    return absl::InvalidArgumentError(strCat("sync ", a_->id, ": wave ", wave_, " of ", cp_.waves));
  SC_RETURN_IF_ERROR(readDirectory());
  SC_RETURN_IF_ERROR(readAmaxes());
  if (req_.has_prepare()) SC_RETURN_IF_ERROR(gateWrites());
  if (wave_ == 0) SC_RETURN_IF_ERROR(copyColocated());
  for (int32_t t = 0; t < static_cast<int32_t>(plan_.transfers.size()); ++t)
    if (cp_.transfer(t).wave == wave_) SC_RETURN_IF_ERROR(sendHeaded(t));
  SC_RETURN_IF_ERROR(device_.flush());
  SC_RETURN_IF_ERROR(receive());
  // The local ranks hold every byte only once the device copies into them are done.
  if (Status st = device_.settle(); !st.ok())
    return Status(st.code(), strCat("sync ", a_->id, ": device copies on node \"", env_.node, "\": ", st.message()));
  return absl::OkStatus();
}

transport::CopyEngine* Execution::engine(const Registry::LocalBuffer& b, Direction direction) {
  return device_.use(direction == Direction::kOutgoing ? b.outgoing : b.incoming);
}

// A folded attempt: writes to each peer wait for its readiness word (SyncAttempt::gateWrites),
// and this node tells every node it exchanges chunks with that it has the attempt open.
Status Execution::gateWrites() {
  std::map<int32_t, std::shared_ptr<transport::Endpoint>> endpoints;
  for (const auto& [node, peer] : peers_) {
    SC_ASSIGN_OR_RETURN(endpoints[node], env_.transport.connect(peer.address, cp_.nodes.name(node)));
  }
  a_->gateWrites(std::move(endpoints));
  return absl::OkStatus();
}

Status Execution::readDirectory() {
  for (const auto& n : req_.nodes()) {
    int32_t id = -1;
    for (int32_t i = 0; i < cp_.nodes.size(); ++i)
      if (cp_.nodes.name(i) == n.node()) id = i;
    if (id < 0) continue;
    Peer& p = peers_[id];
    p.address = n.transport_address();
    p.base = {n.base_version(), n.base_fence()};
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

// The combined amaxes of the blocks this node's source ranks hold part of, checked against the
// parts it computed when prepared.
Status Execution::readAmaxes() {
  auto given = daemon::readAmaxes(req_.split_amax());
  if (given.ok()) {
    if (Status st = checkCombined(a_->own_amax, *given); !st.ok()) given = st;
  }
  if (!given.ok())
    return Status(given.status().code(),
                  strCat("sync ", a_->id, " on node ", quote(env_.node),
                         ": amaxes of blocks split between source ranks: ", given.status().message()));
  split_ = std::move(*given);
  return absl::OkStatus();
}

StageSite Execution::siteOf(const planner::TensorLayout& st, const planner::TensorLayout& dt,
                            const planner::Box& box) const {
  if (!planner::computedFrom(st, dt)) return {dt.name, box};  // copied or converted as it is
  return {dt.name, box, &dt, splitOf(dt), amaxesOf(dt)};
}

const SplitAmax* Execution::splitOf(const planner::TensorLayout& dt) const {
  const std::string& weight = dt.scale_of >= 0 ? cp_.dst.tensors[static_cast<size_t>(dt.scale_of)].name : dt.name;
  const auto it = split_.find(weight);
  return it == split_.end() ? nullptr : &it->second;
}

BlockAmaxes* Execution::amaxesOf(const planner::TensorLayout& dt) const {
  if (dt.scale_of < 0 && !dt.blockScaled()) return nullptr;
  const planner::TensorLayout& weight = dt.scale_of >= 0 ? cp_.dst.tensors[static_cast<size_t>(dt.scale_of)] : dt;
  // Keyed by the weight's name, shape and block: its blocks are the same blocks only under both.
  size_t blocks = 1;
  std::string key = weight.name;
  for (size_t d = 0; d < weight.shape.size(); ++d) {
    blocks *= static_cast<size_t>((weight.shape[d] + weight.block[d] - 1) / weight.block[d]);
    key += strCat("/", weight.shape[d], ":", weight.block[d]);
  }
  return a_->blockAmaxes(key, blocks);
}

Status Execution::alive() const { return a_->usable(); }

StatusOr<Registry::LocalBuffer> Execution::buffer(const planner::ResolvedLayout& l, int32_t rank, int32_t b,
                                                  Registry::Set set) const {
  const std::string& name = l.buffer_names[static_cast<size_t>(b)];
  if (&l == &a_->plan->dst) {  // a replica set's rank is a rank of one of its replicas' groups
    const auto [group, member_rank] = a_->dstRank(rank);
    return env_.registry.localBuffer(group, member_rank, name, set);
  }
  return env_.registry.localBuffer(l.group, rank, name, set);
}

TypedView Execution::typed(const Registry::LocalBuffer& b, int64_t offset, std::vector<int64_t> strides,
                           const planner::TensorLayout& t, Direction direction) {
  if (b.keep_alive) mapped_.emplace(b.keep_alive.get(), b.keep_alive);
  return {{b.data, b.kind, offset, std::move(strides)}, t.dtype, engine(b, direction)};
}

Status Execution::send(const std::shared_ptr<transport::MemoryRegion>& src, uint64_t off, const LandedChunk& word,
                       int32_t node) {
  auto peer = peers_.find(node);
  if (peer == peers_.end())
    return absl::FailedPreconditionError(strCat("no daemon for node \"", cp_.nodes.name(node), "\""));
  const auto* landing = cp_.transfer(word.transfer).landingOn(node);
  if (landing == nullptr)
    return absl::InternalError(strCat("sync ", a_->id, ": transfer ", word.transfer, " does not land on node ", node));
  const auto& chunk = cp_.transfer(word.transfer).chunks[static_cast<size_t>(word.chunk)];
  transport::WriteOp op{
      src, off + chunk.offset, peer->second.arena, landing->arena_offset + chunk.offset, word.bytes, a_->key};
  if (landing->direct()) {
    const std::string& name = cp_.dst.buffer_names[static_cast<size_t>(landing->buffer)];
    auto target = peer->second.buffers.find({landing->rank, name});
    if (target == peer->second.buffers.end())
      return absl::FailedPreconditionError(strCat("sync ", a_->id, ": node \"", cp_.nodes.name(node),
                                                  "\" did not offer buffer \"", name, "\" of rank ", landing->rank));
    op.dst = peer->second.regions[target->second.first];
    op.dst_offset = target->second.second + landing->buffer_offset + chunk.offset;
  }
  SC_ASSIGN_OR_RETURN(auto ep, env_.transport.connect(peer->second.address, cp_.nodes.name(node)));
  SC_RETURN_IF_ERROR(a_->send(node, std::move(ep), {std::move(op), word}));
  a_->moved.bytes_sent += word.bytes;
  return absl::OkStatus();
}

uint64_t Execution::deltaTarget(int32_t t) const {
  if (a_->delta != v1::DELTA_AUTO || !a_->bases) return 0;
  uint64_t fence = 0;
  for (const auto& l : cp_.transfer(t).landings) {
    auto p = peers_.find(l.node);
    if (p == peers_.end() || p->second.base.fence == 0) return 0;
    if (fence != 0 && p->second.base.fence != fence) return 0;
    fence = p->second.base.fence;
  }
  return fence;
}

size_t Execution::deltaUnit(int32_t t) const {
  const auto& tr = plan_.transfers[t];
  int64_t unit = 8;
  for (int32_t i = 0; i < tr.fragments_count; ++i) {
    const auto& frag = plan_.fragments[plan_.transfer_fragments[tr.fragments_begin + i]];
    unit = std::min(unit, cp_.dst.tensors[plan_.tensors[frag.tensor].dst].elemBytes());
  }
  return static_cast<size_t>(unit);
}

Status Execution::encodeChunk(int32_t t, int32_t k, std::byte* packed, uint64_t target, LandedChunk* word) {
  if (!a_->bases) return absl::OkStatus();
  const uint64_t n = word->bytes;
  DeltaBases::Base* base = a_->bases->find(t, k);
  if (target != 0 && base != nullptr && base->committed && base->fence == target && base->bytes.size() == n) {
    const uint64_t result = a_->tree_hash ? transport::treeHash(packed, static_cast<int64_t>(n)) : checksum(packed, n);
    encoded_.resize(static_cast<size_t>(static_cast<double>(n) * kDeltaWorthFraction));
    base->fence = a_->fence;
    base->committed = false;
    if (auto size = encodeDelta(packed, base->bytes.data(), n, deltaUnit(t), encoded_.data(), encoded_.size())) {
      std::memcpy(packed, encoded_.data(), *size);
      word->encoding = a_->tree_hash ? LandedChunk::kDeltaTree : LandedChunk::kDelta;
      word->bytes = *size;
      word->result = result;
      return absl::OkStatus();
    }
    std::memcpy(base->bytes.data(), packed, n);  // too much changed: dense, and these bytes the base
    return absl::OkStatus();
  }
  base = a_->bases->make(t, k, n);
  if (base == nullptr) return absl::OkStatus();  // no room: dense next time too
  std::memcpy(base->bytes.data(), packed, n);
  base->fence = a_->fence;
  return absl::OkStatus();
}

StatusOr<bool> Execution::sendFromGpu(int32_t t, int32_t k, const GpuChunk& g, uint64_t target,
                                      const std::vector<int32_t>& staged,
                                      const std::shared_ptr<transport::MemoryRegion>& staging, uint64_t at) {
  const auto& chunk = cp_.transfer(t).chunks[static_cast<size_t>(k)];
  const uint64_t n = chunk.bytes;
  transport::CopyEngine* engine = g.src.device;
  transport::DeviceRuntime* gpus = env_.registry.deviceRuntime();
  const int gpu = g.gpu;
  if (engine == nullptr || !engine->deltaKernels() || gpus == nullptr || gpu < 0) return false;
  DeltaBases::Base* base = a_->bases->find(t, k);
  const bool delta = target != 0 && base != nullptr && base->device && base->gpu == gpu && base->committed &&
                     base->fence == target && base->size() == n;
  if (delta && (!gpu_chunk_ || gpu_chunk_->size() < n || gpu_chunk_gpu_ != gpu)) {
    // The new bytes are packed next to the base: memory for them first, before the base is
    // touched (none: the host encodes this chunk). The old buffer's copies are done first.
    SC_RETURN_IF_ERROR(device_.flush());
    gpu_chunk_.reset();
    auto memory = gpus->allocateDevice(gpu, n);
    if (!memory.ok()) return false;
    gpu_chunk_ = std::move(*memory);
    gpu_chunk_gpu_ = gpu;
  }
  if (!delta) base = a_->bases->makeOnDevice(t, k, n, gpu, *gpus);
  if (base == nullptr) return false;  // no room on the GPU: the host packs and keeps this one
  base->fence = a_->fence;
  base->committed = false;
  auto* out = static_cast<std::byte*>(staging->data()) + at + chunk.offset;
  const TypedView into_base{{base->device->data(), transport::MemoryKind::kCuda, 0, g.wire}, g.tensor->dtype, engine};
  const StageSite site{g.tensor->name, *g.part};
  LandedChunk word{t, 0, 0, k};
  word.bytes = n;
  auto sendWord = [this, staged, staging, at, out](LandedChunk w) -> Status {
    if (req_.verify()) w.checksum = checksum(out, w.bytes);
    for (const int32_t c : staged) {
      w.chain = c;
      SC_RETURN_IF_ERROR(send(staging, at, w, plan_.chain_nodes[plan_.chains[c].nodes_begin]));
    }
    return absl::OkStatus();
  };
  if (!delta) {  // dense: into the staging region for the wire, and into the base on the GPU
    const TypedView wire{{out, transport::MemoryKind::kHost, 0, g.wire}, g.tensor->dtype};
    SC_RETURN_IF_ERROR(env_.stage.pack(wire, g.src, g.extent, site));
    SC_RETURN_IF_ERROR(env_.stage.pack(into_base, g.src, g.extent, site));
    SC_RETURN_IF_ERROR(device_.whenCopied([sendWord, word] { return sendWord(word); }));
    return true;
  }
  // The new bytes packed dense next to the base on the GPU, compared there; only the delta (or,
  // when too much changed, the dense chunk) is copied out.
  const TypedView now{{gpu_chunk_->data(), transport::MemoryKind::kCuda, 0, g.wire}, g.tensor->dtype, engine};
  SC_RETURN_IF_ERROR(device_.flush());  // the chunk before: its follow-up done (the same stream waits next)
  SC_RETURN_IF_ERROR(env_.stage.pack(now, g.src, g.extent, site));
  uint64_t hash = 0;
  SC_ASSIGN_OR_RETURN(const auto size, engine->encodeDelta(gpu_chunk_->data(), base->device->data(), n, deltaUnit(t),
                                                           out, static_cast<size_t>(n * kDeltaWorthFraction), &hash));
  if (!size) {  // too much changed: dense, and the base holds these bytes already
    SC_RETURN_IF_ERROR(engine->copy({out, transport::MemoryKind::kHost, 0, {1}},
                                    {gpu_chunk_->data(), transport::MemoryKind::kCuda, 0, {1}},
                                    {static_cast<int64_t>(n)}, 1));
    SC_RETURN_IF_ERROR(device_.whenCopied([sendWord, word] { return sendWord(word); }));
    return true;
  }
  word.encoding = LandedChunk::kDeltaTree;
  word.bytes = *size;
  word.result = hash;
  a_->moved.gpu_delta_chunks += 1;
  SC_RETURN_IF_ERROR(sendWord(word));
  return true;
}

// Colocated fragments (first wave): straight from local source ranks into local destination ranks.
Status Execution::copyColocated() {
  for (const auto& ls : plan_.local_sources) {
    if (ls.node != self_) continue;
    const auto& frag = plan_.fragments[ls.fragment];
    const auto& pair = plan_.tensors[frag.tensor];
    const auto& st = cp_.src.tensors[pair.src];
    const auto& dt = cp_.dst.tensors[pair.dst];
    for (const auto& [sub, dr] : planner::destinationRegions(plan_, cp_.dst, ls.fragment, self_)) {
      SC_RETURN_IF_ERROR(alive());
      const auto sr = planner::sourceRegion(plan_, cp_.src, ls.fragment, ls.src_rank, sub);
      SC_ASSIGN_OR_RETURN(auto sb, buffer(cp_.src, sr.rank, sr.buffer));
      SC_ASSIGN_OR_RETURN(auto db, buffer(cp_.dst, dr.rank, dr.buffer));
      SC_RETURN_IF_ERROR(env_.stage.copyLocal(typed(db, dr.offset, dr.strides, dt, Direction::kIncoming),
                                              typed(sb, sr.offset, sr.strides, st, Direction::kOutgoing), dr.extent,
                                              siteOf(st, dt, sub)));
      a_->moved.local_bytes += static_cast<uint64_t>(sub.volume() * dt.elemBytes());
    }
  }
  return absl::OkStatus();
}

// Transfer t's chains that this node's source ranks head. Chains the schedule marks direct are sent
// straight from the source rank's registered buffer; the others are packed into the staging
// region (at the transfer's fixed offset) chunk by chunk, each chunk sent as soon as it is
// packed so the network starts before the packing ends.
Status Execution::sendHeaded(int32_t t) {
  const auto& tr = plan_.transfers[t];
  const auto& ts = cp_.transfer(t);
  std::vector<int32_t> staged;
  for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
    const auto& ch = plan_.chains[c];
    if (ch.src_node != self_) continue;
    if (!ts.direct[static_cast<size_t>(c - tr.chains_begin)]) {
      staged.push_back(c);
      continue;
    }
    const int32_t f = plan_.transfer_fragments[tr.fragments_begin];
    const int64_t elem = cp_.src.tensors[plan_.tensors[plan_.fragments[f].tensor].src].elemBytes();
    const auto sr = planner::sourceRegion(plan_, cp_.src, f, planner::sourceRank(plan_, cp_.src, f, ch));
    SC_ASSIGN_OR_RETURN(auto sb, buffer(cp_.src, sr.rank, sr.buffer));
    if (!sb.region)
      return absl::InternalError(strCat("sync ", a_->id, ": a source buffer of transfer ", t, " is not registered"));
    a_->pin(sb.keep_alive);
    const uint64_t start = static_cast<uint64_t>(sr.offset * elem);
    for (size_t k = 0; k < ts.chunks.size(); ++k) {
      const auto& chunk = ts.chunks[k];
      LandedChunk word{t, c, 0, static_cast<int32_t>(k)};
      word.bytes = chunk.bytes;
      if (req_.verify()) {
        SC_ASSIGN_OR_RETURN(word.checksum, checksumOf(env_.host_copies, sb.outgoing, sb.data + start + chunk.offset,
                                                      sb.kind, chunk.bytes));
      }
      SC_RETURN_IF_ERROR(send(sb.region, sb.region_offset + start, word, plan_.chain_nodes[ch.nodes_begin]));
    }
  }
  if (staged.empty()) return absl::OkStatus();
  const uint64_t at = ts.stagingOffset(self_);
  if (at == UINT64_MAX) return absl::InternalError(strCat("sync ", a_->id, ": no staging planned for transfer ", t));
  SC_RETURN_IF_ERROR(ensureStaging());
  const auto& packer = plan_.chains[staged.front()];  // whose source ranks the bytes are read from
  const auto staging = a_->staging();
  auto* out = static_cast<std::byte*>(staging->data()) + at;
  const uint64_t target = deltaTarget(t);
  // Delta syncs whose daemons check tree hashes: a chunk of one fragment packed from device
  // memory and copied as it is may be encoded on its GPU (sendFromGpu).
  const bool gpu_deltas = env_.gpu_deltas && a_->bases && a_->tree_hash && tr.fragments_count == 1;
  for (size_t k = 0; k < ts.chunks.size(); ++k) {
    const auto& chunk = ts.chunks[k];
    bool sent = false;  // encoded on the GPU and sent (or on its way)
    for (int32_t i = 0; i < tr.fragments_count && !sent; ++i) {
      const int32_t f = plan_.transfer_fragments[tr.fragments_begin + i];
      const auto& frag = plan_.fragments[f];
      const auto& st = cp_.src.tensors[plan_.tensors[frag.tensor].src];
      const auto& dt = cp_.dst.tensors[plan_.tensors[frag.tensor].dst];
      const int32_t rank = planner::sourceRank(plan_, cp_.src, f, packer);
      // A chunk is a row-major slab of its (single) fragment: dense at chunk.offset.
      const planner::Box& part = chunk.box.ndim == 0 ? frag.box : chunk.box;
      const auto sr = chunk.box.ndim == 0 ? planner::sourceRegion(plan_, cp_.src, f, rank)
                                          : planner::sourceRegion(plan_, cp_.src, f, rank, chunk.box);
      SC_ASSIGN_OR_RETURN(auto sb, buffer(cp_.src, sr.rank, sr.buffer));
      if (gpu_deltas && sb.kind == transport::MemoryKind::kCuda && sb.outgoing != nullptr && st.dtype == dt.dtype &&
          !planner::computedFrom(st, dt)) {
        const GpuChunk g{
            typed(sb, sr.offset, sr.strides, st, Direction::kOutgoing), sr.extent, denseFor(part), &dt, &part, sb.gpu};
        SC_ASSIGN_OR_RETURN(sent, sendFromGpu(t, static_cast<int32_t>(k), g, target, staged, staging, at));
        if (sent) break;  // (the transfer's one fragment)
      }
      const TypedView wire{
          {out + cp_.fragment_offset[f] + chunk.offset, transport::MemoryKind::kHost, 0, denseFor(part)}, dt.dtype};
      SC_RETURN_IF_ERROR(env_.stage.pack(wire, typed(sb, sr.offset, sr.strides, st, Direction::kOutgoing), sr.extent,
                                         siteOf(st, dt, part)));
    }
    if (sent) continue;
    // Encoded, checksummed and sent once packed (device packs: a chunk behind the next one's).
    auto then = [this, t, k, packed = out + chunk.offset, bytes = chunk.bytes, target, at, staged,
                 staging]() -> Status {
      LandedChunk word{t, 0, 0, static_cast<int32_t>(k)};
      word.bytes = bytes;
      SC_RETURN_IF_ERROR(encodeChunk(t, static_cast<int32_t>(k), packed, target, &word));
      if (req_.verify()) word.checksum = checksum(packed, word.bytes);
      for (const int32_t c : staged) {
        word.chain = c;
        SC_RETURN_IF_ERROR(send(staging, at, word, plan_.chain_nodes[plan_.chains[c].nodes_begin]));
      }
      return absl::OkStatus();
    };
    SC_RETURN_IF_ERROR(device_.whenCopied(std::move(then)));
  }
  return absl::OkStatus();
}

// The staging region of this sync: a spare one of the same plan, or a new one.
Status Execution::ensureStaging() {
  if (a_->staging()) return absl::OkStatus();
  auto staging = env_.spares.take(cp_.key, SpareMemory::Use::kStaging, cp_.node(self_).staging_bytes);
  if (!staging) {
    SC_ASSIGN_OR_RETURN(staging, transport::allocateHostStaging(env_.transport, cp_.node(self_).staging_bytes,
                                                                env_.registry.deviceRuntime(), "a staging buffer"));
  }
  a_->setStaging(std::move(staging));
  return absl::OkStatus();
}

// Everything that lands here in this wave, one chunk at a time as notifications arrive.
Status Execution::receive() {
  // A folded attempt: nodes that have not said they have it open are told again this often.
  constexpr auto kReadyAgain = std::chrono::milliseconds(100);
  int64_t processed = 0;
  const int64_t expected = cp_.node(self_).incoming[static_cast<size_t>(wave_)];
  while (true) {
    const bool waiting = !a_->unready().empty();
    const auto until = waiting ? std::min(deadline_, Clock::now() + kReadyAgain) : deadline_;
    SC_ASSIGN_OR_RETURN(const auto next, a_->nextLanded(until, processed == expected));
    if (next.kind == SyncAttempt::Next::kTimedOut && Clock::now() < deadline_) {
      for (const int32_t n : a_->unready())  // over a new connection if the old one broke
        if (const auto peer = peers_.find(n); peer != peers_.end())
          if (auto ep = env_.transport.connect(peer->second.address, cp_.nodes.name(n)); ep.ok())
            a_->sayReadyAgain(n, std::move(*ep));
      continue;
    }
    if (next.kind == SyncAttempt::Next::kTimedOut) {
      std::string unready;  // a folded attempt: the nodes that never said they had it open
      for (const int32_t n : a_->unready()) unready += strCat(unready.empty() ? "" : ", ", quote(cp_.nodes.name(n)));
      return absl::DeadlineExceededError(
          strCat("sync ", a_->id, " on node \"", env_.node, "\": ", processed, " of ", expected,
                 " chunks landed before the timeout",
                 unready.empty() ? std::string() : strCat(" (never opened the attempt: ", unready, ")")));
    }
    if (next.kind == SyncAttempt::Next::kDone) return absl::OkStatus();  // all landed, processed and forwarded
    SC_RETURN_IF_ERROR(processLanded(next.chunk));
    ++processed;
  }
}

// A landed chunk, in steps: checked against the plan, located where it landed (and its checksum
// verified), forwarded along its relay chain, unpacked into the local ranks that need part of it
// (a delta: rebuilt from their bytes first), and what they hold verified.
Status Execution::processLanded(const LandedChunk& l) {
  SC_RETURN_IF_ERROR(alive());
  SC_RETURN_IF_ERROR(check(l));
  SC_ASSIGN_OR_RETURN(const Arrival at, land(l));
  SC_RETURN_IF_ERROR(relay(l, at));
  SC_ASSIGN_OR_RETURN(const Unpacked u, unpack(l, at));
  if (req_.verify()) {
    SC_RETURN_IF_ERROR(device_.settle());
    SC_RETURN_IF_ERROR(checkHeld(env_.host_copies, heldPieces(l, u), site(l)));
  }
  // A rebuilt chunk is unpacked from decoded_, which the next delta overwrites: its device
  // copies have to be done first (a landed chunk's bytes stay in the arena until the wave ends).
  if (at.delta) SC_RETURN_IF_ERROR(device_.settle());
  (at.delta ? a_->moved.delta_chunks : a_->moved.dense_chunks) += 1;
  a_->moved.bytes_received += l.bytes;
  return absl::OkStatus();
}

// Every index a peer sent, against the plan: the transfer and chunk exist and belong to this
// wave, the chain is one of the transfer's, and its hop is this node; the encoding is one this
// node can take there; each chunk lands once.
Status Execution::check(const LandedChunk& l) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(strCat("sync ", a_->id, " on node \"", env_.node, "\": a peer announced ", what,
                                             " (transfer ", l.transfer, ", chain ", l.chain, ", hop ", l.hop,
                                             ", chunk ", l.chunk, ")"));
  };
  if (const std::string problem = cp_.landedProblem(l, wave_, self_); !problem.empty()) return bad(problem);
  const auto& ts = cp_.transfer(l.transfer);
  const auto& chunk = ts.chunks[static_cast<size_t>(l.chunk)];
  const auto* landing = ts.landingOn(self_);
  if (landing == nullptr)
    return absl::InternalError(
        strCat("sync ", a_->id, ": transfer ", l.transfer, " landed on node \"", env_.node, "\" unplanned"));
  const bool delta = l.delta();
  if (l.encoding != LandedChunk::kDense && !delta) return bad(strCat("an unknown encoding ", l.encoding));
  if (!delta && l.bytes != chunk.bytes) return bad(strCat("a dense chunk of ", l.bytes, " bytes, not ", chunk.bytes));
  if (delta && l.bytes > chunk.bytes) return bad(strCat("a delta of ", l.bytes, " bytes for a chunk of ", chunk.bytes));
  if (delta && landing->direct()) return bad("a delta for a chunk that lands in a rank directly");
  if (l.encoding == LandedChunk::kDeltaTree && !a_->tree_hash) return bad("a tree-hashed delta in a sync without them");
  if (delta && a_->base.fence == 0) return bad("a delta for a node whose ranks hold no base");
  if (!a_->landOnce(l.transfer, l.chunk)) return bad("a chunk that already landed");
  return absl::OkStatus();
}

// Where the transfer's bytes are here: the landing rank's buffer, or the arena.
StatusOr<Execution::Arrival> Execution::land(const LandedChunk& l) {
  const auto& ts = cp_.transfer(l.transfer);
  Arrival at;
  at.chunk = &ts.chunks[static_cast<size_t>(l.chunk)];
  at.landing = ts.landingOn(self_);
  at.delta = l.delta();
  at.region = a_->arena;
  at.region_offset = at.landing->arena_offset;
  if (a_->arena) at.memory.data = static_cast<std::byte*>(a_->arena->data()) + at.landing->arena_offset;
  if (at.landing->direct()) {
    SC_ASSIGN_OR_RETURN(at.memory, buffer(cp_.dst, at.landing->rank, at.landing->buffer));
    at.region = at.memory.region;
    at.region_offset = at.memory.region_offset + at.landing->buffer_offset;
    at.memory.data += at.landing->buffer_offset;
    a_->moved.bytes_landed_direct += at.chunk->bytes;
  }
  if (req_.verify()) {
    std::byte* bytes = at.memory.data + at.chunk->offset;
    SC_ASSIGN_OR_RETURN(const uint64_t sum,
                        checksumOf(env_.host_copies, at.memory.outgoing, bytes, at.memory.kind, l.bytes));
    SC_RETURN_IF_ERROR(checkChecksum(l.checksum, sum, site(l)));
  }
  return at;
}

// Forwards the chunk along its relay chain first (a star's first node: to every other node of
// it): the next nodes' transfers then overlap the local fan-out (the bytes stay where they
// landed until the sync ends).
Status Execution::relay(const LandedChunk& l, const Arrival& at) {
  const auto& ch = plan_.chains[l.chain];
  const int32_t last = ch.star ? (l.hop == 0 ? ch.nodes_count - 1 : l.hop) : std::min(l.hop + 1, ch.nodes_count - 1);
  for (int32_t hop = l.hop + 1; hop <= last; ++hop) {
    LandedChunk next = l;
    next.hop = hop;
    SC_RETURN_IF_ERROR(send(at.region, at.region_offset, next, plan_.chain_nodes[ch.nodes_begin + hop]));
  }
  return absl::OkStatus();
}

// The dense chunk (where it landed, or rebuilt from the delta) into every local piece; a piece
// that another GPU here already took from host memory is copied from that GPU (deviceCopyOf).
StatusOr<Execution::Unpacked> Execution::unpack(const LandedChunk& l, const Arrival& at) {
  Unpacked u;
  SC_ASSIGN_OR_RETURN(u.pieces, localPieces(l.transfer, l.chunk, at.delta));
  u.wire = at.memory.data + at.chunk->offset;
  u.kind = at.memory.kind;
  u.copies = engine(at.memory, Direction::kIncoming);
  if (at.delta) {
    SC_ASSIGN_OR_RETURN(const bool on_gpu, decodeOnGpu(l, u.wire, &u));
    if (!on_gpu) {
      SC_RETURN_IF_ERROR(decode(l, u.wire, u.pieces));
      u.wire = decoded_.data();
      u.kind = transport::MemoryKind::kHost;
      u.copies = nullptr;
    }
  }
  for (size_t i = 0; i < u.pieces.size(); ++i) {
    const Piece& p = u.pieces[i];
    const uint64_t bytes = static_cast<uint64_t>(p.part.volume() * p.tensor->elemBytes());
    if (u.kind == transport::MemoryKind::kHost)
      if (const Piece* first = deviceCopyOf(u.pieces, i)) {
        SC_RETURN_IF_ERROR(
            env_.stage.unpack(p.memory, first->memory, p.part.sizes(), {p.tensor->name, p.part, p.tensor}));
        a_->moved.local_bytes += bytes;
        a_->moved.device_fanout_bytes += bytes;
        continue;
      }
    const TypedView from{{u.wire + (p.at - at.chunk->offset), u.kind, 0, p.dense}, p.tensor->dtype, u.copies};
    SC_RETURN_IF_ERROR(env_.stage.unpack(p.memory, from, p.part.sizes(), {p.tensor->name, p.part, p.tensor}));
    a_->moved.local_bytes += bytes;
  }
  return u;
}

std::vector<HeldPiece> Execution::heldPieces(const LandedChunk& l, const Unpacked& u) const {
  const auto& chunk = cp_.transfer(l.transfer).chunks[static_cast<size_t>(l.chunk)];
  std::vector<HeldPiece> out;
  for (const auto& p : u.pieces)
    out.push_back({p.memory,
                   {u.wire + (p.at - chunk.offset), u.kind, 0, p.dense},
                   u.copies,
                   p.part.sizes(),
                   p.tensor->elemBytes(),
                   p.rank,
                   p.tensor->name,
                   p.part});
  return out;
}

VerifySite Execution::site(const LandedChunk& l) const {
  return {a_->id, a_->dst_group, env_.node, l.transfer, l.chunk};
}

const Execution::Piece* Execution::deviceCopyOf(const std::vector<Piece>& pieces, size_t i) {
  auto contiguous = [](const Piece& p) {
    int64_t runs = 0;
    transport::forEachRun(p.memory.view, p.memory.view, p.part.sizes(), p.tensor->elemBytes(),
                          [&](int64_t, int64_t, int64_t) { ++runs; });
    return runs == 1;
  };
  const Piece& p = pieces[i];
  if (p.memory.view.kind != transport::MemoryKind::kCuda || !contiguous(p)) return nullptr;
  for (size_t j = 0; j < i; ++j) {
    const Piece& q = pieces[j];
    if (q.tensor == p.tensor && q.part == p.part && q.memory.view.kind == transport::MemoryKind::kCuda &&
        contiguous(q) && deviceCopyOf(pieces, j) == nullptr)
      return &q;
  }
  return nullptr;
}

StatusOr<std::vector<Execution::Piece>> Execution::localPieces(int32_t t, int32_t k, bool bases) {
  const auto& tr = plan_.transfers[t];
  const auto& chunk = cp_.transfer(t).chunks[static_cast<size_t>(k)];
  const auto* landing = cp_.transfer(t).landingOn(self_);
  std::vector<Piece> out;
  for (int32_t i = 0; i < tr.fragments_count; ++i) {
    const int32_t f = plan_.transfer_fragments[tr.fragments_begin + i];
    const auto& frag = plan_.fragments[f];
    const auto& dt = cp_.dst.tensors[plan_.tensors[frag.tensor].dst];
    const int64_t elem = dt.elemBytes();
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
      Piece& p = out.emplace_back();
      p.at = cp_.fragment_offset[f] + static_cast<uint64_t>(src_off * elem);
      p.part = part;
      p.memory = typed(db, dst_off, dr.strides, dt, Direction::kIncoming);
      p.dense = dense;
      p.tensor = &dt;
      p.rank = dr.rank;
      p.gpu = db.gpu;
      if (bases) {
        SC_ASSIGN_OR_RETURN(auto held, buffer(cp_.dst, dr.rank, dr.buffer, Registry::Set::kHeld));
        p.base = typed(held, dst_off, dr.strides, dt, Direction::kIncoming);
        p.base_gpu = held.gpu;
      }
    }
  }
  return out;
}

// The base is what the local ranks hold of the chunk (they all hold the version the delta is
// against: Registry::Base; a double-buffered rank in its set in use, Piece::base); the delta is applied to it, and the
// result must hash as the source's dense bytes did, or a rank here did not hold its base: the sync fails naming them.
Status Execution::decode(const LandedChunk& l, const std::byte* delta, const std::vector<Piece>& pieces) {
  const auto& chunk = cp_.transfer(l.transfer).chunks[static_cast<size_t>(l.chunk)];
  decoded_.resize(static_cast<size_t>(chunk.bytes));
  for (const auto& p : pieces)  // the bases as the ranks hold them: no stage (nothing converts)
    SC_RETURN_IF_ERROR(copyBox(env_.host_copies, p.base.device,
                               {decoded_.data() + (p.at - chunk.offset), transport::MemoryKind::kHost, 0, p.dense},
                               p.base.view, p.part.sizes(), p.tensor->elemBytes()));
  if (auto st = applyDelta(decoded_.data(), chunk.bytes, deltaUnit(l.transfer), delta, l.bytes); !st.ok())
    return absl::InvalidArgumentError(strCat("sync ", a_->id, " on node \"", env_.node, "\": chunk ", l.chunk,
                                             " of transfer ", l.transfer, ": ", st.message()));
  const uint64_t rebuilt = l.encoding == LandedChunk::kDeltaTree
                               ? transport::treeHash(decoded_.data(), static_cast<int64_t>(decoded_.size()))
                               : checksum(decoded_.data(), decoded_.size());
  if (rebuilt == l.result) return absl::OkStatus();
  return notRebuilt(l, pieces);
}

StatusOr<bool> Execution::decodeOnGpu(const LandedChunk& l, const std::byte* delta, Unpacked* u) {
  const auto& pieces = u->pieces;
  if (l.encoding != LandedChunk::kDeltaTree || pieces.empty()) return false;
  // On the GPU the last chunk was rebuilt on when a piece is there (its buffer kept), else the
  // first piece's.
  const Piece* on = &pieces.front();
  for (const auto& p : pieces)
    if (p.gpu == gpu_rebuilt_gpu_) on = &p;
  const int gpu = on->gpu;
  transport::CopyEngine* engine = on->memory.device;
  transport::DeviceRuntime* gpus = env_.registry.deviceRuntime();
  if (!env_.gpu_deltas || gpu < 0 || engine == nullptr || !engine->deltaKernels() || gpus == nullptr) return false;
  // Pieces on other GPUs of the node (TP ranks) are read and written by this GPU's stream, GPU to
  // GPU, where it reaches them (peer access: NVLink or PCIe); each piece's region is this chunk's
  // alone.
  for (const auto& p : pieces)
    if (p.gpu < 0 || p.memory.view.kind != transport::MemoryKind::kCuda || !gpus->peerAccess(gpu, p.gpu) ||
        p.base_gpu < 0 || p.base.view.kind != transport::MemoryKind::kCuda || !gpus->peerAccess(gpu, p.base_gpu))
      return false;
  const auto& chunk = cp_.transfer(l.transfer).chunks[static_cast<size_t>(l.chunk)];
  if (!gpu_rebuilt_ || gpu_rebuilt_->size() < chunk.bytes || gpu_rebuilt_gpu_ != gpu) {
    gpu_rebuilt_.reset();
    auto memory = gpus->allocateDevice(gpu, chunk.bytes);
    if (!memory.ok()) return false;  // no room on the GPU: the host rebuilds it
    gpu_rebuilt_ = std::move(*memory);
    gpu_rebuilt_gpu_ = gpu;
  }
  std::byte* rebuilt = gpu_rebuilt_->data();
  for (const auto& p : pieces)  // the bases as the ranks hold them, on the rebuilding GPU's stream
    SC_RETURN_IF_ERROR(engine->copy({rebuilt + (p.at - chunk.offset), transport::MemoryKind::kCuda, 0, p.dense},
                                    p.base.view, p.part.sizes(), p.tensor->elemBytes()));
  auto hash = engine->applyDelta(rebuilt, chunk.bytes, deltaUnit(l.transfer), delta, l.bytes);
  if (!hash.ok())  // a malformed delta (INVALID_ARGUMENT) or this GPU's failure, as it is
    return Status(hash.status().code(), strCat("sync ", a_->id, " on node \"", env_.node, "\": chunk ", l.chunk,
                                               " of transfer ", l.transfer, ": ", hash.status().message()));
  if (*hash != l.result) return notRebuilt(l, pieces);
  u->wire = rebuilt;
  u->kind = transport::MemoryKind::kCuda;
  u->copies = engine;
  a_->moved.gpu_rebuilt_chunks += 1;
  return true;
}

Status Execution::notRebuilt(const LandedChunk& l, const std::vector<Piece>& pieces) const {
  std::set<int32_t> ranks;
  for (const auto& p : pieces) ranks.insert(p.rank);
  std::string names;
  for (const int32_t r : ranks) names += strCat(names.empty() ? "" : ", ", r);
  return absl::DataLossError(strCat(
      "sync ", a_->id, ": a delta of tensor \"", pieces.empty() ? std::string("?") : pieces.front().tensor->name,
      "\" (transfer ", l.transfer, ", chunk ", l.chunk, ") does not rebuild the source's bytes on node \"", env_.node,
      "\": group \"", a_->dst_group, "\" rank(s) ", names, " there do not hold version ", a_->base.version,
      " as committed (written outside a sync?); sync without deltas (delta: DELTA_DENSE) to repair them"));
}

}  // namespace shardcast::daemon
