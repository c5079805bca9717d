// A queue of closures for a backend's progress thread, with an eventfd that becomes readable when
// work is pushed, so the thread can sleep in poll() next to its network file descriptors.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <deque>
#include <functional>
#include <mutex>
#include <shared_mutex>

namespace shardcast::transport {

class TaskQueue {
 public:
  TaskQueue() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~TaskQueue() {
    if (fd_ >= 0) ::close(fd_);
  }
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }

  // The eventfd is signalled exactly while tasks wait: by the push that makes the queue non-empty,
  // cleared by the drain that empties it, both under the lock (a wake-up per task would cost a
  // syscall and a context switch each; a drain never leaves it readable over an empty queue, where
  // poll would return at once, forever; an empty queue costs no syscall).
  void push(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    if (tasks_.size() > 1) return;  // signalled already
    const uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(fd_, &one, sizeof(one));
  }

  // Runs every queued task outside the lock; returns how many ran.
  size_t drain() {
    std::unique_lock<std::mutex> lock(mu_);
    if (tasks_.empty()) return 0;  // a progress loop drains at every wake-up: no allocation then
    uint64_t ignored;
    [[maybe_unused]] auto n = ::read(fd_, &ignored, sizeof(ignored));
    std::deque<std::function<void()>> batch;  // (constructing one allocates)
    batch.swap(tasks_);
    lock.unlock();
    for (auto& t : batch) t();
    return batch.size();
  }

 private:
  int fd_;
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
};

// A TaskQueue that can be closed: once its owner shuts it down, post() refuses work (so callers
// complete their operations with an error instead of queueing into a dead thread).
class Mailbox {
 public:
  TaskQueue& queue() { return queue_; }
  bool post(std::function<void()> task) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (!open_) return false;
    queue_.push(std::move(task));
    return true;
  }
  void shutdown() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    open_ = false;
  }

 private:
  std::shared_mutex mu_;
  bool open_ = true;
  TaskQueue queue_;
};

}  // namespace shardcast::transport
