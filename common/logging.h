// Logging set-up shared by every Shardcast binary: one spdlog logger to stderr, level by name.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "common/status.h"

namespace shardcast {

// Levels: trace, debug, info, warn, error, critical, off. INVALID_ARGUMENT for anything else.
Status setupLogging(std::string_view level);

// Logs of what callers and peers cause, one line per kind per interval: allow(key) is true for
// the first event of `key` in each interval, and then says how many were held back since the last
// line (`*held`). Keys are bounded (the oldest forgotten past 4,096), so callers cannot grow it.
class LogLimiter {
 public:
  explicit LogLimiter(std::chrono::seconds interval = std::chrono::seconds(10)) : interval_(interval) {}
  bool allow(const std::string& key, uint64_t* held);

 private:
  struct Seen {
    std::chrono::steady_clock::time_point last;
    uint64_t held = 0;
  };
  const std::chrono::seconds interval_;
  std::mutex mu_;
  std::map<std::string, Seen> seen_;
};

}  // namespace shardcast
