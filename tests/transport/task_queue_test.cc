// The progress thread's task queue: its eventfd is readable exactly while tasks wait, so the
// thread sleeps in poll() when there is nothing to do and wakes once per batch of tasks.
#include "transport/task_queue.h"

#include <poll.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>
#include <vector>

using namespace shardcast::transport;

namespace {

bool readable(const TaskQueue& q) {
  pollfd p{q.fd(), POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

}  // namespace

TEST_CASE("TaskQueue: readable exactly while tasks wait - one drain runs a whole batch", "[transport][queue]") {
  TaskQueue q;
  REQUIRE(q.valid());
  CHECK_FALSE(readable(q));
  CHECK(q.drain() == 0);  // nothing queued: nothing to read, nothing run
  CHECK_FALSE(readable(q));

  int ran = 0;
  for (int i = 0; i < 5; ++i) q.push([&] { ++ran; });
  CHECK(readable(q));
  CHECK(q.drain() == 5);
  CHECK(ran == 5);
  CHECK_FALSE(readable(q));  // never left readable over an empty queue (poll would spin)

  // A task pushed by a task runs in the next drain, and signals again.
  q.push([&] { q.push([&] { ran += 10; }); });
  CHECK(q.drain() == 1);
  CHECK(readable(q));
  CHECK(q.drain() == 1);
  CHECK(ran == 15);
  CHECK_FALSE(readable(q));
}

TEST_CASE("TaskQueue: tasks pushed from many threads all run, none waits on a lost wake-up", "[transport][queue]") {
  TaskQueue q;
  constexpr int kThreads = 4, kEach = 20000;
  std::atomic<int> ran{0};
  std::atomic<bool> done{false};
  // The consumer sleeps in poll() as a progress thread does; a lost signal would leave tasks
  // queued with the fd unreadable, and it would only find them through the timeout.
  int timeouts_with_work = 0;
  std::thread consumer([&] {
    while (!done || ran < kThreads * kEach) {
      pollfd p{q.fd(), POLLIN, 0};
      const int r = ::poll(&p, 1, 200);
      const size_t n = q.drain();
      if (r == 0 && n > 0) ++timeouts_with_work;
    }
  });
  std::vector<std::thread> producers;
  for (int t = 0; t < kThreads; ++t)
    producers.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) q.push([&] { ++ran; });
    });
  for (auto& p : producers) p.join();
  done = true;
  consumer.join();
  CHECK(ran == kThreads * kEach);
  CHECK(timeouts_with_work == 0);
  CHECK_FALSE(readable(q));
}
