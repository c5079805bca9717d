#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <string>

namespace shardcast {

Status setupLogging(std::string_view level) {
  const auto parsed = spdlog::level::from_str(std::string(level));
  // from_str maps unknown names to "off"; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError("unknown log level \"" + std::string(level) +
                                      "\" (trace, debug, info, warn, error, critical, off)");
  }
  auto logger = spdlog::get("shardcast");
  if (!logger) logger = spdlog::stderr_color_mt("shardcast");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(parsed);
  return absl::OkStatus();
}

bool LogLimiter::allow(const std::string& key, uint64_t* held) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(key);
  if (it == seen_.end()) {
    if (seen_.size() >= 4096) seen_.clear();  // a flood of distinct keys: start over, never grow
    seen_.emplace(key, Seen{now, 0});
    *held = 0;
    return true;
  }
  if (now - it->second.last < interval_) {
    ++it->second.held;
    return false;
  }
  *held = it->second.held;
  it->second = Seen{now, 0};
  return true;
}

}  // namespace shardcast
