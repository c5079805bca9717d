// gRPC services of shardcastd: the client-facing Shardcast service and the daemon-to-daemon Peer
// service. Handlers validate, call the registry / cluster, and convert Status at this edge only.
#pragma once

#include <chrono>

#include "daemon/cluster.h"
#include "daemon/config.h"
#include "daemon/registry.h"
#include "shardcast/v1/service.grpc.pb.h"

namespace shardcast::daemon {

class ShardcastService final : public v1::Shardcast::Service {
 public:
  ShardcastService(const DaemonConfig& config, Registry& registry, PeerSet& peers, std::string transport);

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*, v1::RegisterResponse*) override;
  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterResponse*) override;
  grpc::Status List(grpc::ServerContext*, const v1::ListRequest*, v1::ListResponse*) override;
  grpc::Status Plan(grpc::ServerContext*, const v1::PlanRequest*, v1::PlanResponse*) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse*) override;

 private:
  StatusOr<ClusterView> cluster();

  const DaemonConfig& config_;
  Registry& registry_;
  PeerSet& peers_;
  std::string transport_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

class PeerService final : public v1::Peer::Service {
 public:
  explicit PeerService(Registry& registry) : registry_(registry) {}
  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*, v1::DescribeResponse* out) override {
    *out = registry_.describe();
    return grpc::Status::OK;
  }

 private:
  Registry& registry_;
};

}  // namespace shardcast::daemon
