// Where a test, a benchmark or the demo finds a program it starts: the path CMake compiled in, or,
// when SHARDCAST_BIN_DIR is set, the program of that name in that directory (a bundle of the
// binaries moved to another machine, where the build's paths do not exist: scripts/device-check.sh).
#pragma once

#include <cstdlib>
#include <string>

namespace shardcast {

inline std::string testBinary(const std::string& compiled) {
  const char* dir = std::getenv("SHARDCAST_BIN_DIR");
  if (dir == nullptr || *dir == '\0') return compiled;
  const size_t slash = compiled.rfind('/');
  return std::string(dir) + "/" + (slash == std::string::npos ? compiled : compiled.substr(slash + 1));
}

}  // namespace shardcast
