// UCX backend: one ucp_context + ucp_worker per Context, owned by a progress thread.
// Writes use RMA put + flush where put is fast (shared memory, cma, RDMA) and active messages
// received straight into registered memory and acknowledged where it is not (TCP); see
// TransportOptions::protocol and docs/transport.md.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace shardcast::transport {

StatusOr<std::unique_ptr<Context>> createUcxContext(const TransportOptions& options);

// am or put: what protocol auto resolves to for a UCX_TLS value ("" = UCX's default), before
// UcxOptions::bounded_writes_only.
Protocol autoProtocolFor(const std::string& tls);
// Whether every transport of a UCX_TLS list bounds a remote write to the registered region in
// hardware (rc/dc verbs, CUDA IPC; ud carries no RMA): put is safe against a peer that lies.
bool putIsBounded(const std::string& tls);

}  // namespace shardcast::transport
