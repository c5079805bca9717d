// String building for error messages. (Debian's abseil is built with its own string_view, so
// absl::StrCat does not take std::string_view; these take anything streamable.)
#pragma once

#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>

namespace shardcast {

// The most bytes of any input an error message or log line repeats.
inline constexpr size_t kQuoteMax = 200;

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

// Any input quoted in an error or a log line: in double quotes, control and non-ASCII bytes
// escaped, cut after `max` bytes with the full length stated (a 10 MB name costs a line, not 10 MB).
inline std::string quote(std::string_view s, size_t max = kQuoteMax) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  if (s.size() > max) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

}  // namespace shardcast
