// `shardcast top`'s screen from Status and List answers: groups with their versions and rank
// states, dirty ranks named, syncs running before ended ones, failures with their errors, and no
// line wider than the terminal. The live view in a terminal is tested in client/python
// (test_cli_top.py, in tmux).
#include "client/cli/top_view.h"

#include <catch2/catch.hpp>
#include <sstream>

using namespace shardcast;
using Catch::Matchers::Contains;

namespace {

v1::RankRegistration rank(const std::string& group, int32_t r, int32_t world, const std::string& node, v1::Role role,
                          v1::RankState state, uint64_t version, const std::string& detail = "") {
  v1::RankRegistration out;
  out.set_group(group);
  out.set_rank(r);
  out.set_world_size(world);
  out.set_node(node);
  out.set_role(role);
  out.set_state(state);
  out.set_version(version);
  out.set_detail(detail);
  return out;
}

v1::SyncProgress sync(const std::string& id, v1::SyncPhase phase, const std::string& state, uint64_t version,
                      double started) {
  v1::SyncProgress p;
  p.set_sync_id(id);
  p.set_phase(phase);
  p.set_state(state);
  p.set_src_group("trainer");
  p.set_dst_group("rollout");
  p.set_version(version);
  p.set_coordinator("n0");
  p.set_started_unix_seconds(started);
  return p;
}

std::vector<std::string> linesOf(const std::string& screen) {
  std::vector<std::string> out;
  std::istringstream in(screen);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

}  // namespace

TEST_CASE("top: groups, dirty ranks, syncs running first, failures, within the width", "[client][top]") {
  v1::StatusResponse status;
  status.set_node("n0");
  status.set_version("0.9.0");
  auto* self = status.add_peers();
  self->set_node("n0");
  self->set_reachable(true);
  auto* down = status.add_peers();
  down->set_address("10.0.0.2:7070");
  down->set_node("n2");
  down->set_error("connection refused");
  *status.add_syncs() = sync("s-old", v1::SYNC_COMMITTED, "committed", 6, 100);
  auto failed = sync("s-failed", v1::SYNC_FAILED, "failed", 7, 200);
  failed.set_error(std::string("node \"n1\" did not answer within 10 s: ") + std::string(200, 'x'));
  *status.add_syncs() = failed;
  auto running = sync("s-running", v1::SYNC_EXECUTING, "executing", 8, 300);
  running.set_bytes_total(1000);
  running.set_bytes_done(450);
  running.set_waves(2);
  running.set_waves_done(1);
  *status.add_syncs() = running;

  v1::ListResponse list;
  *list.add_ranks() = rank("trainer", 0, 2, "n0", v1::ROLE_SOURCE, v1::RANK_READY, 8);
  *list.add_ranks() = rank("trainer", 1, 2, "n0", v1::ROLE_SOURCE, v1::RANK_READY, 8);
  *list.add_ranks() = rank("rollout", 0, 3, "n0", v1::ROLE_DESTINATION, v1::RANK_READY, 6);
  *list.add_ranks() = rank("rollout", 1, 3, "n1", v1::ROLE_DESTINATION, v1::RANK_DIRTY, 6, "sync s-failed: aborted");
  *list.add_ranks() = rank("rollout", 2, 3, "n1", v1::ROLE_DESTINATION, v1::RANK_UPDATING, 8);
  // Replica set "fleet": replica 0 at 8, replica 1 at 7 and missing a rank.
  for (int32_t r = 0; r < 2; ++r) {
    auto a = rank("fleet.r0", r, 2, "n2", v1::ROLE_DESTINATION, v1::RANK_READY, 8);
    a.set_replica_set("fleet");
    *list.add_ranks() = a;
  }
  auto b = rank("fleet.r1", 0, 2, "n3", v1::ROLE_DESTINATION, v1::RANK_READY, 7);
  b.set_replica_set("fleet");
  b.set_replica(1);
  *list.add_ranks() = b;

  cli::TopScreen screen;
  screen.clock = "12:34:56";
  const std::string out = cli::renderTop(status, list, screen);
  const auto lines = linesOf(out);
  for (const auto& l : lines) CHECK(l.size() <= 80);
  CHECK_THAT(lines.at(0), Contains("node n0") && Contains("peers 0/1 reachable") && Contains("12:34:56"));
  CHECK_THAT(out, Contains("unreachable: n2 (connection refused)"));
  // Group rows: role, versions held by READY ranks, ranks registered of the world, states, nodes.
  CHECK_THAT(out, Contains("trainer            src          8       2/2     2        0     0     0     1"));
  CHECK_THAT(out, Contains("rollout            dst          6       3/3     1        1     1     0     2"));
  CHECK_THAT(out, Contains("! dirty rank 1 on n1: sync s-failed: aborted"));
  CHECK_THAT(out, Contains("fleet.r1           dst          7       1/2     1        0     0     0     1"));
  CHECK_THAT(out, Contains("set fleet: 2 replicas (1 complete), versions 7-8"));
  // Syncs: the running one first with its progress, then the newest ended.
  const size_t table = out.find("FROM -> TO");
  const auto at = [&](const std::string& text) { return out.find(text, table); };
  REQUIRE(at("s-running") != std::string::npos);
  CHECK(at("s-running") < at("s-failed"));
  CHECK(at("s-failed") < at("s-old"));
  CHECK_THAT(out, Contains("45% w1/2"));
  CHECK_THAT(out, Contains("trainer -> rollout"));
  // The failure, with the start of its error on two lines at most.
  CHECK_THAT(out, Contains("RECENT FAILURES"));
  CHECK_THAT(out, Contains("s-failed v7 (trainer -> rollout, on n0):"));
  CHECK_THAT(out, Contains("    node \"n1\" did not answer within 10 s"));
  // Broken between words: the second line is the x's, cut at the width.
  CHECK(std::count(lines.begin(), lines.end(), "    node \"n1\" did not answer within 10 s:") == 1);
  CHECK(std::count(lines.begin(), lines.end(), "    " + std::string(76, 'x')) == 1);

  SECTION("a short terminal keeps the top of the screen and says how many lines it left out") {
    screen.height = 12;
    const auto cut = linesOf(cli::renderTop(status, list, screen));
    REQUIRE(cut.size() == 12);
    CHECK(cut.front() == lines.front());
    CHECK_THAT(cut.back(), Contains(std::to_string(lines.size() - 11) + " more lines"));
    screen.height = 0;  // --once, or not a terminal: all of it
    CHECK(linesOf(cli::renderTop(status, list, screen)).size() == lines.size());
  }

  SECTION("ranks of this node only, said under the title") {
    screen.note = "ranks of this node only: peer 10.0.0.2:7070 is unreachable";
    CHECK(linesOf(cli::renderTop(status, list, screen)).at(2) ==
          "  ranks of this node only: peer 10.0.0.2:7070 is unreachable");
  }

  SECTION("a narrow terminal cuts lines, an empty cluster says so") {
    screen.width = 50;
    for (const auto& l : linesOf(cli::renderTop(status, list, screen))) CHECK(l.size() <= 50);
    const std::string empty = cli::renderTop(v1::StatusResponse(), v1::ListResponse(), cli::TopScreen());
    CHECK_THAT(empty, Contains("(nothing registered)") && Contains("(no syncs yet)"));
    CHECK_THAT(empty, !Contains("RECENT FAILURES"));
  }
}

TEST_CASE("top: names cannot act on the operator's terminal nor forge a line", "[client][top][security]") {
  // A group and a set named to clear the screen, set the window title, write the clipboard (OSC 52)
  // and add a fake "set vllm: 8 replicas" line; a peer's error with an escape sequence.
  const std::string evil = "g\x1b[2J\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07\nset vllm: 8 replicas";
  v1::StatusResponse status;
  status.set_node("n0");
  auto* down = status.add_peers();
  down->set_node("n1");
  down->set_error("refused\x1b[31m");
  *status.add_syncs() = sync("s-1", v1::SYNC_FAILED, "failed", 2, 100);
  status.mutable_syncs(0)->set_dst_group(evil);
  status.mutable_syncs(0)->set_error("group " + evil + " is broken");
  v1::ListResponse list;
  auto r = rank(evil, 0, 1, "n0", v1::ROLE_DESTINATION, v1::RANK_DIRTY, 1, "aborted\r\x1b[K");
  r.set_replica_set(evil);
  *list.add_ranks() = r;
  cli::TopScreen screen;
  screen.width = 400;
  const std::string out = cli::renderTop(status, list, screen);
  CHECK(out.find('\x1b') == std::string::npos);
  CHECK(out.find('\x07') == std::string::npos);
  CHECK(out.find('\r') == std::string::npos);
  for (const auto& l : linesOf(out)) CHECK(l.rfind("set vllm", 0) == std::string::npos);
  CHECK_THAT(out, Contains("g\\x1b[2J\\x1b]0;pwned\\x07"));
}
