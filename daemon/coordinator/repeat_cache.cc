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

void RepeatCache::keep(const std::string& key, std::shared_ptr<const RepeatView> view) {
  std::lock_guard<std::mutex> lock(mu_);
  views_[key] = {next_++, std::move(view)};
  if (views_.size() <= kMaxViews) return;
  auto oldest = views_.begin();
  for (auto it = views_.begin(); it != views_.end(); ++it)
    if (it->second.first < oldest->second.first) oldest = it;
  views_.erase(oldest);
}

void RepeatCache::forget(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  views_.erase(key);
}

}  // namespace shardcast::daemon
