// The `shardcast` CLI against real daemons: sync (progress lines when not a terminal, JSON result),
// watch, status, layouts, wait; exit codes for usage errors, an unreachable daemon, failed syncs.
#include <google/protobuf/util/json_util.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <future>

#include "tests/client/client_cluster.h"

#ifndef SHARDCAST_CLI_PATH
#define SHARDCAST_CLI_PATH "shardcast"
#endif

using namespace shardcast;
using namespace shardcast::testing;

namespace {

struct Run {
  int rc = -1;
  std::string out;  // stdout (stderr goes to the test's log)
};

Run cli(std::vector<std::string> args) {
  args.insert(args.begin(), testBinary(SHARDCAST_CLI_PATH));
  Child c = Child::spawn(args);
  Run r;
  while (true) {
    std::string line = c.readLine(std::chrono::seconds(60));
    if (line.empty() && c.readLine(std::chrono::milliseconds(200)).empty()) break;  // EOF (or a quiet minute)
    r.out += line + "\n";
  }
  const int status = c.wait();
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

template <typename M>
M parse(const std::string& json) {
  M m;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &m);
  INFO(json);
  REQUIRE(st.ok());
  return m;
}

}  // namespace

TEST_CASE("CLI: sync, watch, status, layouts and wait against a running cluster", "[cli][daemon]") {
  ClientCluster cluster;
  const std::string daemon = "unix:" + cluster.daemons[0]->socketPath();
  cluster.fillSource(1);

  // A sync in text mode: progress lines go to stderr, the result to stdout.
  auto text = cli({"sync", "--src", "trainer", "--dst", "infer", "--version", "1", "--daemon", daemon, "--verify"});
  INFO(text.out);
  REQUIRE(text.rc == 0);
  CHECK_THAT(text.out, Catch::Contains("committed: \"trainer\" -> \"infer\" version 1"));
  CHECK(cluster.badDestinationElements(1) == 0);

  // --json: one SyncResponse object.
  cluster.fillSource(2);
  auto json = cli({"sync", "--src", "trainer", "--dst", "infer", "--version", "2", "--daemon", daemon, "--json",
                   "--sync-id", "cli-json-2"});
  REQUIRE(json.rc == 0);
  const auto resp = parse<v1::SyncResponse>(json.out);
  CHECK(resp.version() == 2);
  CHECK(resp.sync_id() == "cli-json-2");
  CHECK(resp.plan_cached());
  CHECK(resp.network_bytes() == 16 * 8 * 4 + 8 * 16 * 4);
  CHECK(cluster.badDestinationElements(2) == 0);

  // watch: a sync started elsewhere, followed as JSON lines until committed.
  cluster.fillSource(3);
  auto sync3 = std::async(std::launch::async, [&] {
    return cli({"sync", "--src", "trainer", "--dst", "infer", "--version", "3", "--daemon", daemon, "--sync-id",
                "cli-watched", "--no-progress"});
  });
  auto watched = cli({"watch", "cli-watched", "--daemon", daemon, "--json"});
  CHECK(sync3.get().rc == 0);
  REQUIRE(watched.rc == 0);
  std::string last;
  for (size_t at = 0, nl; (nl = watched.out.find('\n', at)) != std::string::npos; at = nl + 1)
    if (nl > at) last = watched.out.substr(at, nl - at);
  const auto progress = parse<v1::SyncProgress>(last);
  CHECK(progress.state() == "committed");
  CHECK(progress.bytes_done() == progress.bytes_total());

  auto status = cli({"status", "--daemon", daemon, "--json"});
  REQUIRE(status.rc == 0);
  const auto st = parse<v1::StatusResponse>(status.out);
  CHECK(st.node() == "n0");
  CHECK(st.peers_size() == 2);
  REQUIRE(st.groups_size() == 1);
  CHECK(st.groups(0).group() == "trainer");
  auto status_text = cli({"status", "--daemon", daemon});
  REQUIRE(status_text.rc == 0);
  CHECK_THAT(status_text.out, Catch::Contains("2 rank(s)"));
  CHECK_THAT(status_text.out, Catch::Contains("trainer"));

  auto layouts = cli({"layouts", "--daemon", daemon, "--json"});
  REQUIRE(layouts.rc == 0);
  const auto list = parse<v1::ListResponse>(layouts.out);
  CHECK(list.ranks_size() == 4);
  auto table = cli({"layouts", "--daemon", daemon});
  REQUIRE(table.rc == 0);
  CHECK_THAT(table.out, Catch::Contains("GROUP"));
  CHECK_THAT(table.out, Catch::Contains("infer"));
  auto local = cli({"layouts", "--daemon", daemon, "--local", "--json"});
  CHECK(parse<v1::ListResponse>(local.out).ranks_size() == 2);

  const std::string n1 = "unix:" + cluster.daemons[1]->socketPath();
  auto reached = cli({"wait", "--group", "infer", "--version", "3", "--daemon", n1, "--json"});
  CHECK(reached.rc == 0);
  CHECK_THAT(reached.out, Catch::Contains("\"reached\":true"));
  auto not_yet = cli({"wait", "--group", "infer", "--version", "9", "--timeout-s", "0.2", "--daemon", n1});
  CHECK(not_yet.rc == 5);
  CHECK_THAT(not_yet.out, Catch::Contains("version 3"));

  auto health = cli({"health", "--daemon", daemon});
  CHECK(health.rc == 0);
  CHECK_THAT(health.out, Catch::Contains("SERVING"));
  CHECK(cli({"health", "--daemon", daemon, "--service", "no.such.Service"}).rc == 5);

  // Failed syncs exit 5: an old version, an unknown group.
  CHECK(cli({"sync", "--src", "trainer", "--dst", "infer", "--version", "3", "--daemon", daemon}).rc == 5);
  CHECK(cli({"sync", "--src", "trainer", "--dst", "nobody", "--version", "4", "--daemon", daemon}).rc == 5);
}

TEST_CASE("CLI: exit codes tell usage errors and an unreachable daemon apart", "[cli][slow]") {
  CHECK(cli({"sync", "--src", "a", "--dst", "b"}).rc == 2);  // --version missing
  CHECK(cli({"sync", "--src", "a", "--dst", "b", "--version", "x"}).rc == 2);
  CHECK(cli({"sync", "--src", "a", "--dst", "b", "--version", "0"}).rc == 2);
  CHECK(cli({"nonsense"}).rc == 2);
  const std::string nowhere = "unix:/tmp/shardcast-cli-nobody.sock";
  CHECK(cli({"sync", "--src", "a", "--dst", "b", "--version", "1", "--daemon", nowhere}).rc == 4);
  CHECK(cli({"status", "--daemon", nowhere}).rc == 4);
  CHECK(cli({"layouts", "--daemon", nowhere, "--json"}).rc == 4);
  CHECK(cli({"watch", "x", "--daemon", nowhere}).rc == 4);
  CHECK(cli({"wait", "--group", "g", "--version", "1", "--daemon", nowhere}).rc == 4);
  CHECK(cli({"health", "--daemon", nowhere, "--timeout-s", "0.5"}).rc == 4);
}
