// The coordinator of one sync: the daemon a client asked runs it against every daemon of the
// cluster over the Peer service, one phase after another (v1::SyncPhase):
//   gathering   describe every daemon; both groups complete, roles right, the version contract
//               holds as described (each daemon checks again, atomically, when it prepares)
//   preparing   every daemon plans (cached) and allocates where transfers land on it; from here
//               the daemons hold the sync under a lease this coordinator renews (LeaseKeeper)
//   executing   the plan's waves in order, every daemon at once; the first failure aborts all
//   committing  every daemon commits its destination ranks
//   committed / failed
// A failure at any point gives the sync up on every daemon (they revert or mark ranks dirty) and
// names the node at fault. The gRPC handler only validates and translates (service.cc).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/coordinator/cluster.h"
#include "daemon/coordinator/delta_choice.h"
#include "daemon/coordinator/progress.h"
#include "daemon/coordinator/relay.h"
#include "daemon/coordinator/repeat_cache.h"
#include "daemon/engine/split_amax.h"
#include "daemon/engine/sync_counters.h"
#include "daemon/engine/sync_engine.h"
#include "daemon/registry/registry.h"
#include "daemon/server/config.h"
#include "shardcast/v1/service.grpc.pb.h"

namespace shardcast::daemon {

class LateAborts;

// The replicas each replica set had when this daemon last coordinated a sync into it, and the
// nodes their ranks were on: a replica whose node stops answering is then missing from the next
// gather, and is still named in that sync's response as cut (not taken for one that left).
class ReplicaMemory {
 public:
  struct Member {
    int32_t replica = 0;
    std::set<std::string> nodes;                   // holding its ranks
    std::map<std::string, std::string> instances;  // node -> its daemon's instance then
  };
  using Members = std::map<std::string, Member>;  // by replica group
  Members recall(const std::string& set) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = sets_.find(set);
    return it == sets_.end() ? Members{} : it->second;
  }
  // Adds (or moves) the replicas `seen` without forgetting the others: what a catch-up this
  // daemon coordinates learns of the set (a replica that joined through it is then named when
  // its node goes silent before the set's next sync).
  void learn(const std::string& set, const Members& seen) { update(set, seen, {}); }
  // learn(), and forgets the replicas that `left`: once a sync into the set named them and
  // committed (until then every attempt, and the next sync, names them again).
  void update(const std::string& set, const Members& seen, const std::vector<std::string>& left) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& members = sets_[set];
    for (const auto& group : left) members.erase(group);
    for (const auto& [group, member] : seen) members[group] = member;
  }
  void forget(const std::string& set, const std::vector<std::string>& left) { update(set, {}, left); }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Members> sets_;
};

// The Peer service of every daemon of one sync, with deadlines, and with every call in flight
// cancellable at once (when the sync is given up).
class PeerClient {
 public:
  // `fanout`: more daemons than this are called through a tree of Relays (relay.h; 0: never).
  PeerClient(const PeerSet& peers, std::vector<std::string> addresses, uint32_t fanout);

  size_t size() const { return addresses_.size(); }
  uint32_t fanout() const { return fanout_; }
  // The calls this client makes itself per phase: one per daemon, or one per subtree.
  size_t directCalls() const { return relayGroups(addresses_.size(), fanout_).size(); }
  // Calls Peer `method` ("Prepare", "Execute", "Finish") on every daemon at once, request(i) to
  // daemon i, its response into (*responses)[i], and runs then(i, status) on this thread as each
  // completes; returns every status once all have. Every call has `deadline` and is cancelled by
  // cancelAll(). `stop_at_failure`: in a tree, a relay whose subtree has a failure answers at
  // once (the sync is given up anyway).
  template <class Request, class Response>
  std::vector<grpc::Status> call(const std::string& method, std::chrono::system_clock::time_point deadline,
                                 const std::function<const Request&(size_t)>& request, std::vector<Response>* responses,
                                 const std::function<void(size_t, const grpc::Status&)>& then, bool stop_at_failure) {
    return call<Request, Response>(method, deadline, request, nullptr, responses, then, stop_at_failure);
  }
  // The same, where daemon i's request is request(i) with the fields own(i, r) sets in an empty
  // one merged in (a Prepare: the same layouts for all, each daemon's own stamp).
  template <class Request, class Response>
  std::vector<grpc::Status> call(const std::string& method, std::chrono::system_clock::time_point deadline,
                                 const std::function<const Request&(size_t)>& request,
                                 const std::function<void(size_t, Request*)>& own, std::vector<Response>* responses,
                                 const std::function<void(size_t, const grpc::Status&)>& then, bool stop_at_failure) {
    std::vector<RawCall> calls(addresses_.size());
    const auto timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::system_clock::now());
    // One request object for every daemon is serialized once, and travels once per Relay; each
    // daemon's own part travels after it (RawCall.request).
    const Request* common = calls.empty() ? nullptr : &request(0);
    for (size_t i = 1; i < calls.size() && common; ++i)
      if (&request(i) != common) common = nullptr;
    std::string common_request;
    if (common) common->SerializeToString(&common_request);
    for (size_t i = 0; i < calls.size(); ++i) {
      calls[i].address = addresses_[i];
      calls[i].timeout = timeout;
      if (!common) request(i).SerializeToString(&calls[i].request);
      if (own) {
        Request part;
        own(i, &part);
        calls[i].request += part.SerializeAsString();  // (serialized messages merge when concatenated)
      }
    }
    responses->assign(calls.size(), Response{});
    return callRaw(method, std::move(calls), std::move(common_request), stop_at_failure,
                   [&](size_t i, const RawResult& r) {
                     grpc::Status st = parseResult(r, &(*responses)[i]);
                     if (then) then(i, st);
                     return st;
                   });
  }
  // Cancels every call in flight and every later one; false when already cancelled.
  bool cancelAll() { return calls_.cancel(); }

 private:
  // callTree with this client's fanout and cancellation; `each` turns a result into its status.
  std::vector<grpc::Status> callRaw(const std::string& method, std::vector<RawCall> calls, std::string common_request,
                                    bool stop_at_failure,
                                    const std::function<grpc::Status(size_t, const RawResult&)>& each);

  const PeerSet& peers_;
  const std::vector<std::string> addresses_;
  const uint32_t fanout_;
  CallSet calls_;
};

class SyncCoordinator {
 public:
  struct Context {
    const DaemonConfig& config;
    Registry& registry;
    const PeerSet& peers;
    SyncEngine& engine;
    ProgressBoard& progress;
    ReplicaMemory& replica_sets;
    std::string self_address;  // this daemon, as the others and the coordinator reach it
    // A local caller other than root (the kernel's uid): may sync only what ClusterView::maySync
    // allows. Unset for root, remote callers of the job (certificate or token) and --insecure.
    std::optional<uint32_t> caller_uid{};
    // Replicas an earlier attempt of this sync cut (group -> why): left out of this one.
    std::map<std::string, std::string> cut{};
    // Nodes whose failure cut those replicas (node -> why): not asked again by this attempt.
    std::map<std::string, std::string> failed_nodes{};
    // Views of the last syncs (repeat_cache.h): a plain sync that repeats one skips the gather,
    // unless `full_gather` (an attempt that skipped it was refused).
    RepeatCache* repeats = nullptr;
    bool full_gather = false;
    // What DELTA_AUTO runs, from the delta and dense syncs measured so far (delta_choice.h).
    DeltaChoices* delta_choices = nullptr;
    // The fences of the earlier attempts of this Sync call (PrepareRequest.supersedes).
    std::vector<uint64_t> earlier_fences{};
    // Folds refused in a row before this attempt (RepeatView::fold_refusals), kept with its view.
    int fold_refusals = 0;
    // The Sync call is over (its client went, or the daemon is stopping): polled where the sync
    // waits (for ranks to register), which then ends CANCELLED. Unset: never.
    std::function<bool()> gone{};
    // Those of `earlier_fences` given up before they executed (PrepareRequest.supersedes_unexecuted).
    std::vector<uint64_t> earlier_unexecuted{};
    // Where the abort goes again when the node the sync was given up for did not answer it
    // (late_aborts.h). Unset: nowhere.
    LateAborts* late_aborts = nullptr;
  };
  // `id` is started on the progress board already; `fence` names this attempt (never 0).
  SyncCoordinator(Context ctx, const v1::SyncRequest& request, std::string id, uint64_t fence);
  ~SyncCoordinator();

  // Runs every phase; the response of a committed sync, or the failure naming the node at fault.
  StatusOr<v1::SyncResponse> run();
  // After a failed run: the node the failure names ("" when it names none: a refused request).
  const std::string& faultyNode() const { return faulty_node_; }
  // After a failed run: the replicas taking part whose ranks are on `node`, when no other group
  // of the sync has ranks there (a node holding source ranks or a plain destination: none).
  // Once the commit began, none (a retry would misreport the replicas that committed).
  std::vector<std::string> replicasOnlyOn(const std::string& node) const;
  // After a failed run: the replicas to sync again without. A replica whose own ranks refused the
  // Prepare (acquired, being written or read by another sync since the gather: common/refusal.h)
  // is that replica alone, its node being healthy (other replicas sharing it still take part);
  // else the replicas only on the faulty node. `node_failed`: the node failed (it is asked no
  // more in this sync), rather than one replica refusing.
  std::vector<std::string> replicasToCut(bool* node_failed) const;
  // After a failed run: it skipped the gather and failed before anything was executed (a daemon's
  // registrations changed, its ranks are not at the version, its address is gone...), or named a
  // replica set's layouts by digest to a daemon whose plan cache lost their plan: run it again
  // with a full gather and the layouts, which names the fault as it always does. Not when a daemon did not
  // answer in time: the gather would wait for it again, and fail the same way.
  // A folded attempt (its Prepare riding on wave 0) that failed in that wave without a silent
  // daemon is run again in full too: its daemons' Prepare refusals come back from that wave.
  bool retryInFull() const {
    return (route_ != Route::kGathered || fault_ == Fault::kStaleSet) && fault_ != Fault::kSilentDaemon &&
           (!executed() || fault_ == Fault::kFoldedWave);
  }
  // A replica set's Prepare named the layouts by digest and a daemon no longer cached their plan
  // (repeat_cache.h, SetMemo::stale_refusals).
  bool setLayoutsStale() const { return fault_ == Fault::kStaleSet; }
  // This attempt's Prepare named the layouts by digest (SyncResponse.layouts_by_digest).
  bool layoutsByDigest() const { return set_by_digest_ || (route_ != Route::kGathered && !digests_.src.empty()); }
  // Folds refused in a row, this attempt's included (for the attempt that runs it again in full).
  int foldRefusals() const { return fault_ == Fault::kFoldedWave ? repeat_->fold_refusals + 1 : 0; }
  // After a failed run: the seconds of each phase it finished and of the one it failed in.
  const v1::SyncResponse& figures() const { return out_; }
  // Execute calls went out: the attempt reached kExecuting (given up: it was given up there or
  // later). Its daemons' ranks then end DIRTY, not reverted (FinishRequest.executed).
  bool executed() const;

 private:
  using Clock = std::chrono::steady_clock;
  // The replicas taking part with ranks on `node`, when no other group of the sync has ranks there.
  std::vector<std::string> replicasOn(const std::string& node) const;
  class LeaseKeeper;

  Status gather();
  // One look at the cluster: OK with the cluster and both layouts adopted (or a catch-up that has
  // nothing to move); else why not, `*incomplete` set when ranks still to register could cure it
  // (SyncOptions.wait_for_ranks waits then).
  Status gatherOnce(bool* incomplete);
  // What the gather asks the peer set for: the nodes to leave out and those to give less time.
  PeerSet::Ask gatherAsk() const;
  // dst_group names both a registered group and a replica set: decides which the sync writes
  // (set_despite_group_), or refuses to guess.
  Status chooseSetOrGroup(const ClusterView& view);
  // A catch-up that found its replica at the version already: OK once the replica is whole and
  // the caller may write it.
  Status caughtUp(const ClusterView& view, const std::vector<std::string>& unreachable);
  // A sync reads only source groups (or a catch-up's seed replica) and writes only destinations.
  Status checkRoles(const ClusterView& view, bool src_found, bool dst_found) const;
  // A local caller other than root may write every group the sync writes (ClusterView::maySync).
  Status mayWrite(const ClusterView& view, bool replica_set) const;
  // The gathered cluster becomes the attempt's (a replica set's: only the daemons it reads or
  // writes), with the peer client its phases call through.
  void adopt(ClusterSnapshot snapshot, bool replica_set);
  Status plan();
  Status prepare();
  // The Prepare round: every daemon's answer into `prepared` (by the cluster's index), the first
  // daemon whose own failure gave the sync up into `at_fault`.
  std::vector<grpc::Status> prepareRound(v1::PrepareRequest p, std::vector<v1::PrepareResponse>* prepared,
                                         std::optional<size_t>* at_fault);
  // A Prepare round that failed: the node at fault (a repeated sync's silent ones noted silent to
  // the peer set), and the sync given up naming it.
  Status prepareFailed(const std::vector<grpc::Status>& results, size_t at_fault, Clock::time_point started);
  // Every daemon checked the kept view (a repeated sync) and planned the coordinator's plan.
  Status checkPrepared(const std::vector<v1::PrepareResponse>& prepared);
  // The attempt's Prepare as every daemon gets it, but for its stamp (addStamp).
  v1::PrepareRequest prepareRequest() const;
  // A repeated sync's Prepare tells daemon i the registrations the kept view holds of it (it
  // checks they are still its own). Added to daemon i's own part of the call where every daemon
  // relays call parts (O(1) per daemon), else to the request common to all (prepare()).
  void addStamp(size_t i, v1::PrepareRequest* p) const;
  // The daemons daemon i writes to in the plan (by the cluster's index; a planned node without a
  // daemon left out: its sends fail naming it).
  std::vector<size_t> writesTo(size_t i) const;
  // Node `j`'s name, transport address and daemon address into `n` (what a daemon checks before
  // connecting: PrepareRequest.peers, ExecuteRequest.nodes).
  void nodeAddress(size_t j, v1::NodeDirectory* n) const;
  // A repeated dense sync whose kept view holds its daemons' landing targets: each daemon's
  // Prepare rides on its wave 0 Execute (ExecuteRequest.prepare), no Prepare round.
  bool foldable() const;
  void fold(const v1::PrepareRequest& p);
  // Every daemon's Execute request: the landing directory of the nodes it writes to, from the
  // daemons' Prepare answers (by the cluster's index), and the split blocks' combined amaxes.
  void directories(const std::vector<v1::PrepareResponse>& prepared, const std::vector<SplitAmaxes>& amaxes);
  // The Prepare responses' amaxes of split blocks, checked and combined: per daemon, its blocks'.
  StatusOr<std::vector<SplitAmaxes>> combinedAmaxes(const std::vector<v1::PrepareResponse>& prepared);
  Status execute();
  Status commit();
  // A plain sync that committed: its view kept under `repeat_key` (repeat_cache.h), with the
  // daemons' Prepare answers (their next landings) and what its Prepare cost.
  void keepView(const std::string& repeat_key);
  // (node, instance) of every daemon of the view, in its order: what a SetMemo compares.
  std::vector<std::pair<std::string, std::string>> daemonInstances() const;
  // Runs one phase and records its seconds in out_ (the setter `seconds`), whether it succeeds.
  Status timed(Status (SyncCoordinator::*phase)(), void (v1::SyncResponse::*seconds)(double));
  // Finishes the sync on every daemon (commit or abort) at once; the per-daemon results.
  // (`silent`: the node of a daemon found silent, not waited for.)
  std::vector<grpc::Status> finishAll(bool commit, const std::string& reason, const std::string& silent = "");
  // Gives the sync up everywhere (once): calls in flight are cancelled, every daemon aborts.
  void giveUp(const std::string& reason, const std::string& silent = "");
  // Gives the sync up for `failure`, and fails the attempt with it.
  Status giveUpWith(const Status& failure);

  // The attempt's lifecycle (docs/thread_model.md, "A coordinator's attempt"). The run thread
  // moves it forward, phase by phase (a catch-up with nothing to move: from kGathering to
  // kCommitted); giveUp() (the run thread's or the lease keeper's) ends it from any step before
  // kCommitting; commit() takes it to kCommitting only if it was not given up, and from there
  // nothing gives it up (its aborts would race the commits).
  enum class Step : uint8_t { kGathering, kPlanning, kPreparing, kExecuting, kCommitting, kCommitted, kGivenUp };
  static const char* stepName(Step step);
  // The run thread's move from `from` to `to`: true when made; false when the attempt was given up
  // meanwhile (the one step another thread sets). Any other step is a bug: logged, and aborts.
  bool advance(Step from, Step to);
  // How the attempt learns the cluster and prepares its daemons (docs/architecture.md).
  enum class Route : uint8_t {
    kGathered,  // a gather describes every daemon; then a Prepare round
    kRepeated,  // a kept view (repeat_cache.h) instead of the gather; each daemon's Prepare checks it
    kFolded,    // a kept view, and each daemon's Prepare rides on its first Execute wave (fold())
  };
  // What the attempt reads (a catch-up decides it in resolveCatchUp).
  enum class Reads : uint8_t {
    kSource,   // the source group: the request's (or a catch-up with no replica to seed it)
    kSeed,     // a catch-up's seed: a replica of the set at the version (PrepareRequest.seed)
    kNothing,  // a catch-up whose replica holds the version already: nothing to move
  };
  // What a failed attempt of a kept view met, as far as running it again in full goes (retryInFull).
  enum class Fault : uint8_t {
    kOther,
    kSilentDaemon,  // a daemon did not answer its Prepare in time: a gather would wait for it too
    kFoldedWave,    // its Prepares rode on wave 0 and that wave failed, every daemon answering
    kStaleSet,      // a replica set's Prepare by digest met a daemon whose plan cache lost the plan
  };
  // The lease keeper found `node` silent: the node at fault, named with how long it had.
  Status stoppedAnswering(const std::string& node);
  // The node of the first daemon that does not answer a quick call ("" when all answer).
  std::string firstSilent();
  // The version contract as the daemons described it.
  Status checkVersions() const;
  // dst_group names a replica set: every replica registered now either takes part (replicas_) or
  // is cut (outcomes_ says why: incomplete, on a node that does not answer, refusing the version,
  // or not a replica like the others). Fails when fewer than SyncOptions.min_replicas take part.
  Status gatherReplicas(const ClusterView& view, const std::vector<std::string>& unreachable);
  // The set's members: those registered now that the source's bytes may reach, and remembered ones
  // whose nodes do not answer (cut, into `cut`); notes them for the replica-set memory. Remembered
  // ones registered nowhere any more, whose nodes answer, left: named once in `left` (not cut).
  ReplicaMemory::Members membersNow(const ClusterView& view, const std::vector<std::string>& unreachable,
                                    std::vector<std::string>* cut, std::vector<v1::ReplicaOutcome>* left);
  // A replica that does not take part: its outcome says why, and `cut` lists it.
  void cutOut(v1::ReplicaOutcome outcome, const std::string& why, std::vector<std::string>* cut);
  // node -> the first replica taking part with ranks there, and its owner.
  using Sharing = std::map<std::string, std::pair<std::string, std::optional<uint32_t>>>;
  // Why `group` (its complete layout, or why it is not, and its nodes) cannot take part: cut by an
  // earlier attempt, incomplete, a source, not the source's owner's to receive, refusing the
  // version, its id taken, unlike the replicas taking part, or on another owner's node ("": it can).
  std::string replicaRefusal(const ClusterView& view, const std::string& group, const StatusOr<v1::Layout>& layout,
                             const std::set<std::string>& nodes, const Sharing& sharing,
                             const std::vector<std::string>& unreachable) const;
  // `group` is written by this sync: the destination group, or a replica taking part.
  bool writes(const std::string& group) const;
  bool isReplica(const std::string& group) const;  // a replica of the set taking part
  // A catch-up (SyncOptions.catch_up): resolves the version (the newest a complete replica of
  // dst_group's set holds, or the one asked for) and the seed: such a replica that nothing
  // writes, else the source; reads nothing when dst_group holds that version or newer already.
  Status resolveCatchUp(const ClusterView& view);
  // A catch-up that may run: the coordinator remembers the replicas of its set it sees (those
  // whose owner may receive the source), so one that joined this way is named when it goes silent.
  void learnSet(const ClusterView& view);

  void setPhase(v1::SyncPhase phase);
  void nodeState(size_t i, const std::string& state, const std::string& error = "");
  void record(size_t i, uint64_t received, uint64_t sent);
  Status failed(const Status& st);
  std::chrono::system_clock::time_point callDeadline() const;
  double since(Clock::time_point t) const { return std::chrono::duration<double>(Clock::now() - t).count(); }

  Context ctx_;
  const v1::SyncRequest& req_;
  // The group read and the version synced: the request's, or a catch-up's seed and the version
  // it resolved (SyncOptions.catch_up).
  std::string src_group_;
  // The sync writes the set although a group of its name is registered (one the source's bytes
  // may not reach: another uid's squatting the name).
  bool set_despite_group_ = false;
  // gatherReplicas: the set's members it saw (that the source's bytes may reach) and the
  // remembered ones that left, for the coordinator's memory once the caller's checks pass.
  ReplicaMemory::Members members_seen_;
  std::vector<std::string> members_left_;
  uint64_t version_ = 0;
  Reads reads_ = Reads::kSource;
  std::atomic<Step> step_{Step::kGathering};
  std::atomic<Step> given_up_in_{Step::kGivenUp};  // the step giveUp() ended the attempt in (set once, by it)
  const std::string id_;
  std::string faulty_node_;
  std::string refusing_replica_;  // a replica whose own ranks refused the Prepare on faulty_node_
  const uint64_t fence_;
  // The attempt's write key (PrepareRequest.write_key): handed to its daemons only in Prepare.
  const transport::WriteKey key_ = transport::WriteKey::random();
  const Clock::time_point start_ = Clock::now();
  Clock::time_point deadline_;
  uint32_t timeout_ms_ = 0;
  std::chrono::milliseconds lease_;

  std::shared_ptr<const ClusterSnapshot> cluster_;  // shared with the repeat cache
  Route route_ = Route::kGathered;
  // A replica set's Prepare names the layouts by digest (repeat_cache.h, SetMemo): a daemon's
  // refusal as a stale view runs the sync again with them (retryInFull).
  bool set_by_digest_ = false;
  mutable std::vector<int64_t> daemon_at_;  // writesTo: plan node -> daemon of cluster_ (-1: none)
  Fault fault_ = Fault::kOther;
  std::shared_ptr<const RepeatView> repeat_;   // the kept view a repeated sync runs on
  std::vector<v1::PrepareResponse> prepared_;  // the daemons' Prepare answers (for the kept view)
  v1::Layout src_, dst_;                       // a replica set: dst_ names it (group) and replicas_ are its members
  LayoutDigests digests_;                      // of src_ and dst_, kept with a repeated sync's view ("" until computed)
  std::vector<planner::Replica> replicas_;
  std::vector<v1::ReplicaOutcome> outcomes_;  // every replica of the set: taking part, or cut
  std::shared_ptr<const CachedPlan> plan_;
  bool plan_cached_ = false;
  bool packed_ = false;  // planned without zero-copy: some daemon stages device memory
  std::unique_ptr<PeerClient> peers_;
  std::unique_ptr<LeaseKeeper> lease_keeper_;
  // Per daemon (same index as the cluster's): its Execute request, with the landing directory
  // of the nodes it writes to or encodes for only (planner::Schedule::NodeSchedule::peers).
  std::vector<v1::ExecuteRequest> exec_;
  AtomicSyncCounters moved_;             // every daemon's waves, as their Execute responses report them
  uint64_t wire_bytes_ = 0;              // every node's bytes sent, once every wave is done
  v1::DeltaMode delta_ = v1::DELTA_OFF;  // the mode it runs in (a periodic refresh: DELTA_DENSE)
  std::string delta_choice_;             // asked DELTA_AUTO, runs DELTA_DENSE: why
  v1::SyncResponse out_;
};

}  // namespace shardcast::daemon
