// One Sync call, from a checked request to its answer: attempts of SyncCoordinator until one
// commits, a replica set's sync run again without the replicas an attempt cut, a sync that skipped
// the gather and was refused run again in full (docs/daemon.md, "Replica sets"; repeat_cache.h).
// The gRPC handler (server/service.cc) validates the request and hands it here.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/status.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/delta_choice.h"
#include "daemon/coordinator/late_aborts.h"
#include "daemon/coordinator/repeat_cache.h"

namespace shardcast::daemon {

class SyncRunner {
 public:
  // `peer_failed(node)`: a node failed an attempt (counted by the caller's metrics).
  SyncRunner(const DaemonConfig& config, Registry& registry, const PeerSet& peers, SyncEngine& engine,
             ProgressBoard& progress, std::function<void(const std::string&)> peer_failed);

  // Runs `req` as sync `id` (started on the progress board already) for `caller_uid` (as
  // SyncCoordinator::Context), within its timeout (`timeout_ms`, else the smaller of 300 s and
  // --max-wait-ms). OK with the committed response in `*out`; else the last attempt's error, with
  // its figures in `*out`. `gone`: the call is over (SyncCoordinator::Context::gone).
  Status run(const v1::SyncRequest& req, const std::string& id, std::optional<uint32_t> caller_uid,
             const std::function<bool()>& gone, v1::SyncResponse* out);

 private:
  // A random write fence for one sync attempt (never 0).
  static uint64_t newFence();
  // The sync's progress as a new attempt starts it (Watch shows that attempt from its gather; the
  // failed attempt's error is not the sync's).
  void restartProgress(const std::string& id);

  const DaemonConfig& config_;
  Registry& registry_;
  const PeerSet& peers_;
  SyncEngine& engine_;
  ProgressBoard& progress_;
  std::function<void(const std::string&)> peer_failed_;
  ReplicaMemory replica_sets_;      // of the replica sets this daemon coordinated syncs into
  RepeatCache repeats_;             // the views of the last plain syncs it coordinated
  DeltaChoices delta_choices_;      // delta against dense syncs, as measured (DELTA_AUTO)
  LateAborts late_aborts_{peers_};  // to daemons that did not take an attempt's abort in time
};

}  // namespace shardcast::daemon
