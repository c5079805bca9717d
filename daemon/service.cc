#include "daemon/service.h"

#include <spdlog/spdlog.h>

#include "common/strings.h"
#include "planner/plan.h"
#include "planner/report.h"

namespace shardcast::daemon {

inline constexpr const char* kVersion = "0.1.0";

ShardcastService::ShardcastService(const DaemonConfig& config, Registry& registry, PeerSet& peers, std::string transport)
    : config_(config), registry_(registry), peers_(peers), transport_(std::move(transport)) {}

grpc::Status ShardcastService::Register(grpc::ServerContext*, const v1::RegisterRequest* req, v1::RegisterResponse* out) {
  auto r = registry_.registerRank(*req);
  if (!r.ok()) {
    spdlog::warn("register refused: {}", std::string(r.status().message()));
    return toGrpc(r.status());
  }
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Unregister(grpc::ServerContext*, const v1::UnregisterRequest* req, v1::UnregisterResponse*) {
  return toGrpc(registry_.unregisterRank(req->group(), req->rank()));
}

StatusOr<ClusterView> ShardcastService::cluster() {
  SC_ASSIGN_OR_RETURN(auto peers, peers_.describeAll());
  return ClusterView::build(registry_.describe(), peers);
}

grpc::Status ShardcastService::List(grpc::ServerContext*, const v1::ListRequest* req, v1::ListResponse* out) {
  for (auto& r : registry_.list()) *out->add_ranks() = std::move(r);
  if (!req->all_nodes()) return grpc::Status::OK;
  auto peers = peers_.describeAll();
  if (!peers.ok()) return toGrpc(peers.status());
  for (const auto& p : *peers) {
    if (!p.described.ok()) return toGrpc(p.described.status());
    for (const auto& r : p.described->ranks()) {
      auto* reg = out->add_ranks();
      reg->set_group(r.group());
      reg->set_rank(r.rank());
      reg->set_node(p.described->node());
      reg->set_layout_digest(r.layout_digest());
      uint64_t bytes = 0;
      for (const auto& b : r.buffers()) {
        bytes += b.size();
        reg->add_buffers(b.buffer());
      }
      reg->set_registered_bytes(bytes);
      for (const auto& l : p.described->layouts())
        if (l.group() == r.group()) {
          int64_t world = 1;
          for (int64_t s : l.mesh().shape()) world *= s;
          reg->set_world_size(static_cast<int32_t>(world));
        }
    }
  }
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Plan(grpc::ServerContext*, const v1::PlanRequest* req, v1::PlanResponse* out) {
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
  auto plan = planner::makePlan(*rs, *rd, nodes);
  if (!plan.ok()) return toGrpc(plan.status());
  planner::CostModel model;
  if (req->nic_gbps() < 0 || req->local_gbps() < 0)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "nic_gbps and local_gbps must not be negative");
  if (req->nic_gbps() > 0) model.nic_gbps = req->nic_gbps();
  if (req->local_gbps() > 0) model.local_gbps = req->local_gbps();
  out->set_summary_json(planner::renderJson(*plan, nodes, model));
  out->set_summary_text(planner::renderText(*plan, nodes, model, rs->group, rd->group));
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse* out) {
  out->set_node(config_.node);
  out->set_version(kVersion);
  out->set_transport(transport_);
  out->set_registered_bytes(registry_.registeredBytes());
  out->set_registered_ranks(registry_.registeredRanks());
  out->set_uptime_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  auto addrs = peers_.addresses();
  if (!addrs.ok()) {
    auto* p = out->add_peers();
    p->set_address(config_.peer_dns);
    p->set_error(std::string(addrs.status().message()));
    return grpc::Status::OK;
  }
  auto views = peers_.describeAll();
  for (const auto& a : *addrs) {
    auto* p = out->add_peers();
    p->set_address(a);
    bool found = false;
    if (views.ok())
      for (const auto& v : *views)
        if (v.address == a) {
          found = true;
          p->set_reachable(v.described.ok());
          if (v.described.ok()) p->set_node(v.described->node());
          else p->set_error(std::string(v.described.status().message()));
        }
    if (!found) {  // the address is this daemon itself
      p->set_reachable(true);
      p->set_node(config_.node);
    }
  }
  return grpc::Status::OK;
}

}  // namespace shardcast::daemon
