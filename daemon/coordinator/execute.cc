// A sync's execute: every daemon's waves, the lease keeper watching for a silent one.
#include <spdlog/spdlog.h>

#include "common/grpc_status.h"
#include "common/strings.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/lease_keeper.h"

namespace shardcast::daemon {

// Every wave everywhere at once, waves in order; the first failure gives the sync up.
Status SyncCoordinator::execute() {
  setPhase(v1::SYNC_EXECUTING);
  const auto& daemons = cluster_->view.daemons();
  std::vector<grpc::Status> results(daemons.size());
  // Bytes of the waves each node has finished: the floor under what the lease keeper reports.
  std::vector<uint64_t> done_received(daemons.size(), 0), done_sent(daemons.size(), 0);
  int32_t failed_wave = -1;
  for (int32_t wave = 0; wave < plan_->waves; ++wave) {
    for (auto& e : exec_) e.set_wave(static_cast<uint32_t>(wave));
    std::vector<v1::ExecuteResponse> parts;
    for (size_t i = 0; i < daemons.size(); ++i) nodeState(i, "executing");
    results = peers_->call<v1::ExecuteRequest, v1::ExecuteResponse>(
        "Execute", callDeadline() + std::chrono::seconds(5),
        [&](size_t i) -> const v1::ExecuteRequest& { return exec_[i]; }, &parts,
        [&](size_t i, const grpc::Status& st) {
          const v1::ExecuteResponse& part = parts[i];
          if (st.ok()) {
            done_received[i] += part.bytes_received();
            done_sent[i] += part.bytes_sent();
            moved_.add(SyncCounters::of(part));
            record(i, done_received[i], done_sent[i]);
            if (wave + 1 == plan_->waves) nodeState(i, "done");
          } else {
            nodeState(i, st.error_code() == grpc::StatusCode::ABORTED ? "aborted" : "failed", st.error_message());
            giveUp(strCat("node \"", daemons[i].node(), "\" failed: ", st.error_message()));  // once
          }
        },
        /*stop_at_failure=*/true);
    bool all_ok = true;
    for (const auto& r : results) all_ok = all_ok && r.ok();
    if (!all_ok) {
      failed_wave = wave;
      break;
    }
    if (wave == 0 && route_ == Route::kFolded)  // the Prepare rode on this wave only
      for (auto& e : exec_) {
        e.clear_prepare();
        e.clear_plan_key();
        e.clear_self();
      }
    ctx_.progress.update(id_, [&](v1::SyncProgress& p) { p.set_waves_done(static_cast<uint32_t>(wave + 1)); });
  }
  if (const std::string node = lease_keeper_->stalled(); !node.empty()) return stoppedAnswering(node);
  bool any_failed = false;
  for (const auto& r : results) any_failed = any_failed || !r.ok();
  if (!any_failed) {
    for (const uint64_t sent : done_sent) wire_bytes_ += sent;
    return absl::OkStatus();
  }
  // A node that failed because a peer vanished reports the peer; the peer itself may not answer
  // at all. Name the daemon that is gone when there is one.
  const auto cancelled = [](const grpc::Status& r) {
    return r.error_code() == grpc::StatusCode::ABORTED || r.error_code() == grpc::StatusCode::CANCELLED;
  };
  if (const std::string gone = firstSilent(); !gone.empty()) {
    std::string first;
    for (size_t i = 0; i < results.size() && first.empty(); ++i)
      if (!results[i].ok() && !cancelled(results[i]))
        first = strCat(" (node \"", daemons[i].node(), "\": ", results[i].error_message(), ")");
    spdlog::warn("sync {} failed: node \"{}\" does not answer{}", id_, gone, first);
    faulty_node_ = gone;
    return failed(absl::UnavailableError(strCat("sync ", id_, " failed: node \"", gone, "\" does not answer", first)));
  }
  // A folded attempt that failed in wave 0 (a daemon's Prepare refused there, say) runs again in
  // full, which decides as a Prepare round would have and names the fault as it always does.
  if (route_ == Route::kFolded && failed_wave == 0) fault_ = Fault::kFoldedWave;
  // The node whose own failure started it, rather than the ones aborted because of it.
  for (size_t i = 0; i < results.size(); ++i)
    if (!results[i].ok() && !cancelled(results[i])) {
      spdlog::warn("sync {} failed on node \"{}\": {}", id_, daemons[i].node(), results[i].error_message());
      faulty_node_ = daemons[i].node();
      // A replica's own registrations changed there (its client gone mid-sync): its node is
      // healthy, and only that replica is cut, as for a refusal at the Prepare.
      if (const std::string group = refusingGroup(results[i]); !group.empty() && isReplica(group))
        for (const auto& r : daemons[i].ranks())
          if (r.group() == group) refusing_replica_ = group;
      return failed(fromGrpc(results[i], strCat("sync ", id_, " failed on node \"", daemons[i].node(), "\"")));
    }
  for (size_t i = 0; i < results.size(); ++i)
    if (!results[i].ok()) {
      faulty_node_ = daemons[i].node();
      return failed(fromGrpc(results[i], strCat("sync ", id_, " failed on node \"", daemons[i].node(), "\"")));
    }
  return absl::OkStatus();
}

Status SyncCoordinator::stoppedAnswering(const std::string& node) {
  if (node.empty())  // (only the lease keeper gives an attempt up between its phases)
    return failed(absl::UnavailableError(strCat("sync ", id_, " failed: it was given up")));
  faulty_node_ = node;
  fault_ = Fault::kSilentDaemon;
  if (route_ == Route::kFolded)  // as a repeated sync's Prepare round would have found it (prepare())
    for (size_t i = 0; i < cluster_->view.daemons().size(); ++i)
      if (cluster_->view.daemons()[i].node() == node) ctx_.peers.noteSilent(cluster_->addresses[i], start_);
  return failed(absl::UnavailableError(
      strCat("sync ", id_, " failed: node \"", node, "\" stopped answering (for ", lease_keeper_->allowed(), ")")));
}

}  // namespace shardcast::daemon
