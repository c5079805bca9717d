// String building for error messages. (Debian's abseil is built with its own string_view, so
// absl::StrCat does not take std::string_view; these take anything streamable.)
#pragma once

#include <sstream>
#include <string>

namespace shardcast {

template <typename... Args>
std::string strCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename Container>
std::string strJoin(const Container& items, const char* sep) {
  std::ostringstream os;
  bool first = true;
  for (const auto& item : items) {
    if (!first) os << sep;
    os << item;
    first = false;
  }
  return os.str();
}

}  // namespace shardcast
