// Real shardcastd processes for integration tests (the local-cluster launcher) and call contexts.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>

#include "tests/support/local_daemon.h"
#include "tests/transport/process.h"

namespace shardcast::testing {

using examples::Daemon;
using examples::freePort;

// A deadline-bounded context for test calls.
inline std::unique_ptr<grpc::ClientContext> ctx(int seconds = 30) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return c;
}

}  // namespace shardcast::testing
