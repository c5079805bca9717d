#include "daemon/plan_cache.h"

#include <utility>

#include "common/strings.h"
#include "planner/layout.h"

namespace shardcast::daemon {

StatusOr<std::shared_ptr<const CachedPlan>> PlanCache::get(const v1::Layout& src, const v1::Layout& dst,
                                                           uint64_t staging_budget, uint64_t chunk_bytes, bool* hit) {
  if (staging_budget == 0 || chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  const std::string key =
      strCat(planner::layoutDigest(src), "/", planner::layoutDigest(dst), "/", staging_budget, "/", chunk_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      ++hits_;
      *hit = true;
      lru_.splice(lru_.begin(), lru_, it->second.age);
      return it->second.plan;
    }
  }
  *hit = false;
  SC_ASSIGN_OR_RETURN(auto schedule, planner::makeSchedule(src, dst, staging_budget, chunk_bytes));
  auto c = std::make_shared<CachedPlan>();
  static_cast<planner::Schedule&>(*c) = std::move(schedule);
  c->key = key;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto raced = plans_.find(key); raced != plans_.end()) return raced->second.plan;  // planned twice at once
  lru_.push_front(key);
  plans_[key] = Entry{c, lru_.begin()};
  while (plans_.size() > capacity_) {
    evicted_.push_back(lru_.back());
    plans_.erase(lru_.back());
    lru_.pop_back();
  }
  return std::shared_ptr<const CachedPlan>(c);
}

uint64_t PlanCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

bool PlanCache::contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.count(key) > 0;
}

size_t PlanCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

std::vector<std::string> PlanCache::takeEvicted() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(evicted_, {});
}

std::shared_ptr<transport::MemoryRegion> SpareMemory::take(const std::string& key, Use use) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = spare_.find({key, use});
  if (it == spare_.end()) return nullptr;
  auto region = std::move(it->second);
  spare_.erase(it);
  return region;
}

void SpareMemory::keep(const std::string& key, Use use, std::shared_ptr<transport::MemoryRegion> region) {
  if (!region) return;
  std::lock_guard<std::mutex> lock(mu_);
  spare_[{key, use}] = std::move(region);
}

void SpareMemory::drop(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  spare_.erase({key, Use::kArena});
  spare_.erase({key, Use::kStaging});
}

size_t SpareMemory::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spare_.size();
}

}  // namespace shardcast::daemon
