// The table of data-plane backends, and createContext, which chooses from it (transport.h).
#include "common/strings.h"
#include "transport/loopback/loopback.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_context.h"

namespace shardcast::transport {

const std::vector<Backend>& backends() {
  static const std::vector<Backend> table = {
      {"ucx", createUcxContext, "UCX: tcp, shared memory, RDMA verbs, CUDA where the installed UCX has them"},
      {"loopback", createLoopbackContext, "in-process memcpy between contexts of one process (tests)"},
  };
  return table;
}

StatusOr<std::unique_ptr<Context>> createContext(const TransportOptions& options) {
  if (options.op_timeout.count() <= 0) return absl::InvalidArgumentError("transport op_timeout must be positive");
  std::vector<std::string> names;
  for (const Backend& b : backends()) {
    if (options.backend == b.name) return b.create(options);
    names.push_back(b.name);
  }
  return absl::InvalidArgumentError(
      strCat("unknown transport backend \"", options.backend, "\" (expected ", strJoin(names, " or "), ")"));
}

}  // namespace shardcast::transport
