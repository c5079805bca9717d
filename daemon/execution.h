// One execute() call: this daemon's part of one wave of a sync. Copies colocated fragments
// (first wave), packs and sends the transfers this node's source ranks head, then processes every
// chunk that lands here as peers announce it: checks it against the plan, forwards it along its
// relay chain, unpacks it into the local destination ranks. Runs on the calling thread (a gRPC
// handler), fed by the transport's progress thread through SyncAttempt::landed.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/plan_cache.h"
#include "daemon/registry.h"
#include "daemon/stage.h"
#include "daemon/sync_attempt.h"
#include "shardcast/v1/service.pb.h"
#include "transport/copy_engine.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// What an execution uses of its daemon, and nothing else.
struct ExecutionEnv {
  const std::string& node;  // this daemon's node name (in messages)
  Registry& registry;
  transport::Context& transport;
  Stage& stage;
  transport::CopyEngine& host_copies;  // raw byte copies (checksums of device memory)
  SpareMemory& spares;
};

class Execution {
 public:
  Execution(ExecutionEnv env, std::shared_ptr<SyncAttempt> attempt, const v1::ExecuteRequest& req);
  Status run();

 private:
  using Clock = std::chrono::steady_clock;
  // What this node knows of another: its transport address and where to write into it.
  struct Peer {
    std::string address;
    transport::RemoteRegion arena;
    std::vector<transport::RemoteRegion> regions;
    std::map<std::pair<int32_t, std::string>, std::pair<uint32_t, uint64_t>>
        buffers;  // (rank, name) -> (region, offset)
  };

  Status readDirectory();
  // Before every local copy into or out of rank memory: the sync may have been ended meanwhile
  // (aborted, or its lease ran out); then its ranks are no longer its to touch.
  Status alive() const;
  StatusOr<Registry::LocalBuffer> buffer(const planner::ResolvedLayout& l, int32_t rank, int32_t b) const;
  // A rank buffer's view of region `r`, typed as tensor `t` of layout `l`.
  static TypedView typed(const Registry::LocalBuffer& b, int64_t offset, std::vector<int64_t> strides,
                         const planner::TensorLayout& t);
  // XXH64 of bytes [offset, offset + n) of a buffer (device memory: through its transport mirror,
  // which holds the bytes around a send or a landing, or a host copy).
  StatusOr<uint64_t> checksum(const Registry::LocalBuffer& b, uint64_t offset, uint64_t n);
  // Sends chunk k of transfer t (its first byte at `off` in `src`) to where it lands on `node`,
  // then the notification that announces it.
  Status send(const std::shared_ptr<transport::MemoryRegion>& src, uint64_t off, int32_t t, int32_t chain, int32_t hop,
              int32_t k, int32_t node, uint64_t sum);
  Status copyColocated();
  Status sendHeaded(int32_t t);
  Status ensureStaging();
  Status receive();
  Status processLanded(const LandedChunk& l);

  ExecutionEnv env_;
  std::shared_ptr<SyncAttempt> a_;
  const v1::ExecuteRequest& req_;
  const CachedPlan& cp_;
  const planner::Plan& plan_;
  const int32_t self_;
  const int32_t wave_;
  const Clock::time_point deadline_;
  std::map<int32_t, Peer> peers_;
};

}  // namespace shardcast::daemon
