// Progress of the syncs a daemon coordinates, for the Watch stream: the coordinator updates it at
// every phase and node completion; watchers wait for changes. Keeps the last 64 finished syncs.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "proto/shardcast/v1/names.h"
#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

class ProgressBoard {
 public:
  // Applies `fn` to the sync's progress (creating it) and wakes the watchers.
  template <typename Fn>
  void update(const std::string& id, Fn&& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, inserted] = syncs_.try_emplace(id);
      if (inserted) {
        it->second.set_sync_id(id);
        order_.push_back(id);
      }
      fn(it->second);
      trim();
      ++generation_;
    }
    cv_.notify_all();
  }

  // Starts sync `id` afresh ("gathering"); false when a sync of that id is still running here.
  bool start(const std::string& id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, inserted] = syncs_.try_emplace(id);
      if (!inserted && !isDone(it->second)) return false;
      // Newest last: a retry under the same id moves to the end.
      if (!inserted) order_.erase(std::find(order_.begin(), order_.end(), id));
      order_.push_back(id);
      it->second = v1::SyncProgress();
      it->second.set_sync_id(id);
      setPhase(it->second, v1::SYNC_GATHERING);
      trim();
      ++generation_;
    }
    cv_.notify_all();
    return true;
  }

  // Calls emit(progress) for the current state and every change until the sync ends; false when
  // the id is unknown after `wait_for_start`, or when emit returns false (the watcher left).
  template <typename Emit>
  bool watch(const std::string& id, std::chrono::milliseconds wait_for_start, Emit&& emit) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, wait_for_start, [&] { return syncs_.count(id) > 0; })) return false;
    uint64_t seen = 0;
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return generation_ != seen; });
      seen = generation_;
      const v1::SyncProgress snapshot = syncs_[id];
      lock.unlock();
      if (!emit(snapshot)) return true;
      if (isDone(snapshot)) return true;
      lock.lock();
    }
  }

  // The syncs running, then the last `ended` that ended, newest first (Status, `shardcast top`).
  std::vector<v1::SyncProgress> recent(size_t ended) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<v1::SyncProgress> running, done;
    for (auto id = order_.rbegin(); id != order_.rend(); ++id) {
      const auto it = syncs_.find(*id);
      if (it == syncs_.end()) continue;
      if (!isDone(it->second))
        running.push_back(it->second);
      else if (done.size() < ended)
        done.push_back(it->second);
    }
    running.insert(running.end(), done.begin(), done.end());
    return running;
  }

  static bool isDone(const v1::SyncProgress& p) {
    return p.phase() == v1::SYNC_COMMITTED || p.phase() == v1::SYNC_FAILED;
  }
  // The phase, as the enum and as its name (the field clients before 0.3 read).
  static void setPhase(v1::SyncProgress& p, v1::SyncPhase phase) {
    p.set_phase(phase);
    p.set_state(std::string(v1::syncPhaseName(phase)));
  }

 private:
  // Under mu_: forgets the oldest ended syncs beyond the 64 kept (running ones are never dropped).
  void trim() {
    while (order_.size() > 64 && isDone(syncs_[order_.front()])) {
      syncs_.erase(order_.front());
      order_.pop_front();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, v1::SyncProgress> syncs_;
  std::deque<std::string> order_;
  uint64_t generation_ = 0;
};

}  // namespace shardcast::daemon
