// One attempt of a sync as this daemon holds it, from its Prepare to its end, and the table of the
// attempts a daemon holds. An attempt is a state machine of six phases; every transition is a
// method here, checked against one table (SyncAttempt::moveTo), and docs/thread_model.md says
// which thread calls which:
//
//   preparing --publish--> prepared --beginExecute--> executing
//       |                   |    ^                        |
//       |                   |    +-----endExecute---------+
//       |                   +------beginClose-------------+--> closing --> draining --> closed
//       +--abandon-----------------------------------------------^  |  ------endClose------^
//                                                                   +--------endClose------^
//
// A close may begin while an execute still runs (an abort, an expired lease): the attempt is then
// closing, its writes stop, and closing waits (quiesce) until that execute has returned.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/engine/delta.h"
#include "daemon/engine/notification.h"
#include "daemon/engine/plan_cache.h"
#include "daemon/engine/split_amax.h"
#include "daemon/engine/sync_counters.h"
#include "daemon/registry/registry.h"
#include "daemon/stage/convert.h"
#include "shardcast/v1/service.pb.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// The writes of one attempt to its peers, by destination node: those waiting for room in the
// node's window, the bytes in flight, and how many writes and notifications are started or queued
// and not completed. No lock of its own: its attempt's mutex guards it.
class Outbox {
 public:
  // A chunk's write, and the word announcing it to the target once the write is visible there.
  struct Write {
    transport::WriteOp op;
    LandedChunk landed;
  };
  // How much may start at once toward one node.
  struct Limits {
    uint64_t window_bytes = 0;  // bytes in flight (at least one write, whatever its size)
    uint64_t batch_bytes = 0;   // bytes started together (at least one write)
    size_t max_batch = 0;       // writes started together
  };

  // Queues `w` toward `node` over `endpoint` (the write and its notification pending from here).
  void queue(int32_t node, std::shared_ptr<transport::Endpoint> endpoint, Write w);
  // The writes queued toward `node` that may start now (moved out, their bytes in flight), and the
  // endpoint to start them on. Nothing while a batch would overflow the window.
  std::vector<Write> take(int32_t node, const Limits& limits, std::shared_ptr<transport::Endpoint>* endpoint);
  // `ops` writes or notifications toward `node` completed, freeing `bytes` of its window.
  void completed(int32_t node, uint64_t bytes, int64_t ops);
  // Drops every write not started yet (they will never complete).
  void dropQueued();
  int64_t pending() const { return pending_; }

 private:
  struct Node {
    std::shared_ptr<transport::Endpoint> endpoint;
    std::deque<Write> queued;
    uint64_t bytes_in_flight = 0;
  };
  std::map<int32_t, Node> nodes_;
  int64_t pending_ = 0;
};

class SyncAttempt : public std::enable_shared_from_this<SyncAttempt> {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kPreparing, kPrepared, kExecuting, kClosing, kDraining, kClosed };
  static std::string_view name(Phase p);

  // What the attempt is. Set by the preparing thread before publish(), read-only afterwards: read
  // by every thread without a lock.
  std::string id;
  std::string src_group;
  std::string dst_group;  // a group, or a replica set's name (then dst_members are its groups)
  // dst_group a replica set (PrepareRequest.replicas): the replicas' groups in the order they are
  // stacked, each of member_world ranks: rank k x W + r of the set is rank r of dst_members[k].
  std::vector<std::string> dst_members;
  int32_t member_world = 0;
  uint64_t version = 0;
  uint64_t generation = 0;  // the registry's when prepared (PrepareRequest.expect)
  // Registry::stamps of the groups it reads and writes (`stamped`: the source, then the
  // destination or each replica's group) as its Prepare began: their registrations may not change
  // under the sync.
  std::vector<std::string> stamped;
  std::vector<uint64_t> stamps;
  uint64_t fence = 0;       // names the attempt (PrepareRequest.fence); not a secret
  transport::WriteKey key;  // WriteOp::key of this sync's writes, open here from prepare to close
  bool key_open = false;    // this attempt opened it (and so closes it)
  std::shared_ptr<const CachedPlan> plan;
  int32_t self = -1;  // this node's id in the plan, -1 when it takes no part
  // Block-scaled fp8: this node's source ranks' parts of the blocks source shards split
  // (daemon/engine/split_amax.h), what the coordinator's combined amaxes are checked against.
  SplitAmaxes own_amax;
  uint64_t window_bytes = 0;
  // Delta syncs (daemon/engine/delta.h): the mode; what this node's destination ranks held when the sync
  // took them (a delta may land here only on that base); the bases of the chunks this node packs
  // (null: none kept, every chunk it packs dense).
  v1::DeltaMode delta = v1::DELTA_OFF;
  bool tree_hash = false;  // delta chunks checked by tree hash (PrepareRequest.delta_tree_hash)
  Registry::Base base;
  std::shared_ptr<DeltaBases::Plan> bases;
  // Where transfers land here (not directly); moved out only by takeMemory().
  std::shared_ptr<transport::MemoryRegion> arena;
  // The coordinator's lease: renewed by every call about this sync; when it runs out the reaper
  // aborts the sync here.
  std::chrono::milliseconds lease{10000};

  // What it moved here over all waves, read by progress() while an execute runs.
  AtomicSyncCounters moved;

  // The group and rank registered for rank `rank` of the destination the plan executes.
  std::pair<std::string, int32_t> dstRank(int32_t rank) const {
    if (dst_members.empty()) return {dst_group, rank};
    return {dst_members[static_cast<size_t>(rank / member_world)], rank % member_world};
  }
  // The groups the sync writes: the replicas of a set, or dst_group.
  std::vector<std::string> dstGroups() const {
    return dst_members.empty() ? std::vector<std::string>{dst_group} : dst_members;
  }

  void renew() { lease_until_ = (Clock::now() + lease).time_since_epoch().count(); }
  bool expired(Clock::time_point now) const { return now.time_since_epoch().count() > lease_until_; }
  Phase phase() const;

  // ---- Transitions (docs/thread_model.md: who calls which) ----
  // preparing -> prepared (AttemptTable::publish, under the table's lock).
  void publish();
  // preparing -> closed: a Prepare that failed after the attempt entered the table.
  void abandon();
  // prepared -> executing: one execute at a time; refused once the attempt failed or closes.
  Status beginExecute(const std::string& node);
  // executing -> prepared; wave `wave` counts as done here when `ok`. While closing, the execute
  // is only counted out (closing waits for it).
  void endExecute(int32_t wave, bool ok);
  // prepared|executing -> closing: no write starts any more (queued ones are dropped) and no
  // chunk is processed. Returns the end this node can honour: a commit becomes kDirty when a write
  // failed or a wave or chunk planned here is missing (the coordinator's word alone commits
  // nothing); the reason is kept as the failure.
  Registry::SyncEnd beginClose(Registry::SyncEnd end, const std::string& node, const std::string& reason);
  // closing: waits until every write this node started completed or failed and every execute
  // returned; false if that takes longer than `timeout`.
  bool quiesce(std::chrono::milliseconds timeout);
  // What quiesce waits for, now: no write this node started is pending and no execute runs.
  bool quiet() const;
  // closing -> draining: peers' writes into this node were still landing when it ended, or its own
  // writes or executes were still running (`reading`: those may still read its source's ranks).
  void drain(bool reading);
  // draining: it ended with its own work still running, which may still read its source's ranks.
  bool drainsReading() const;
  // closing|draining -> closed.
  void endClose();

  // ---- While prepared or executing ----
  // OK while the sync may still touch its ranks' memory (not failed, not closing).
  Status usable() const;
  // Records the first failure (later ones are dropped) and wakes every waiter.
  void fail(Status st);
  Status failure() const;
  // Chunks a peer's notification announced (the transport's progress thread; never blocks).
  void announce(const std::vector<LandedChunk>& chunks);
  // The next announced chunk, waiting until `deadline`: kDone once `all_processed` and every
  // write of this node completed, kTimedOut at the deadline; the failure if the attempt failed.
  struct Next {
    enum Kind { kChunk, kDone, kTimedOut } kind = kDone;
    LandedChunk chunk{};
  };
  StatusOr<Next> nextLanded(Clock::time_point deadline, bool all_processed);
  // Chunk `chunk` of transfer `transfer` lands here for the first time: false for a repeat.
  bool landOnce(int32_t transfer, int32_t chunk);
  // Keeps rank memory this attempt sends from or lands in directly mapped until it is gone.
  void pin(std::shared_ptr<void> keep_alive);
  // Where this node packs the transfers it heads (null until its first execute needs it).
  std::shared_ptr<transport::MemoryRegion> staging() const;
  void setStaging(std::shared_ptr<transport::MemoryRegion> staging);
  // Queues chunk write `w` to `node` over `endpoint` and starts what fits in that node's window.
  Status send(int32_t node, std::shared_ptr<transport::Endpoint> endpoint, Outbox::Write w);
  // ---- A folded attempt (ExecuteRequest.prepare): no daemon waited for the others' Prepare ----
  // From here on a write to a node starts only once that node said it has this attempt open (its
  // readiness word); this node says so now to every node of `peers` (those it writes to and those
  // writing to it, by plan index) and answers their words. The executing thread.
  void gateWrites(std::map<int32_t, std::shared_ptr<transport::Endpoint>> peers);
  // Node `node` has this attempt open (its readiness word, the progress thread): its queued writes
  // start, and a word that is not itself an answer is answered.
  void peerReady(int32_t node, bool answer);
  // Tells `node` again, over `endpoint` (a word lost with a connection that broke; the executing
  // thread, while unready() names it).
  void sayReadyAgain(int32_t node, std::shared_ptr<transport::Endpoint> endpoint);
  // The nodes of gateWrites' `peers` that have not said they have the attempt open (errors).
  std::vector<int32_t> unready() const;
  // Block-scaled fp8: the block amaxes of a weight (`weight`: its name, shape and block; `blocks` of
  // them) read on this node during this attempt, shared by the packs of its values and of its
  // scale tensor (each block read once). Null past a budget (kAmaxSlotsKept): read again then.
  BlockAmaxes* blockAmaxes(const std::string& weight, size_t blocks);

  // ---- While closing ----
  // An execute still running (one that outlived quiesce's wait).
  bool executing() const;
  // The arena and the staging region, once nothing of this attempt can touch them any more
  // (no write pending, no execute running); nulls otherwise.
  std::pair<std::shared_ptr<transport::MemoryRegion>, std::shared_ptr<transport::MemoryRegion>> takeMemory();

  // Writes and notifications started or queued and not completed (tests, logs).
  int64_t writesPending() const;

 private:
  // The one place a phase changes: a transition the diagram above does not have is a bug, and
  // aborts the daemon naming it. Under mu_.
  void moveTo(Phase to);
  // Why this node cannot commit ("" when it can): the waves it did not execute, the chunks
  // planned to land here that did not. Under mu_.
  std::string missing() const;
  // Starts the writes queued for `node` that fit in its window (see sync_attempt.cc).
  void startWrites(int32_t node);
  // This node's readiness word (or its answer) to a peer, over `endpoint`.
  void sayReady(const std::shared_ptr<transport::Endpoint>& endpoint, bool answer) const;
  // quiet(), under mu_.
  bool quietLocked() const;

  std::atomic<int64_t> lease_until_{0};  // steady-clock nanoseconds
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<Phase> phase_{Phase::kPreparing};  // written under mu_, read without it
  int executes_ = 0;                             // execute() calls running (at most one, but one may outlive a close)
  bool drains_reading_ = false;                  // drain(reading)
  Status failure_;                               // set by a failure or by the close
  std::deque<LandedChunk> landed_;               // announced by peers, not processed yet
  // Chunks processed here (transfer, chunk): each lands on a node once; a repeat is refused.
  std::set<std::pair<int32_t, int32_t>> seen_;
  // Waves whose execute finished here without error. A commit here needs every wave and every
  // chunk the schedule lands on this node (missing()).
  std::set<int32_t> waves_done_;
  // Rank buffers sent from directly or landed in directly: kept mapped until the sync is gone.
  std::vector<std::shared_ptr<void>> pinned_;
  std::shared_ptr<transport::MemoryRegion> staging_;
  Outbox outbox_;
  // A folded attempt: writes wait for their node's readiness word (gateWrites, peerReady).
  bool gated_ = false;
  std::map<int32_t, std::shared_ptr<transport::Endpoint>> handshake_;  // the nodes told, by plan index
  std::set<int32_t> ready_;                                            // the nodes that said so
  static constexpr size_t kAmaxSlotsKept = size_t{8} << 20;            // 64 MiB of block amaxes per attempt
  std::mutex amaxes_mu_;
  std::map<std::string, std::unique_ptr<BlockAmaxes>> amaxes_;  // by weight
  size_t amax_slots_ = 0;                                       // blocks of amaxes_ together
};

// The attempts one daemon holds: open ones (preparing, prepared, executing) by sync id, draining
// ones until their fences close, and the attempts their coordinators gave up before they were
// prepared here. Lock order: the table's lock before an attempt's (publish), never the reverse.
class AttemptTable {
 public:
  explicit AttemptTable(std::string node) : node_(std::move(node)) {}

  // `a` (preparing) enters the table. Refused while another attempt of its id is open here
  // (ALREADY_EXISTS), or when its coordinator already gave this attempt up (ABORTED). An open
  // attempt whose fence is in `supersedes` (an earlier attempt of the same Sync call: its
  // coordinator gave it up and runs the sync again, and the abort did not reach this node) is not
  // in the way: it is taken out and returned, for the caller to close before `a` goes on. One of
  // those still being prepared here is marked given up (its Prepare ends refused) and waited for,
  // `wait` at most.
  StatusOr<std::shared_ptr<SyncAttempt>> begin(const std::shared_ptr<SyncAttempt>& a,
                                               const std::vector<uint64_t>& supersedes = {},
                                               std::chrono::milliseconds wait = std::chrono::seconds(2));
  // preparing -> prepared: from here peers' notifications and the coordinator's calls find it,
  // and its lease runs. Refused (ABORTED) when its coordinator gave it up meanwhile (a Finish
  // that found nothing prepared): under this lock, so one of the two always sees the other.
  Status publish(const std::shared_ptr<SyncAttempt>& a);
  // A preparing attempt whose Prepare failed leaves the table (closed).
  void abandon(const std::shared_ptr<SyncAttempt>& a);
  // The prepared or executing attempt of `id` (of `fence`, unless 0); null if none.
  std::shared_ptr<SyncAttempt> find(const std::string& id, uint64_t fence = 0) const;
  // Takes the prepared or executing attempt of `id` out to be closed by the caller. None there:
  // null, and (id, fence) is remembered as given up, so a Prepare of it still on its way is refused.
  // With a `commit` (and a fence), the caller reports how the close ended (closed()).
  std::shared_ptr<SyncAttempt> takeForClose(const std::string& id, uint64_t fence, std::optional<bool> commit = {});
  // How the close of attempt (id, fence) taken with a `commit` ended (its Finish's answer).
  void closed(const std::string& id, uint64_t fence, const StatusOr<v1::FinishResponse>& outcome);
  // A Finish repeated for an attempt a Finish already took here (a commit the coordinator sent
  // again directly, after the relay that carried it went silent): the first one's answer, once
  // its close has ended (UNAVAILABLE after `timeout`); FAILED_PRECONDITION when the first one
  // ended it the other way (a commit after an abort). nullopt: no Finish took it (among the
  // last kClosedKept).
  std::optional<StatusOr<v1::FinishResponse>> closedBefore(const std::string& id, uint64_t fence, bool commit,
                                                           std::chrono::milliseconds timeout);
  // Waits until no Prepare of attempt (id, fence) is running here (it ends refused once given
  // up, its ranks released), at most `timeout`; false if one still runs.
  bool awaitPrepare(const std::string& id, uint64_t fence, std::chrono::milliseconds timeout);
  // Takes every prepared or executing attempt whose lease ran out (the reaper closes them).
  std::vector<std::shared_ptr<SyncAttempt>> takeExpired(SyncAttempt::Clock::time_point now);
  // Takes every prepared or executing attempt (shutdown closes them).
  std::vector<std::shared_ptr<SyncAttempt>> takeAll();
  // `a` (draining) is held until `drained(a)` says its writes are done.
  void addDraining(std::shared_ptr<SyncAttempt> a);
  std::vector<std::shared_ptr<SyncAttempt>> takeDrained(const std::function<bool(const SyncAttempt&)>& drained);

 private:
  static constexpr size_t kGivenUpKept = 4096;
  static bool isOpen(const SyncAttempt& a);                     // prepared or executing
  void rememberGivenUp(const std::string& id, uint64_t fence);  // under mu_

  const std::string node_;
  mutable std::mutex mu_;
  std::condition_variable left_;                              // a preparing attempt left the table, or was published
  std::map<std::string, std::shared_ptr<SyncAttempt>> open_;  // preparing, prepared, executing
  std::vector<std::shared_ptr<SyncAttempt>> draining_;
  std::set<std::pair<std::string, uint64_t>> given_up_;  // (id, fence), the last kGivenUpKept
  std::deque<std::pair<std::string, uint64_t>> given_up_order_;
  // The attempts Finish took (by (id, fence), the last kClosedKept): committed or aborted, and
  // the answer once the close has ended.
  struct Closed {
    bool commit = false;
    bool done = false;
    StatusOr<v1::FinishResponse> outcome;
  };
  static constexpr size_t kClosedKept = 1024;
  std::map<std::pair<std::string, uint64_t>, Closed> closed_;
  std::deque<std::pair<std::string, uint64_t>> closed_order_;
  std::condition_variable closed_cv_;  // a close ended
};

}  // namespace shardcast::daemon
