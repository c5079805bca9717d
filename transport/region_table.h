// The ranges a context has registered, for validating where peers may write (memory a client did
// not register can never be written) and for reusing a registration of the same range.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

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

  // Write fences (WriteOp::key): a write lands only under a key open here, inside the ranges
  // opened with it, and inside a live registered region.
  // False (nothing changes) when `key` is open here already: one attempt's fence is never
  // redefined by another's Prepare naming the same key.
  bool openFence(const WriteKey& key, std::vector<LandingRange> ranges) {
    std::lock_guard<std::mutex> lock(fences_->mu);
    auto [it, added] = fences_->open.try_emplace(key);
    if (!added) return false;
    it->second.ranges = mergeRanges(std::move(ranges));
    return true;
  }
  // Refuses later writes under `key`, then waits (up to `timeout`) until the writes landing under
  // it now are done. False when some were still landing at the timeout: the fence stays closing
  // (refusing) and a later call (timeout 0 to poll) finishes it once they are done.
  bool closeFence(const WriteKey& key, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(fences_->mu);
    auto it = fences_->open.find(key);
    if (it == fences_->open.end()) return true;
    it->second.closing = true;
    const bool drained = fences_->cv.wait_for(lock, timeout, [&] {
      auto f = fences_->open.find(key);
      return f == fences_->open.end() || f->second.landing == 0;
    });
    if (!drained) return false;
    fences_->open.erase(key);
    return true;
  }
  // True while `key` is open here and not closing (a notification under it may be delivered).
  bool fenceOpen(const WriteKey& key) {
    std::lock_guard<std::mutex> lock(fences_->mu);
    auto it = fences_->open.find(key);
    return it != fences_->open.end() && !it->second.closing;
  }
  // What one incoming write holds while it lands: the fence it came under and the region it lands
  // in. Empty (the write is refused) unless `key` is open here, [addr, addr + len) lies inside
  // one of its ranges, and inside a live registered region: the caller gives one answer for every
  // refusal, so a refused write tells the sender nothing about where memory is.
  struct Landing {
    std::shared_ptr<void> fence;
    std::shared_ptr<MemoryRegion> region;
    explicit operator bool() const { return fence && region; }
  };
  Landing admit(const WriteKey& key, uint64_t addr, uint64_t len) {
    Landing out;
    {
      std::lock_guard<std::mutex> lock(fences_->mu);
      auto it = fences_->open.find(key);
      if (key.empty() || it == fences_->open.end() || it->second.closing || !inside(it->second.ranges, addr, len))
        return {};
      ++it->second.landing;
      auto fences = fences_;
      out.fence = std::shared_ptr<void>(fences.get(), [fences, key](void*) {
        std::lock_guard<std::mutex> released(fences->mu);
        auto f = fences->open.find(key);
        if (f != fences->open.end() && --f->second.landing == 0) fences->cv.notify_all();
      });
    }
    out.region = containing(addr, len);
    if (!out.region) return {};  // the fence hold goes with `out`
    return out;
  }

 private:
  struct Fence {
    std::vector<LandingRange> ranges;  // sorted by address, disjoint
    int64_t landing = 0;               // writes landing under it now
    bool closing = false;
  };
  static std::vector<LandingRange> mergeRanges(std::vector<LandingRange> ranges) {
    std::erase_if(ranges, [](const LandingRange& r) { return r.size == 0 || r.addr + r.size < r.addr; });
    std::sort(ranges.begin(), ranges.end(),
              [](const LandingRange& a, const LandingRange& b) { return a.addr < b.addr; });
    std::vector<LandingRange> out;
    for (const LandingRange& r : ranges) {
      if (!out.empty() && r.addr <= out.back().addr + out.back().size)
        out.back().size = std::max(out.back().addr + out.back().size, r.addr + r.size) - out.back().addr;
      else
        out.push_back(r);
    }
    return out;
  }
  static bool inside(const std::vector<LandingRange>& ranges, uint64_t addr, uint64_t len) {
    // The last range starting at or before addr is the only one that can hold it (disjoint).
    auto it = std::upper_bound(ranges.begin(), ranges.end(), addr,
                               [](uint64_t a, const LandingRange& r) { return a < r.addr; });
    if (it == ranges.begin()) return false;
    --it;
    return len <= it->size && addr - it->addr <= it->size - len;
  }

  std::mutex mu_;
  std::map<std::tuple<uintptr_t, size_t, MemoryKind>, std::weak_ptr<MemoryRegion>> by_range_;
  struct Fences {
    std::mutex mu;
    std::condition_variable cv;
    std::map<WriteKey, Fence> open;
  };
  std::shared_ptr<Fences> fences_ = std::make_shared<Fences>();
};

}  // namespace shardcast::transport
