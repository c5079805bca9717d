// SyncCounters: a wave's difference of the live counters, carried in an Execute response and summed
// by the coordinator, comes back field for field (a field dropped on one of those routes would
// show as a zero in SyncResponse or /metrics, not as an error).
#include "daemon/engine/sync_counters.h"

#include <catch2/catch.hpp>

using namespace shardcast::daemon;

TEST_CASE("sync counters: a wave's difference survives the Execute response and sums field by field") {
  AtomicSyncCounters live;
  live.add({1, 2, 3, 4, 5, 6, 7});
  const SyncCounters before = live.load();
  live.add({10, 20, 30, 40, 50, 60, 70});
  live.bytes_sent += 100;  // as Execution counts: one field at a time
  const SyncCounters wave = live.load() - before;

  shardcast::v1::ExecuteResponse resp;
  wave.writeTo(resp);
  const SyncCounters back = SyncCounters::of(resp);
  CHECK(back.bytes_sent == 110);
  CHECK(back.bytes_received == 20);
  CHECK(back.local_bytes == 30);
  CHECK(back.bytes_landed_direct == 40);
  CHECK(back.device_fanout_bytes == 50);
  CHECK(back.delta_chunks == 60);
  CHECK(back.dense_chunks == 70);

  SyncCounters total = before;
  total += back;
  const SyncCounters now = live.load();
  CHECK(total.bytes_sent == now.bytes_sent);
  CHECK(total.bytes_received == now.bytes_received);
  CHECK(total.local_bytes == now.local_bytes);
  CHECK(total.bytes_landed_direct == now.bytes_landed_direct);
  CHECK(total.device_fanout_bytes == now.device_fanout_bytes);
  CHECK(total.delta_chunks == now.delta_chunks);
  CHECK(total.dense_chunks == now.dense_chunks);
}
