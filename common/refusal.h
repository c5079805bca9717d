// A refusal that one destination group's own ranks caused (acquired by their client, being
// written or read by another sync, registered again), on a node that may hold other groups the
// sync writes: the group travels with the status (an absl payload here, gRPC's binary details
// between daemons: common/grpc_status.h), so that a replica set's coordinator cuts that replica
// only, not every replica on the node.
#pragma once

#include <string>

#include "absl/strings/cord.h"
#include "common/status.h"

namespace shardcast {

inline constexpr char kRefusingGroup[] = "shardcast.dev/refusing-group";

inline Status refusedBy(Status st, const std::string& group) {
  if (!st.ok() && !group.empty()) st.SetPayload(kRefusingGroup, absl::Cord(group));
  return st;
}

// The group a refusal names (refusedBy), or "" when it names none.
inline std::string refusingGroup(const Status& st) {
  const auto group = st.GetPayload(kRefusingGroup);
  return group ? std::string(*group) : std::string();
}

// A refusal because the daemon no longer holds what a request named by reference (a plan named
// by digest: daemon/engine/plan_cache.h, kStaleView). Marked apart from its message, which
// quotes names a caller chose: the coordinator runs the sync again with the layouts only for it.
inline constexpr char kStaleViewMark[] = "shardcast.dev/stale-view";

inline Status markedStale(Status st) {
  if (!st.ok()) st.SetPayload(kStaleViewMark, absl::Cord("1"));
  return st;
}

inline bool isMarkedStale(const Status& st) { return st.GetPayload(kStaleViewMark).has_value(); }

}  // namespace shardcast
