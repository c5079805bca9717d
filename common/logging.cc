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

}  // namespace shardcast
