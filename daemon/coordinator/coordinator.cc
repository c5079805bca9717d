#include "daemon/coordinator/coordinator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <optional>
#include <thread>

#include "common/grpc_status.h"
#include "common/strings.h"
#include "daemon/registry/sync_preconditions.h"
#include "planner/report.h"

namespace shardcast::daemon {

// ---- PeerClient ----

PeerClient::PeerClient(const PeerSet& peers, std::vector<std::string> addresses, uint32_t fanout)
    : peers_(peers), addresses_(std::move(addresses)), fanout_(fanout) {}

std::vector<grpc::Status> PeerClient::callRaw(const std::string& method, std::vector<RawCall> calls,
                                              std::string common_request, bool stop_at_failure,
                                              const std::function<grpc::Status(size_t, const RawResult&)>& each) {
  std::vector<grpc::Status> statuses(calls.size());
  TreeOptions options;
  options.method = method;
  options.fanout = fanout_;
  options.stop_at_failure = stop_at_failure;
  options.common_request = std::move(common_request);
  options.track = [this](grpc::ClientContext& c, bool add) { calls_.track(c, add); };
  callTree(peers_, calls, options, [&](size_t i, const RawResult& r) { statuses[i] = each(i, r); });
  return statuses;
}

// ---- LeaseKeeper ----

// From prepare on, the daemons hold the sync under a lease: this renews it with a Progress call to
// every daemon each quarter lease (recording their bytes for Watch), and gives the sync up, naming
// the node, when one has not answered for a whole lease (a node holding only replicas of a set:
// for the sync's replica deadline, when shorter).
class SyncCoordinator::LeaseKeeper {
 public:
  explicit LeaseKeeper(SyncCoordinator& c)
      : c_(c),
        answered_(c.cluster_->addresses.size(), Clock::now()),
        unanswered_since_(answered_.size(), Clock::time_point::max()) {
    // A node holding only replicas of a set may be silent for the sync's replica deadline at most.
    // (At least 200 ms: below it every replica node would look silent between two polls.)
    const auto deadline = c.req_.options().replica_deadline_ms() == 0
                              ? std::chrono::milliseconds(0)
                              : std::max(std::chrono::milliseconds(c.req_.options().replica_deadline_ms()),
                                         std::chrono::milliseconds(200));
    for (const auto& d : c.cluster_->view.daemons())
      silence_.push_back(deadline.count() > 0 && !c.replicasOnlyOn(d.node()).empty() ? std::min(deadline, c.lease_)
                                                                                     : c.lease_);
    // A folded sync has no Prepare round, whose deadline found a silent daemon as soon as the
    // gather would have: until a daemon shows it holds the attempt, it may be silent that long.
    if (c.folded_)
      unprepared_ = std::min(c.lease_, std::chrono::milliseconds(std::max(c.ctx_.config.peer_timeout_ms, 1000)));
    prepared_.assign(silence_.size(), !c.folded_);
    thread_ = std::thread([this] { run(); });
  }
  ~LeaseKeeper() { stop(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    polling_.cancel();
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // The node that stopped answering ("" while all answer).
  std::string stalled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stalled_;
  }
  // How long it was allowed to be silent: "250 ms, the sync's replica deadline".
  std::string allowed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allowed_;
  }

 private:
  void run() {
    using std::chrono::milliseconds;
    auto shortest = *std::min_element(silence_.begin(), silence_.end());  // of the silences allowed
    if (unprepared_.count() > 0) shortest = std::min(shortest, unprepared_);
    const auto period = std::min(milliseconds(250), shortest / 4);
    auto pause = period;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, pause, [&] { return !running_; })) {
      lock.unlock();
      // A poll waits for answers until the first node's allowed silence runs out (a period at
      // least, half the shortest silence at most), and one that had to wait for a silent node
      // polls again at once: a node is found silent when its silence runs out, not a poll later.
      const auto sent = Clock::now();
      const auto silentSince = [&](size_t i) {  // if it leaves this poll unanswered
        return unanswered_since_[i] != Clock::time_point::max() ? unanswered_since_[i]
                                                                : std::max(answered_[i], sent - period);
      };
      auto first_end = silentSince(0) + allowance(0);
      for (size_t i = 1; i < answered_.size(); ++i) first_end = std::min(first_end, silentSince(i) + allowance(i));
      const auto wait = std::clamp(std::chrono::duration_cast<milliseconds>(first_end - sent), period,
                                   std::max(period, shortest / 2));
      // Not through the sync's PeerClient: these calls go on after the sync is given up (its
      // calls cancelled), until the coordinator is done with it. Through the sync's relay tree:
      // a daemon silent below a relay comes back DEADLINE_EXCEEDED from the relay (in time: a
      // relay gets a margin per hop), and a relay that is silent itself is named before the
      // daemons it did not reach, which follow it in the daemons' order.
      const auto& addresses = c_.cluster_->addresses;
      v1::ProgressRequest pr;
      pr.set_sync_id(c_.id_);
      pr.set_fence(c_.fence_);
      TreeOptions options;
      options.method = "Progress";
      options.fanout = c_.peers_ ? c_.peers_->fanout() : 0;
      pr.SerializeToString(&options.common_request);
      // stop() never waits for a silent node.
      options.track = [this](grpc::ClientContext& context, bool add) { polling_.track(context, add); };
      std::vector<RawCall> calls;
      for (const auto& a : addresses) calls.push_back({a, {}, wait});
      {
        std::lock_guard<std::mutex> guard(mu_);
        if (!running_) return;
      }
      const auto results = callTree(c_.ctx_.peers, calls, options);
      std::vector<grpc::Status> st(results.size());
      std::vector<v1::ProgressResponse> got(results.size());
      for (size_t i = 0; i < results.size(); ++i) st[i] = parseResult(results[i], &got[i]);
      std::string silent;
      pause = period;
      // How long a node that left this poll unanswered is known silent: up to the poll's deadline,
      // not until now when this thread got to it late (a coordinator descheduled during the poll).
      const auto observed = std::min(Clock::now(), sent + wait);
      // A node's silence counts from its last answer, but a poll the coordinator sent later than
      // a period after it (not scheduled meanwhile: a loaded machine) counts it from the poll less
      // a period: a healthy node is not found silent for the coordinator's own delay.
      for (size_t i = 0; i < st.size(); ++i) {
        if (st[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) pause = milliseconds(0);
        // NOT_FOUND: the daemon answers (the sync is not prepared there yet, or over).
        if (st[i].ok() || st[i].error_code() == grpc::StatusCode::NOT_FOUND) {
          answered_[i] = Clock::now();
          unanswered_since_[i] = Clock::time_point::max();
        } else {
          unanswered_since_[i] = silentSince(i);
        }
        if (st[i].ok()) c_.record(i, got[i].bytes_received(), got[i].bytes_sent());
        prepared_[i] = prepared_[i] || st[i].ok();  // the attempt is open there
        if (unanswered_since_[i] != Clock::time_point::max() && observed - unanswered_since_[i] >= allowance(i) &&
            silent.empty())
          silent = c_.cluster_->view.daemons()[i].node();
      }
      lock.lock();
      if (!silent.empty() && stalled_.empty() && running_) {
        stalled_ = silent;
        for (size_t i = 0; i < silence_.size(); ++i)
          if (c_.cluster_->view.daemons()[i].node() == silent)
            allowed_ = strCat(allowance(i).count(), " ms, ",
                              !prepared_[i]             ? "the peer timeout of a Prepare"
                              : silence_[i] < c_.lease_ ? "the sync's replica deadline"
                                                        : "the sync's lease");
        lock.unlock();
        spdlog::warn("sync {}: node \"{}\" has not answered in time: giving the sync up", c_.id_, silent);
        c_.giveUp(strCat("node \"", silent, "\" stopped answering"), silent);
        lock.lock();
      }
    }
  }

  // How long daemon i may stay silent now.
  std::chrono::milliseconds allowance(size_t i) const {
    return prepared_[i] ? silence_[i] : std::min(silence_[i], unprepared_);
  }

  SyncCoordinator& c_;
  std::vector<Clock::time_point> answered_;          // per daemon: its last answer (the sync's start before one)
  std::vector<Clock::time_point> unanswered_since_;  // per daemon: since when it is silent (max: it answered)
  std::vector<std::chrono::milliseconds> silence_;   // per daemon: how long it may stay silent
  std::chrono::milliseconds unprepared_{0};          // a folded sync: before its attempt is open there
  std::vector<bool> prepared_;                       // per daemon: it answered for the open attempt
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = true;
  CallSet polling_;  // the calls of the poll in flight
  std::string stalled_;
  std::string allowed_;
  std::thread thread_;
};

// ---- SyncCoordinator ----

SyncCoordinator::SyncCoordinator(Context ctx, const v1::SyncRequest& request, std::string id, uint64_t fence)
    : ctx_(std::move(ctx)),
      req_(request),
      src_group_(request.src_group()),
      version_(request.version()),
      id_(std::move(id)),
      fence_(fence),
      lease_(ctx_.config.sync_lease_ms) {
  timeout_ms_ = req_.options().timeout_ms() ? req_.options().timeout_ms() : 300000;
  deadline_ = start_ + std::chrono::milliseconds(timeout_ms_);
}

SyncCoordinator::~SyncCoordinator() {
  if (lease_keeper_) lease_keeper_->stop();
}

Status SyncCoordinator::timed(Status (SyncCoordinator::*phase)(), void (v1::SyncResponse::*seconds)(double)) {
  const auto started = Clock::now();
  Status st = (this->*phase)();
  (out_.*seconds)(since(started));
  return st;
}

StatusOr<v1::SyncResponse> SyncCoordinator::run() {
  using R = v1::SyncResponse;
  const std::string repeat_key = RepeatCache::keyOf(req_, ctx_.caller_uid);
  std::shared_ptr<const RepeatView> repeat;
  if (ctx_.repeats && !ctx_.full_gather && !req_.options().catch_up()) repeat = ctx_.repeats->find(repeat_key);
  if (repeat && repeat->prepare_seconds * 2000 > std::max(ctx_.config.peer_timeout_ms, 1000)) repeat = nullptr;
  if (repeat) {  // each daemon's Prepare checks what the gather would have (repeat_cache.h)
    repeated_ = true;
    cluster_ = repeat->cluster;
    src_ = repeat->src;
    dst_ = repeat->dst;
    digests_ = repeat->digests;
    repeat_ = repeat;
    peers_ =
        std::make_unique<PeerClient>(ctx_.peers, cluster_->addresses, static_cast<uint32_t>(ctx_.config.relay_fanout));
    out_.set_repeated(true);
  } else {
    SC_RETURN_IF_ERROR(timed(&SyncCoordinator::gather, &R::set_gather_seconds));
  }
  if (peers_) out_.set_coordinator_calls(static_cast<uint32_t>(peers_->directCalls()));
  if (current_) {  // a catch-up with nothing to move
    out_.set_sync_id(id_);
    out_.set_version(version_);
    out_.set_seconds(since(start_));
    ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
      p.set_version(version_);
      ProgressBoard::setPhase(p, v1::SYNC_COMMITTED);
    });
    return out_;
  }
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::plan, &R::set_plan_seconds));
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::prepare, &R::set_prepare_seconds));
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::execute, &R::set_execute_seconds));
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::commit, &R::set_finish_seconds));
  if (ctx_.repeats && !req_.options().catch_up() && replicas_.empty() && !seed_) {  // (again: its Prepare's time)
    if (digests_.src.empty()) digests_ = {planner::layoutDigest(src_), planner::layoutDigest(dst_)};
    // A folded sync's Prepare took no round: the kept view keeps its earlier Prepare's time.
    const double prepare_seconds = folded_ ? repeat_->prepare_seconds : out_.prepare_seconds();
    if (folded_) prepared_ = repeat_->prepared;  // each daemon found them still its own
    for (auto& answer : prepared_)  // the next sync's landings: double-buffered ranks flipped at this commit
      if (answer.has_next_targets()) answer.mutable_targets()->Swap(answer.mutable_next_targets());
    const int fold_refusals = folded_ ? 0 : repeat_ ? repeat_->fold_refusals : ctx_.fold_refusals;
    ctx_.repeats->keep(
        repeat_key, std::make_shared<const RepeatView>(RepeatView{cluster_, src_, dst_, digests_, std::move(prepared_),
                                                                  fold_refusals, prepare_seconds}));
  }

  const auto& stats = plan_->plan.stats;
  out_.set_sync_id(id_);
  out_.set_version(version_);
  out_.set_network_bytes(static_cast<uint64_t>(stats.network_bytes));
  out_.set_local_bytes(static_cast<uint64_t>(stats.local_bytes));
  out_.set_bytes_needed(static_cast<uint64_t>(stats.bytes_needed));
  out_.set_seconds(since(start_));
  out_.set_plan_cached(plan_cached_);
  const SyncCounters moved = moved_.load();
  out_.set_bytes_landed_direct(moved.bytes_landed_direct);
  out_.set_device_fanout_bytes(moved.device_fanout_bytes);
  out_.set_waves(static_cast<uint32_t>(plan_->waves));
  out_.set_wire_bytes(wire_bytes_);
  out_.set_delta_chunks(moved.delta_chunks);
  out_.set_dense_chunks(moved.dense_chunks);
  out_.set_delta(delta_);
  out_.set_strategy(req_.options().strategy());
  if (req_.options().catch_up()) out_.set_seeded_from(src_group_);
  for (auto& o : outcomes_) {
    o.set_committed(o.cut().empty());
    *out_.add_replicas() = o;
  }
  out_.set_plan_summary_json(planner::renderJson(plan_->plan, plan_->nodes, planner::CostModel{}));
  // The one line a committed sync leaves, with its figures (a failed one: the service's warning).
  spdlog::info(
      "sync {}: {} -> {} version {} committed in {:.3f} s (gather {:.3f} s, plan {:.3f} s, prepare {:.3f} s, "
      "execute {:.3f} s, finish {:.3f} s): {} bytes over the network, {} landed direct, {} copied locally",
      id_, src_group_, req_.dst_group(), version_, out_.seconds(), out_.gather_seconds(), out_.plan_seconds(),
      out_.prepare_seconds(), out_.execute_seconds(), out_.finish_seconds(), out_.network_bytes(),
      out_.bytes_landed_direct(), moved.local_bytes);
  return out_;
}

// Both groups complete across the cluster (or wait for them, if asked), roles right, and the
// version contract as described.
Status SyncCoordinator::gather() {
  while (true) {
    // Daemons that do not answer: a replica set syncs without the replicas on them; any other
    // sync fails, naming the first.
    std::vector<std::string> unreachable;
    // Nodes that failed an earlier attempt are not asked again; with a replica deadline, nodes
    // that held only this set's replicas at its last sync get no longer than that deadline to
    // answer (a frozen replica costs the deadline here too, not the peer timeout).
    PeerSet::Ask ask{ctx_.failed_nodes, {}};
    if (const auto deadline = std::chrono::milliseconds(req_.options().replica_deadline_ms()); deadline.count() > 0)
      for (const auto& [group, member] : ctx_.replica_sets.recall(req_.dst_group()))
        for (const auto& node : member.nodes)
          if (node != ctx_.config.node) ask.briefly[node] = std::max(deadline, std::chrono::milliseconds(200));
    auto snapshot = snapshotCluster(ctx_.peers, ctx_.registry.describe(), ctx_.self_address, &unreachable, ask);
    StatusOr<v1::Layout> src = absl::UnknownError(""), dst = absl::UnknownError("");
    // A group named like a replica set: the reading the source's bytes may reach is written (a
    // group, or replicas, another uid registered under the name decide nothing); when both may,
    // the caller could mean either, so neither is written.
    set_despite_group_ = false;
    if (snapshot.ok() && !req_.options().catch_up() && snapshot->view.layoutOf(req_.dst_group()) &&
        snapshot->view.namedAsSet(req_.dst_group())) {
      const ClusterView& view = snapshot->view;
      const auto reaches = [&](const std::string& group) {
        return view.mayReceive(src_group_, group).ok() &&
               (!ctx_.caller_uid || view.maySync(*ctx_.caller_uid, src_group_, group).ok());
      };
      const auto members = view.replicasOf(req_.dst_group(), /*despite_group=*/true);
      const bool as_set = std::any_of(members.begin(), members.end(), reaches);
      if (as_set && reaches(req_.dst_group()))
        return failed(absl::FailedPreconditionError(
            strCat("sync: \"", req_.dst_group(),
                   "\" is both a registered group and the replica set that groups' "
                   "layouts name: refusing to guess which to write (unregister the group, or rename the set)")));
      set_despite_group_ = as_set;
    }
    const bool replica_set = snapshot.ok() && !snapshot->view.replicasOf(req_.dst_group(), set_despite_group_).empty();
    // Daemons that do not answer fail a plain sync; a set's sync and a catch-up go on without
    // them, and fail only when a group they read or write has ranks there (incomplete, below).
    if (snapshot.ok() && !unreachable.empty() && !replica_set && !req_.options().catch_up())
      snapshot = absl::UnavailableError(unreachable.front());
    if (snapshot.ok() && req_.options().catch_up()) {
      if (Status resolved = resolveCatchUp(snapshot->view); !resolved.ok()) return failed(resolved);
      if (current_) {  // nothing to move, once the replica is whole and the caller may write it
        if (auto whole = snapshot->view.completeGroup(req_.dst_group()); !whole.ok())
          return failed(unreachable.empty() ? whole.status()
                                            : absl::UnavailableError(
                                                  strCat(whole.status().message(), "; ", strJoin(unreachable, "; "))));
        if (ctx_.caller_uid)
          if (Status allowed = snapshot->view.maySync(*ctx_.caller_uid, src_group_, req_.dst_group()); !allowed.ok())
            return failed(allowed);
        learnSet(snapshot->view);
        return absl::OkStatus();
      }
    }
    if (snapshot.ok()) {
      src = snapshot->view.completeGroup(src_group_);
      if (!src.ok() && !unreachable.empty())  // its missing ranks may be on them
        src = absl::UnavailableError(strCat(src.status().message(), "; ", strJoin(unreachable, "; ")));
      if (!replica_set) {
        dst = snapshot->view.completeGroup(req_.dst_group());
        if (!dst.ok() && !unreachable.empty())  // a catch-up's replica: its missing ranks may be on them
          dst = absl::UnavailableError(strCat(dst.status().message(), "; ", strJoin(unreachable, "; ")));
      } else if (Status members = gatherReplicas(snapshot->view, unreachable); members.ok()) {
        v1::Layout named;
        named.set_group(req_.dst_group());
        dst = named;
      } else {
        dst = members;
      }
      // Roles are not worth waiting for: a wrong one is the caller's mistake.
      if (src.ok() && !seed_ && snapshot->view.role(src_group_) != v1::ROLE_SOURCE)
        return failed(absl::FailedPreconditionError(strCat(
            "sync: group \"", src_group_, "\" is registered as a destination; a sync reads only source groups")));
      if (dst.ok() && !replica_set && snapshot->view.role(req_.dst_group()) != v1::ROLE_DESTINATION)
        return failed(absl::FailedPreconditionError(
            strCat("sync: group \"", req_.dst_group(),
                   "\" is registered as a source; a sync writes only destination groups (refusing to "
                   "overwrite it)")));
    }
    const Status st = !snapshot.ok() ? snapshot.status() : !src.ok() ? src.status() : dst.status();
    if (st.ok() && ctx_.caller_uid) {  // not worth waiting for either
      std::vector<std::string> written{req_.dst_group()};
      if (replica_set) {
        written.clear();
        for (const auto& r : replicas_) written.push_back(r.layout.group());
      }
      for (const auto& group : written)
        if (Status allowed = snapshot->view.maySync(*ctx_.caller_uid, src_group_, group); !allowed.ok())
          return failed(allowed);
    }
    if (st.ok()) {
      if (req_.options().catch_up()) learnSet(snapshot->view);
      if (replica_set) ctx_.replica_sets.update(req_.dst_group(), members_seen_, members_left_);
      auto cluster = std::make_shared<ClusterSnapshot>(std::move(*snapshot));
      src_ = std::move(*src);
      dst_ = std::move(*dst);
      // A replica set's sync asks only the daemons it reads or writes: a node left with only cut
      // replicas (silent, or failing this sync's prepare) is not waited on again.
      if (replica_set)
        cluster->keepOnly([&](const v1::DescribeResponse& d) {
          return std::any_of(d.ranks().begin(), d.ranks().end(), [&](const v1::RemoteRank& r) {
            return r.group() == src_group_ || (writes(r.group()) && r.group() != req_.dst_group());
          });
        });
      cluster_ = std::move(cluster);
      // Fail before preparing anything, naming the rank (each daemon checks again when it prepares).
      if (auto contract = checkVersions(); !contract.ok()) return failed(contract);
      // Replica sets call every daemon directly: a replica's node that is silent is cut from the
      // sync, and a silent relay would have the healthy nodes below it cut too.
      const bool direct = replica_set || req_.options().catch_up();
      peers_ = std::make_unique<PeerClient>(ctx_.peers, cluster_->addresses,
                                            direct ? 0 : static_cast<uint32_t>(ctx_.config.relay_fanout));
      return absl::OkStatus();
    }
    if (!req_.options().wait_for_ranks() || Clock::now() + std::chrono::milliseconds(100) > deadline_)
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
      }
  return members;
}

}  // namespace

Status SyncCoordinator::gatherReplicas(const ClusterView& view, const std::vector<std::string>& unreachable) {
  replicas_.clear();
  outcomes_.clear();
  const uint64_t version = version_;
  std::vector<std::string> cut;
  auto cutOut = [&](v1::ReplicaOutcome outcome, const std::string& why) {
    outcome.set_cut(why);
    cut.push_back(strCat(outcome.group(), ": ", why));
    outcomes_.push_back(std::move(outcome));
  };
  // Where each replica's ranks are now, and where they were at the last sync into the set.
  ReplicaMemory::Members now = membersOf(view, req_.dst_group(), src_group_);
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
    if (gone.empty()) continue;  // its nodes answer without it: it left
    v1::ReplicaOutcome outcome;
    outcome.set_group(group);
    outcome.set_replica(was.replica);
    if (const auto earlier = ctx_.cut.find(group); earlier != ctx_.cut.end())
      cutOut(outcome, earlier->second);  // its node failed an earlier attempt: not asked again
    else
      cutOut(outcome, strCat("node(s) ", strJoin(gone, ", "), " holding its ranks do not answer (",
                             strJoin(unreachable, "; "), ")"));
    now[group] = was;  // still a member: named again while its nodes stay silent
  }
  // Remembered once the caller's checks pass (gather): members seen now that the source's bytes
  // may reach are added, and members are forgotten only when they are registered nowhere and
  // their nodes answer (they left), whatever source this caller named.
  members_seen_ = now;
  members_left_.clear();
  const auto anyone = membersOf(view, req_.dst_group(), "");
  for (const auto& [group, was] : remembered)
    if (!anyone.count(group) && !now.count(group)) members_left_.push_back(group);

  // node -> the first replica taking part with ranks there, and its owner
  std::map<std::string, std::pair<std::string, std::optional<uint32_t>>> sharing;
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
    if (const auto earlier = ctx_.cut.find(group); earlier != ctx_.cut.end()) {
      cutOut(outcome, earlier->second);
      continue;
    }
    auto layout = view.completeGroup(group);
    if (!layout.ok()) {
      cutOut(outcome, strCat(layout.status().message(),
                             unreachable.empty() ? "" : strCat(" (", strJoin(unreachable, "; "), ")")));
      continue;
    }
    if (view.role(group) != v1::ROLE_DESTINATION) {
      cutOut(outcome, "it is registered as a source; a sync writes only destinations");
      continue;
    }
    // Before ids and layouts are compared: a replica whose owner may not receive the source (or,
    // for a local caller, that the caller may not write) neither takes part nor displaces one.
    if (Status eligible = view.mayReceive(src_group_, group); !eligible.ok()) {
      cutOut(outcome, std::string(eligible.message()));
      continue;
    }
    if (ctx_.caller_uid)
      if (Status allowed = view.maySync(*ctx_.caller_uid, src_group_, group); !allowed.ok()) {
        cutOut(outcome, std::string(allowed.message()));
        continue;
      }
    std::string refused;
    for (const auto& d : view.daemons())
      for (const auto& r : d.ranks())
        if (refused.empty() && r.group() == group) {
          std::string why = destinationRefusal(factsOf(r), version);
          // Retried without replicas an earlier attempt cut: a single-buffered replica still written
          // by that attempt (a peer it was exchanging bytes with froze mid-write) may be taken
          // over by this one, whose bytes are the same. Its daemon decides at Prepare (the rank
          // is this sync's at this version: taken; else refused, naming the replica, cut alone).
          const bool retaken = !ctx_.cut.empty() && r.written() && !r.held() && !r.double_buffered();
          if (why.empty() && r.refuses_writes() && !retaken)
            why = r.held() ? " does not accept updates (acquired by its client)"
                  : r.state() == v1::RANK_UPDATING || (r.double_buffered() && r.written())
                      ? " does not accept updates (another sync is writing it)"
                  : r.written() ? " does not accept updates (writes of a sync that ended are still landing in it)"
                                : " does not accept updates (a catch-up is reading it)";
          if (!why.empty()) refused = strCat("rank ", r.rank(), " on node \"", d.node(), "\"", why);
        }
    const auto owner = view.ownerOf(group);
    if (refused.empty())
      for (const auto& taking : replicas_)
        if (taking.id == registered.replica())
          refused = strCat("replica id ", registered.replica(), " is taken by group ", quote(taking.layout.group()),
                           view.ownerOf(taking.layout.group()) == owner
                               ? " (registered first)"
                               : " of another owner, weighed first (it owns the source, or was registered first)");
    if (refused.empty() && !replicas_.empty())
      if (Status same = planner::checkReplicaSet({replicas_.front(), {registered.replica(), *layout, {}}}); !same.ok())
        refused = std::string(same.message());
    // Replicas may share nodes (engines on one machine), if they have one owner: a shared node
    // lands each byte once in one replica's memory and copies it from there into the others',
    // and no uid's replica is written from memory another uid can change.
    for (const auto& node : now[group].nodes)
      if (const auto it = sharing.find(node); refused.empty() && it != sharing.end() && it->second.second != owner)
        refused = strCat("node \"", node, "\" holds replica ", quote(it->second.first), " of another owner (",
                         "replicas share a node only with replicas of their own owner)");
    if (!refused.empty()) {
      cutOut(outcome, refused);
      continue;
    }
    replicas_.push_back({registered.replica(), *layout, {}});
    for (const auto& node : now[group].nodes) sharing.emplace(node, std::make_pair(group, owner));
    outcomes_.push_back(std::move(outcome));
  }
  std::sort(replicas_.begin(), replicas_.end(),
            [](const planner::Replica& a, const planner::Replica& b) { return a.id < b.id; });
  std::sort(outcomes_.begin(), outcomes_.end(), [](const v1::ReplicaOutcome& a, const v1::ReplicaOutcome& b) {
    return std::make_pair(a.replica(), a.group()) < std::make_pair(b.replica(), b.group());
  });
  const size_t needed = std::max<uint32_t>(1, req_.options().min_replicas());
  if (replicas_.size() < needed)
    return absl::FailedPreconditionError(strCat("sync: replica set \"", req_.dst_group(), "\": ", replicas_.size(),
                                                " of ", outcomes_.size(), " replicas can take part, at least ", needed,
                                                " needed (", strJoin(cut, "; "), ")"));
  if (!cut.empty())
    spdlog::warn("sync {}: replica set \"{}\" syncs {} of {} replicas; cut: {}", id_, req_.dst_group(),
                 replicas_.size(), outcomes_.size(), strJoin(cut, "; "));
  return absl::OkStatus();
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
  seed_ = current_ = false;
  std::map<std::string, Held> held;
  for (const auto& d : view.daemons())
    for (const auto& r : d.ranks()) {
      const v1::Layout* l = view.layoutOf(r.group());
      if (!l || (l->replica_set() != layout->replica_set() && r.group() != src_group_)) continue;
      auto& h = held[r.group()];
      h.ready = std::min(h.ready, r.state() == v1::RANK_READY ? r.version() : 0);
      // Held by its engine is fine, and so is another catch-up reading it (all only read); written
      // by a sync, or double-buffered (the set a sync would read is not the one holding the
      // version), is not.
      h.readable = h.readable && r.state() == v1::RANK_READY && !r.double_buffered() && !r.written();
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
    current_ = true;  // caught up already (by a sync into the set, say): at its own version
    version_ = mine->second.ready;
    return absl::OkStatus();
  }
  if (!seed.empty()) {
    src_group_ = seed;
    seed_ = true;
  }  // else the source: the request's src_group, which must have published the version
  spdlog::info("sync {}: catching \"{}\" up to version {} from \"{}\"", id_, dst, version_, src_group_);
  return absl::OkStatus();
}

std::vector<std::string> SyncCoordinator::replicasOnlyOn(const std::string& node) const {
  // Once the commit began some replicas may hold the version: running the sync again would
  // misreport them (cut, "not newer"). commit() itself cuts the replicas of a node that fails it.
  if (commit_started_) return {};
  return replicasOn(node);
}

std::vector<std::string> SyncCoordinator::replicasToCut(bool* node_failed) const {
  *node_failed = refusing_replica_.empty();
  if (!refusing_replica_.empty()) return {refusing_replica_};
  return replicasOnlyOn(faulty_node_);
}

bool SyncCoordinator::isReplica(const std::string& group) const {
  for (const auto& r : replicas_)
    if (r.layout.group() == group) return true;
  return false;
}

std::vector<std::string> SyncCoordinator::replicasOn(const std::string& node) const {
  if (!cluster_ || replicas_.empty() || node.empty()) return {};
  std::set<std::string> on;
  for (const auto& d : cluster_->view.daemons()) {
    if (d.node() != node) continue;
    for (const auto& r : d.ranks()) {
      if (r.group() == src_group_) return {};
      if (writes(r.group()) && r.group() != req_.dst_group()) on.insert(r.group());
    }
  }
  return {on.begin(), on.end()};
}

bool SyncCoordinator::writes(const std::string& group) const { return group == req_.dst_group() || isReplica(group); }

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
        if (const std::string why = destinationRefusal(factsOf(r), version); !why.empty())
          return absl::FailedPreconditionError(strCat("sync: ", who(d, r), why));
  for (const auto& d : cluster_->view.daemons())
    for (const auto& r : d.ranks())
      if (r.group() == src) {
        // A catch-up's seed replica: READY at exactly the version (its daemon checks the rest).
        const std::string why = !seed_ ? sourceRefusal(factsOf(r), version)
                                : r.state() != v1::RANK_READY || r.version() != version
                                    ? strCat(" is not ready at version ", version, " (a catch-up's seed)")
                                    : std::string();
        if (!why.empty()) return absl::FailedPreconditionError(strCat("sync: ", who(d, r), why));
      }
  return absl::OkStatus();
}

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
  if (!replicas_.empty() && req_.options().delta() != v1::DELTA_OFF)
    return failed(absl::InvalidArgumentError(strCat(
        "sync: replica set \"", req_.dst_group(), "\" syncs dense: delta syncs into replica sets are not built yet")));
  const auto key = PlanKey::forSync(budget, chunk_bytes, req_.options().delta(), packed_, *strategy);
  // A repeated sync finds its plan by the kept digests (planned again only if evicted meanwhile).
  auto plan = !replicas_.empty()     ? ctx_.engine.plans().getReplicaSet(src_, replicas_, key, &plan_cached_)
              : digests_.src.empty() ? ctx_.engine.plans().get(src_, dst_, key, &plan_cached_)
                                     : ctx_.engine.plans().get(src_, dst_, digests_, key, &plan_cached_);
  if (!plan.ok()) return failed(plan.status());
  plan_ = std::move(*plan);
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
  if (repeated_ && !digests_.src.empty()) {  // the layouts by the digests each daemon planned them under
    p.mutable_src()->set_group(src_.group());
    p.mutable_dst()->set_group(dst_.group());
    p.set_src_digest(digests_.src);
    p.set_dst_digest(digests_.dst);
  } else {
    *p.mutable_src() = src_;
    *p.mutable_dst() = dst_;
  }
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
  p.set_seed(seed_);
  for (const uint64_t earlier : ctx_.earlier_fences) p.add_supersedes(earlier);
  p.set_staging_bytes(static_cast<uint64_t>(ctx_.config.staging_mib) << 20);
  p.set_chunk_bytes(static_cast<uint64_t>(ctx_.config.chunk_bytes));
  p.set_delta(delta_);
  p.set_strategy(req_.options().strategy());
  p.set_packed(packed_);
  return p;
}

void SyncCoordinator::addStamp(size_t i, v1::PrepareRequest* p) const {
  if (!repeated_) return;
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
      version_ % static_cast<uint64_t>(ctx_.config.delta_dense_every) == 0)
    delta_ = v1::DELTA_DENSE;  // the periodic refresh
  const auto prepare_started = Clock::now();
  folded_ = foldable();
  lease_keeper_ = std::make_unique<LeaseKeeper>(*this);
  const auto& daemons = cluster_->view.daemons();
  v1::PrepareRequest p = prepareRequest();
  if (folded_) {
    fold(p);
    return absl::OkStatus();
  }
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
  std::vector<v1::PrepareResponse> prepared(daemons.size());
  // The first daemon whose own failure gave the sync up: the others' calls are then cancelled,
  // or refused as given up, because of it.
  std::optional<size_t> at_fault;
  // Skipping the gather skipped its peer timeout: a daemon silent to this Prepare is found as
  // soon as the gather would have found it (then the full protocol runs, and decides).
  auto deadline = callDeadline();
  if (repeated_)
    deadline = std::min(deadline, std::chrono::system_clock::now() +
                                      std::chrono::milliseconds(std::max(ctx_.config.peer_timeout_ms, 1000)));
  const std::vector<grpc::Status> results = peers_->call<v1::PrepareRequest, v1::PrepareResponse>(
      "Prepare", deadline, [&](size_t) -> const v1::PrepareRequest& { return p; }, own, &prepared,
      [&](size_t i, const grpc::Status& st) {
        if (!st.ok() && st.error_code() != grpc::StatusCode::CANCELLED) {
          if (!at_fault) at_fault = i;
          // A daemon that did not answer in time gets no more than a moment to take the abort.
          const bool silent = st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
          giveUp(strCat("prepare failed on node \"", daemons[i].node(), "\": ", st.error_message()),
                 silent ? daemons[i].node() : std::string());  // once
        }
      },
      /*stop_at_failure=*/true);
  for (size_t i = 0; i < results.size() && !at_fault; ++i)
    if (!results[i].ok()) at_fault = i;  // the lease keeper gave it up: every call cancelled
  if (at_fault) {
    const std::string stalled = lease_keeper_->stalled();
    // Skipping the gather skipped its Describe calls: a daemon silent here is silent to the
    // peer set too (its lease runs from this call, as it would have from the gather's). One that
    // did not answer in time fails the sync as the gather would have (no second wait for it).
    if (repeated_)
      for (size_t i = 0; i < daemons.size(); ++i) {
        const grpc::StatusCode code = results[i].error_code();
        const bool silent = code == grpc::StatusCode::DEADLINE_EXCEEDED || daemons[i].node() == stalled;
        if (silent || code == grpc::StatusCode::UNAVAILABLE)
          ctx_.peers.noteSilent(cluster_->addresses[i], prepare_started);
        silent_daemon_ = silent_daemon_ || silent;
      }
    faulty_node_ = stalled.empty() ? daemons[*at_fault].node() : stalled;
    // A replica's own ranks refused: its node answered, and is healthy. Taken only for a replica
    // of this sync with ranks on the refusing node (a daemon cannot have another node's cut).
    if (stalled.empty())
      if (const std::string group = refusingGroup(results[*at_fault]); !group.empty() && isReplica(group))
        for (const auto& r : daemons[*at_fault].ranks())
          if (r.group() == group) refusing_replica_ = group;
    // A node the lease keeper found silent is named with how long it had (its own call and the
    // others' were cancelled, which says nothing).
    const Status failure =
        stalled.empty() ? fromGrpc(results[*at_fault], strCat("sync ", id_, ": prepare on node \"", faulty_node_, "\""))
                        : absl::UnavailableError(strCat("sync ", id_, ": prepare failed: node \"", stalled,
                                                        "\" stopped answering (for ", lease_keeper_->allowed(), ")"));
    giveUp(std::string(failure.message()));
    return failed(failure);
  }
  // A sync that skipped the gather relies on every daemon having checked its registrations
  // against the kept view: one that did not (an older daemon ignores PrepareRequest.expect) sends
  // the sync back to a full gather.
  if (repeated_)
    for (size_t i = 0; i < daemons.size(); ++i)
      if (!prepared[i].expect_checked()) {
        const Status stale = absl::FailedPreconditionError(strCat("sync ", id_, ": node ", quote(daemons[i].node()),
                                                                  " did not check the kept view (", kStaleView,
                                                                  ": a daemon of an older version?)"));
        giveUp(std::string(stale.message()));
        return failed(stale);
      }
  // Every daemon must execute the coordinator's plan: one that planned another (a daemon of
  // another version, say) would write where the others do not read.
  for (size_t i = 0; i < daemons.size(); ++i)
    if (prepared[i].plan_key() != plan_->key) {
      faulty_node_ = daemons[i].node();
      const Status failure = absl::FailedPreconditionError(
          strCat("sync ", id_, ": node \"", daemons[i].node(), "\" planned this sync differently (plan \"",
                 prepared[i].plan_key(), "\", not \"", plan_->key, "\"): are the daemons of one version?"));
      giveUp(std::string(failure.message()));
      return failed(failure);
    }
  // Block-scaled fp8 from source shards that cut blocks: each node's parts of the split blocks'
  // amaxes, combined; each node quantises its parts with the whole blocks' (split_amax.h).
  auto amaxes = combinedAmaxes(prepared);
  if (!amaxes.ok()) {
    giveUp(std::string(amaxes.status().message()));
    return failed(amaxes.status());
  }
  directories(prepared, *amaxes);
  prepared_ = std::move(prepared);
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
    executed_ = true;
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
    if (wave == 0 && folded_)  // the Prepare rode on this wave only
      for (auto& e : exec_) {
        e.clear_prepare();
        e.clear_plan_key();
        e.clear_self();
      }
    ctx_.progress.update(id_, [&](v1::SyncProgress& p) { p.set_waves_done(static_cast<uint32_t>(wave + 1)); });
  }
  if (const std::string node = lease_keeper_->stalled(); !node.empty()) {
    faulty_node_ = node;
    if (folded_)  // as a repeated sync's Prepare round would have found it (prepare())
      for (size_t i = 0; i < daemons.size(); ++i)
        if (daemons[i].node() == node) ctx_.peers.noteSilent(cluster_->addresses[i], start_);
    return failed(absl::UnavailableError(
        strCat("sync ", id_, " failed: node \"", node, "\" stopped answering (for ", lease_keeper_->allowed(), ")")));
  }
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
  fold_failed_ = folded_ && failed_wave == 0;
  // The node whose own failure started it, rather than the ones aborted because of it.
  for (size_t i = 0; i < results.size(); ++i)
    if (!results[i].ok() && !cancelled(results[i])) {
      spdlog::warn("sync {} failed on node \"{}\": {}", id_, daemons[i].node(), results[i].error_message());
      faulty_node_ = daemons[i].node();
      return failed(fromGrpc(results[i], strCat("sync ", id_, " failed on node \"", daemons[i].node(), "\"")));
    }
  for (size_t i = 0; i < results.size(); ++i)
    if (!results[i].ok()) {
      faulty_node_ = daemons[i].node();
      return failed(fromGrpc(results[i], strCat("sync ", id_, " failed on node \"", daemons[i].node(), "\"")));
    }
  return absl::OkStatus();
}

// Every daemon commits; one that cannot (it restarted, or its lease ran out) left its ranks
// DIRTY: the sync failed there, whatever the others committed.
Status SyncCoordinator::commit() {
  commit_started_ = true;
  // From here on the sync is the commit's: a lease that runs out meanwhile no longer gives it up
  // (its aborts would race the commits, leaving some nodes at the new version and some not). If
  // it was given up since execute() checked, nothing is committed.
  if (given_up_.exchange(true)) {
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
  f.set_executed(executed_);
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
  }
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {  // what the sync left each node's ranks at, for Watch
    for (size_t i = 0; i < results.size(); ++i)
      if (results[i].ok() && r[i].ranks_size() > 0 && static_cast<int>(i) < p.nodes_size())
        *p.mutable_nodes(static_cast<int>(i))->mutable_ranks() = r[i].ranks();
  });
  return results;
}

void SyncCoordinator::giveUp(const std::string& reason, const std::string& silent) {
  if (given_up_.exchange(true)) return;
  peers_->cancelAll();
  finishAll(false, reason, silent);
}

std::string SyncCoordinator::firstSilent() {
  const auto& daemons = cluster_->view.daemons();
  std::vector<grpc::ClientContext> contexts(daemons.size());
  std::vector<v1::ProgressResponse> r(daemons.size());
  const v1::ProgressRequest pr;  // the cheapest call: answers NOT_FOUND once the sync is gone
  const auto st =
      fanOut(contexts,
             std::chrono::system_clock::now() + std::chrono::milliseconds(std::min(ctx_.config.peer_timeout_ms, 1000)),
             [&](size_t i, grpc::ClientContext& c, CallDone done) {
               v1::Peer::NewStub(ctx_.peers.channel(cluster_->addresses[i]))
                   ->async()
                   ->Progress(&c, &pr, &r[i], std::move(done));
             });
  for (size_t i = 0; i < daemons.size(); ++i)
    if (st[i].error_code() == grpc::StatusCode::UNAVAILABLE ||
        st[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      return daemons[i].node();
  return "";
}

void SyncCoordinator::setPhase(v1::SyncPhase phase) {
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) { ProgressBoard::setPhase(p, phase); });
}

void SyncCoordinator::nodeState(size_t i, const std::string& state, const std::string& error) {
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    p.mutable_nodes(static_cast<int>(i))->set_state(state);
    if (!error.empty()) p.mutable_nodes(static_cast<int>(i))->set_error(error);
    p.set_seconds(since(start_));
  });
}

void SyncCoordinator::record(size_t i, uint64_t received, uint64_t sent) {
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    auto* n = p.mutable_nodes(static_cast<int>(i));
    const uint64_t before = n->bytes_received();  // (the total moves by what this node adds: O(1), not O(nodes))
    n->set_bytes_received(std::max(before, received));
    n->set_bytes_sent(std::max(n->bytes_sent(), sent));
    p.set_bytes_done(p.bytes_done() + (n->bytes_received() - before));
    p.set_seconds(since(start_));
  });
}

Status SyncCoordinator::failed(const Status& st) {
  if (lease_keeper_) lease_keeper_->stop();
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    ProgressBoard::setPhase(p, v1::SYNC_FAILED);
    p.set_error(std::string(st.message()));
    p.set_seconds(since(start_));
  });
  return st;
}

std::chrono::system_clock::time_point SyncCoordinator::callDeadline() const {
  return std::chrono::system_clock::now() + (deadline_ - Clock::now());
}

}  // namespace shardcast::daemon
