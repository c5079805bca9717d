// The rank-state preconditions both sides of a sync apply (daemon/registry/sync_preconditions.h): which
// source and destination ranks refuse a version, and why. The refusals end to end, from the
// coordinator and from a daemon's Prepare, are in contract_test.cc and sync_test.cc.
#include "daemon/registry/sync_preconditions.h"

#include <catch2/catch.hpp>

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

RankFacts facts(v1::RankState state, bool held, uint64_t version, v1::Role role = v1::ROLE_SOURCE) {
  RankFacts f;
  f.state = state;
  f.held = held;
  f.version = version;
  f.role = role;
  return f;
}

}  // namespace

TEST_CASE("sync preconditions: a source is read only at exactly its published version", "[daemon][preconditions]") {
  CHECK(sourceRefusal(facts(v1::RANK_READY, false, 4), 4).empty());
  CHECK(sourceRefusal(facts(v1::RANK_READY, false, 3), 4) == " published version 3, not 4");
  CHECK(sourceRefusal(facts(v1::RANK_READY, false, 5), 4) == " published version 5, not 4");
  CHECK(sourceRefusal(facts(v1::RANK_EMPTY, false, 0), 4) == " has published no version, not 4");
  CHECK(sourceRefusal(facts(v1::RANK_DIRTY, false, 4), 4) == " has published no version, not 4");
  // Acquired by its client: being written, whatever it published before.
  CHECK(sourceRefusal(facts(v1::RANK_UPDATING, true, 4), 4) ==
        " is being written by its owner (acquired, version 4 was published before)");
  CHECK(sourceRefusal(facts(v1::RANK_READY, true, 4), 4).find("being written by its owner") != std::string::npos);
  CHECK(sourceRefusal(facts(v1::RANK_UPDATING, false, 0), 1) ==
        " is being written by its owner (acquired, no version was published before)");
}

TEST_CASE("sync preconditions: a destination takes only a newer version", "[daemon][preconditions]") {
  CHECK(destinationRefusal(facts(v1::RANK_EMPTY, false, 0), 1).empty());
  CHECK(destinationRefusal(facts(v1::RANK_READY, false, 3), 4).empty());
  CHECK(destinationRefusal(facts(v1::RANK_READY, false, 4), 4) == " is at version 4: version 4 is not newer");
  CHECK(destinationRefusal(facts(v1::RANK_DIRTY, false, 7), 4) == " is at version 7: version 4 is not newer");
  // Being written by another sync: its own refusal (a sync in progress) comes from the registry.
  CHECK(destinationRefusal(facts(v1::RANK_UPDATING, false, 4), 4).empty());
}

TEST_CASE("sync preconditions: the facts of a described rank", "[daemon][preconditions]") {
  v1::RemoteRank st;
  st.set_state(v1::RANK_READY);
  st.set_held(true);
  st.set_version(9);
  const RankFacts f = factsOf(st);
  CHECK(f.state == v1::RANK_READY);
  CHECK(f.held);
  CHECK(f.version == 9);
  CHECK(f.role == v1::ROLE_DESTINATION);  // unspecified: a destination
  CHECK_FALSE(f.double_buffered);
  CHECK(f.written.empty());
  st.set_role(v1::ROLE_SOURCE);
  st.set_double_buffered(true);
  st.set_written(true);
  const RankFacts g = factsOf(st);
  CHECK(g.role == v1::ROLE_SOURCE);
  CHECK(g.double_buffered);
  CHECK(g.written == "a sync is writing it");
}

TEST_CASE("sync preconditions: a catch-up's seed is a replica at exactly the version, read by nothing else that writes",
          "[daemon][preconditions]") {
  RankFacts seed = facts(v1::RANK_READY, /*held=*/true, 5, v1::ROLE_DESTINATION);
  CHECK(seedRefusal(seed, 5).empty());  // held by its engine: only read
  CHECK(seedRefusal(seed, 6) == " cannot seed a catch-up: it is not ready at version 6");
  CHECK(seedRefusal(facts(v1::RANK_DIRTY, false, 5, v1::ROLE_DESTINATION), 5) ==
        " cannot seed a catch-up: it is not ready at version 5");
  CHECK(seedRefusal(facts(v1::RANK_READY, false, 5, v1::ROLE_SOURCE), 5) ==
        " cannot seed a catch-up: it is a source (a catch-up reads a replica)");
  RankFacts doubled = seed;
  doubled.double_buffered = true;
  CHECK(seedRefusal(doubled, 5).find("double-buffered") != std::string::npos);
  RankFacts written = seed;
  written.written = "sync s7 is writing it";
  CHECK(seedRefusal(written, 5) == " cannot seed a catch-up: sync s7 is writing it");
}
