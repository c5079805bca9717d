// The attempts of one Sync call (sync_runner.h).
#include "daemon/coordinator/sync_runner.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "common/strings.h"
#include "transport/transport.h"

namespace shardcast::daemon {

SyncRunner::SyncRunner(const DaemonConfig& config, Registry& registry, const PeerSet& peers, SyncEngine& engine,
                       ProgressBoard& progress, std::function<void(const std::string&)> peer_failed)
    : config_(config),
      registry_(registry),
      peers_(peers),
      engine_(engine),
      progress_(progress),
      peer_failed_(std::move(peer_failed)) {}

void SyncRunner::restartProgress(const std::string& id) {
  progress_.update(id, [](v1::SyncProgress& p) {  // the new attempt's progress, from the start
    p.clear_nodes();
    p.clear_error();
    p.set_bytes_done(0);
    p.set_waves_done(0);
    ProgressBoard::setPhase(p, v1::SYNC_GATHERING);
  });
}

uint64_t SyncRunner::newFence() {
  // From the kernel's CSPRNG, not a generator seeded once: a destination's delta base is matched
  // by fence (the bytes are then checked by hash), and two coordinators seeded alike would hand
  // out the same fences.
  uint64_t f = 0;
  while (f == 0) transport::randomBytes(&f, sizeof(f));
  return f;
}

Status SyncRunner::run(const v1::SyncRequest& req, const std::string& id, std::optional<uint32_t> caller_uid,
                       const std::function<bool()>& gone, v1::SyncResponse* out) {
  // A replica set's sync that fails at a node holding only replicas is run again without them,
  // as a new attempt under the same id, within what is left of its timeout (docs/daemon.md,
  // "Replica sets"): the others still commit.
  const auto began = std::chrono::steady_clock::now();
  const auto timeout = std::chrono::milliseconds(
      req.options().timeout_ms() ? req.options().timeout_ms() : std::min<int64_t>(300000, config_.max_wait_ms));
  std::map<std::string, std::string> cut;     // by earlier attempts: replica group -> why
  std::map<std::string, std::string> failed;  // the nodes that failed them -> why
  v1::SyncRequest attempt = req;
  bool full_gather = false;
  int fold_refusals = 0;             // a folded attempt refused: the one that runs it in full keeps the count
  std::vector<uint64_t> fences;      // of this call's attempts so far
  std::vector<uint64_t> unexecuted;  // those of them given up before they executed
  while (true) {
    const uint64_t fence = newFence();
    SyncCoordinator coordinator(
        {config_, registry_, peers_, engine_, progress_, replica_sets_, config_.selfAddress(), caller_uid, cut, failed,
         &repeats_, full_gather, &delta_choices_, fences, fold_refusals, gone, unexecuted, &late_aborts_},
        attempt, id, fence);
    fences.push_back(fence);
    auto done = coordinator.run();
    if (!done.ok() && !coordinator.executed()) unexecuted.push_back(fence);
    if (done.ok()) {
      *out = std::move(*done);
      if (!req.options().catch_up()) delta_choices_.record(req.src_group(), req.dst_group(), *out);
      out->set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
      return absl::OkStatus();
    }
    // The view a failed sync ran on is not reused; one that skipped the gather and was refused
    // before executing runs again at once with a full gather (repeat_cache.h).
    if (coordinator.setLayoutsStale()) {
      if (repeats_.setStale(RepeatCache::keyOf(req, caller_uid)) == SetMemo::kMaxStaleRefusals)
        spdlog::warn(
            "sync {}: a daemon's plan cache had lost replica set {}'s plan at {} syncs in a row: its syncs from {} "
            "send the layouts from now on (a daemon keeps --plan-cache-entries plans)",
            id, quote(req.dst_group()), SetMemo::kMaxStaleRefusals, quote(req.src_group()));
    } else {
      repeats_.forget(RepeatCache::keyOf(req, caller_uid));
    }
    const auto left =
        timeout - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - began);
    if (coordinator.retryInFull() && !full_gather && left > std::chrono::milliseconds(0)) {
      spdlog::debug("sync {}: skipped the gather and was refused ({}): running it again with one", id,
                    std::string(done.status().message()));
      full_gather = true;
      fold_refusals = coordinator.foldRefusals();
      if (fold_refusals >= RepeatView::kMaxFoldRefusals)
        spdlog::warn(
            "sync {}: its Prepare folded into the first wave was refused {} times in a row: syncs of {} -> {} "
            "run a Prepare round from now on",
            id, fold_refusals, req.src_group(), req.dst_group());
      attempt.mutable_options()->set_timeout_ms(static_cast<uint32_t>(left.count()));
      restartProgress(id);
      continue;
    }
    const std::string& faulty = coordinator.faultyNode();
    bool node_failed = true;
    const auto replicas = coordinator.replicasToCut(&node_failed);
    if (!faulty.empty() && node_failed && peer_failed_) peer_failed_(faulty);
    if (!replicas.empty() && left > std::chrono::milliseconds(0)) {
      for (const auto& group : replicas)
        cut[group] = node_failed
                         ? strCat("node ", quote(faulty), " failed during the sync (", done.status().message(), ")")
                         : strCat("its ranks refused the sync (", done.status().message(), ")");
      if (node_failed) failed[faulty] = strCat("it failed an earlier attempt of sync ", id);
      spdlog::warn("sync {}: {}: syncing replica set {} again without {}", id,
                   node_failed ? strCat("node ", quote(faulty), " failed") : std::string(done.status().message()),
                   quote(req.dst_group()), strJoin(replicas, ", "));
      attempt.mutable_options()->set_timeout_ms(static_cast<uint32_t>(left.count()));
      restartProgress(id);
      continue;
    }
    // Its id and phases' seconds, for the metrics and Sync's line (a failed call sends no response).
    *out = coordinator.figures();
    out->set_sync_id(id);
    progress_.update(id, [&](v1::SyncProgress& p) {
      ProgressBoard::setPhase(p, v1::SYNC_FAILED);
      p.set_error(std::string(done.status().message()));
      p.set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
    });
    return done.status();
  }
}

}  // namespace shardcast::daemon
