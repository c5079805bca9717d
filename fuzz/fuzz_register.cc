// A RegisterRequest as a client sends it (serialised protobuf), through what the daemon does with
// it: the request's string bounds, then Registry::registerRank (layout resolution, buffers against
// the layout, dtypes and shapes, segment names, ownership, mapping). The seeds name a real segment
// (/shardcast-fuzz) that the initialiser creates, so mutations reach the mapping checks too.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "daemon/registry/registry.h"
#include "planner/limits.h"
#include "transport/shm.h"
#include "transport/transport.h"

using namespace shardcast;

namespace {

struct World {
  std::unique_ptr<transport::Context> transport;
  std::unique_ptr<daemon::Registry> registry;
  std::unique_ptr<transport::ShmSegment> segment;
};

World& world() {
  static World w = [] {
    World out;
    transport::TransportOptions o;
    o.backend = "loopback";
    o.name = "n0";
    out.transport = std::move(*transport::createContext(o));
    out.registry = std::make_unique<daemon::Registry>("n0", *out.transport);
    // The segment the seeds name (fuzz_seeds.cc): 1 MiB, ours, created once per process.
    ::shm_unlink("/shardcast-fuzz");  // left by an earlier run that crashed
    auto seg = transport::ShmSegment::create("/shardcast-fuzz", 1 << 20);
    if (seg.ok()) out.segment = std::make_unique<transport::ShmSegment>(std::move(*seg));
    return out;
  }();
  return w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  v1::RegisterRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (!planner::checkStringLengths(req).ok()) return 0;  // the service's edge check
  daemon::MemoryCaller caller;
  caller.uid = ::getuid();
  caller.local = true;
  auto r = w.registry->registerRank(req, caller);
  if (r.ok()) w.registry->unregisterRank(req.group(), req.rank(), caller).IgnoreError();
  return 0;
}
