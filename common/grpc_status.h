// absl::Status <-> grpc::Status at the service edges (daemon services, clients). Header-only so
// that common/ itself does not link gRPC; absl and gRPC share the canonical code numbering.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "common/refusal.h"
#include "common/status.h"
#include "common/strings.h"

namespace shardcast {

// The group a refusal names (refusedBy, common/refusal.h) after it crossed gRPC: in the binary
// details, under kRefusingGroup.
inline std::string refusingGroup(const grpc::Status& st) {
  const std::string& details = st.error_details();
  const std::string prefix = strCat(kRefusingGroup, "=");
  return details.compare(0, prefix.size(), prefix) == 0 ? details.substr(prefix.size()) : std::string();
}

inline grpc::Status toGrpc(const Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

// Whether a refusal that crossed gRPC is marked stale (markedStale, common/refusal.h).
inline bool isMarkedStale(const grpc::Status& st) { return st.error_details() == kStaleViewMark; }

// toGrpc, with the group a refusal names (refusedBy), or its stale-view mark, in the binary
// details: only on Peer.Prepare and Peer.Execute, whose caller is a daemon's coordinator (the
// details are not a google.rpc.Status, which clients' tools would expect there).
inline grpc::Status toGrpcNamingGroup(const Status& st) {
  const std::string group = refusingGroup(st);
  if (!st.ok() && group.empty() && isMarkedStale(st))
    return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()), kStaleViewMark);
  if (st.ok() || group.empty()) return toGrpc(st);
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()),
                      strCat(kRefusingGroup, "=", group));
}

// The gRPC status as an absl::Status; `context` (what was being done) prefixes the message when given.
inline Status fromGrpc(const grpc::Status& st, const std::string& context = "") {
  if (st.ok()) return absl::OkStatus();
  return refusedBy(Status(static_cast<absl::StatusCode>(st.error_code()),
                          context.empty() ? st.error_message() : strCat(context, ": ", st.error_message())),
                   refusingGroup(st));
}

}  // namespace shardcast
