// JSON logs (--log-format json): one object per line, every line parses, escapes hold, and the
// fields a LogScope names (sync, group, rank) appear while it lives on the logging thread and not
// after. A daemon started with the flag is in client/python/tests/test_daemon_hygiene.py.
#include "common/logging.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <sstream>
#include <thread>

#include "common/strings.h"

using namespace shardcast;

namespace {

std::vector<google::protobuf::Struct> lines(const std::string& text) {
  std::vector<google::protobuf::Struct> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    google::protobuf::Struct s;
    INFO(line);
    REQUIRE(google::protobuf::util::JsonStringToMessage(line, &s).ok());
    out.push_back(std::move(s));
  }
  return out;
}

std::string field(const google::protobuf::Struct& s, const std::string& name) {
  const auto it = s.fields().find(name);
  if (it == s.fields().end()) return "(absent)";
  if (it->second.has_number_value()) return std::to_string(static_cast<int64_t>(it->second.number_value()));
  return it->second.string_value();
}

}  // namespace

TEST_CASE("logs: json lines carry time, level, node and the scope's sync, group and rank", "[daemon][logging]") {
  std::ostringstream text;
  spdlog::logger logger("json-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(text));
  logger.set_formatter(makeJsonFormatter("n7"));
  logger.info("plain \"quoted\" \\ back\nsecond line\t\x01 end");
  {
    const LogScope sync("s-1", "infer");
    logger.warn("in a sync");
    {
      const LogScope rank("", "", 3);
      logger.error("about a rank");
    }
    std::thread other([&] { logger.info("another thread"); });  // scopes are per thread
    other.join();
  }
  logger.info("after");
  const auto got = lines(text.str());
  REQUIRE(got.size() == 5);
  CHECK(field(got[0], "level") == "info");
  CHECK(field(got[0], "node") == "n7");
  CHECK(field(got[0], "msg") == "plain \"quoted\" \\ back\nsecond line\t\x01 end");
  CHECK(field(got[0], "sync") == "(absent)");
  CHECK(field(got[0], "time").size() == 24);  // 2026-12-02T17:29:16.123Z
  CHECK(field(got[0], "time").back() == 'Z');
  CHECK(field(got[1], "level") == "warning");
  CHECK(field(got[1], "sync") == "s-1");
  CHECK(field(got[1], "group") == "infer");
  CHECK(field(got[1], "rank") == "(absent)");
  CHECK(field(got[2], "level") == "error");
  CHECK(field(got[2], "sync") == "s-1");  // the outer scope's, with the inner one's rank
  CHECK(field(got[2], "rank") == "3");
  CHECK(field(got[3], "sync") == "(absent)");
  CHECK(field(got[4], "sync") == "(absent)");
  CHECK(field(got[4], "group") == "(absent)");
}

TEST_CASE("logs: an unknown format or level is refused, naming the choices", "[daemon][logging]") {
  CHECK(setupLogging("info", "xml").code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(setupLogging("info", "xml").message()).find("text, json") != std::string::npos);
  CHECK(setupLogging("loud", "text").code() == absl::StatusCode::kInvalidArgument);
  CHECK(setupLogging("info", "text").ok());
}

TEST_CASE("logs: a name with a line break or an escape sequence cannot forge a text line or reach the terminal",
          "[daemon][logging][security]") {
  std::ostringstream text;
  spdlog::logger logger("text-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(text));
  logger.set_formatter(makeTextFormatter());
  // What a group named to forge a line, clear the screen and write the clipboard (OSC 52) would log.
  logger.warn("register refused: group {}",
              "g\n2026-12-04T00:00:00.000 info [shardcast] sync ok\x1b[2J\x1b]52;c;eA==\x07");
  logger.info("caf\xc3\xa9 -> ok");  // UTF-8 text passes
  const std::string out = text.str();
  CHECK(std::count(out.begin(), out.end(), '\n') == 2);  // one line each
  CHECK(out.find('\x1b') == std::string::npos);
  CHECK(out.find('\x07') == std::string::npos);
  CHECK_THAT(
      out, Catch::Contains("group g\\x0a2026-12-04T00:00:00.000 info [shardcast] sync ok\\x1b[2J\\x1b]52;c;eA==\\x07"));
  CHECK_THAT(out, Catch::Contains("caf\xc3\xa9 -> ok"));
}

TEST_CASE("names: shown() escapes what a terminal would act on, control characters and bad UTF-8 are found",
          "[daemon][logging][security]") {
  CHECK(shown("vllm") == "vllm");
  CHECK(shown("a\nb\x1b]0;title\x07") == "a\\x0ab\\x1b]0;title\\x07");
  CHECK(shown("\xc2\x9b"
              "2J") == "\\xc2\\x9b2J");  // C1 CSI, as UTF-8
  CHECK(shown("abcdef", 3) == "abc... (6 bytes)");
  CHECK_FALSE(hasControlOrInvalidUtf8("vllm-0.tp_2"));
  CHECK_FALSE(hasControlOrInvalidUtf8("模型-\xc2\xa0x"));  // UTF-8 text, a no-break space
  CHECK(hasControlOrInvalidUtf8("a\nb"));
  CHECK(hasControlOrInvalidUtf8("a\x1b[2J"));
  CHECK(hasControlOrInvalidUtf8("a\x7f"));
  CHECK(hasControlOrInvalidUtf8("a\xc2\x9b"));  // C1
  CHECK(hasControlOrInvalidUtf8("a\x9b"));      // a lone continuation byte
  CHECK(hasControlOrInvalidUtf8("a\xe6\xa8"));  // cut short
  CHECK(hasControlOrInvalidUtf8("a\xc0\xaf"));  // overlong
}
