// In-process loopback backend: contexts in one process find each other through a registry, and
// writes are memcpys executed on the writer's progress thread. Same semantics as UCX (completion
// = visible, notifications after earlier writes, validation of target ranges), no network.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace shardcast::transport {

// The loopback has no settings of its own: any "loopback." one is INVALID_ARGUMENT. Its writes are
// always bounded (bounded_writes_only holds whatever the options).
Status checkLoopbackOptions(const TransportOptions& options);
StatusOr<std::unique_ptr<Context>> createLoopbackContext(const TransportOptions& options);

}  // namespace shardcast::transport
