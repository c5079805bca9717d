#include "daemon/registry/sync_preconditions.h"

#include "common/strings.h"

namespace shardcast::daemon {

RankFacts factsOf(const v1::RemoteRank& r) {
  return {r.state(),           r.held(),
          r.version(),         r.role() == v1::ROLE_SOURCE ? v1::ROLE_SOURCE : v1::ROLE_DESTINATION,
          r.double_buffered(), r.written() ? "a sync is writing it" : ""};
}

std::string sourceRefusal(const RankFacts& r, uint64_t version) {
  if (r.held || r.state == v1::RANK_UPDATING)
    return strCat(" is being written by its owner (acquired, ",
                  r.version > 0 ? strCat("version ", r.version, " was published before)")
                                : std::string("no version was published before)"));
  if (r.state != v1::RANK_READY || r.version != version)
    return strCat(
        r.state == v1::RANK_READY ? strCat(" published version ", r.version) : std::string(" has published no version"),
        ", not ", version);
  return "";
}

std::string destinationRefusal(const RankFacts& r, uint64_t version) {
  if ((r.state == v1::RANK_READY || r.state == v1::RANK_DIRTY) && r.version >= version)
    return strCat(" is at version ", r.version, ": version ", version, " is not newer");
  return "";
}

std::string seedRefusal(const RankFacts& r, uint64_t version) {
  const char* why = " cannot seed a catch-up: ";
  if (r.role != v1::ROLE_DESTINATION) return strCat(why, "it is a source (a catch-up reads a replica)");
  if (r.state != v1::RANK_READY || r.version != version) return strCat(why, "it is not ready at version ", version);
  if (r.double_buffered) return strCat(why, "it is double-buffered (the set it holds is the one its engine reads)");
  if (!r.written.empty()) return strCat(why, r.written);
  return "";
}

}  // namespace shardcast::daemon
