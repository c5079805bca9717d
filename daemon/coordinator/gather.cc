// A sync's gather (docs/architecture.md, "A sync, step by step"): both groups complete across the
// cluster, a replica set's members and a catch-up's seed resolved, and the version contract checked.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "common/strings.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/registry/sync_preconditions.h"

namespace shardcast::daemon {

// Both groups complete across the cluster (or wait for them, if asked), roles right, and the
// version contract as described.
Status SyncCoordinator::gather() {
  while (true) {
    bool incomplete = false;
    const Status st = gatherOnce(&incomplete);
    if (st.ok()) return st;
    if (!incomplete || !req_.options().wait_for_ranks() || Clock::now() + std::chrono::milliseconds(100) > deadline_)
      return failed(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // A caller that left, or a daemon stopping, ends the wait: nobody is there to take the result.
    if (ctx_.gone && ctx_.gone())
      return failed(absl::CancelledError(strCat("sync ", id_,
                                                ": the caller went away (or the daemon is stopping) "
                                                "while it waited for ranks: ",
                                                st.message())));
  }
}

Status SyncCoordinator::gatherOnce(bool* incomplete) {
  // Daemons that do not answer: a replica set syncs without the replicas on them; any other
  // sync fails, naming the first.
  std::vector<std::string> unreachable;
  auto snapshot = snapshotCluster(ctx_.peers, ctx_.registry.describe(), ctx_.self_address, &unreachable, gatherAsk());
  if (snapshot.ok())
    if (Status chosen = chooseSetOrGroup(snapshot->view); !chosen.ok()) return chosen;
  const bool replica_set = snapshot.ok() && !snapshot->view.replicasOf(req_.dst_group(), set_despite_group_).empty();
  // A group whose layout could not be gathered may be a replica of the set synced (its layout
  // says which set): the set is not synced as if it were not, nor a set of its name called unknown.
  if (snapshot.ok() && !snapshot->view.missingLayouts().empty() &&
      (replica_set || !snapshot->view.layoutOf(req_.dst_group()))) {
    *incomplete = true;
    return absl::UnavailableError(
        strCat("sync into ", quote(req_.dst_group()), ": ", strJoin(snapshot->view.missingLayouts(), "; ")));
  }
  // Daemons that do not answer fail a plain sync; a set's sync and a catch-up go on without
  // them, and fail only when a group they read or write has ranks there (incomplete, below).
  if (snapshot.ok() && !unreachable.empty() && !replica_set && !req_.options().catch_up())
    snapshot = absl::UnavailableError(unreachable.front());
  if (snapshot.ok() && req_.options().catch_up()) {
    SC_RETURN_IF_ERROR(resolveCatchUp(snapshot->view));
    if (reads_ == Reads::kNothing) return caughtUp(snapshot->view, unreachable);
  }
  // With the daemons that did not answer named: the missing ranks may be on them.
  const auto orUnreachable = [&](StatusOr<v1::Layout> layout) -> StatusOr<v1::Layout> {
    if (layout.ok() || unreachable.empty()) return layout;
    return absl::UnavailableError(strCat(layout.status().message(), "; ", strJoin(unreachable, "; ")));
  };
  StatusOr<v1::Layout> src = absl::UnknownError(""), dst = absl::UnknownError("");
  if (snapshot.ok()) {
    src = orUnreachable(snapshot->view.completeGroup(src_group_));
    if (!replica_set) {
      dst = orUnreachable(snapshot->view.completeGroup(req_.dst_group()));
    } else if (Status members = gatherReplicas(snapshot->view, unreachable); members.ok()) {
      v1::Layout named;
      named.set_group(req_.dst_group());
      dst = named;
    } else {
      dst = members;
    }
    // Roles are not worth waiting for: a wrong one is the caller's mistake.
    SC_RETURN_IF_ERROR(checkRoles(snapshot->view, src.ok(), dst.ok() && !replica_set));
  }
  const Status st = !snapshot.ok() ? snapshot.status() : !src.ok() ? src.status() : dst.status();
  if (!st.ok()) {
    *incomplete = true;
    return st;
  }
  SC_RETURN_IF_ERROR(mayWrite(snapshot->view, replica_set));  // not worth waiting for either
  if (req_.options().catch_up()) learnSet(snapshot->view);
  // (Those that left are forgotten when the sync commits: SyncCoordinator::run.)
  if (replica_set) ctx_.replica_sets.learn(req_.dst_group(), members_seen_);
  src_ = std::move(*src);
  dst_ = std::move(*dst);
  adopt(std::move(*snapshot), replica_set);
  // Fail before preparing anything, naming the rank (each daemon checks again when it prepares).
  return checkVersions();
}

PeerSet::Ask SyncCoordinator::gatherAsk() const {
  // Nodes that failed an earlier attempt are not asked again; with a replica deadline, nodes
  // that held only this set's replicas at its last sync get no longer than that deadline to
  // answer (a frozen replica costs the deadline here too, not the peer timeout).
  PeerSet::Ask ask{ctx_.failed_nodes, {}};
  if (const auto deadline = std::chrono::milliseconds(req_.options().replica_deadline_ms()); deadline.count() > 0)
    for (const auto& [group, member] : ctx_.replica_sets.recall(req_.dst_group()))
      for (const auto& node : member.nodes)
        if (node != ctx_.config.node) ask.briefly[node] = std::max(deadline, std::chrono::milliseconds(200));
  return ask;
}

Status SyncCoordinator::chooseSetOrGroup(const ClusterView& view) {
  // A group named like a replica set: the reading the source's bytes may reach is written (a
  // group, or replicas, another uid registered under the name decide nothing); when both may,
  // the caller could mean either, so neither is written.
  set_despite_group_ = false;
  if (req_.options().catch_up() || !view.layoutOf(req_.dst_group()) || !view.namedAsSet(req_.dst_group()))
    return absl::OkStatus();
  const auto reaches = [&](const std::string& group) {
    return view.mayReceive(src_group_, group).ok() &&
           (!ctx_.caller_uid || view.maySync(*ctx_.caller_uid, src_group_, group).ok());
  };
  const auto members = view.replicasOf(req_.dst_group(), /*despite_group=*/true);
  const bool as_set = std::any_of(members.begin(), members.end(), reaches);
  if (as_set && reaches(req_.dst_group()))
    return absl::FailedPreconditionError(
        strCat("sync: \"", req_.dst_group(),
               "\" is both a registered group and the replica set that groups' "
               "layouts name: refusing to guess which to write (unregister the group, or rename the set)"));
  set_despite_group_ = as_set;
  return absl::OkStatus();
}

Status SyncCoordinator::caughtUp(const ClusterView& view, const std::vector<std::string>& unreachable) {
  // Nothing to move, once the replica is whole and the caller may write it.
  if (auto whole = view.completeGroup(req_.dst_group()); !whole.ok())
    return unreachable.empty()
               ? whole.status()
               : absl::UnavailableError(strCat(whole.status().message(), "; ", strJoin(unreachable, "; ")));
  if (ctx_.caller_uid) SC_RETURN_IF_ERROR(view.maySync(*ctx_.caller_uid, src_group_, req_.dst_group()));
  learnSet(view);
  return absl::OkStatus();
}

Status SyncCoordinator::checkRoles(const ClusterView& view, bool src_found, bool dst_found) const {
  if (src_found && reads_ != Reads::kSeed && view.role(src_group_) != v1::ROLE_SOURCE)
    return absl::FailedPreconditionError(
        strCat("sync: group \"", src_group_, "\" is registered as a destination; a sync reads only source groups"));
  if (dst_found && view.role(req_.dst_group()) != v1::ROLE_DESTINATION)
    return absl::FailedPreconditionError(
        strCat("sync: group \"", req_.dst_group(),
               "\" is registered as a source; a sync writes only destination groups (refusing to "
               "overwrite it)"));
  return absl::OkStatus();
}

Status SyncCoordinator::mayWrite(const ClusterView& view, bool replica_set) const {
  if (!ctx_.caller_uid) return absl::OkStatus();
  std::vector<std::string> written{req_.dst_group()};
  if (replica_set) {
    written.clear();
    for (const auto& r : replicas_) written.push_back(r.layout.group());
  }
  for (const auto& group : written) SC_RETURN_IF_ERROR(view.maySync(*ctx_.caller_uid, src_group_, group));
  return absl::OkStatus();
}

void SyncCoordinator::adopt(ClusterSnapshot snapshot, bool replica_set) {
  auto cluster = std::make_shared<ClusterSnapshot>(std::move(snapshot));
  // A replica set's sync asks only the daemons it reads or writes: a node left with only cut
  // replicas (silent, or failing this sync's prepare) is not waited on again.
  if (replica_set)
    cluster->keepOnly([&](const v1::DescribeResponse& d) {
      return std::any_of(d.ranks().begin(), d.ranks().end(), [&](const v1::RemoteRank& r) {
        return r.group() == src_group_ || (writes(r.group()) && r.group() != req_.dst_group());
      });
    });
  cluster_ = std::move(cluster);
  // Replica sets call every daemon directly: a replica's node that is silent is cut from the
  // sync, and a silent relay would have the healthy nodes below it cut too.
  const bool direct = replica_set || req_.options().catch_up();
  peers_ = std::make_unique<PeerClient>(ctx_.peers, cluster_->addresses,
                                        direct ? 0 : static_cast<uint32_t>(ctx_.config.relay_fanout));
}

namespace {

// Every replica of `set` registered in `view` whose owner may receive `src`'s bytes ("": every
// replica), and the nodes holding its ranks.
ReplicaMemory::Members membersOf(const ClusterView& view, const std::string& set, const std::string& src) {
  ReplicaMemory::Members members;
  for (const auto& d : view.daemons())
    for (const auto& r : d.ranks())
      if (const v1::Layout* l = view.layoutOf(r.group());
          l && l->replica_set() == set && (src.empty() || view.mayReceive(src, r.group()).ok())) {
        auto& member = members[r.group()];
        member.replica = l->replica();
        member.nodes.insert(d.node());
        member.instances[d.node()] = d.instance();
      }
  return members;
}

// Why a replica's ranks refuse this sync's version ("" when none does). `retaking`: retried
// without replicas an earlier attempt cut, so a single-buffered replica still written by that
// attempt (a peer it was exchanging bytes with froze mid-write) may be taken over by this one,
// whose bytes are the same. Its daemon decides at Prepare (the rank is this sync's at this
// version: taken; else refused, naming the replica, cut alone).
std::string ranksRefusal(const ClusterView& view, const std::string& group, uint64_t version, bool retaking) {
  for (const auto& d : view.daemons())
    for (const auto& r : d.ranks()) {
      if (r.group() != group) continue;
      std::string why = destinationRefusal(factsOf(r), version);
      const bool retaken = retaking && r.written() && !r.held() && !r.double_buffered();
      if (why.empty() && r.refuses_writes() && !retaken)
        why = r.held() ? " does not accept updates (acquired by its client)"
              : r.state() == v1::RANK_UPDATING || (r.double_buffered() && r.written())
                  ? " does not accept updates (another sync is writing it)"
              : r.written() ? " does not accept updates (writes of a sync that ended are still landing in it)"
                            : " does not accept updates (a catch-up is reading it)";
      if (!why.empty()) return strCat("rank ", r.rank(), " on node \"", d.node(), "\"", why);
    }
  return "";
}

}  // namespace

Status SyncCoordinator::gatherReplicas(const ClusterView& view, const std::vector<std::string>& unreachable) {
  replicas_.clear();
  outcomes_.clear();
  std::vector<std::string> cut;
  std::vector<v1::ReplicaOutcome> left;
  const ReplicaMemory::Members now = membersNow(view, unreachable, &cut, &left);
  Sharing sharing;
  // Replicas are weighed in the order of their claims, the source owner's first (the bytes are its
  // own to place), then each by when its group was registered, cluster-wide (by id within that):
  // another uid's replica neither takes an id or a node from one that was there first nor becomes
  // the layout the others must match. They are stacked by id all the same (below).
  std::vector<std::string> members = view.replicasOf(req_.dst_group(), set_despite_group_);
  const auto source_owner = view.ownerOf(src_group_);
  const auto claim = [&](const std::string& group) {
    const uint64_t since = view.registeredSince(group);
    return std::make_pair(!source_owner || view.ownerOf(group) != source_owner, since ? since : UINT64_MAX);
  };
  std::stable_sort(members.begin(), members.end(),
                   [&](const std::string& a, const std::string& b) { return claim(a) < claim(b); });
  for (const auto& group : members) {
    const v1::Layout& registered = *view.layoutOf(group);
    v1::ReplicaOutcome outcome;
    outcome.set_group(group);
    outcome.set_replica(registered.replica());
    auto layout = view.completeGroup(group);
    const auto member = now.find(group);  // (a replica the source's bytes may not reach is not one)
    const std::set<std::string> nodes = member == now.end() ? std::set<std::string>() : member->second.nodes;
    const std::string refused = replicaRefusal(view, group, layout, nodes, sharing, unreachable);
    if (!refused.empty()) {
      cutOut(std::move(outcome), refused, &cut);
      continue;
    }
    replicas_.push_back({registered.replica(), *layout});
    for (const auto& node : nodes) sharing.emplace(node, std::make_pair(group, view.ownerOf(group)));
    outcomes_.push_back(std::move(outcome));
  }
  const size_t weighed = outcomes_.size();  // those registered now, and the silent ones
  outcomes_.insert(outcomes_.end(), left.begin(), left.end());
  std::sort(replicas_.begin(), replicas_.end(),
            [](const planner::Replica& a, const planner::Replica& b) { return a.id < b.id; });
  std::sort(outcomes_.begin(), outcomes_.end(), [](const v1::ReplicaOutcome& a, const v1::ReplicaOutcome& b) {
    return std::make_pair(a.replica(), a.group()) < std::make_pair(b.replica(), b.group());
  });
  const size_t needed = std::max<uint32_t>(1, req_.options().min_replicas());
  if (replicas_.size() < needed)
    return absl::FailedPreconditionError(strCat("sync: replica set \"", req_.dst_group(), "\": ", replicas_.size(),
                                                " of ", weighed, " replicas can take part, at least ", needed,
                                                " needed", cut.empty() ? "" : strCat(" (", strJoin(cut, "; "), ")")));
  if (!cut.empty())
    spdlog::warn("sync {}: replica set \"{}\" syncs {} of {} replicas; cut: {}", id_, req_.dst_group(),
                 replicas_.size(), weighed, strJoin(cut, "; "));
  return absl::OkStatus();
}

void SyncCoordinator::cutOut(v1::ReplicaOutcome outcome, const std::string& why, std::vector<std::string>* cut) {
  outcome.set_cut(why);
  cut->push_back(strCat(outcome.group(), ": ", why));
  outcomes_.push_back(std::move(outcome));
}

ReplicaMemory::Members SyncCoordinator::membersNow(const ClusterView& view, const std::vector<std::string>& unreachable,
                                                   std::vector<std::string>* cut,
                                                   std::vector<v1::ReplicaOutcome>* left) {
  // Where each replica's ranks are now, and where they were at the last sync into the set.
  ReplicaMemory::Members now = membersOf(view, req_.dst_group(), src_group_);
  const auto anyone = membersOf(view, req_.dst_group(), "");
  std::set<std::string> silent;  // nodes of daemons that do not answer
  for (const auto& [address, node] : ctx_.peers.knownNodes())
    for (const auto& why : unreachable)
      if (why.rfind(strCat("peer daemon ", address, " "), 0) == 0) silent.insert(node);
  auto remembered = ctx_.replica_sets.recall(req_.dst_group());
  for (const auto& [group, was] : remembered) {
    if (now.count(group)) continue;
    std::vector<std::string> gone;
    for (const auto& node : was.nodes)
      if (silent.count(node)) gone.push_back(quote(node));
    v1::ReplicaOutcome outcome;
    outcome.set_group(group);
    outcome.set_replica(was.replica);
    if (gone.empty()) {  // its nodes answer without it
      // (Nodes forgotten past their lease neither answer nor are silent: not named.)
      std::vector<std::string> restarted;
      bool answering = true;
      for (const auto& node : was.nodes) {
        const auto d = std::find_if(view.daemons().begin(), view.daemons().end(),
                                    [&](const v1::DescribeResponse& r) { return r.node() == node; });
        answering = answering && d != view.daemons().end();
        if (const auto then = was.instances.find(node);
            d != view.daemons().end() && then != was.instances.end() && then->second != d->instance())
          restarted.push_back(quote(node));
      }
      if (!answering || anyone.count(group)) continue;
      if (!restarted.empty()) {  // not left: its client registers it with the new daemon
        cutOut(outcome,
               strCat("the daemon of node(s) ", strJoin(restarted, ", "),
                      " restarted since the last sync into the set and has not had its ranks registered again"),
               cut);
        // Still a member, at the instances now: if it is not back by the next sync, it left.
        ReplicaMemory::Member now_member = was;
        for (const auto& d : view.daemons())
          if (now_member.nodes.count(d.node())) now_member.instances[d.node()] = d.instance();
        now[group] = std::move(now_member);
        continue;
      }
      // It left: its client unregistered its ranks, or the process holding them exited.
      outcome.set_left(true);
      outcome.set_cut(strCat("left the set since the last sync into it: its ranks are registered nowhere (",
                             "unregistered, or the process that registered them exited; the daemons' logs say ",
                             "which: \"session ... ended\")"));
      left->push_back(std::move(outcome));
      continue;
    }
    if (const auto earlier = ctx_.cut.find(group); earlier != ctx_.cut.end())
      cutOut(outcome, earlier->second, cut);  // its node failed an earlier attempt: not asked again
    else
      cutOut(outcome,
             strCat("node(s) ", strJoin(gone, ", "), " holding its ranks do not answer (", strJoin(unreachable, "; "),
                    ")"),
             cut);
    now[group] = was;  // still a member: named again while its nodes stay silent
  }
  // Remembered once the caller's checks pass (gather): members seen now that the source's bytes
  // may reach are added, and members are forgotten only when they are registered nowhere and
  // their nodes answer (they left), whatever source this caller named.
  members_seen_ = now;
  members_left_.clear();
  for (const auto& [group, was] : remembered)
    if (!anyone.count(group) && !now.count(group)) members_left_.push_back(group);
  return now;
}

std::string SyncCoordinator::replicaRefusal(const ClusterView& view, const std::string& group,
                                            const StatusOr<v1::Layout>& layout, const std::set<std::string>& nodes,
                                            const Sharing& sharing, const std::vector<std::string>& unreachable) const {
  if (const auto earlier = ctx_.cut.find(group); earlier != ctx_.cut.end()) return earlier->second;
  if (!layout.ok())
    return strCat(layout.status().message(), unreachable.empty() ? "" : strCat(" (", strJoin(unreachable, "; "), ")"));
  if (view.role(group) != v1::ROLE_DESTINATION) return "it is registered as a source; a sync writes only destinations";
  // Before ids and layouts are compared: a replica whose owner may not receive the source (or,
  // for a local caller, that the caller may not write) neither takes part nor displaces one.
  if (Status eligible = view.mayReceive(src_group_, group); !eligible.ok()) return std::string(eligible.message());
  if (ctx_.caller_uid)
    if (Status allowed = view.maySync(*ctx_.caller_uid, src_group_, group); !allowed.ok())
      return std::string(allowed.message());
  if (std::string why = ranksRefusal(view, group, version_, !ctx_.cut.empty()); !why.empty()) return why;
  const int32_t id = view.layoutOf(group)->replica();
  const auto owner = view.ownerOf(group);
  for (const auto& taking : replicas_)
    if (taking.id == id)
      return strCat("replica id ", id, " is taken by group ", quote(taking.layout.group()),
                    view.ownerOf(taking.layout.group()) == owner
                        ? " (registered first)"
                        : " of another owner, weighed first (it owns the source, or was registered first)");
  if (!replicas_.empty())
    if (Status same = planner::checkReplicaSet({replicas_.front(), {id, *layout}}); !same.ok())
      return std::string(same.message());
  // Replicas may share nodes (engines on one machine), if they have one owner: a shared node
  // lands each byte once in one replica's memory and copies it from there into the others',
  // and no uid's replica is written from memory another uid can change.
  for (const auto& node : nodes)
    if (const auto it = sharing.find(node); it != sharing.end() && it->second.second != owner)
      return strCat("node \"", node, "\" holds replica ", quote(it->second.first), " of another owner (",
                    "replicas share a node only with replicas of their own owner)");
  return "";
}

void SyncCoordinator::learnSet(const ClusterView& view) {
  const v1::Layout* layout = view.layoutOf(req_.dst_group());
  if (layout && !layout->replica_set().empty())
    ctx_.replica_sets.learn(layout->replica_set(), membersOf(view, layout->replica_set(), req_.src_group()));
}

Status SyncCoordinator::resolveCatchUp(const ClusterView& view) {
  const std::string& dst = req_.dst_group();
  const v1::Layout* layout = view.layoutOf(dst);
  if (layout == nullptr || layout->replica_set().empty())
    return absl::FailedPreconditionError(strCat("catch-up: group \"", dst,
                                                "\" is not a registered replica of a set (its layout names no "
                                                "replica_set)"));
  // Per group of the set (and the source): the version all its ranks are READY at (0: not all
  // are), and whether a catch-up could read it as its seed now.
  struct Held {
    uint64_t ready = UINT64_MAX;
    bool readable = true;
    uint32_t readers = 0;  // syncs reading it now, on its most-read rank (a catch-up may read it too)
  };
  src_group_ = req_.src_group();  // a wait_for_ranks round starts afresh
  reads_ = Reads::kSource;
  std::map<std::string, Held> held;
  for (const auto& d : view.daemons())
    for (const auto& r : d.ranks()) {
      const v1::Layout* l = view.layoutOf(r.group());
      if (!l || (l->replica_set() != layout->replica_set() && r.group() != src_group_)) continue;
      auto& h = held[r.group()];
      h.ready = std::min(h.ready, r.state() == v1::RANK_READY ? r.version() : 0);
      // Held by its engine is fine, and so is another catch-up reading it (all only read). The
      // seed's version is checked on the whole group below (h.ready).
      h.readable = h.readable && seedRefusal(factsOf(r), r.version()).empty();
      h.readers = std::max(h.readers, r.readers());
    }
  // The replica's owner must be one the source's bytes may reach, and a seed must be the same
  // owner's replica, holding a version its owner may have synced from the source: another uid's
  // replica is never read (its bytes are whatever that uid put there).
  if (Status eligible = view.mayReceive(src_group_, dst); !eligible.ok())
    return Status(eligible.code(), strCat("catch-up: ", eligible.message()));
  const auto owner = view.ownerOf(dst);
  // The seed: a replica at the newest version (or the one asked for); among those, the one the
  // fewest other syncs read now, ties broken by a hash of this replica's and the seed's names:
  // catch-ups that start together (each sees no reader yet) spread over the replicas, and with
  // more catch-ups than replicas they share them rather than falling back to the source.
  uint64_t newest = req_.version();
  std::string seed;
  std::pair<uint32_t, size_t> seed_rank{0, 0};  // (readers, tie-break hash)
  for (const auto& group : view.replicasOf(layout->replica_set())) {
    if (group == dst || !view.completeGroup(group).ok()) continue;
    if (view.ownerOf(group) != owner || !view.mayReceive(src_group_, group).ok()) continue;
    const Held& h = held[group];
    if (h.ready == 0 || h.ready == UINT64_MAX || !h.readable) continue;
    if (req_.version() == 0 ? h.ready < newest : h.ready != req_.version()) continue;
    const std::pair<uint32_t, size_t> rank{h.readers, std::hash<std::string>()(strCat(dst, "\n", group))};
    if (seed.empty() || h.ready > newest || rank < seed_rank) {
      newest = h.ready;
      seed = group;
      seed_rank = rank;
    }
  }
  if (newest == 0) {  // no replica readable at a version: the source's published one, if any
    const auto source = held.find(src_group_);
    if (source != held.end() && source->second.ready != 0 && source->second.ready != UINT64_MAX)
      newest = source->second.ready;
  }
  if (newest == 0)
    return absl::FailedPreconditionError(strCat("catch-up of \"", dst, "\": no replica of set \"",
                                                layout->replica_set(), "\" holds a version, and \"", src_group_,
                                                "\" has published none"));
  version_ = newest;
  const auto mine = held.find(dst);
  if (mine != held.end() && mine->second.ready != UINT64_MAX && mine->second.ready >= newest) {
    reads_ = Reads::kNothing;  // caught up already (by a sync into the set, say): at its own version
    version_ = mine->second.ready;
    return absl::OkStatus();
  }
  if (!seed.empty()) {
    src_group_ = seed;
    reads_ = Reads::kSeed;
  }  // else the source: the request's src_group, which must have published the version
  spdlog::info("sync {}: catching \"{}\" up to version {} from \"{}\"", id_, dst, version_, src_group_);
  return absl::OkStatus();
}

Status SyncCoordinator::checkVersions() const {
  const auto& src = src_group_;
  const auto& dst = req_.dst_group();
  const uint64_t version = version_;
  auto who = [](const v1::DescribeResponse& d, const v1::RemoteRank& r) {
    return strCat("group \"", r.group(), "\" rank ", r.rank(), " on node \"", d.node(), "\"");
  };
  // Destinations first: a replayed old sync is told so, whatever its sources hold now. The rules
  // are the daemons' own (daemon/registry/sync_preconditions.h), which apply them again in Prepare.
  for (const auto& d : cluster_->view.daemons())
    for (const auto& r : d.ranks())
      if (r.group() == dst)
        if (const std::string why = destinationRefusal(factsOf(r), version); !why.empty()) {
          // A rank that lacks the version its group's others hold (registered again after its
          // process restarted, say) gets the next one: say so, rather than only name the rank
          // that refused.
          std::string lacking;
          for (const auto& d2 : cluster_->view.daemons())
            for (const auto& r2 : d2.ranks())
              if (lacking.empty() && r2.group() == dst && !r2.held() && !r2.written() &&
                  (r2.state() == v1::RANK_EMPTY ||
                   ((r2.state() == v1::RANK_READY || r2.state() == v1::RANK_DIRTY) && r2.version() < version)))
                lacking = strCat("; ", who(d2, r2), " is ", v1::rankStateName(r2.state()),
                                 r2.state() == v1::RANK_EMPTY ? "" : strCat(" at version ", r2.version()),
                                 ": publish a newer version to bring it up (a rank that missed a version takes the "
                                 "next)");
          return absl::FailedPreconditionError(strCat("sync: ", who(d, r), why, lacking));
        }
  for (const auto& d : cluster_->view.daemons())
    for (const auto& r : d.ranks())
      if (r.group() == src) {
        const std::string why =
            reads_ == Reads::kSeed ? seedRefusal(factsOf(r), version) : sourceRefusal(factsOf(r), version);
        if (!why.empty()) return absl::FailedPreconditionError(strCat("sync: ", who(d, r), why));
      }
  return absl::OkStatus();
}

}  // namespace shardcast::daemon
