// The ranges a context has registered, for validating where peers may write (memory a client did
// not register can never be written) and for reusing a registration of the same range.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>

#include "transport/transport.h"

namespace shardcast::transport {

class RegionTable {
 public:
  // The live region registered for exactly this range, if any.
  std::shared_ptr<MemoryRegion> find(void* data, size_t size, MemoryKind kind) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_range_.find({reinterpret_cast<uintptr_t>(data), size, kind});
    return it == by_range_.end() ? nullptr : it->second.lock();
  }
  void add(const std::shared_ptr<MemoryRegion>& r) {
    std::lock_guard<std::mutex> lock(mu_);
    by_range_[{reinterpret_cast<uintptr_t>(r->data()), r->size(), r->kind()}] = r;
  }
  void remove(void* data, size_t size, MemoryKind kind) {
    std::lock_guard<std::mutex> lock(mu_);
    by_range_.erase({reinterpret_cast<uintptr_t>(data), size, kind});
  }
  // The live registered region [addr, addr + len) lies inside, or null. Whoever writes there
  // holds it until the write is done: the region (an arena) cannot be freed under the write.
  std::shared_ptr<MemoryRegion> containing(uint64_t addr, uint64_t len) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, weak] : by_range_) {
      const uint64_t base = std::get<0>(key), size = std::get<1>(key);
      if (addr >= base && len <= size && addr - base <= size - len)
        if (auto live = weak.lock()) return live;
    }
    return nullptr;
  }
  bool covers(uint64_t addr, uint64_t len) { return containing(addr, len) != nullptr; }

  // Write fences (see WriteOp::fence): a write naming a fence lands only while it is open here.
  void openFence(uint64_t fence) {
    std::lock_guard<std::mutex> lock(fences_->mu);
    fences_->landing.emplace(fence, 0);
  }
  // Refuses later writes naming `fence`, then waits (up to `timeout`) until the writes landing
  // under it now are done. False when some were still landing at the timeout: the fence stays
  // closing (refusing) and a later call (timeout 0 to poll) finishes it once they are done.
  bool closeFence(uint64_t fence, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(fences_->mu);
    fences_->closing.insert(fence);
    const bool drained = fences_->cv.wait_for(lock, timeout, [&] {
      auto it = fences_->landing.find(fence);
      return it == fences_->landing.end() || it->second == 0;
    });
    if (!drained) return false;
    fences_->landing.erase(fence);
    fences_->closing.erase(fence);
    return true;
  }
  // Held by one write while it lands; null when `fence` is not open (the write is refused).
  std::shared_ptr<void> enterFence(uint64_t fence) {
    std::lock_guard<std::mutex> lock(fences_->mu);
    auto it = fences_->landing.find(fence);
    if (it == fences_->landing.end() || fences_->closing.count(fence)) return nullptr;
    ++it->second;
    auto fences = fences_;
    return std::shared_ptr<void>(reinterpret_cast<void*>(fence), [fences, fence](void*) {
      std::lock_guard<std::mutex> released(fences->mu);
      auto f = fences->landing.find(fence);
      if (f != fences->landing.end() && --f->second == 0) fences->cv.notify_all();
    });
  }

 private:
  std::mutex mu_;
  std::map<std::tuple<uintptr_t, size_t, MemoryKind>, std::weak_ptr<MemoryRegion>> by_range_;
  struct Fences {
    std::mutex mu;
    std::condition_variable cv;
    std::map<uint64_t, int64_t> landing;  // open fences: writes landing under each now
    std::set<uint64_t> closing;
  };
  std::shared_ptr<Fences> fences_ = std::make_shared<Fences>();
};

}  // namespace shardcast::transport
