// The table of data-plane backends, and createContext, which chooses from it (transport.h).
#include <algorithm>

#include "common/strings.h"
#include "transport/loopback/loopback.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_context.h"
#include "transport/ucx/ucx_options.h"

namespace shardcast::transport {

const std::vector<Backend>& backends() {
  static const std::vector<Backend> table = {
      {"ucx", checkUcxOptions, createUcxContext,
       "UCX: tcp, shared memory, RDMA verbs, CUDA where the installed UCX has them"},
      {"loopback", checkLoopbackOptions, createLoopbackContext,
       "in-process memcpy between contexts of one process (tests)"},
  };
  return table;
}

namespace {

// The backend options.backend names, once what every backend shares is valid: the timeout, and
// each setting's name naming a backend.
StatusOr<const Backend*> chosenBackend(const TransportOptions& options) {
  if (options.op_timeout.count() <= 0) return absl::InvalidArgumentError("transport op_timeout must be positive");
  std::vector<std::string> names;
  const Backend* chosen = nullptr;
  for (const Backend& b : backends()) {
    if (options.backend == b.name) chosen = &b;
    names.push_back(b.name);
  }
  if (!chosen)
    return absl::InvalidArgumentError(
        strCat("unknown transport backend \"", options.backend, "\" (expected ", strJoin(names, " or "), ")"));
  for (const auto& setting : options.settings) {
    const std::string owner = setting.first.substr(0, setting.first.find('.'));
    if (owner == setting.first || std::find(names.begin(), names.end(), owner) == names.end())
      return absl::InvalidArgumentError(strCat("transport setting ", quote(setting.first),
                                               " names no backend (expected ", strJoin(names, ".<setting> or "),
                                               ".<setting>)"));
  }
  return chosen;
}

}  // namespace

Status checkOptions(const TransportOptions& options) {
  SC_ASSIGN_OR_RETURN(const Backend* backend, chosenBackend(options));
  return backend->check(options);
}

StatusOr<std::unique_ptr<Context>> createContext(const TransportOptions& options) {
  SC_ASSIGN_OR_RETURN(const Backend* backend, chosenBackend(options));
  SC_RETURN_IF_ERROR(backend->check(options));
  return backend->create(options);
}

}  // namespace shardcast::transport
