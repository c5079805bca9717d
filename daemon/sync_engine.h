// One daemon's part of a sync. Three phases, driven by the coordinating daemon over the Peer
// service:
//   prepare  plan (cached by the layouts' digests; every daemon computes the same deterministic
//            plan), allocate this node's landing arena, name the rank buffers peers may write
//            into directly, start accepting "landed" notifications
//   execute  copy colocated fragments locally; pack and send the fragments this node's source ranks
//            head; for every transfer landing here: verify (optional), fan out to the local
//            destination ranks, forward it to the next node of its relay chain
//   finish   wait for this node's writes in flight, then commit the destination group's version
//            here, or abort and drop everything
// Writes and notifications go through the transport; execute's work runs on the calling (gRPC)
// thread, which the transport's progress thread feeds through a queue. See docs/daemon.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/metrics.h"
#include "daemon/notification.h"
#include "daemon/registry.h"
#include "planner/plan.h"
#include "planner/schedule.h"
#include "shardcast/v1/service.pb.h"
#include "transport/copy_engine.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// A schedule as the daemon caches it, under the key of its layouts and budgets.
struct CachedPlan : planner::Schedule {
  std::string key;  // the two layout digests, the staging budget and the chunk size
  std::string landedProblem(const LandedChunk& l, int32_t in_wave, int32_t self) const {
    return Schedule::landedProblem(l.transfer, l.chain, l.hop, l.chunk, in_wave, self);
  }
};

// The plans of the layout pairs synced lately: a bounded LRU of immutable plans (syncs in flight
// keep theirs alive by reference). A plan evicted here takes the engine's spare arena and staging
// for it along (SyncEngine drops them when it learns of the eviction).
class PlanCache {
 public:
  explicit PlanCache(size_t capacity = 16) : capacity_(capacity == 0 ? 1 : capacity) {}
  // The plan for these layouts and staging budget; *hit says whether it was cached.
  StatusOr<std::shared_ptr<const CachedPlan>> get(const v1::Layout& src, const v1::Layout& dst, uint64_t staging_budget,
                                                  uint64_t chunk_bytes, bool* hit);
  uint64_t hits() const;
  size_t size() const;
  bool contains(const std::string& key) const;
  // The keys evicted since the last call.
  std::vector<std::string> takeEvicted();

 private:
  struct Entry {
    std::shared_ptr<const CachedPlan> plan;
    std::list<std::string>::iterator age;
  };
  const size_t capacity_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> plans_;
  std::list<std::string> lru_;  // most recently used first
  std::vector<std::string> evicted_;
  uint64_t hits_ = 0;
};

class SyncEngine {
 public:
  // `window_bytes`: per destination node, the bytes of writes in flight at once (at least one write).
  SyncEngine(std::string node, Registry& registry, transport::Context& transport, Metrics& metrics,
             uint64_t window_bytes = uint64_t{32} << 20);
  ~SyncEngine();

  StatusOr<v1::PrepareResponse> prepare(const v1::PrepareRequest& req);
  StatusOr<v1::ExecuteResponse> execute(const v1::ExecuteRequest& req);
  // The states of this node's destination ranks after the sync ended here.
  StatusOr<v1::FinishResponse> finish(const v1::FinishRequest& req);
  // What a sync prepared here has moved so far; NOT_FOUND once it finished.
  // `fence` 0: whichever attempt of `sync_id`; else only that attempt.
  StatusOr<v1::ProgressResponse> progress(const std::string& sync_id, uint64_t fence = 0);
  PlanCache& plans() { return plans_; }
  // Shutdown: aborts every sync prepared here (destination ranks written by them become DIRTY).
  void abortAll(const std::string& reason);

 private:
  using Landed = LandedChunk;
  struct Active;
  class Execution;

  // Starts the writes queued for `node` that fit in its window of bytes in flight.
  static void pump(const std::shared_ptr<Active>& a, int32_t node);

  void onNotification(const std::string& payload);
  StatusOr<v1::PrepareResponse> prepareTargets(const std::shared_ptr<Active>& a, bool hit);
  // Ends a sync here (removed from active_ already): waits for its writes, then tells the registry.
  StatusOr<v1::FinishResponse> close(const std::shared_ptr<Active>& a, Registry::SyncEnd end,
                                     const std::string& reason);
  // The reaper thread: aborts syncs whose coordinator's lease ran out.
  void reap();
  // Copies with the engine that reaches both sides: the host engine, or the registry's CUDA engine
  // (synchronized, so the bytes are in place when it returns).
  Status copy(const transport::StridedView& dst, const transport::StridedView& src, const std::vector<int64_t>& extent,
              int64_t elem, transport::CopyEngine* device_copies);
  // XXH64 of bytes [offset, offset + n) of a buffer (device memory: through its transport mirror,
  // which holds the bytes around a send or a landing, or a host copy).
  StatusOr<uint64_t> checksum(const Registry::LocalBuffer& b, uint64_t offset, uint64_t n);
  std::shared_ptr<Active> find(const std::string& id, uint64_t fence = 0);

  std::string node_;
  Registry& registry_;
  transport::Context& transport_;
  Metrics& metrics_;
  const uint64_t window_bytes_;
  PlanCache plans_;
  std::unique_ptr<transport::CopyEngine> copies_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Active>> active_;
  std::set<std::string> preparing_;  // ids between the start of prepare and active_
  // Attempts (id, fence) finished (given up) before they were prepared here: refused if they come.
  std::set<std::pair<std::string, uint64_t>> finished_;
  std::deque<std::pair<std::string, uint64_t>> finished_order_;
  // Closed syncs whose incoming writes were still landing: their fences are polled by the reaper.
  std::vector<std::shared_ptr<Active>> draining_;
  // Arenas and staging buffers of committed syncs, reused by the next sync of the same plan
  // (allocation and first touch of large registered buffers costs more than the copies).
  std::map<std::string, std::shared_ptr<transport::MemoryRegion>> spare_arenas_, spare_staging_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  bool stopping_ = false;
  std::thread reaper_;
  std::vector<std::future<void>> closers_;  // the reaper's closes in flight (reaper thread only)
};

}  // namespace shardcast::daemon
