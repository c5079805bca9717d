// A peer's notification (the data plane's only message) through the one parser, then every chunk
// it announces checked against a real plan for every wave and node, as a receiver would. A parsed
// notification must also survive encode -> parse unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "daemon/engine/notification.h"
#include "daemon/engine/sync_engine.h"
#include "fuzz/fuzz_plan.h"

using namespace shardcast;
using namespace shardcast::daemon;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::shared_ptr<const CachedPlan> plan = fuzzing::examplePlan();
  auto n = parseNotification(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!n.ok()) return 0;
  auto again = parseNotification(encodeNotification(*n));
  if (!again.ok() || again->sync_id != n->sync_id || again->fence != n->fence ||
      again->chunks.size() != n->chunks.size())
    std::abort();
  for (const auto& chunk : n->chunks)
    for (int32_t wave = 0; wave < plan->waves; ++wave)
      for (int32_t node = 0; node < plan->nodes.size(); ++node) (void)plan->landedProblem(chunk, wave, node);
  return 0;
}
