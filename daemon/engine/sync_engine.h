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
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/engine/delta.h"
#include "daemon/engine/notification.h"
#include "daemon/engine/plan_cache.h"
#include "daemon/engine/sync_attempt.h"
#include "daemon/registry/registry.h"
#include "daemon/server/metrics.h"
#include "daemon/stage/stage.h"
#include "shardcast/v1/service.pb.h"
#include "transport/copy_engine.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// Bounds on what a coordinating peer may ask of this daemon in a Prepare (docs/security.md,
// "Limits"): outside them the Prepare is refused with INVALID_ARGUMENT, never clamped.
struct PeerLimits {
  // The sync's lease: a peer cannot hold this node's ranks past the daemon's own bound.
  std::chrono::milliseconds min_lease{200};
  std::chrono::milliseconds max_lease{60000};  // --max-sync-lease-ms
  // Chunks below this cost the plan memory out of proportion to the bytes (a chunk of 4 bytes
  // made one Prepare cost 194 MB); the daemons' own flags never go below it.
  uint64_t min_chunk_bytes = uint64_t{64} << 10;
};

class SyncEngine {
 public:
  // `window_bytes`: per destination node, the bytes of writes in flight at once (at least one write).
  // `stage`: how bytes are packed and unpacked (daemon/stage/stage.h); the copy stage when null.
  // `delta_cache_bytes`: host memory for the bases of delta syncs (daemon/engine/delta.h), all plans;
  // `delta_device_bytes`: GPU memory for the bases of chunks packed from device memory, encoded on
  // their GPU.
  SyncEngine(std::string node, Registry& registry, transport::Context& transport, Metrics& metrics,
             uint64_t window_bytes = uint64_t{128} << 20, std::unique_ptr<Stage> stage = nullptr,
             uint64_t delta_cache_bytes = uint64_t{8} << 30, uint64_t delta_device_bytes = 0, PeerLimits limits = {});
  ~SyncEngine();

  StatusOr<v1::PrepareResponse> prepare(const v1::PrepareRequest& req);
  StatusOr<v1::ExecuteResponse> execute(const v1::ExecuteRequest& req);
  // The states of this node's destination ranks after the sync ended here.
  // `deadline`: the caller's; a Finish repeated while the first one's close still runs waits for
  // it until then (10 s at most).
  StatusOr<v1::FinishResponse> finish(const v1::FinishRequest& req, std::chrono::system_clock::time_point deadline =
                                                                        std::chrono::system_clock::time_point::max());
  // What a sync prepared here has moved so far; NOT_FOUND once it finished.
  // `fence` 0: whichever attempt of `sync_id`; else only that attempt.
  StatusOr<v1::ProgressResponse> progress(const std::string& sync_id, uint64_t fence = 0);
  PlanCache& plans() { return plans_; }
  const DeltaBases& deltaBases() const { return bases_; }
  // Shutdown: aborts every sync prepared here (destination ranks written by them become DIRTY).
  void abortAll(const std::string& reason);
  // How long ending an attempt waits for this node's own writes and execute calls (120 s); one
  // still running then keeps the attempt's ranks held until it returns. Tests shorten it (set it
  // before the first sync).
  void setOwnWorkWait(std::chrono::milliseconds wait) { own_work_wait_ = wait; }

 private:
  void onNotification(const std::string& payload, const transport::WriteKey& key);
  // ExecuteRequest.prepare: prepares, and keeps the attempt only where the coordinator's kept
  // view says its peers land their writes here (else ends it, refused as a stale view).
  Status prepareFolded(const v1::ExecuteRequest& req);
  StatusOr<v1::PrepareResponse> prepareTargets(const std::shared_ptr<SyncAttempt>& a, bool hit);
  StatusOr<float> amaxOf(const planner::ResolvedLayout& src, const std::string& group,
                         const planner::TensorLayout& weight, const planner::Region& part);
  // Ends a sync here (taken out of the table already): closing, waits for its writes, then tells
  // the registry; draining when peers' writes into this node are still landing, or its own writes
  // or execute calls still run.
  StatusOr<v1::FinishResponse> close(const std::shared_ptr<SyncAttempt>& a, Registry::SyncEnd end,
                                     const std::string& reason);
  // The reaper thread: aborts syncs whose coordinator's lease ran out, ends drained ones.
  void reap();
  // Closes `a` (taken out of the table already) on a thread of its own, kept until it ends: one
  // sync's slow peer must not hold the caller, or other syncs' ranks.
  std::shared_future<void> closeInBackground(std::shared_ptr<SyncAttempt> a, Registry::SyncEnd end, std::string why);

  std::string node_;
  Registry& registry_;
  transport::Context& transport_;
  Metrics& metrics_;
  const uint64_t window_bytes_;
  const PeerLimits limits_;
  std::chrono::milliseconds own_work_wait_{std::chrono::seconds(120)};
  PlanCache plans_;
  SpareMemory spares_;
  DeltaBases bases_;
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<transport::CopyEngine> copies_;
  AttemptTable attempts_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  bool stopping_ = false;
  std::thread reaper_;
  std::mutex closers_mu_;
  std::vector<std::shared_future<void>> closers_;  // closes in flight (closeInBackground)
};

}  // namespace shardcast::daemon
