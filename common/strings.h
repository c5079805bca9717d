// String building for error messages. (Debian's abseil is built with its own string_view, so
// absl::StrCat does not take std::string_view; these take anything streamable.)
#pragma once

#include <algorithm>
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

// `s` safe for a terminal or one line of text: bytes below 0x20, DEL and every byte >= 0x80
// written as \xNN (no escape sequence, line break or C1 control of a name reaches an operator's
// screen or forges a log line), cut after `max` bytes with the full length stated.
inline std::string shown(std::string_view s, size_t max = std::string_view::npos) {
  std::string out;
  out.reserve(std::min(s.size(), max));
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > max) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

// Whether `s` holds a byte shown() escapes but for UTF-8 text: a control character (below 0x20,
// DEL, or C1 U+0080-U+009F) or a byte that is not valid UTF-8. Names that reach logs, metrics and
// terminals (groups, replica sets) are refused with one.
inline bool hasControlOrInvalidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) return true;
    if (c < 0x80) {
      ++i;
      continue;
    }
    const size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c <= 0xdf ? 2 : 0;
    if (n == 0 || i + n > s.size()) return true;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return true;
    if (c == 0xc2 && static_cast<unsigned char>(s[i + 1]) < 0xa0) return true;  // C1 controls
    i += n;
  }
  return false;
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
