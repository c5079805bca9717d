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
  std::lock_guard<std::mutex> lock(mu_);
  expire(now);
  size_t held = 0;
  auto oldest = by_token_.end();
  for (auto it = by_token_.begin(); it != by_token_.end(); ++it)
    if (it->second.uid == uid) {
      ++held;
      if (oldest == by_token_.end() || it->second.at < oldest->second.at) oldest = it;
    }
  if (held >= kPerUid) by_token_.erase(oldest);
  by_token_[token] = Entry{uid, std::move(fds), now};
  return token;
}

StatusOr<std::vector<OwnedFd>> HandedFds::take(const std::string& token, uid_t uid, bool any_owner) {
  std::lock_guard<std::mutex> lock(mu_);
  expire(std::chrono::steady_clock::now());
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

size_t HandedFds::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_token_.size();
}

void HandedFds::expire(std::chrono::steady_clock::time_point now) {
  for (auto it = by_token_.begin(); it != by_token_.end();)
    it = now - it->second.at > kUnclaimedFor ? by_token_.erase(it) : std::next(it);
}

}  // namespace shardcast::daemon
