// One pool of threads for the blocking calls a coordinator makes to every daemon at once: the lease
// keeper's Progress polls, and the Progress probes that look for a node that does not answer once
// a wave failed. (Prepare, Execute and Finish do not use it: they go out through gRPC's callback
// API, fanOut in daemon/cluster.h.) Threads are reused from poll to poll and sync to sync, started
// only when the tasks waiting outnumber the threads free to take them (up to max_threads), and the
// caller of forEach works too, so a forEach from inside another one completes, even on a pool of
// one thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace shardcast::daemon {

class Executor {
 public:
  explicit Executor(size_t max_threads = 256);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // fn(0) ... fn(n-1), in parallel, on the pool and on the calling thread; returns when all ran.
  void forEach(size_t n, const std::function<void(size_t)>& fn);
  // Threads started so far (for tests).
  size_t threads() const;

 private:
  struct Task {
    std::function<void()> fn;
    const void* owner;  // the forEach that posted it
  };
  void post(Task task);
  // Drops the tasks of `owner` not started yet (a forEach that finished without them).
  void forget(const void* owner);
  void work();

  const size_t max_threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  std::vector<std::thread> threads_;
  size_t busy_ = 0;     // threads running a task
  size_t idle_ = 0;     // threads waiting that no post() has woken yet
  size_t wakeups_ = 0;  // posts that woke a waiting thread which has not taken it yet
  bool stopping_ = false;
};

}  // namespace shardcast::daemon
