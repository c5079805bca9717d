// What a peer holding a daemon certificate can ask of a daemon's sync engine: Prepare, Execute and
// Finish (serialised protobuf; the first byte picks which), through the service's edge check and
// SyncEngine on an empty registry: a Prepare gets through every bound a peer controls (lease,
// chunk size, write key, string lengths) and the planning of its two layouts before the registry
// refuses it for want of ranks. Nothing may abort, trip a sanitizer or block (Execute's timeout
// is cut to 1 ms). What follows an accepted Prepare is reached by the daemon tests instead.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "daemon/engine/sync_engine.h"
#include "daemon/registry/registry.h"
#include "daemon/server/metrics.h"
#include "planner/limits.h"
#include "transport/transport.h"

using namespace shardcast;

namespace {

struct World {
  std::unique_ptr<transport::Context> transport;
  std::unique_ptr<daemon::Registry> registry;
  daemon::Metrics metrics;
  std::unique_ptr<daemon::SyncEngine> engine;
};

World& world() {
  static World* w = [] {
    auto* out = new World;  // lives for the process: the engine's threads run until it exits
    transport::TransportOptions o;
    o.backend = "loopback";
    o.name = "n0";
    out->transport = std::move(*transport::createContext(o));
    out->registry = std::make_unique<daemon::Registry>("n0", *out->transport);
    out->engine = std::make_unique<daemon::SyncEngine>("n0", *out->registry, *out->transport, out->metrics,
                                                       uint64_t{8} << 20, nullptr, uint64_t{64} << 20);
    return out;
  }();
  return *w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  World& w = world();
  const auto* body = data + 1;
  const int n = static_cast<int>(size - 1);
  switch (data[0] % 3) {
    case 0: {
      v1::PrepareRequest req;
      if (!req.ParseFromArray(body, n) || !planner::checkStringLengths(req).ok()) return 0;
      if (w.engine->prepare(req).ok()) {
        v1::FinishRequest fin;  // never leave an attempt holding the ranks
        fin.set_sync_id(req.sync_id());
        fin.set_fence(req.fence());
        w.engine->finish(fin).IgnoreError();
      }
      break;
    }
    case 1: {
      v1::ExecuteRequest req;
      if (!req.ParseFromArray(body, n) || !planner::checkStringLengths(req).ok()) return 0;
      req.set_timeout_ms(1);
      w.engine->execute(req).IgnoreError();
      break;
    }
    default: {
      v1::FinishRequest req;
      if (!req.ParseFromArray(body, n) || !planner::checkStringLengths(req).ok()) return 0;
      w.engine->finish(req).IgnoreError();
      break;
    }
  }
  return 0;
}
