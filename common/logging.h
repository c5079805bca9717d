// Logging set-up shared by every Shardcast binary: one spdlog logger to stderr, level by name.
#pragma once

#include <string_view>

#include "common/status.h"

namespace shardcast {

// Levels: trace, debug, info, warn, error, critical, off. INVALID_ARGUMENT for anything else.
Status setupLogging(std::string_view level);

}  // namespace shardcast
