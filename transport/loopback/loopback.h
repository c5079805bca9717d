// In-process loopback backend: contexts in one process find each other through a registry, and
// writes are memcpys executed on the writer's progress thread. Same semantics as UCX (completion
// = visible, notifications after earlier writes, validation of target ranges), no network.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace shardcast::transport {

StatusOr<std::unique_ptr<Context>> createLoopbackContext(const TransportOptions& options);

}  // namespace shardcast::transport
