#include "daemon/server/service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <mutex>

#include "common/logging.h"
#include "common/strings.h"
#include "daemon/coordinator/relay.h"
#include "daemon/engine/notification.h"
#include "planner/plan.h"
#include "planner/report.h"

namespace shardcast::daemon {

namespace {

// A handler's result: the value into the response, or the error as gRPC's.
template <typename T>
grpc::Status reply(StatusOr<T> result, T* out) {
  if (!result.ok()) return toGrpc(result.status());
  *out = std::move(*result);
  return grpc::Status::OK;
}

// The transport addresses a coordinator hands this daemon (`nodes`, this daemon's own left out),
// checked against what each node describes to this daemon before it connects to any: they reach
// UCX's own (unchecking) parser. A node slow to answer is waited for until a little before the
// call's deadline, so that it is refused by name rather than by the call running out.
Status checkNodes(const PeerSet& peers, const Registry& registry,
                  const google::protobuf::RepeatedPtrField<v1::NodeDirectory>& nodes, grpc::ServerContext& ctx) {
  std::vector<PeerSet::NodeAddress> given;
  for (const auto& n : nodes)
    if (n.node() != registry.node() || n.transport_address() != registry.transportAddress())
      given.push_back({n.node(), n.transport_address(), n.address()});
  if (given.empty()) return absl::OkStatus();
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(ctx.deadline() - std::chrono::system_clock::now());
  const auto margin = std::clamp(left / 10, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  return peers.checkTransportAddresses(given, std::chrono::steady_clock::now() + (left - margin),
                                       [&ctx] { return ctx.IsCancelled(); });
}

// A wait a client asks for (`timeout_ms` of `call`), refused above the daemon's --max-wait-ms:
// a call may hold a thread here that long at most (docs/security.md, "Every wait ends").
Status checkWait(const char* call, uint32_t timeout_ms, int64_t max_wait_ms) {
  if (timeout_ms <= max_wait_ms) return absl::OkStatus();
  return absl::InvalidArgumentError(strCat(call, ": timeout_ms ", timeout_ms,
                                           " is longer than this daemon's longest wait, ", max_wait_ms,
                                           " ms (--max-wait-ms)"));
}

}  // namespace

ShardcastService::ShardcastService(const DaemonConfig& config, const AccessPolicy& access, Registry& registry,
                                   PeerSet& peers, SyncEngine& engine, Metrics& metrics, ProgressBoard& progress,
                                   std::string transport)
    : config_(config),
      access_(access),
      registry_(registry),
      peers_(peers),
      metrics_(metrics),
      progress_(progress),
      runner_(config, registry, peers, engine, progress,
              [&metrics](const std::string& node) { metrics.peerFailed(node); }),
      transport_(std::move(transport)) {}

StatusOr<ClusterView> ShardcastService::cluster() {
  SC_ASSIGN_OR_RETURN(auto c, snapshotCluster(peers_, registry_.describe(), config_.selfAddress()));
  return std::move(c.view);
}

grpc::Status ShardcastService::Sync(grpc::ServerContext* ctx, const v1::SyncRequest* req, v1::SyncResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  // A local caller acts for its uid (root for everyone); a remote caller of the job (certificate
  // or token) for the job (docs/security.md, "Who may sync").
  std::optional<uint32_t> uid;
  if (caller->local && caller->local->uid != 0 && !access_.insecure()) uid = caller->local->uid;
  const auto started = std::chrono::steady_clock::now();
  grpc::Status st;
  if (auto wait = checkWait("sync", req->options().timeout_ms(), config_.max_wait_ms); !wait.ok()) {
    st = toGrpc(wait);
  } else {
    Metrics::InFlight in_flight(metrics_);
    st = coordinate(*req, out, uid, [this, ctx] { return ended(*ctx); });
  }
  if (st.ok()) {
    metrics_.syncCommitted(*out);
    if (out->replicas_size() > 0) {
      const auto count = [&](auto pred) {
        return static_cast<size_t>(std::count_if(out->replicas().begin(), out->replicas().end(), pred));
      };
      metrics_.replicaSetSynced(req->dst_group(), count([](const v1::ReplicaOutcome& r) { return r.committed(); }),
                                count([](const v1::ReplicaOutcome& r) { return !r.committed() && !r.left(); }));
    }
  } else {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    metrics_.syncFailed(seconds, *out);
    // Every refused or failed sync leaves one line: which, for whom, why, and, when it reached its
    // daemons, its phases' figures. A caller retrying in a loop gets one line per 10 s, with the
    // count of those held back. Keyed by caller and kind only: group names are the caller's to
    // choose, and varying them must not buy a line each.
    uint64_t held = 0;
    if (failure_log_.allow(strCat(caller->who, "|", st.error_code()), &held)) {
      const LogScope scope(out->sync_id(), req->dst_group());
      std::string figures;
      if (out->prepare_seconds() > 0)  // it reached the daemons
        figures = fmt::format(
            " after {:.3f} s (gather {:.3f} s, plan {:.3f} s, prepare {:.3f} s, execute {:.3f} s, "
            "finish {:.3f} s)",
            seconds, out->gather_seconds(), out->plan_seconds(), out->prepare_seconds(), out->execute_seconds(),
            out->finish_seconds());
      spdlog::warn(
          "sync {} -> {} version {} for {} failed{}: {}{}{}", quote(req->src_group()), quote(req->dst_group()),
          req->version(), caller->who, figures, st.error_message(),
          out->sync_id().empty() ? "" : strCat(" (sync ", out->sync_id(), ")"),
          held ? strCat(" (and ", held, " more failed syncs of this caller since the last line)") : std::string());
    }
  }
  return st;
}

grpc::Status ShardcastService::coordinate(const v1::SyncRequest& req, v1::SyncResponse* out,
                                          std::optional<uint32_t> caller_uid, const std::function<bool()>& gone) {
  if (req.src_group().empty() || req.dst_group().empty() || req.src_group() == req.dst_group())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "sync: give two different groups (src_group, dst_group)");
  // (A catch-up may leave the version to the daemons: 0, the newest a replica of the set holds.)
  if (!planner::isVersion(req.version()) && !(req.version() == 0 && req.options().catch_up()))
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        strCat("sync: version ", req.version(), " is not in ", planner::kVersionRange));
  // A client's sync id travels in the daemons' notifications, logs and metrics.
  const bool id_ok =
      req.sync_id().size() <= planner::kMaxSyncIdBytes &&
      std::all_of(req.sync_id().begin(), req.sync_id().end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':';
      });
  if (!id_ok)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        strCat("sync: sync_id must be at most ", planner::kMaxSyncIdBytes,
                               " characters of letters, digits and - _ . :"));
  const std::string id = req.sync_id().empty() ? strCat(config_.node, "-", registry_.instance().substr(0, 8), "-",
                                                        next_sync_++, "-v", req.version())
                                               : req.sync_id();
  // Daemons tell the attempts of one id apart by their fence; a client that reuses the id of a
  // sync still running here is refused outright.
  if (!progress_.start(id))
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        strCat("sync: a sync with id \"", id, "\" is still running on node \"", config_.node, "\""));
  progress_.update(id, [&](v1::SyncProgress& p) {
    p.set_src_group(req.src_group());
    p.set_dst_group(req.dst_group());
    p.set_version(req.version());
    p.set_coordinator(config_.node);
    p.set_started_unix_seconds(
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  });
  const LogScope scope(id, req.dst_group());
  return toGrpc(runner_.run(req, id, caller_uid, gone, out));
}

grpc::Status ShardcastService::Watch(grpc::ServerContext* context, const v1::WatchRequest* req,
                                     grpc::ServerWriter<v1::SyncProgress>* writer) {
  const auto caller = access_.client(*context, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  const bool known = progress_.watch(req->sync_id(), std::chrono::seconds(5), [&](const v1::SyncProgress& p) {
    return !context->IsCancelled() && writer->Write(p);
  });
  if (!known)
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        strCat("sync \"", req->sync_id(), "\" is not coordinated by node \"", config_.node, "\""));
  return grpc::Status::OK;
}

grpc::Status ShardcastService::WaitVersion(grpc::ServerContext* ctx, const v1::WaitVersionRequest* req,
                                           v1::WaitVersionResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto wait = checkWait("wait", req->timeout_ms(), config_.max_wait_ms); !wait.ok()) return toGrpc(wait);
  const Metrics::Waiting waiting(metrics_);
  return reply(registry_.waitVersion(req->group(), req->version(), std::chrono::milliseconds(req->timeout_ms()),
                                     [this, ctx] { return ended(*ctx); }),
               out);
}

grpc::Status ShardcastService::Acquire(grpc::ServerContext* context, const v1::AcquireRequest* req,
                                       v1::AcquireResponse* out) {
  const auto caller = access_.client(*context, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto wait = checkWait("acquire", req->timeout_ms(), config_.max_wait_ms); !wait.ok()) return toGrpc(wait);
  const Metrics::Waiting waiting(metrics_);
  auto r = registry_.acquire(
      req->group(), req->rank(), caller->memory(access_.insecure()),
      std::chrono::milliseconds(req->timeout_ms() ? req->timeout_ms() : std::min<int64_t>(30000, config_.max_wait_ms)),
      [this, context] { return ended(*context); }, req->registration());
  if (!r.ok()) return toGrpc(r.status());
  *out->mutable_status() = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req,
                                       v1::ReleaseResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  auto r = registry_.release(req->group(), req->rank(), req->version(), caller->memory(access_.insecure()),
                             req->registration());
  if (!r.ok()) return toGrpc(r.status());
  *out->mutable_status() = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Session(grpc::ServerContext* context, const v1::SessionRequest* req,
                                       grpc::ServerWriter<v1::SessionEvent>* writer) {
  const auto caller = access_.client(*context, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  const std::string session = registry_.openSession(req->client());
  v1::SessionEvent ev;
  ev.set_session_id(session);
  ev.set_node(config_.node);
  if (writer->Write(ev)) {
    // Until the client goes (its process ends: the connection closes) or the daemon stops.
    // IsCancelled has no wake-up of its own in the synchronous API: look every 100 ms, and tell
    // the client of its ranks another process took over meanwhile.
    std::unique_lock<std::mutex> lock(sessions_mu_);
    while (!sessions_cv_.wait_for(lock, std::chrono::milliseconds(100),
                                  [&] { return stopping_ || context->IsCancelled(); })) {
      auto superseded = registry_.takeSuperseded(session);
      if (superseded.empty()) continue;
      v1::SessionEvent told;
      told.set_session_id(session);
      told.set_node(config_.node);
      for (auto& s : superseded) *told.add_superseded() = std::move(s);
      lock.unlock();
      const bool written = writer->Write(told);
      lock.lock();
      if (!written) break;
    }
  }
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    stopping = stopping_;
  }
  if (stopping)
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, strCat("shardcastd on node \"", config_.node, "\" is stopping"));
  registry_.closeSession(session);
  ++metrics_.sessions_ended;
  return grpc::Status::OK;
}

bool ShardcastService::ended(const grpc::ServerContext& ctx) const {
  // Lock-free: the registry polls it under its own lock, which Session takes under sessions_mu_.
  return stopped_.load() || ctx.IsCancelled();
}

void ShardcastService::stop() {
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    stopping_ = true;
  }
  stopped_ = true;
  sessions_cv_.notify_all();
}

grpc::Status PeerService::Describe(grpc::ServerContext* ctx, const v1::DescribeRequest* req,
                                   v1::DescribeResponse* out) {
  if (auto allowed = access_.peer(*ctx, *req); !allowed.ok()) return toGrpc(allowed);
  *out = registry_.describe(*req);
  if (req->layouts_size() > 0) return grpc::Status::OK;  // layouts fetched by digest: those alone
  for (auto& [address, node] : peers_.knownNodes()) (*out->mutable_peer_nodes())[address] = node;
  if (req->syncs())
    for (auto& p : progress_.recent(kRecentSyncs)) *out->add_syncs() = std::move(p);
  return grpc::Status::OK;
}

grpc::Status PeerService::Prepare(grpc::ServerContext* ctx, const v1::PrepareRequest* req, v1::PrepareResponse* out) {
  if (auto allowed = access_.peer(*ctx, *req); !allowed.ok()) return toGrpc(allowed);
  const LogScope scope(req->sync_id(), req->dst().group());
  // The peers this daemon's part of the plan reaches, checked before any rank is taken: a sync
  // that cannot connect fails here, not in its first wave with ranks left DIRTY.
  if (Status st = checkNodes(peers_, registry_, req->peers(), *ctx); !st.ok())
    return toGrpc(Status(st.code(), strCat("prepare of sync ", req->sync_id(), " on node ", quote(registry_.node()),
                                           ": ", st.message())));
  auto prepared = engine_.prepare(*req);
  if (!prepared.ok()) return toGrpcNamingGroup(prepared.status());  // the group whose ranks refused
  return reply(std::move(prepared), out);
}

grpc::Status PeerService::Execute(grpc::ServerContext* ctx, const v1::ExecuteRequest* req, v1::ExecuteResponse* out) {
  if (auto allowed = access_.peer(*ctx, *req); !allowed.ok()) return toGrpc(allowed);
  const LogScope scope(req->sync_id());
  // Known since the Prepare (PrepareRequest.peers), but for a folded Prepare, a coordinator of an
  // older version, or a node that restarted since.
  if (Status st = checkNodes(peers_, registry_, req->nodes(), *ctx); !st.ok())
    return toGrpc(Status(st.code(), strCat("execute of sync ", req->sync_id(), ": ", st.message())));
  auto executed = engine_.execute(*req);
  // The group whose registrations changed under it, or whose ranks refused its folded Prepare.
  if (!executed.ok()) return toGrpcNamingGroup(executed.status());
  return reply(std::move(executed), out);
}

grpc::Status PeerService::Progress(grpc::ServerContext* ctx, const v1::ProgressRequest* req,
                                   v1::ProgressResponse* out) {
  if (auto allowed = access_.peer(*ctx, *req); !allowed.ok()) return toGrpc(allowed);
  return reply(engine_.progress(req->sync_id(), req->fence()), out);
}

grpc::Status PeerService::Relay(grpc::ServerContext* ctx, const v1::RelayRequest* req, v1::RelayResponse* out) {
  if (auto allowed = access_.peer(*ctx, *req); !allowed.ok()) return toGrpc(allowed);
  return reply(relay(peers_, *req, ctx->deadline(), [ctx] { return ctx->IsCancelled(); }), out);
}

grpc::Status PeerService::Finish(grpc::ServerContext* ctx, const v1::FinishRequest* req, v1::FinishResponse* out) {
  if (auto allowed = access_.peer(*ctx, *req); !allowed.ok()) return toGrpc(allowed);
  const LogScope scope(req->sync_id());
  return reply(engine_.finish(*req, ctx->deadline()), out);
}

grpc::Status ShardcastService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                        v1::RegisterResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  if (!caller->local && !access_.insecure())
    return toGrpc(absl::PermissionDeniedError(strCat(
        caller->who, ": ranks register over the Unix socket (the daemon checks that the memory is the caller's own)")));
  const LogScope scope("", req->group(), req->rank());
  auto r = registry_.registerRank(*req, caller->memory(access_.insecure()));
  if (!r.ok()) {
    spdlog::warn("register refused: {}", std::string(r.status().message()));
    return toGrpc(r.status());
  }
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Unregister(grpc::ServerContext* ctx, const v1::UnregisterRequest* req,
                                          v1::UnregisterResponse*) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  return toGrpc(
      registry_.unregisterRank(req->group(), req->rank(), caller->memory(access_.insecure()), req->registration()));
}

grpc::Status ShardcastService::List(grpc::ServerContext* ctx, const v1::ListRequest* req, v1::ListResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  for (auto& r : registry_.list()) *out->add_ranks() = std::move(r);
  if (!req->all_nodes()) return grpc::Status::OK;
  v1::DescribeRequest by_digest;  // each layout fetched once, not from every daemon holding it
  by_digest.set_layout_digests(true);
  auto peers = peers_.describeAll(by_digest);
  if (!peers.ok()) return toGrpc(peers.status());
  for (const auto& p : *peers)
    if (!p.described.ok()) return toGrpc(p.described.status());
  const auto layouts = peers_.layoutsOf(registry_.describe(), *peers).found;  // (a missing one: no world size)
  for (const auto& p : *peers) {
    for (const auto& r : p.described->ranks()) {
      auto* reg = out->add_ranks();
      reg->set_group(r.group());
      reg->set_rank(r.rank());
      reg->set_node(p.described->node());
      reg->set_layout_digest(r.layout_digest());
      reg->set_version(r.version());
      reg->set_state(r.state());
      reg->set_role(r.role());
      reg->set_held(r.held());
      uint64_t bytes = 0;
      for (const auto& b : r.buffers()) {
        bytes += b.size();
        reg->add_buffers(b.buffer());
      }
      reg->set_registered_bytes(bytes);
      if (const auto l = layouts.find({r.group(), r.layout_digest()}); l != layouts.end()) {
        int64_t world = 1;
        for (int64_t s : l->second->mesh().shape()) world *= s;
        reg->set_world_size(static_cast<int32_t>(world));
        reg->set_replica_set(l->second->replica_set());
        reg->set_replica(l->second->replica());
      }
    }
  }
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Plan(grpc::ServerContext* ctx, const v1::PlanRequest* req, v1::PlanResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  auto view = cluster();
  if (!view.ok()) return toGrpc(view.status());
  auto src = view->completeGroup(req->src_group());
  if (!src.ok()) return toGrpc(src.status());
  auto dst = view->completeGroup(req->dst_group());
  if (!dst.ok()) return toGrpc(dst.status());
  planner::NodeTable nodes;
  auto rs = planner::resolveLayout(*src, nodes);
  if (!rs.ok()) return toGrpc(rs.status());
  auto rd = planner::resolveLayout(*dst, nodes);
  if (!rd.ok()) return toGrpc(rd.status());
  if (auto st = planner::addScaleSources(*rs, *rd); !st.ok()) return toGrpc(st);
  auto strategy = strategyOf(req->strategy(), v1::DELTA_OFF);
  if (!strategy.ok()) return toGrpc(strategy.status());
  planner::PlanOptions options;  // as a sync plans it (SyncEngine)
  options.chunk_bytes = config_.chunk_bytes;
  options.strategy = *strategy;
  auto plan = planner::makePlan(*rs, *rd, nodes, options);
  if (!plan.ok()) return toGrpc(plan.status());
  planner::CostModel model;
  if (config_.nic_gbps > 0) model.nic_gbps = config_.nic_gbps;
  if (req->nic_gbps() < 0 || req->local_gbps() < 0)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "nic_gbps and local_gbps must not be negative");
  if (req->nic_gbps() > 0) model.nic_gbps = req->nic_gbps();
  if (req->local_gbps() > 0) model.local_gbps = req->local_gbps();
  out->set_summary_json(planner::renderJson(*plan, nodes, model));
  out->set_summary_text(planner::renderText(*plan, nodes, model, rs->group, rd->group));
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Status(grpc::ServerContext* ctx, const v1::StatusRequest* req, v1::StatusResponse* out) {
  const auto caller = access_.client(*ctx, *req);
  if (!caller.ok()) return toGrpc(caller.status());
  out->set_node(config_.node);
  out->set_version(kShardcastVersion);
  out->set_transport(transport_);
  out->set_registered_bytes(registry_.registeredBytes());
  out->set_registered_ranks(registry_.registeredRanks());
  out->set_uptime_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  for (auto& g : registry_.groups()) *out->add_groups() = std::move(g);
  for (auto& p : progress_.recent(kRecentSyncs)) *out->add_syncs() = std::move(p);
  auto addrs = peers_.addresses();
  if (!addrs.ok()) {
    auto* p = out->add_peers();
    p->set_address(config_.peer_dns);
    p->set_error(std::string(addrs.status().message()));
    return grpc::Status::OK;
  }
  v1::DescribeRequest ask;  // (no layouts: digests only)
  ask.set_syncs(req->all_nodes());
  ask.set_layout_digests(true);
  auto views = peers_.describeAll(ask);
  const auto known = peers_.knownNodes();
  if (views.ok() && req->all_nodes())
    for (const auto& v : *views)
      if (v.described.ok())
        for (const auto& p : v.described->syncs()) *out->add_syncs() = p;
  for (const auto& a : *addrs) {
    auto* p = out->add_peers();
    p->set_address(a);
    bool found = false;
    if (views.ok())
      for (const auto& v : *views)
        if (v.address == a) {
          found = true;
          p->set_reachable(v.described.ok());
          if (v.described.ok()) {
            p->set_node(v.described->node());
          } else {
            p->set_error(std::string(v.described.status().message()));
            if (const auto it = known.find(a); it != known.end()) p->set_node(it->second);  // as last described
          }
        }
    if (!found) {  // the address is this daemon itself
      p->set_reachable(true);
      p->set_node(config_.node);
    }
  }
  return grpc::Status::OK;
}

}  // namespace shardcast::daemon
