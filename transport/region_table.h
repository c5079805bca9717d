// The ranges a context has registered, for validating where peers may write (memory a client did
// not register can never be written) and for reusing a registration of the same range.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
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

 private:
  std::mutex mu_;
  std::map<std::tuple<uintptr_t, size_t, MemoryKind>, std::weak_ptr<MemoryRegion>> by_range_;
};

}  // namespace shardcast::transport
