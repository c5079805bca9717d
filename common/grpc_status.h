// absl::Status <-> grpc::Status at the service edges (daemon services, clients). Header-only so
// that common/ itself does not link gRPC; absl and gRPC share the canonical code numbering.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "common/status.h"
#include "common/strings.h"

namespace shardcast {

inline grpc::Status toGrpc(const Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

// The gRPC status as an absl::Status; `context` (what was being done) prefixes the message when given.
inline Status fromGrpc(const grpc::Status& st, const std::string& context = "") {
  if (st.ok()) return absl::OkStatus();
  return Status(static_cast<absl::StatusCode>(st.error_code()),
                context.empty() ? st.error_message() : strCat(context, ": ", st.error_message()));
}

}  // namespace shardcast
