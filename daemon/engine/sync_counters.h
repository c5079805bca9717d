// What a sync moved, one type wherever it is counted: each daemon's attempt counts as its waves
// run (AtomicSyncCounters, read by Progress meanwhile), an Execute reports one wave's difference
// (writeTo / of), the coordinator sums those over every daemon and wave into the SyncResponse, and
// the daemon's metrics sum every wave of every sync that ran here.
#pragma once

#include <atomic>
#include <cstdint>

#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

struct SyncCounters {
  uint64_t bytes_sent = 0;           // over the network: sources and relays
  uint64_t bytes_received = 0;       // landed here over the network
  uint64_t local_bytes = 0;          // copied node-locally into destination ranks
  uint64_t bytes_landed_direct = 0;  // of bytes_received: landed in rank memory directly
  uint64_t device_fanout_bytes = 0;  // of local_bytes: copied GPU to GPU
  uint64_t delta_chunks = 0;         // chunks landed here as deltas
  uint64_t dense_chunks = 0;         // chunks landed here whole
  uint64_t gpu_delta_chunks = 0;     // chunks encoded here as deltas on a GPU
  uint64_t gpu_rebuilt_chunks = 0;   // delta chunks rebuilt here on a GPU

  SyncCounters& operator+=(const SyncCounters& o);
  SyncCounters operator-(const SyncCounters& o) const;  // fieldwise; `o` counted no later than this
  void writeTo(v1::ExecuteResponse& out) const;
  static SyncCounters of(const v1::ExecuteResponse& r);
};

// The live form: counted from several threads, read while counting goes on.
struct AtomicSyncCounters {
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, local_bytes{0}, bytes_landed_direct{0};
  std::atomic<uint64_t> device_fanout_bytes{0}, delta_chunks{0}, dense_chunks{0}, gpu_delta_chunks{0};
  std::atomic<uint64_t> gpu_rebuilt_chunks{0};

  SyncCounters load() const;
  void add(const SyncCounters& c);
};

}  // namespace shardcast::daemon
