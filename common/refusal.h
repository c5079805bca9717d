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

}  // namespace shardcast
