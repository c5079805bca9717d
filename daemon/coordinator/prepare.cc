// A sync's plan and prepare: the plan from the gathered layouts, each daemon's Prepare (folded into
// the first Execute of a repeated sync), the node directories and the split amaxes they return.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "common/grpc_status.h"
#include "common/strings.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/lease_keeper.h"

namespace shardcast::daemon {

Status SyncCoordinator::plan() {
  const uint64_t budget = static_cast<uint64_t>(ctx_.config.staging_mib) << 20;
  const auto chunk_bytes = static_cast<uint64_t>(ctx_.config.chunk_bytes);
  // Device memory some daemon's transport cannot reach travels through host staging: no
  // zero-copy sends or landings anywhere (every daemon plans what the coordinator tells it).
  for (const auto& d : cluster_->view.daemons())
    for (const auto& r : d.ranks())
      if (r.group() == src_group_ || writes(r.group()))
        for (const auto& b : r.buffers()) packed_ = packed_ || b.staged();
  auto strategy = strategyOf(req_.options().strategy(), req_.options().delta());
  if (!strategy.ok()) return failed(strategy.status());
  const auto key = PlanKey::forSync(budget, chunk_bytes, req_.options().delta(), packed_, *strategy);
  // A repeated sync finds its plan by the kept digests (planned again only if evicted meanwhile).
  auto plan = !replicas_.empty()     ? ctx_.engine.plans().getReplicaSet(src_, replicas_, key, &plan_cached_)
              : digests_.src.empty() ? ctx_.engine.plans().get(src_, dst_, key, &plan_cached_)
                                     : ctx_.engine.plans().getRepeated(src_, dst_, digests_, key, &plan_cached_);
  if (!plan.ok()) return failed(plan.status());
  plan_ = std::move(*plan);
  // A replica set's sync into the same members, from the same source, over the same daemons as
  // its last committed one names the layouts by digest (repeat_cache.h, SetMemo).
  if (!replicas_.empty() && reads_ == Reads::kSource && ctx_.repeats && !ctx_.full_gather &&
      !req_.options().catch_up() && !plan_->src_digest.empty())
    if (const auto memo = ctx_.repeats->findSet(RepeatCache::keyOf(req_, ctx_.caller_uid))) {
      const auto& daemons = cluster_->view.daemons();
      set_by_digest_ =
          memo->plan_key == plan_->key && memo->daemons == daemonInstances() &&
          memo->stale_refusals < SetMemo::kMaxStaleRefusals &&
          std::all_of(daemons.begin(), daemons.end(), [](const auto& d) { return d.set_layouts_by_digest(); });
    }
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    ProgressBoard::setPhase(p, v1::SYNC_PREPARING);
    p.set_bytes_total(static_cast<uint64_t>(plan_->plan.stats.network_bytes));
    p.set_waves(static_cast<uint32_t>(plan_->waves));
    // This attempt's nodes, from nothing moved (an earlier attempt of the same call, run again in
    // full or without a replica, left its own).
    p.clear_nodes();
    p.set_bytes_done(0);
    p.set_waves_done(0);
    for (const auto& d : cluster_->view.daemons()) {
      auto* n = p.add_nodes();
      n->set_node(d.node());
      n->set_state("pending");
    }
  });
  return absl::OkStatus();
}

v1::PrepareRequest SyncCoordinator::prepareRequest() const {
  v1::PrepareRequest p;
  p.set_lease_ms(static_cast<uint32_t>(lease_.count()));
  p.set_fence(fence_);
  p.set_write_key(std::string(key_.view()));
  p.set_sync_id(id_);
  if (route_ != Route::kGathered &&
      !digests_.src.empty()) {  // the layouts by the digests each daemon planned them under
    p.mutable_src()->set_group(src_.group());
    p.mutable_dst()->set_group(dst_.group());
    p.set_src_digest(digests_.src);
    p.set_dst_digest(digests_.dst);
  } else if (set_by_digest_) {  // the members' groups, and the digests each daemon planned them under
    p.mutable_src()->set_group(src_.group());
    p.set_src_digest(plan_->src_digest);
    *p.mutable_dst() = dst_;
    for (const auto& m : plan_->members) {
      v1::Layout* named = p.add_replicas();
      named->set_group(m.group);
      named->set_replica_set(dst_.group());
      named->set_replica(m.replica);
      p.add_replica_digests(m.digest);
    }
  } else {
    *p.mutable_src() = src_;
    *p.mutable_dst() = dst_;
  }
  if (!set_by_digest_)
    for (const auto& r : replicas_) *p.add_replicas() = r.layout;
  // Whose groups the gather found these to be: each daemon checks its own registrations (a rank
  // that changed hands since is neither read nor written).
  std::vector<std::string> groups{src_group_};
  if (replicas_.empty()) groups.push_back(req_.dst_group());
  for (const auto& r : replicas_) groups.push_back(r.layout.group());
  for (const auto& group : groups)
    if (const auto owner = cluster_->view.ownerOf(group)) {
      auto* o = p.add_owners();
      o->set_group(group);
      o->set_owner_uid(*owner);
    }
  p.set_version(version_);
  p.set_seed(reads_ == Reads::kSeed);
  for (const uint64_t earlier : ctx_.earlier_fences) p.add_supersedes(earlier);
  for (const uint64_t earlier : ctx_.earlier_unexecuted) p.add_supersedes_unexecuted(earlier);
  p.set_staging_bytes(static_cast<uint64_t>(ctx_.config.staging_mib) << 20);
  p.set_chunk_bytes(static_cast<uint64_t>(ctx_.config.chunk_bytes));
  p.set_delta(delta_ == v1::DELTA_ALWAYS ? v1::DELTA_AUTO : delta_);  // what the daemons run
  const auto& daemons = cluster_->view.daemons();
  p.set_delta_tree_hash(delta_ != v1::DELTA_OFF &&
                        std::all_of(daemons.begin(), daemons.end(), [](const auto& d) { return d.delta_tree_hash(); }));
  p.set_strategy(req_.options().strategy());
  p.set_packed(packed_);
  return p;
}

void SyncCoordinator::addStamp(size_t i, v1::PrepareRequest* p) const {
  if (route_ == Route::kGathered) return;
  const auto& d = cluster_->view.daemons()[i];
  auto* stamp = p->add_expect();
  stamp->set_node(d.node());
  stamp->set_instance(d.instance());
  stamp->set_generation(d.generation());
}

bool SyncCoordinator::foldable() const {
  if (ctx_.config.fold_prepare == "never" || !repeat_ || delta_ != v1::DELTA_OFF || !ctx_.earlier_fences.empty() ||
      repeat_->prepared.size() != cluster_->view.daemons().size() ||
      repeat_->fold_refusals >= RepeatView::kMaxFoldRefusals)
    return false;
  // Without a Prepare round no daemon waits for the others': one that fails its Prepare (silent,
  // or refusing) fails the sync after others may have written part of it. "auto" folds only
  // where that costs no rank its version: every destination rank double-buffered (the part lands
  // in the set the engine is not reading).
  if (ctx_.config.fold_prepare == "auto")
    for (const auto& d : cluster_->view.daemons())
      for (const auto& r : d.ranks())
        if (r.group() == dst_.group() && !r.double_buffered()) return false;
  // Split fp8 blocks' amaxes are combined between the Prepare and the Execute: a round of their own.
  for (const auto& answer : repeat_->prepared)
    if (answer.split_amax_size() > 0 || answer.plan_key() != plan_->key) return false;
  return true;
}

// Each daemon's wave 0 carries its Prepare (with its own stamp), the plan it must have made, and
// where the kept view says it lands its peers' writes; its directory also names the nodes that
// write to it, which it tells it has the attempt open (a readiness word).
void SyncCoordinator::fold(const v1::PrepareRequest& p) {
  out_.set_folded(true);
  const auto& daemons = cluster_->view.daemons();
  const auto& kept = repeat_->prepared;
  directories(kept, std::vector<SplitAmaxes>(daemons.size()));
  std::map<std::string, size_t> daemon_of;
  for (size_t i = 0; i < daemons.size(); ++i) daemon_of[daemons[i].node()] = i;
  std::vector<std::set<size_t>> writers(daemons.size());  // per daemon: the daemons writing to it
  for (size_t i = 0; i < daemons.size(); ++i)
    for (const auto& n : exec_[i].nodes())
      if (const auto it = daemon_of.find(n.node()); it != daemon_of.end()) writers[it->second].insert(i);
  for (size_t i = 0; i < daemons.size(); ++i) {
    auto& e = exec_[i];
    std::set<std::string> listed;
    for (const auto& n : e.nodes()) listed.insert(n.node());
    for (const size_t w : writers[i])
      if (listed.insert(daemons[w].node()).second) nodeAddress(w, e.add_nodes());
    *e.mutable_prepare() = p;
    addStamp(i, e.mutable_prepare());
    e.set_plan_key(plan_->key);
    auto* self = e.mutable_self();
    self->set_node(daemons[i].node());
    *self->mutable_targets() = kept[i].targets();
    self->set_base_version(kept[i].base_version());
    self->set_base_fence(kept[i].base_fence());
  }
}

// Every daemon plans (cached) and allocates where transfers land on it, all at once; the first
// failure gives the sync up everywhere (a Prepare still on its way is refused where the Finish
// came first). The lease starts here.
Status SyncCoordinator::prepare() {
  delta_ = req_.options().delta();
  if (delta_ == v1::DELTA_AUTO && ctx_.config.delta_dense_every > 0 &&
      version_ % static_cast<uint64_t>(ctx_.config.delta_dense_every) == 0) {
    delta_ = v1::DELTA_DENSE;  // the periodic refresh
    delta_choice_ = strCat("version ", version_, " is a multiple of --delta-dense-every ",
                           ctx_.config.delta_dense_every, ": a dense refresh");
  } else if (delta_ == v1::DELTA_AUTO && ctx_.delta_choices && !req_.options().catch_up()) {  // where faster
    auto choice = ctx_.delta_choices->choose(req_.src_group(), req_.dst_group());
    delta_ = choice.mode;
    delta_choice_ = std::move(choice.why);
    if (!delta_choice_.empty()) spdlog::info("sync {}: {}", id_, delta_choice_);
  }
  const auto prepare_started = Clock::now();
  if (foldable()) route_ = Route::kFolded;
  lease_keeper_ = std::make_unique<LeaseKeeper>(*this);
  v1::PrepareRequest p = prepareRequest();
  if (route_ == Route::kFolded) {
    fold(p);
    return absl::OkStatus();
  }
  std::vector<v1::PrepareResponse> prepared(cluster_->view.daemons().size());
  // The first daemon whose own failure gave the sync up: the others' calls are then cancelled,
  // or refused as given up, because of it.
  std::optional<size_t> at_fault;
  const std::vector<grpc::Status> results = prepareRound(std::move(p), &prepared, &at_fault);
  for (size_t i = 0; i < results.size() && !at_fault; ++i)
    if (!results[i].ok()) at_fault = i;  // the lease keeper gave it up: every call cancelled
  if (at_fault) return prepareFailed(results, *at_fault, prepare_started);
  SC_RETURN_IF_ERROR(checkPrepared(prepared));
  // Block-scaled fp8 from source shards that cut blocks: each node's parts of the split blocks'
  // amaxes, combined; each node quantises its parts with the whole blocks' (split_amax.h).
  auto amaxes = combinedAmaxes(prepared);
  if (!amaxes.ok()) return giveUpWith(amaxes.status());
  directories(prepared, *amaxes);
  prepared_ = std::move(prepared);
  return absl::OkStatus();
}

std::vector<grpc::Status> SyncCoordinator::prepareRound(v1::PrepareRequest p,
                                                        std::vector<v1::PrepareResponse>* prepared,
                                                        std::optional<size_t>* at_fault) {
  const auto& daemons = cluster_->view.daemons();
  // Each daemon's stamp as its call's own part; while a daemon of an older version could relay
  // (a rolling update), every stamp in the common request instead, each daemon finding its own.
  const bool parts =
      std::all_of(daemons.begin(), daemons.end(), [](const v1::DescribeResponse& d) { return d.relays_call_parts(); });
  if (!parts)
    for (size_t i = 0; i < daemons.size(); ++i) addStamp(i, &p);
  // And the nodes each writes to, which it checks before taking any rank (a part of its own: in
  // the common request every daemon would check every node).
  std::function<void(size_t, v1::PrepareRequest*)> own;
  if (parts)
    own = [&](size_t i, v1::PrepareRequest* part) {
      addStamp(i, part);
      for (const size_t j : writesTo(i)) nodeAddress(j, part->add_peers());
    };
  // Skipping the gather skipped its peer timeout: a daemon silent to this Prepare is found as
  // soon as the gather would have found it (then the full protocol runs, and decides).
  auto deadline = callDeadline();
  if (route_ != Route::kGathered)
    deadline = std::min(deadline, std::chrono::system_clock::now() +
                                      std::chrono::milliseconds(std::max(ctx_.config.peer_timeout_ms, 1000)));
  return peers_->call<v1::PrepareRequest, v1::PrepareResponse>(
      "Prepare", deadline, [&](size_t) -> const v1::PrepareRequest& { return p; }, own, prepared,
      [&](size_t i, const grpc::Status& st) {
        if (!st.ok() && st.error_code() != grpc::StatusCode::CANCELLED) {
          if (!*at_fault) *at_fault = i;
          // A daemon that did not answer in time gets no more than a moment to take the abort.
          const bool silent = st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
          giveUp(strCat("prepare failed on node \"", daemons[i].node(), "\": ", st.error_message()),
                 silent ? daemons[i].node() : std::string());  // once
        }
      },
      /*stop_at_failure=*/true);
}

Status SyncCoordinator::prepareFailed(const std::vector<grpc::Status>& results, size_t at_fault,
                                      Clock::time_point started) {
  const auto& daemons = cluster_->view.daemons();
  const std::string stalled = lease_keeper_->stalled();
  // Skipping the gather skipped its Describe calls: a daemon silent here is silent to the
  // peer set too (its lease runs from this call, as it would have from the gather's). One that
  // did not answer in time fails the sync as the gather would have (no second wait for it). One
  // silent to a set's Prepare by digest is not run again with the layouts either (retryInFull):
  // that would wait for it once more; its replicas are cut as after any set's Prepare.
  if (route_ != Route::kGathered || set_by_digest_)
    for (size_t i = 0; i < daemons.size(); ++i) {
      const grpc::StatusCode code = results[i].error_code();
      const bool silent = code == grpc::StatusCode::DEADLINE_EXCEEDED || daemons[i].node() == stalled;
      if (route_ != Route::kGathered && (silent || code == grpc::StatusCode::UNAVAILABLE))
        ctx_.peers.noteSilent(cluster_->addresses[i], started);
      if (silent) fault_ = Fault::kSilentDaemon;
    }
  // A set's Prepare by digest that a daemon refused for want of the plan runs again with the
  // layouts (retryInFull); any other refusal is handled as with them (replicas cut, say), and
  // the next attempt sends them.
  // (Known by its mark, not its message: messages quote names callers chose.)
  if (set_by_digest_ && fault_ == Fault::kOther && stalled.empty() &&
      std::any_of(results.begin(), results.end(), [](const grpc::Status& st) { return isMarkedStale(st); }))
    fault_ = Fault::kStaleSet;
  faulty_node_ = stalled.empty() ? daemons[at_fault].node() : stalled;
  // A replica's own ranks refused: its node answered, and is healthy. Taken only for a replica
  // of this sync with ranks on the refusing node (a daemon cannot have another node's cut).
  if (stalled.empty())
    if (const std::string group = refusingGroup(results[at_fault]); !group.empty() && isReplica(group))
      for (const auto& r : daemons[at_fault].ranks())
        if (r.group() == group) refusing_replica_ = group;
  // A node the lease keeper found silent is named with how long it had (its own call and the
  // others' were cancelled, which says nothing).
  return giveUpWith(stalled.empty()
                        ? fromGrpc(results[at_fault], strCat("sync ", id_, ": prepare on node \"", faulty_node_, "\""))
                        : absl::UnavailableError(strCat("sync ", id_, ": prepare failed: node \"", stalled,
                                                        "\" stopped answering (for ", lease_keeper_->allowed(), ")")));
}

Status SyncCoordinator::checkPrepared(const std::vector<v1::PrepareResponse>& prepared) {
  const auto& daemons = cluster_->view.daemons();
  // A sync that skipped the gather relies on every daemon having checked its registrations
  // against the kept view: one that did not (an older daemon ignores PrepareRequest.expect) sends
  // the sync back to a full gather.
  if (route_ != Route::kGathered)
    for (size_t i = 0; i < daemons.size(); ++i)
      if (!prepared[i].expect_checked())
        return giveUpWith(absl::FailedPreconditionError(strCat("sync ", id_, ": node ", quote(daemons[i].node()),
                                                               " did not check the kept view (", kStaleView,
                                                               ": a daemon of an older version?)")));
  // Every daemon must execute the coordinator's plan: one that planned another (a daemon of
  // another version, say) would write where the others do not read.
  for (size_t i = 0; i < daemons.size(); ++i)
    if (prepared[i].plan_key() != plan_->key) {
      faulty_node_ = daemons[i].node();
      return giveUpWith(absl::FailedPreconditionError(
          strCat("sync ", id_, ": node \"", daemons[i].node(), "\" planned this sync differently (plan \"",
                 prepared[i].plan_key(), "\", not \"", plan_->key, "\"): are the daemons of one version?")));
    }
  return absl::OkStatus();
}

void SyncCoordinator::directories(const std::vector<v1::PrepareResponse>& prepared,
                                  const std::vector<SplitAmaxes>& amaxes) {
  const auto& daemons = cluster_->view.daemons();
  // Each daemon learns where the nodes it writes to land, not every node's directory: the
  // requests' total size grows with the plan's edges, not with the square of the nodes.
  exec_.assign(daemons.size(), {});
  for (size_t i = 0; i < daemons.size(); ++i) {
    auto& e = exec_[i];
    e.set_sync_id(id_);
    e.set_timeout_ms(timeout_ms_);
    e.set_verify(req_.options().verify());
    e.set_fence(fence_);
    writeAmaxes(amaxes[i], e.mutable_split_amax());
    for (const size_t j : writesTo(i)) {
      auto* n = e.add_nodes();
      nodeAddress(j, n);
      *n->mutable_targets() = prepared[j].targets();
      n->set_base_version(prepared[j].base_version());
      n->set_base_fence(prepared[j].base_fence());
    }
  }
}

std::vector<size_t> SyncCoordinator::writesTo(size_t i) const {
  const auto& daemons = cluster_->view.daemons();
  const auto& nodes = plan_->nodes;
  // Lookups, not a scan of every node per daemon: at 1024 daemons that was a million string
  // compares per sync on the coordinator.
  if (daemon_at_.empty()) {
    daemon_at_.assign(static_cast<size_t>(nodes.size()), -1);
    for (size_t d = 0; d < daemons.size(); ++d)
      if (const int32_t at = nodes.find(daemons[d].node()); at >= 0)
        daemon_at_[static_cast<size_t>(at)] = static_cast<int64_t>(d);
  }
  std::vector<size_t> out;
  if (const int32_t self = nodes.find(daemons[i].node()); self >= 0)
    for (const int32_t peer : plan_->node(self).peers)
      if (const int64_t d = daemon_at_[static_cast<size_t>(peer)]; d >= 0) out.push_back(static_cast<size_t>(d));
  return out;
}

void SyncCoordinator::nodeAddress(size_t j, v1::NodeDirectory* n) const {
  n->set_node(cluster_->view.daemons()[j].node());
  n->set_transport_address(cluster_->view.daemons()[j].transport_address());
  n->set_address(cluster_->addresses[j]);
}

StatusOr<std::vector<SplitAmaxes>> SyncCoordinator::combinedAmaxes(const std::vector<v1::PrepareResponse>& prepared) {
  const auto& daemons = cluster_->view.daemons();
  std::vector<SplitAmaxes> reports(daemons.size());
  std::vector<int32_t> ids(daemons.size(), -1);
  std::vector<std::string> names(daemons.size());
  for (size_t i = 0; i < daemons.size(); ++i) {
    names[i] = daemons[i].node();
    ids[i] = plan_->nodes.find(names[i]);
    auto report = readAmaxes(prepared[i].split_amax());
    if (!report.ok()) {
      faulty_node_ = names[i];
      return Status(report.status().code(),
                    strCat("sync ", id_, ": node ", quote(names[i]), ": ", report.status().message()));
    }
    reports[i] = std::move(*report);
  }
  auto combined = combineAmaxes(plan_->src, ids, names, reports);
  if (!combined.ok()) return Status(combined.status().code(), strCat("sync ", id_, ": ", combined.status().message()));
  return combined;
}

}  // namespace shardcast::daemon
