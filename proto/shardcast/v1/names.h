// Names of the contract's enums as logs, errors, the CLI and metrics print them (header only:
// the daemon and the clients share it).
#pragma once

#include <string_view>

#include "shardcast/v1/service.pb.h"

namespace shardcast::v1 {

inline std::string_view roleName(Role role) { return role == ROLE_SOURCE ? "source" : "destination"; }

inline std::string_view rankStateName(RankState state) {
  switch (state) {
    case RANK_EMPTY:
      return "empty";
    case RANK_UPDATING:
      return "updating";
    case RANK_READY:
      return "ready";
    case RANK_DIRTY:
      return "dirty";
    default:
      return "unknown";
  }
}

inline std::string_view syncPhaseName(SyncPhase phase) {
  switch (phase) {
    case SYNC_GATHERING:
      return "gathering";
    case SYNC_PREPARING:
      return "preparing";
    case SYNC_EXECUTING:
      return "executing";
    case SYNC_COMMITTING:
      return "committing";
    case SYNC_COMMITTED:
      return "committed";
    case SYNC_FAILED:
      return "failed";
    default:
      return "unknown";
  }
}

}  // namespace shardcast::v1
