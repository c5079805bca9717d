// The project's one error type: absl::Status / absl::StatusOr (gRPC already depends on abseil).
// Converted to grpc::Status only at service edges.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardcast {

using Status = absl::Status;
template <typename T>
using StatusOr = absl::StatusOr<T>;

}  // namespace shardcast

// Returns the status of `expr` from the enclosing function when it is not OK.
#define SC_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status sc_status_ = (expr);      \
    if (!sc_status_.ok()) return sc_status_; \
  } while (0)

#define SC_CONCAT_INNER_(a, b) a##b
#define SC_CONCAT_(a, b) SC_CONCAT_INNER_(a, b)
// Declares `lhs` from a StatusOr expression, returning its status from the enclosing function on error.
#define SC_ASSIGN_OR_RETURN(lhs, expr) SC_ASSIGN_OR_RETURN_IMPL_(SC_CONCAT_(sc_or_, __LINE__), lhs, expr)
#define SC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
