// gRPC services of shardcastd: the client-facing Shardcast service and the daemon-to-daemon Peer
// service. Handlers validate, call the registry / cluster, and convert Status at this edge only.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>

#include "common/logging.h"
#include "daemon/coordinator/cluster.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/progress.h"
#include "daemon/coordinator/sync_runner.h"
#include "daemon/engine/sync_engine.h"
#include "daemon/registry/registry.h"
#include "daemon/server/access.h"
#include "daemon/server/config.h"
#include "shardcast/v1/service.grpc.pb.h"

namespace shardcast::daemon {

// Status and Describe (DescribeRequest.syncs) list the syncs running and this many that ended.
inline constexpr size_t kRecentSyncs = 16;

class ShardcastService final : public v1::Shardcast::Service {
 public:
  // `progress`: of the syncs coordinated here (Watch, Status; PeerService's Describe reads it).
  ShardcastService(const DaemonConfig& config, const AccessPolicy& access, Registry& registry, PeerSet& peers,
                   SyncEngine& engine, Metrics& metrics, ProgressBoard& progress, std::string transport);

  grpc::Status Sync(grpc::ServerContext*, const v1::SyncRequest*, v1::SyncResponse*) override;
  // `caller_uid`: SyncCoordinator::Context::caller_uid; `gone`: SyncCoordinator::Context::gone.
  grpc::Status coordinate(const v1::SyncRequest& req, v1::SyncResponse* out, std::optional<uint32_t> caller_uid,
                          const std::function<bool()>& gone);
  grpc::Status WaitVersion(grpc::ServerContext*, const v1::WaitVersionRequest*, v1::WaitVersionResponse*) override;
  grpc::Status Watch(grpc::ServerContext*, const v1::WatchRequest*, grpc::ServerWriter<v1::SyncProgress>*) override;
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*, v1::RegisterResponse*) override;
  grpc::Status Acquire(grpc::ServerContext*, const v1::AcquireRequest*, v1::AcquireResponse*) override;
  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest*, v1::ReleaseResponse*) override;
  grpc::Status Session(grpc::ServerContext*, const v1::SessionRequest*, grpc::ServerWriter<v1::SessionEvent>*) override;
  // Shutdown: ends every open session stream (their registrations end with them), and every
  // call waiting here (a Sync waiting for ranks, WaitVersion, Acquire) at its next look.
  void stop();
  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterResponse*) override;
  grpc::Status List(grpc::ServerContext*, const v1::ListRequest*, v1::ListResponse*) override;
  grpc::Status Plan(grpc::ServerContext*, const v1::PlanRequest*, v1::PlanResponse*) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse*) override;

 private:
  StatusOr<ClusterView> cluster();
  // A call's wait ends: its client went (cancelled the call, or its deadline passed) or the daemon
  // is stopping. Polled by every wait of a handler (gRPC's synchronous API has no wake-up for it).
  bool ended(const grpc::ServerContext& ctx) const;

  const DaemonConfig& config_;
  const AccessPolicy& access_;
  Registry& registry_;
  PeerSet& peers_;
  Metrics& metrics_;
  std::atomic<uint64_t> next_sync_{1};
  ProgressBoard& progress_;
  SyncRunner runner_;  // the attempts of each Sync call
  std::string transport_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  LogLimiter failure_log_;  // Sync: one line per failed sync kind per caller and 10 s
  std::mutex sessions_mu_;
  std::condition_variable sessions_cv_;
  bool stopping_ = false;
  std::atomic<bool> stopped_{false};  // stopping_, for ended(): read without sessions_mu_
};

class PeerService final : public v1::Peer::Service {
 public:
  PeerService(const AccessPolicy& access, Registry& registry, const PeerSet& peers, SyncEngine& engine,
              const ProgressBoard& progress)
      : access_(access), registry_(registry), peers_(peers), engine_(engine), progress_(progress) {}
  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*, v1::DescribeResponse* out) override;
  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest* req, v1::PrepareResponse* out) override;
  grpc::Status Execute(grpc::ServerContext*, const v1::ExecuteRequest* req, v1::ExecuteResponse* out) override;
  grpc::Status Finish(grpc::ServerContext*, const v1::FinishRequest* req, v1::FinishResponse*) override;
  grpc::Status Progress(grpc::ServerContext*, const v1::ProgressRequest* req, v1::ProgressResponse* out) override;
  grpc::Status Relay(grpc::ServerContext*, const v1::RelayRequest* req, v1::RelayResponse* out) override;

 private:
  const AccessPolicy& access_;
  Registry& registry_;
  const PeerSet& peers_;
  SyncEngine& engine_;
  const ProgressBoard& progress_;
};

}  // namespace shardcast::daemon
