#include "common/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <ctime>
#include <string>

namespace shardcast {

namespace {

thread_local LogScope::Fields scope_fields;

void put(spdlog::memory_buf_t& out, std::string_view s) { out.append(s.data(), s.data() + s.size()); }

void appendJsonString(spdlog::memory_buf_t& out, std::string_view s) {
  out.push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        put(out, "\\\"");
        break;
      case '\\':
        put(out, "\\\\");
        break;
      case '\n':
        put(out, "\\n");
        break;
      case '\r':
        put(out, "\\r");
        break;
      case '\t':
        put(out, "\\t");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          put(out, esc);
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

class JsonFormatter : public spdlog::formatter {
 public:
  explicit JsonFormatter(std::string node) : node_(std::move(node)) {}
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since = msg.time.time_since_epoch();
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(since);
    const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(since - secs).count();
    const std::time_t t = static_cast<std::time_t>(secs.count());
    std::tm tm{};
    gmtime_r(&t, &tm);
    char when[80];  // 25 bytes; room for any int the compiler cannot rule out
    std::snprintf(when, sizeof(when), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                  tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(millis));
    put(dest, "{\"time\":\"");
    put(dest, when);
    put(dest, "\",\"level\":");
    const auto level = spdlog::level::to_string_view(msg.level);
    appendJsonString(dest, std::string_view(level.data(), level.size()));
    if (!node_.empty()) {
      put(dest, ",\"node\":");
      appendJsonString(dest, node_);
    }
    const auto& f = LogScope::current();
    if (!f.sync.empty()) {
      put(dest, ",\"sync\":");
      appendJsonString(dest, f.sync);
    }
    if (!f.group.empty()) {
      put(dest, ",\"group\":");
      appendJsonString(dest, f.group);
    }
    if (f.rank >= 0) {
      put(dest, ",\"rank\":");
      put(dest, std::to_string(f.rank));
    }
    put(dest, ",\"msg\":");
    appendJsonString(dest, std::string_view(msg.payload.data(), msg.payload.size()));
    put(dest, "}\n");
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(node_); }

 private:
  const std::string node_;
};

// The text format's message (%*): control characters written as \xNN, so that a name holding a
// line break cannot forge a log line, nor an escape sequence reach the terminal reading the log.
// (UTF-8 text passes: it is not a control.)
class EscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    for (const char ch : std::string_view(msg.payload.data(), msg.payload.size())) {
      const auto c = static_cast<unsigned char>(ch);
      if (c >= 0x20 && c != 0x7f) {
        dest.push_back(ch);
        continue;
      }
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      put(dest, hex);
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<EscapedMessage>(); }
};

}  // namespace

std::unique_ptr<spdlog::formatter> makeTextFormatter() {
  auto f = std::make_unique<spdlog::pattern_formatter>();
  f->add_flag<EscapedMessage>('*').set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %*");
  return f;
}

LogScope::LogScope(std::string sync, std::string group, int32_t rank) : saved_(scope_fields) {
  if (!sync.empty()) scope_fields.sync = std::move(sync);
  if (!group.empty()) scope_fields.group = std::move(group);
  if (rank >= 0) scope_fields.rank = rank;
}

LogScope::~LogScope() { scope_fields = std::move(saved_); }

const LogScope::Fields& LogScope::current() { return scope_fields; }

std::unique_ptr<spdlog::formatter> makeJsonFormatter(const std::string& node) {
  return std::make_unique<JsonFormatter>(node);
}

Status setupLogging(std::string_view level, std::string_view format, const std::string& node) {
  if (format != "text" && format != "json")
    return absl::InvalidArgumentError("unknown log format \"" + std::string(format) + "\" (text, json)");
  const auto parsed = spdlog::level::from_str(std::string(level));
  // from_str maps unknown names to "off"; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError("unknown log level \"" + std::string(level) +
                                      "\" (trace, debug, info, warn, error, critical, off)");
  }
  auto logger = spdlog::get("shardcast");
  if (!logger) logger = spdlog::stderr_color_mt("shardcast");
  if (format == "json")
    logger->set_formatter(makeJsonFormatter(node));
  else
    logger->set_formatter(makeTextFormatter());
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
