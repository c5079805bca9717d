#include "daemon/executor.h"

#include <algorithm>

namespace shardcast::daemon {

Executor::Executor(size_t max_threads) : max_threads_(max_threads == 0 ? 1 : max_threads) {}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

size_t Executor::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_.size();
}

void Executor::forget(const void* owner) {
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.erase(std::remove_if(tasks_.begin(), tasks_.end(), [&](const Task& t) { return t.owner == owner; }),
               tasks_.end());
}

void Executor::post(Task task) {
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.push_back(std::move(task));
  if (idle_ > 0) {  // wake one waiting thread (it leaves the idle count now)
    --idle_;
    ++wakeups_;
    cv_.notify_one();
  }
  // Every thread not running a task takes one soon; start another only for tasks beyond those.
  // (Past the cap, busy threads take the rest when done, and forEach's caller works meanwhile.)
  if (tasks_.size() > threads_.size() - busy_ && threads_.size() < max_threads_)
    threads_.emplace_back([this] { work(); });
}

void Executor::work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    while (!tasks_.empty()) {
      auto task = std::move(tasks_.front().fn);
      tasks_.pop_front();
      ++busy_;
      lock.unlock();
      task();
      lock.lock();
      --busy_;
    }
    if (stopping_) return;
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || wakeups_ > 0; });
    if (wakeups_ > 0) {
      --wakeups_;  // post() took us off the idle count
    } else {
      --idle_;  // stopping
    }
  }
}

void Executor::forEach(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  struct Shared {
    std::atomic<size_t> next{0};
    size_t left;
    std::mutex mu;
    std::condition_variable done;
  };
  auto shared = std::make_shared<Shared>();
  shared->left = n;
  // Whoever runs it takes indices until none is left; a helper that starts after the caller
  // finished everything finds none and never touches `fn`.
  auto drain = [shared, n, f = &fn] {
    for (size_t i; (i = shared->next.fetch_add(1)) < n;) {
      (*f)(i);
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->left == 0) shared->done.notify_all();
    }
  };
  for (size_t k = 1; k < n; ++k) post({drain, shared.get()});
  drain();
  // Helpers that have not started are no longer needed: the queue keeps only live work, so idle
  // threads are not outnumbered by stale helpers (which would start more threads).
  forget(shared.get());
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->done.wait(lock, [&] { return shared->left == 0; });
}

}  // namespace shardcast::daemon
