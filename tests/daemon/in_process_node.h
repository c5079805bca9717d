// A daemon's data plane in a test's own process: a loopback transport, a registry and a sync
// engine, driven by hand as a coordinator would (prepare, execute, finish).
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

#include "daemon/engine/sync_engine.h"
#include "daemon/registry/registry.h"
#include "daemon/server/metrics.h"
#include "transport/transport.h"

namespace shardcast::testing {

struct InProcessNode {
  // `stage`: null for the engine's standard stage.
  explicit InProcessNode(const std::string& node, std::unique_ptr<daemon::Stage> stage = nullptr)
      : name(node),
        context(makeContext(node)),
        registry(node, *context),
        engine(node, registry, *context, metrics, 1 << 20, std::move(stage)) {}
  static std::unique_ptr<transport::Context> makeContext(const std::string& name) {
    transport::TransportOptions options;
    options.backend = "loopback";
    options.name = name;
    auto c = transport::createContext(options);
    if (!c.ok()) throw std::runtime_error(std::string(c.status().message()));
    return std::move(*c);
  }
  std::string name;
  std::unique_ptr<transport::Context> context;
  daemon::Metrics metrics;
  daemon::Registry registry;
  daemon::SyncEngine engine;
};

}  // namespace shardcast::testing
