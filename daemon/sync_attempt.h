// One attempt of a sync as this daemon holds it between prepare and finish: its plan, its memory,
// the chunks peers announced, and the writes it has in flight to each peer (a bounded window per
// destination node). Shared by the engine (prepare, finish, the reaper), the executions of its
// waves and the transport's completions; everything mutable is under `mu`.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/delta.h"
#include "daemon/notification.h"
#include "daemon/plan_cache.h"
#include "daemon/registry.h"
#include "daemon/sync_counters.h"
#include "shardcast/v1/service.pb.h"
#include "transport/transport.h"

namespace shardcast::daemon {

struct SyncAttempt {
  using Clock = std::chrono::steady_clock;

  std::string id;
  std::string src_group;
  std::string dst_group;
  uint64_t version = 0;
  uint64_t generation = 0;  // the registry's when prepared: registrations may not change under a sync
  uint64_t fence = 0;       // names the attempt (PrepareRequest.fence); not a secret
  transport::WriteKey key;  // WriteOp::key of this sync's writes, open here from prepare to close
  bool key_open = false;    // this attempt opened it (and so closes it)
  std::shared_ptr<const CachedPlan> plan;
  int32_t self = -1;  // this node's id in the plan, -1 when it takes no part
  uint64_t window_bytes = 0;
  // Delta syncs (daemon/delta.h): the mode; what this node's destination ranks held when the sync
  // took them (a delta may land here only on that base); the bases of the chunks this node packs
  // (null: none kept, every chunk it packs dense).
  v1::DeltaMode delta = v1::DELTA_OFF;
  Registry::Base base;
  std::shared_ptr<DeltaBases::Plan> bases;

  // The coordinator's lease: renewed by every call about this sync; when it runs out the reaper
  // aborts the sync here.
  std::chrono::milliseconds lease{10000};
  std::atomic<int64_t> lease_until{0};  // steady-clock nanoseconds
  void renew() { lease_until = (Clock::now() + lease).time_since_epoch().count(); }
  bool expired(Clock::time_point now) const { return now.time_since_epoch().count() > lease_until; }

  std::shared_ptr<transport::MemoryRegion> arena;  // where transfers land here (not directly)
  // Where this node packs the transfers it heads: freed with the sync (or kept for the next one
  // of the same plan on commit), after every completion has run.
  std::shared_ptr<transport::MemoryRegion> staging;

  // What it moved here over all waves, read by progress() while execute() runs.
  AtomicSyncCounters moved;

  std::mutex mu;
  std::condition_variable cv;
  int executing = 0;               // execute() calls running: close() waits for them
  std::deque<LandedChunk> landed;  // announced by peers, not processed yet
  Status failure;                  // set by abort or by a failed write
  bool closed = false;             // finished: no write may start any more
  int64_t writes_pending = 0;      // writes and notifications started or queued, not completed
  // Rank buffers sent from directly or landed in directly: kept mapped until the sync is gone.
  std::vector<std::shared_ptr<void>> pinned;
  // Chunks processed here (transfer, chunk): each lands on a node once; a repeat is refused.
  std::set<std::pair<int32_t, int32_t>> seen;
  // Waves whose execute finished here without error. A commit here needs every wave and every
  // chunk the schedule lands on this node (SyncEngine::missing): the coordinator's word alone
  // commits nothing.
  std::set<int32_t> waves_done;

  // A write waiting for room in its destination node's window, and the word announcing it.
  struct Outgoing {
    transport::WriteOp op;
    LandedChunk landed;  // announced to the target once the write is visible there
  };
  struct Outbox {
    std::shared_ptr<transport::Endpoint> endpoint;
    std::deque<Outgoing> queued;
    uint64_t bytes_in_flight = 0;
  };
  std::map<int32_t, Outbox> outboxes;  // by destination node

  // OK while the sync may still touch its ranks' memory (not failed, not ended); under mu.
  Status usable() const;
  // Drops writes not started yet (after a failure or the end); under mu.
  void dropQueued();
};

// Queues chunk write `out` to `node` over `endpoint` and starts what fits in that node's window.
Status queueWrite(const std::shared_ptr<SyncAttempt>& a, int32_t node, std::shared_ptr<transport::Endpoint> endpoint,
                  SyncAttempt::Outgoing out);
// Starts the writes queued for `node` that fit in its window (see sync_attempt.cc).
void startWrites(const std::shared_ptr<SyncAttempt>& a, int32_t node);

}  // namespace shardcast::daemon
