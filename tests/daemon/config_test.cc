// The daemon's configuration: a link rate sizes chunks and the write window unless they are given.
#include "daemon/config.h"

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
  CHECK(plain->chunk_mib == 64);  // no link rate: the defaults
  CHECK(plain->window_mib == 128);
  const std::vector<std::pair<std::string, int64_t>> rates{{"1", 1},   {"2", 1},    {"10", 8},
                                                           {"25", 16}, {"100", 64}, {"400", 64}};
  for (const auto& [gbps, chunk] : rates) {
    auto c = parse({"--nic-gbps=" + gbps});
    REQUIRE(c.ok());
    INFO(gbps << " Gbit/s");
    CHECK(c->chunk_mib == chunk);
    CHECK(c->window_mib == 2 * chunk);
    CHECK(c->nic_gbps == std::stod(gbps));
  }
  auto given = parse({"--nic-gbps=1", "--chunk-mib=4"});
  REQUIRE(given.ok());
  CHECK(given->chunk_mib == 4);
  CHECK(given->window_mib == 8);  // two of the chunks given
  auto both = parse({"--nic-gbps=1", "--chunk-mib=4", "--window-mib=32"});
  REQUIRE(both.ok());
  CHECK(both->window_mib == 32);
  CHECK(!parse({"--nic-gbps=-1"}).ok());
}
