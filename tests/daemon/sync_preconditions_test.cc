// The rank-state preconditions both sides of a sync apply (daemon/registry/sync_preconditions.h): which
// source and destination ranks refuse a version, and why. The refusals end to end, from the
// coordinator and from a daemon's Prepare, are in contract_test.cc and sync_test.cc.
#include "daemon/registry/sync_preconditions.h"

#include <catch2/catch.hpp>

using namespace shardcast;
using namespace shardcast::daemon;

TEST_CASE("sync preconditions: a source is read only at exactly its published version", "[daemon][preconditions]") {
  CHECK(sourceRefusal({v1::RANK_READY, false, 4}, 4).empty());
  CHECK(sourceRefusal({v1::RANK_READY, false, 3}, 4) == " published version 3, not 4");
  CHECK(sourceRefusal({v1::RANK_READY, false, 5}, 4) == " published version 5, not 4");
  CHECK(sourceRefusal({v1::RANK_EMPTY, false, 0}, 4) == " has published no version, not 4");
  CHECK(sourceRefusal({v1::RANK_DIRTY, false, 4}, 4) == " has published no version, not 4");
  // Acquired by its client: being written, whatever it published before.
  CHECK(sourceRefusal({v1::RANK_UPDATING, true, 4}, 4) ==
        " is being written by its owner (acquired, version 4 was published before)");
  CHECK(sourceRefusal({v1::RANK_READY, true, 4}, 4).find("being written by its owner") != std::string::npos);
  CHECK(sourceRefusal({v1::RANK_UPDATING, false, 0}, 1) ==
        " is being written by its owner (acquired, no version was published before)");
}

TEST_CASE("sync preconditions: a destination takes only a newer version", "[daemon][preconditions]") {
  CHECK(destinationRefusal({v1::RANK_EMPTY, false, 0}, 1).empty());
  CHECK(destinationRefusal({v1::RANK_READY, false, 3}, 4).empty());
  CHECK(destinationRefusal({v1::RANK_READY, false, 4}, 4) == " is at version 4: version 4 is not newer");
  CHECK(destinationRefusal({v1::RANK_DIRTY, false, 7}, 4) == " is at version 7: version 4 is not newer");
  // Being written by another sync: its own refusal (a sync in progress) comes from the registry.
  CHECK(destinationRefusal({v1::RANK_UPDATING, false, 4}, 4).empty());
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
}
