// The rank-state preconditions of a sync, written once for both sides: the coordinator applies
// them to the ranks its gather described (v1::RemoteRank), and each daemon again to its registry's
// ranks when the sync begins there (Registry::beginSync), so the two never disagree about which
// rank refuses a sync and why. Pure functions: "" when the rank may take part, else the reason,
// to follow the rank's name ("group \"g\" rank 3 on node \"n\"").
#pragma once

#include <cstdint>
#include <string>

#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

// What the preconditions look at of one rank.
struct RankFacts {
  v1::RankState state = v1::RANK_EMPTY;
  bool held = false;     // acquired by its client
  uint64_t version = 0;  // READY and DIRTY: the version it committed (a source: published)
  v1::Role role = v1::ROLE_DESTINATION;
  bool double_buffered = false;  // a destination with a second set of buffers
  // What writes it now, as a refusal names it ("sync s7 is writing it"; a rank as a daemon
  // described it: "a sync is writing it"); "" when nothing does.
  std::string written;
};
// A rank as a daemon described it to the coordinator (DescribeResponse.ranks).
RankFacts factsOf(const v1::RemoteRank& r);

// A source rank is read by a sync of `version` only when it published exactly that version and
// its client is not writing it.
std::string sourceRefusal(const RankFacts& r, uint64_t version);
// A destination rank takes only a version newer than the one it holds (a replayed or reordered
// sync is refused, whatever its sources hold).
std::string destinationRefusal(const RankFacts& r, uint64_t version);
// A catch-up reads a replica as its seed only when it is a destination rank READY at exactly
// `version`, single-buffered (a double-buffered rank's engine reads the set holding the version,
// and a sync would write the other) and written by no sync (nor still landing one's writes).
std::string seedRefusal(const RankFacts& r, uint64_t version);

}  // namespace shardcast::daemon
