// A sync's commit: the Finish that makes its version every destination rank's, on every daemon or
// none, and the abort of a sync given up.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

#include "common/grpc_status.h"
#include "common/strings.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/late_aborts.h"
#include "daemon/coordinator/lease_keeper.h"

namespace shardcast::daemon {

// Every daemon commits; one that cannot (it restarted, or its lease ran out) left its ranks
// DIRTY: the sync failed there, whatever the others committed.
Status SyncCoordinator::commit() {
  // From here on the sync is the commit's: a lease that runs out meanwhile no longer gives it up
  // (its aborts would race the commits, leaving some nodes at the new version and some not). If
  // it was given up since execute() checked, nothing is committed.
  if (!advance(Step::kExecuting, Step::kCommitting)) {
    const std::string node = lease_keeper_->stalled();
    return failed(absl::UnavailableError(strCat(
        "sync ", id_,
        " failed: ", node.empty() ? std::string("it was given up") : strCat("node \"", node, "\" stopped answering"),
        " before it was committed")));
  }
  setPhase(v1::SYNC_COMMITTING);
  const auto committed = finishAll(true, "");
  lease_keeper_->stop();
  const auto& daemons = cluster_->view.daemons();
  // Every byte has landed by now. A node that fails its commit holding only replicas of a set
  // costs those replicas, which are cut: their ranks are dirty, or at V with V's bytes if its
  // commit lands late. Any other node's failure fails the sync (the others may have committed).
  std::map<std::string, std::string> lost;  // replica group -> why
  std::vector<std::string> named;           // "group: why", for the line and the error
  for (size_t i = 0; i < committed.size(); ++i) {
    if (committed[i].ok()) continue;
    const std::string& node = daemons[i].node();
    spdlog::warn("sync {}: commit on node \"{}\" failed: {}", id_, node, committed[i].error_message());
    const auto replicas = replicasOn(node);
    if (replicas.empty()) {
      faulty_node_ = node;
      return failed(fromGrpc(committed[i], strCat("sync ", id_, ": commit on node \"", node, "\"")));
    }
    for (const auto& group : replicas)
      named.push_back(
          group + ": " +
          (lost[group] = strCat("node ", quote(node), " failed during the commit (", committed[i].error_message(),
                                "): its ranks are dirty, or hold this version's bytes if its commit landed late")));
  }
  if (!lost.empty()) {
    size_t kept = 0;
    for (auto& o : outcomes_) {
      if (const auto it = lost.find(o.group()); it != lost.end()) o.set_cut(it->second);
      kept += o.cut().empty();
    }
    spdlog::warn("sync {}: replica set {} committed {} replicas; cut during the commit: {}", id_,
                 quote(req_.dst_group()), kept, strJoin(named, "; "));
    const size_t needed = std::max<uint32_t>(1, req_.options().min_replicas());
    if (kept < needed)
      return failed(absl::UnavailableError(strCat("sync ", id_, ": replica set \"", req_.dst_group(), "\": ", kept,
                                                  " replicas committed, at least ", needed, " needed (",
                                                  strJoin(named, "; "), ")")));
  }
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    ProgressBoard::setPhase(p, v1::SYNC_COMMITTED);
    p.set_seconds(since(start_));
  });
  return absl::OkStatus();
}

std::vector<grpc::Status> SyncCoordinator::finishAll(bool commit, const std::string& reason,
                                                     const std::string& silent) {
  // Its own deadline (not the sync's): a sync given up for its timeout must still be ended. Given
  // up for a silent node, the abort waits 100 ms for that node and 250 ms for the others: each
  // daemon ends its part by itself (its own lease, if the abort does not reach it), and one still
  // exchanging bytes with the silent node would hold the coordinator until that transfer fails.
  v1::FinishRequest f;
  f.set_sync_id(id_);
  f.set_fence(fence_);
  f.set_commit(commit);
  f.set_executed(executed());
  f.set_reason(reason);
  std::vector<v1::FinishResponse> r(peers_->size());
  std::vector<grpc::Status> results;
  if (commit) {
    // Through the relay tree when the sync uses one; the daemons a relay that went silent left
    // unreached get the commit again directly (a commit reaching only part of the cluster would
    // leave healthy daemons dirty). A daemon the relay did reach answers the repeat with its
    // first answer.
    TreeOptions options;
    options.method = "Finish";
    options.fanout = peers_->fanout();
    f.SerializeToString(&options.common_request);
    std::vector<RawCall> calls;
    for (const auto& a : cluster_->addresses)
      calls.push_back({a, {}, std::chrono::milliseconds(ctx_.config.peer_timeout_ms)});
    // The first round's calls end well within the daemons' lease: those below a relay that went
    // silent get no lease renewal either (renewals go through the same relays), and the direct
    // round must reach them before their lease runs out and they abort.
    const auto first = std::max(std::chrono::milliseconds(250), lease_ / 4);
    size_t again = 0;
    const auto raw = callTreeReachingAll(ctx_.peers, calls, options, first, &again);
    if (again > 0)
      spdlog::warn("sync {}: a relay did not carry the commit to {} daemon(s): sent to them directly", id_, again);
    for (size_t i = 0; i < raw.size(); ++i) results.push_back(parseResult(raw[i], &r[i]));
  } else {
    // An abort goes straight to every daemon: a relay gone silent (the likely reason the sync is
    // given up) must not keep it from the daemons below it.
    std::vector<grpc::ClientContext> contexts(peers_->size());
    results =
        fanOut(contexts, std::chrono::system_clock::now() + std::chrono::milliseconds(ctx_.config.peer_timeout_ms),
               [&](size_t i, grpc::ClientContext& c, CallDone done) {
                 if (!silent.empty())
                   c.set_deadline(std::chrono::system_clock::now() +
                                  std::chrono::milliseconds(cluster_->view.daemons()[i].node() == silent
                                                                ? 100
                                                                : std::min(250, ctx_.config.peer_timeout_ms)));
                 v1::Peer::NewStub(ctx_.peers.channel(cluster_->addresses[i]))
                     ->async()
                     ->Finish(&c, &f, &r[i], std::move(done));
               });
    // The silent node, not answering, holds the attempt until its lease runs out (refusing a
    // catch-up or an unregister meanwhile): the abort waits for it, beyond this call. (Another
    // daemon slow to answer is still closing the attempt: it took the abort. One the retried
    // attempt asks again is ended by that attempt's Prepare, which supersedes it.)
    if (ctx_.late_aborts && !silent.empty())
      for (size_t i = 0; i < results.size(); ++i)
        if (cluster_->view.daemons()[i].node() == silent &&
            (results[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
             results[i].error_code() == grpc::StatusCode::UNAVAILABLE))
          ctx_.late_aborts->send(silent, cluster_->addresses[i], f,
                                 lease_ + std::chrono::milliseconds(ctx_.config.peer_timeout_ms));
  }
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {  // what the sync left each node's ranks at, for Watch
    for (size_t i = 0; i < results.size(); ++i)
      if (results[i].ok() && r[i].ranks_size() > 0 && static_cast<int>(i) < p.nodes_size())
        *p.mutable_nodes(static_cast<int>(i))->mutable_ranks() = r[i].ranks();
  });
  return results;
}

}  // namespace shardcast::daemon
