// The other daemons: found from a static list or a DNS name (a Kubernetes headless Service), asked
// over the Peer service what they hold; and the cluster-wide view of groups built from that.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/grpc_status.h"
#include "common/status.h"
#include "daemon/server/config.h"
#include "shardcast/v1/service.grpc.pb.h"

namespace shardcast::daemon {

// The one way a daemon calls other daemons (Describe, Prepare, Execute, Progress, Finish): one
// call per context, all at once through gRPC's callback API (no thread and no completion queue per
// call; PeerClient adds cancelling a sync's calls at once): start(i, contexts[i], done) issues call i with `done` as
// its completion, after the context's deadline is set. `each(i, status)` (optional) runs on the calling thread as each
// call completes, never on gRPC's threads, so it may block (give a sync up, cancel the other
// contexts). Returns every call's status once all have completed; a call ends by its deadline, so
// this does too. The contexts are the caller's, for cancelling calls in flight. `cancel_when`
// (optional) is asked on the calling thread after each completion and every 20 ms: once it says
// true, every call still in flight is cancelled (a relay whose caller went away, a failure that
// gives the rest up).
using CallDone = std::function<void(grpc::Status)>;
std::vector<grpc::Status> fanOut(std::vector<grpc::ClientContext>& contexts,
                                 std::chrono::system_clock::time_point deadline,
                                 const std::function<void(size_t, grpc::ClientContext&, CallDone)>& start,
                                 const std::function<void(size_t, const grpc::Status&)>& each = nullptr,
                                 const std::function<bool()>& cancel_when = nullptr);

// Calls in flight that one cancel() ends at once: a sync's calls when it is given up
// (PeerClient), the lease keeper's polls when it stops. track() is TreeOptions::track: a call
// added after cancel() is cancelled as it starts. Thread-safe.
class CallSet {
 public:
  void track(grpc::ClientContext& context, bool add);
  // False when cancelled before (nothing more to do).
  bool cancel();

 private:
  std::mutex mu_;
  bool cancelled_ = false;
  std::set<grpc::ClientContext*> calls_;
};

// A gather's layouts by group and digest (planner::layoutDigest), shared by the views holding
// them. Keyed by both: a layout whose digest equals another group's (digests are not collision
// resistant: docs/security.md) stays apart from it.
using LayoutKey = std::pair<std::string, std::string>;  // group, digest
struct GatheredLayouts {
  std::map<LayoutKey, std::shared_ptr<const v1::Layout>> found;
  // Named by some daemon, but sent by none of those naming it: why (the group fails its syncs).
  std::map<LayoutKey, std::string> missing;
};

class PeerSet {
 public:
  // `instance`: this daemon's (DescribeResponse.instance), to tell itself from a daemon that
  // claims the same node name.
  PeerSet(const DaemonConfig& config, std::string instance);

  // Peer addresses (host:port), sorted; for --peer-dns resolved anew on each call.
  StatusOr<std::vector<std::string>> addresses() const;
  // `address` is one of the cluster's daemons (as the last addresses() found them; looked up again
  // at most once a second when it is not).
  bool isPeer(const std::string& address) const;

  struct PeerView {
    std::string address;
    StatusOr<v1::DescribeResponse> described;
    // Silent past its lease (DaemonConfig::peer_lease_ms): a gather goes on without it.
    bool forgotten = false;
  };
  // How a gather asks the peers known to be certain nodes (by node name).
  struct Ask {
    std::map<std::string, std::string> skip;                   // not asked: unreachable, saying why
    std::map<std::string, std::chrono::milliseconds> briefly;  // asked with this deadline instead
  };
  // Describe of every peer other than this node, each within the peer timeout (or as `ask` says),
  // as `request` asks (DescribeRequest.syncs, layout_digests; not `layouts`: fetchLayouts).
  StatusOr<std::vector<PeerView>> describeAll(const v1::DescribeRequest& request = {}, const Ask& ask = {}) const;
  // The layouts a gather's daemons name (DescribeResponse.layouts whole, or layout_digests): `self`
  // first (this daemon, its layouts whole), then `peers` (what describeAll answered). A layout
  // named by digest is taken from the last gather's (kept until a gather names it no more), or
  // fetched once, from the first daemon in that order naming it (DescribeRequest.layouts, all
  // such daemons at once), then from the next while one does not send it. A fetched layout is
  // taken only with the group and digest it was named by (its digest computed again). One that no
  // daemon naming it sends (its registrations changed since it answered, it stopped answering, or
  // it sent another) is `missing`, saying why.
  GatheredLayouts layoutsOf(const v1::DescribeResponse& self, const std::vector<PeerView>& peers) const;
  // The peers of the last addresses() that have described themselves, by node: reachable when
  // their channel is connected, or connecting or idle and the last Describe of them answered.
  // Sends no call (a scrape must stay cheap): a channel not connected is only nudged to connect,
  // and counts by its state at the next call. The addresses are looked up again when the last
  // lookup is older than 30 s: a peer gone from --peer-dns drops out.
  std::map<std::string, bool> reachability() const;
  // The peers reached so far: address -> the node each described itself as.
  std::map<std::string, std::string> knownNodes() const;
  // A node's transport address as a coordinator hands it out (v1::NodeDirectory): `transport`,
  // said to be `node`'s, and `address`, that node's daemon as the coordinator reached it (where to
  // ask it; "" when not given).
  struct NodeAddress {
    std::string node, transport, address;
  };
  // OK when each `transport` is the transport address its node gave in its own Describe to this
  // daemon (over mutual TLS): this daemon connects to no transport address a third party hands it
  // (docs/security.md). Nodes not known yet, or known with another address (a restarted peer),
  // are asked all at once, at `address` when that is one of the cluster's peers, else where they
  // were reached before, else the peers not described yet; and asked again, until `deadline`,
  // while one has not answered: a peer that is merely slow is waited for, never taken for one
  // describing another address. INVALID_ARGUMENT as soon as a node answers with another address;
  // UNAVAILABLE naming the nodes still silent at `deadline`. Each address is asked at most once per
  // kAskEvery, whoever asks (a coordinator naming nodes cannot make this daemon flood the cluster).
  // `cancelled` (optional): the call asking has ended; checked between rounds (CANCELLED).
  // The wait ends at `deadline` or after 4 peer timeouts (--peer-timeout-ms), whichever is first.
  Status checkTransportAddresses(const std::vector<NodeAddress>& nodes, std::chrono::steady_clock::time_point deadline,
                                 const std::function<bool()>& cancelled = nullptr) const;
  static constexpr std::chrono::milliseconds kAskEvery{250};
  // A cached channel to a daemon (a peer, or this daemon itself).
  std::shared_ptr<grpc::Channel> channel(const std::string& address) const;
  // A call other than Describe to `address`, made at `asked`, got no answer (a sync that skipped
  // the gather): its lease runs from then, as after a Describe that got none.
  void noteSilent(const std::string& address, std::chrono::steady_clock::time_point asked) const;
  // Forgets every peer's silence so far: the Describes a starting daemon sends (to find another
  // daemon serving its node) reach peers that are starting too, and their silence then must not
  // run toward their lease (a peer forgotten gets 100 ms at a gather: 64 daemons starting on a
  // loaded machine took over --peer-lease-ms, and a first gather left out peers that answered).
  void forgetSilence() const;

 private:
  // Silent past its lease (mu_ held).
  bool forgottenLocked(const std::string& address, std::chrono::steady_clock::time_point now) const;
  // Describe of each of `addrs` at once; remembers which node and transport address each gave.
  // `until`: no call's deadline after it.
  std::vector<grpc::Status> describe(
      const std::vector<std::string>& addrs, std::vector<v1::DescribeResponse>* responses,
      const v1::DescribeRequest& request = {}, const std::map<std::string, std::chrono::milliseconds>& briefly = {},
      std::chrono::steady_clock::time_point until = std::chrono::steady_clock::time_point::max()) const;
  // layoutsOf(): one round of fetches, `wanted[i]` the layouts asked of `addrs[i]`; each layout
  // sent with a group and digest asked of its sender lands in `found` (mu_ not held).
  void fetchLayouts(const std::vector<std::string>& addrs, const std::vector<std::set<LayoutKey>>& wanted,
                    std::chrono::system_clock::time_point deadline,
                    std::map<LayoutKey, std::shared_ptr<const v1::Layout>>* found) const;
  // describe(): each call's deadline (100 ms for a peer silent past its lease, `briefly` for its
  // node, none after `until`), and which peers were forgotten when `asked` (mu_ not held).
  std::vector<std::chrono::milliseconds> describeDeadlines(
      const std::vector<std::string>& addrs, const std::map<std::string, std::chrono::milliseconds>& briefly,
      std::chrono::steady_clock::time_point until, std::chrono::steady_clock::time_point asked,
      std::vector<bool>* forgotten) const;
  // describe(): who answered (and who is silent since `asked`, or forgotten past its lease), and
  // the peers the answers name (mu_ not held).
  void noteAnswers(const std::vector<std::string>& addrs, const std::vector<v1::DescribeResponse>& responses,
                   const std::vector<grpc::Status>& statuses, const std::vector<bool>& forgotten,
                   std::chrono::steady_clock::time_point asked) const;
  // checkTransportAddresses: where to ask next for the nodes of `pending` (mu_ not held), marked as
  // being asked (asking_) until the caller's round is over. A node known nowhere is looked for
  // among every peer once per check, not every round: the first time (`first`), and then only at
  // the addresses that look left out (`left`: another check's round was asking them).
  struct Everywhere {
    bool first = true;
    std::set<std::string> left;
  };
  std::vector<std::string> whereToAsk(const std::vector<const NodeAddress*>& pending, Everywhere* everywhere) const;

  DaemonConfig config_;
  std::string instance_;
  mutable std::mutex mu_;
  mutable std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;
  mutable std::map<std::string, std::string> nodes_;  // address -> node it last described itself as
  mutable std::map<std::string, bool> answered_;      // address -> its last Describe succeeded
  mutable std::map<std::string, std::chrono::steady_clock::time_point> silent_since_;  // address -> first failure
  mutable std::vector<std::string> current_;                                           // the last addresses() found
  mutable std::chrono::steady_clock::time_point current_at_{};                         // and when
  mutable std::map<std::string, std::string> transports_;  // node -> the transport address it described
  mutable std::map<std::string, std::chrono::steady_clock::time_point> looked_up_;  // address -> asked then
  mutable std::set<std::string> asking_;  // addresses a checkTransportAddresses round is asking now
  mutable std::map<LayoutKey, std::shared_ptr<const v1::Layout>> layouts_;  // the last gather's (layoutsOf)
};

// Groups as registered across the cluster.
class ClusterView {
 public:
  // From this daemon's own description and its peers'. Unreachable peers make the view fail; or,
  // given `unreachable`, are left out of it and each described there ("peer daemon A (node "N")
  // is unreachable: why").
  // `layouts`: those named by digest (DescribeResponse.layout_digests; PeerSet::layoutsOf), and
  // any of those sent whole; a group whose layout is missing fails its syncs, saying why.
  static StatusOr<ClusterView> build(const v1::DescribeResponse& self, std::vector<PeerSet::PeerView> peers,
                                     const GatheredLayouts& layouts, std::vector<std::string>* unreachable = nullptr);

  // The layout of `group` when every rank of it is registered somewhere, consistently (problem()
  // is ""); FAILED_PRECONDITION naming the missing ranks, an unknown group, or its problem otherwise.
  StatusOr<v1::Layout> completeGroup(const std::string& group) const;
  // What makes `group` unusable, "" when nothing does: ranks of another uid than its owner (its
  // first registration cluster-wide), two layouts, two roles, a rank registered on two nodes. It
  // fails the syncs that read or write `group`; the rest of the view is unaffected.
  std::string problem(const std::string& group) const;
  // When `group` got its owner (the owner's earliest GroupAccess.since_unix_ms; 0: not known).
  uint64_t registeredSince(const std::string& group) const;
  const std::vector<v1::DescribeResponse>& daemons() const { return daemons_; }
  // Leaves daemons()[i] out where !keep[i] (groups and their layouts stay as they were built).
  void keepDaemons(const std::vector<bool>& keep);
  // The role `group` registered with (ROLE_UNSPECIFIED for an unknown group).
  v1::Role role(const std::string& group) const;
  // The groups registered as replicas of set `set` (Layout.replica_set), by replica id; empty
  // when `set` is no replica set's name, or a group of that name is registered (unless
  // `despite_group`: the sync found that group is not one the source's bytes may reach).
  std::vector<std::string> replicasOf(const std::string& set, bool despite_group = false) const;
  // The layout `group` registered with, complete or not (null for an unknown group).
  const v1::Layout* layoutOf(const std::string& group) const;
  // May a local caller of `uid` (not root) sync `src` into `dst`? Only the owner of `dst` on every
  // node that holds part of it, reading a `src` that is its own on every node or whose owner there
  // granted it (RegisterRequest.readers). PERMISSION_DENIED naming the group, node and owner.
  Status maySync(uint32_t uid, const std::string& src, const std::string& dst) const;
  // The uid owning `group` cluster-wide: whose registration of it came first, on any node (a name
  // reserved after a restart included); nullopt when no node names an owner. problem() names any
  // other uid's ranks of it.
  std::optional<uint32_t> ownerOf(const std::string& group) const;
  // May `group`'s owner receive `src`'s bytes, whoever asks for the sync? Its owner is one uid on
  // every node holding it, and owns `src` or was granted it there (what maySync checks for a
  // caller). A replica of a set or a catch-up's seed that fails this does not take part: the bytes
  // of a trainer reach only the uids it granted, and a replica's bytes came from a source its
  // owner may read.
  Status mayReceive(const std::string& src, const std::string& group) const;
  // Whether a group's layout names `set` as its replica set.
  bool namedAsSet(const std::string& set) const;
  // Why each layout some daemon named could not be gathered (GatheredLayouts::missing): those
  // groups fail their syncs, and which replica set such a group is a replica of is not known.
  const std::vector<std::string>& missingLayouts() const { return missing_layouts_; }

 private:
  struct GroupInfo {
    std::shared_ptr<const v1::Layout> layout;  // the first node's, when two differ (null: none named)
    std::string digest;
    const v1::Layout& get() const;  // the layout (an empty one when none was named)
    std::set<int32_t> ranks;
    v1::Role role = v1::ROLE_UNSPECIFIED;
    std::string problem;   // the first inconsistency found (problem())
    std::string conflict;  // another uid's ranks (named before any other problem)
    void fail(std::string why) {
      if (problem.empty()) problem = std::move(why);
    }
  };
  // With groups_ and access_ built: each group's owner, and the conflicts of other uids' ranks.
  void findOwners();
  std::vector<v1::DescribeResponse> daemons_;
  std::map<std::string, GroupInfo> groups_;
  // Per group: each node's owner and read grants (DescribeResponse.access).
  using Claim = std::pair<std::string, v1::GroupAccess>;
  std::map<std::string, std::vector<Claim>> access_;
  struct Owner {
    uint32_t uid = 0;
    uint64_t since_unix_ms = 0;
  };
  std::map<std::string, Owner> owners_;  // per group: its owner cluster-wide (ownerOf)
  std::vector<std::string> missing_layouts_;
};

// The cluster as one gather saw it: the view, and each daemon's address (addresses[i] reaches
// view.daemons()[i]; this daemon first, at `self_address`).
struct ClusterSnapshot {
  ClusterView view;
  std::vector<std::string> addresses;
  // Only the daemons for which `keep(daemon)` holds, and this one (the first), take part.
  template <typename Keep>
  void keepOnly(Keep&& keep) {
    std::vector<bool> kept;
    std::vector<std::string> addrs;
    for (size_t i = 0; i < view.daemons().size(); ++i) {
      kept.push_back(i == 0 || keep(view.daemons()[i]));
      if (kept.back()) addrs.push_back(addresses[i]);
    }
    view.keepDaemons(kept);
    addresses = std::move(addrs);
  }
};
// `unreachable`: as in ClusterView::build; `ask`: as in PeerSet::describeAll.
StatusOr<ClusterSnapshot> snapshotCluster(const PeerSet& peers, const v1::DescribeResponse& self,
                                          const std::string& self_address,
                                          std::vector<std::string>* unreachable = nullptr,
                                          const PeerSet::Ask& ask = {});

// "0-2, 5, 7-9"
std::string rankRanges(const std::vector<int32_t>& ranks);

}  // namespace shardcast::daemon
