// The coordinator's executor: every index runs, in parallel, threads are reused, and a forEach
// inside another one completes even when the pool is exhausted.
#include "daemon/executor.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

using shardcast::daemon::Executor;

TEST_CASE("executor: forEach runs every index once, all at the same time", "[daemon][executor]") {
  Executor pool;
  constexpr size_t kN = 8;
  // A barrier of kN: passes only when all kN calls run at once (a serial run would wait forever,
  // so it is bounded; the check is on how many arrived, not on time).
  std::mutex mu;
  std::condition_variable cv;
  size_t arrived = 0;
  std::multiset<size_t> seen;
  bool all_met = true;
  pool.forEach(kN, [&](size_t i) {
    std::unique_lock<std::mutex> lock(mu);
    seen.insert(i);
    ++arrived;
    cv.notify_all();
    all_met &= cv.wait_for(lock, std::chrono::seconds(30), [&] { return arrived == kN; });
  });
  CHECK(all_met);
  CHECK(seen.size() == kN);
  for (size_t i = 0; i < kN; ++i) CHECK(seen.count(i) == 1);
}

TEST_CASE("executor: threads are reused from one forEach to the next", "[daemon][executor]") {
  Executor pool;
  std::atomic<int> calls{0};
  for (int round = 0; round < 50; ++round) pool.forEach(4, [&](size_t) { ++calls; });
  CHECK(calls == 200);
  CHECK(pool.threads() <= 4 * 2);  // not one per call: idle threads take the next round's work
}

TEST_CASE("executor: a forEach inside another completes on a pool of one thread", "[daemon][executor]") {
  Executor pool(1);
  std::atomic<int> inner{0};
  pool.forEach(3, [&](size_t) { pool.forEach(3, [&](size_t) { ++inner; }); });
  CHECK(inner == 9);
  pool.forEach(0, [&](size_t) { FAIL("no index"); });
}
