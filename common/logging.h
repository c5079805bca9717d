// Logging set-up shared by every Shardcast binary: one spdlog logger to stderr, level by name,
// lines for humans (text) or one JSON object per line for log pipelines (json).
#pragma once

#include <spdlog/formatter.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/status.h"

namespace shardcast {

// Levels: trace, debug, info, warn, error, critical, off; formats: text, json. INVALID_ARGUMENT
// for anything else. `node` goes into every JSON line.
Status setupLogging(std::string_view level, std::string_view format = "text", const std::string& node = "");

// JSON lines: {"time":"2026-12-02T17:29:16.123Z","level":"info","node":"n0","sync":"s-1",
// "group":"infer","rank":3,"msg":"..."}; sync, group and rank only where a LogScope on the
// logging thread names them.
std::unique_ptr<spdlog::formatter> makeJsonFormatter(const std::string& node);
// Text lines: "2026-12-02T17:29:16.123 info [shardcast] msg", the message's control characters
// written as \xNN (a name with a line break cannot forge a line).
std::unique_ptr<spdlog::formatter> makeTextFormatter();

// What the log lines of this thread are about while the scope lives (a handler's sync, a rank's
// registration); scopes nest, the inner one's fields win where it sets them.
class LogScope {
 public:
  explicit LogScope(std::string sync, std::string group = "", int32_t rank = -1);
  ~LogScope();
  LogScope(const LogScope&) = delete;
  LogScope& operator=(const LogScope&) = delete;

  struct Fields {
    std::string sync;
    std::string group;
    int32_t rank = -1;
  };
  static const Fields& current();

 private:
  Fields saved_;
};

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
