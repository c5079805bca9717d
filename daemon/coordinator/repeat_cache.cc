#include "daemon/coordinator/repeat_cache.h"

#include "common/strings.h"

namespace shardcast::daemon {

std::string RepeatCache::keyOf(const v1::SyncRequest& req, std::optional<uint32_t> caller_uid) {
  // Length-prefixed: no two pairs of names give one key.
  return strCat(req.src_group().size(), ":", req.src_group(), req.dst_group().size(), ":", req.dst_group(),
                caller_uid ? strCat("uid ", *caller_uid) : std::string("any"));
}

std::shared_ptr<const RepeatView> RepeatCache::find(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = views_.find(key);
  return it == views_.end() ? nullptr : it->second.second;
}

namespace {

// Keeps `value` under `key` in `kept` (key -> (age, value)), the oldest going beyond kMaxViews.
template <typename T>
void keepBounded(std::map<std::string, std::pair<uint64_t, T>>& kept, uint64_t& next, const std::string& key, T value) {
  kept[key] = {next++, std::move(value)};
  if (kept.size() <= RepeatCache::kMaxViews) return;
  auto oldest = kept.begin();
  for (auto it = kept.begin(); it != kept.end(); ++it)
    if (it->second.first < oldest->second.first) oldest = it;
  kept.erase(oldest);
}

}  // namespace

void RepeatCache::keep(const std::string& key, std::shared_ptr<const RepeatView> view) {
  std::lock_guard<std::mutex> lock(mu_);
  keepBounded(views_, next_, key, std::move(view));
}

void RepeatCache::forget(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  views_.erase(key);
  sets_.erase(key);
}

std::optional<SetMemo> RepeatCache::findSet(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = sets_.find(key);
  if (it == sets_.end()) return std::nullopt;
  return it->second.second;
}

void RepeatCache::keepSet(const std::string& key, SetMemo memo) {
  std::lock_guard<std::mutex> lock(mu_);
  keepBounded(sets_, next_, key, std::move(memo));
}

int RepeatCache::setStale(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  views_.erase(key);
  const auto it = sets_.find(key);
  return it == sets_.end() ? 0 : ++it->second.second.stale_refusals;
}

}  // namespace shardcast::daemon
