// The daemon's configuration: a link rate sizes chunks and the write window unless they are given.
#include "daemon/server/config.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

StatusOr<DaemonConfig> parse(std::vector<std::string> args) {
  args.insert(args.begin(), "shardcastd");
  args.push_back("--listen");
  args.push_back("");  // one node: no TLS needed
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  int exit_code = 0;
  std::string output;
  return parseConfig(static_cast<int>(argv.size()), argv.data(), &exit_code, &output);
}

}  // namespace

TEST_CASE("config: --nic-gbps sizes chunks (about 8 ms on the link) and a window of two chunks", "[daemon][config]") {
  auto plain = parse({});
  REQUIRE(plain.ok());
  constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;
  CHECK(plain->chunk_bytes == 64 * kMiB);  // no link rate: the defaults
  CHECK(plain->window_bytes == 128 * kMiB);
  const std::vector<std::pair<std::string, int64_t>> rates{
      {"0.01", 64 * kKiB}, {"0.25", 256 * kKiB}, {"0.5", 512 * kKiB}, {"1", kMiB},       {"2", 2 * kMiB},
      {"10", 8 * kMiB},    {"25", 32 * kMiB},    {"100", 64 * kMiB},  {"400", 64 * kMiB}};
  for (const auto& [gbps, chunk] : rates) {
    auto c = parse({"--nic-gbps=" + gbps});
    REQUIRE(c.ok());
    INFO(gbps << " Gbit/s");
    CHECK(c->chunk_bytes == chunk);
    CHECK(c->window_bytes == 2 * chunk);
    CHECK(c->nic_gbps == std::stod(gbps));
  }
  auto given = parse({"--nic-gbps=1", "--chunk-mib=4"});
  REQUIRE(given.ok());
  CHECK(given->chunk_bytes == 4 * kMiB);
  CHECK(given->window_bytes == 8 * kMiB);  // two of the chunks given
  auto both = parse({"--nic-gbps=1", "--chunk-mib=4", "--window-mib=32"});
  REQUIRE(both.ok());
  CHECK(both->window_bytes == 32 * kMiB);
  auto unsized = parse({"--chunk-mib=2", "--window-mib=3"});
  REQUIRE(unsized.ok());
  CHECK(unsized->chunk_bytes == 2 * kMiB);
  CHECK(unsized->window_bytes == 3 * kMiB);
  CHECK(!parse({"--nic-gbps=-1"}).ok());
}
