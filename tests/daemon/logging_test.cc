// JSON logs (--log-format json): one object per line, every line parses, escapes hold, and the
// fields a LogScope names (sync, group, rank) appear while it lives on the logging thread and not
// after. A daemon started with the flag is in client/python/tests/test_daemon_hygiene.py.
#include "common/logging.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <catch2/catch.hpp>
#include <sstream>
#include <thread>

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
