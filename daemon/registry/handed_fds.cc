// The one-time tokens of handed-over descriptors (daemon/registry/handed_fds.h).
#include "daemon/registry/handed_fds.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "common/strings.h"

namespace shardcast::daemon {

StatusOr<std::string> HandedFds::put(uid_t uid, std::vector<OwnedFd> fds) {
  unsigned char raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    const ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(strCat("getrandom: ", std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : raw) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  const auto now = std::chrono::steady_clock::now();
  const size_t n = fds.size();
  std::vector<Entry> dropped;  // closed after mu_ is released (declared before the lock)
  std::lock_guard<std::mutex> lock(mu_);
  expire(now, &dropped);
  size_t held = 0, held_fds = 0, total_fds = 0;
  for (const auto& [t, e] : by_token_) {
    total_fds += e.fds.size();
    if (e.uid == uid) {
      ++held;
      held_fds += e.fds.size();
    }
  }
  // This uid's oldest tokens make room for its new one (its own, never another uid's).
  while (held > 0 && (held >= kPerUid || held_fds + n > kFdsPerUid)) {
    auto oldest = by_token_.end();
    for (auto it = by_token_.begin(); it != by_token_.end(); ++it)
      if (it->second.uid == uid && (oldest == by_token_.end() || it->second.at < oldest->second.at)) oldest = it;
    --held;
    held_fds -= oldest->second.fds.size();
    total_fds -= oldest->second.fds.size();
    dropped.push_back(std::move(oldest->second));
    by_token_.erase(oldest);
  }
  if (total_fds + n > kFdsTotal)
    return absl::ResourceExhaustedError(strCat("this daemon holds ", total_fds, " handed-over descriptors not yet ",
                                               "registered (at most ", kFdsTotal, "): register what was handed over, ",
                                               "or hand over again in a while"));
  by_token_[token] = Entry{uid, std::move(fds), now};
  return token;
}

StatusOr<std::vector<OwnedFd>> HandedFds::take(const std::string& token, uid_t uid, bool any_owner) {
  std::vector<Entry> dropped;  // closed after mu_ is released (declared before the lock)
  std::lock_guard<std::mutex> lock(mu_);
  expire(std::chrono::steady_clock::now(), &dropped);
  auto it = by_token_.find(token);
  if (it == by_token_.end())
    return absl::NotFoundError(strCat("descriptor token ", quote(token, 40),
                                      " is not one this daemon's descriptor channel gave out, or was used already "
                                      "(each names one registration) or expired unused"));
  if (it->second.uid != uid && !any_owner)  // left for its owner: a token another uid learnt proves nothing
    return absl::PermissionDeniedError(strCat("descriptor token ", quote(token, 40), " was handed over by uid ",
                                              it->second.uid, ", not by uid ", uid));
  auto fds = std::move(it->second.fds);
  by_token_.erase(it);
  return fds;
}

void HandedFds::sweep(std::chrono::steady_clock::time_point now) {
  std::vector<Entry> dropped;  // closed after mu_ is released (declared before the lock)
  std::lock_guard<std::mutex> lock(mu_);
  expire(now, &dropped);
}

size_t HandedFds::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_token_.size();
}

void HandedFds::expire(std::chrono::steady_clock::time_point now, std::vector<Entry>* dropped) {
  for (auto it = by_token_.begin(); it != by_token_.end();) {
    if (now - it->second.at <= kUnclaimedFor) {
      ++it;
      continue;
    }
    dropped->push_back(std::move(it->second));
    it = by_token_.erase(it);
  }
}

}  // namespace shardcast::daemon
