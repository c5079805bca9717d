#include "daemon/engine/sync_counters.h"

namespace shardcast::daemon {

SyncCounters& SyncCounters::operator+=(const SyncCounters& o) {
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  local_bytes += o.local_bytes;
  bytes_landed_direct += o.bytes_landed_direct;
  device_fanout_bytes += o.device_fanout_bytes;
  delta_chunks += o.delta_chunks;
  dense_chunks += o.dense_chunks;
  gpu_delta_chunks += o.gpu_delta_chunks;
  gpu_rebuilt_chunks += o.gpu_rebuilt_chunks;
  return *this;
}

SyncCounters SyncCounters::operator-(const SyncCounters& o) const {
  return {bytes_sent - o.bytes_sent,
          bytes_received - o.bytes_received,
          local_bytes - o.local_bytes,
          bytes_landed_direct - o.bytes_landed_direct,
          device_fanout_bytes - o.device_fanout_bytes,
          delta_chunks - o.delta_chunks,
          dense_chunks - o.dense_chunks,
          gpu_delta_chunks - o.gpu_delta_chunks,
          gpu_rebuilt_chunks - o.gpu_rebuilt_chunks};
}

void SyncCounters::writeTo(v1::ExecuteResponse& out) const {
  out.set_bytes_sent(bytes_sent);
  out.set_bytes_received(bytes_received);
  out.set_local_bytes(local_bytes);
  out.set_bytes_landed_direct(bytes_landed_direct);
  out.set_device_fanout_bytes(device_fanout_bytes);
  out.set_delta_chunks(delta_chunks);
  out.set_dense_chunks(dense_chunks);
  out.set_gpu_delta_chunks(gpu_delta_chunks);
  out.set_gpu_rebuilt_chunks(gpu_rebuilt_chunks);
}

SyncCounters SyncCounters::of(const v1::ExecuteResponse& r) {
  return {r.bytes_sent(),   r.bytes_received(), r.local_bytes(),      r.bytes_landed_direct(), r.device_fanout_bytes(),
          r.delta_chunks(), r.dense_chunks(),   r.gpu_delta_chunks(), r.gpu_rebuilt_chunks()};
}

SyncCounters AtomicSyncCounters::load() const {
  return {bytes_sent,   bytes_received, local_bytes,      bytes_landed_direct, device_fanout_bytes,
          delta_chunks, dense_chunks,   gpu_delta_chunks, gpu_rebuilt_chunks};
}

void AtomicSyncCounters::add(const SyncCounters& c) {
  bytes_sent += c.bytes_sent;
  bytes_received += c.bytes_received;
  local_bytes += c.local_bytes;
  bytes_landed_direct += c.bytes_landed_direct;
  device_fanout_bytes += c.device_fanout_bytes;
  delta_chunks += c.delta_chunks;
  dense_chunks += c.dense_chunks;
  gpu_delta_chunks += c.gpu_delta_chunks;
  gpu_rebuilt_chunks += c.gpu_rebuilt_chunks;
}

}  // namespace shardcast::daemon
