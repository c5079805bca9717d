// UCX backend: one ucp_context + ucp_worker per Context, owned by a progress thread.
// Writes use RMA put + flush where put is fast (shared memory, cma, RDMA) and active messages
// received straight into registered memory and acknowledged where it is not (TCP); its settings
// (ucx_options.h) choose, and docs/transport.md says why.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace shardcast::transport {

// INVALID_ARGUMENT for a bad "ucx." setting (resolveUcxOptions) or transport list UCX refuses.
StatusOr<std::unique_ptr<Context>> createUcxContext(const TransportOptions& options);

}  // namespace shardcast::transport
