// The plan the notification fuzzer checks against, and the seeds describe: the example layouts
// (client/examples/layouts: FSDP2 x TP4 trainer into vLLM TP4 x DP2), small chunks and staging so
// that it has several waves, relay chains and many chunks per transfer.
#pragma once

#include <filesystem>
#include <memory>

#include "daemon/engine/sync_engine.h"
#include "planner/layout.h"

#ifndef SHARDCAST_SOURCE_DIR
#define SHARDCAST_SOURCE_DIR "."
#endif

namespace shardcast::fuzzing {

inline std::shared_ptr<const daemon::CachedPlan> examplePlan() {
  const std::filesystem::path dir = std::filesystem::path(SHARDCAST_SOURCE_DIR) / "client/examples/layouts";
  auto src = planner::readLayoutFile((dir / "trainer_fsdp2_tp4.json").string());
  auto dst = planner::readLayoutFile((dir / "vllm_tp4_dp2.json").string());
  if (!src.ok() || !dst.ok()) std::abort();
  daemon::PlanCache cache;
  bool hit = false;
  auto plan = cache.get(*src, *dst, shardcast::daemon::PlanKey{uint64_t{64} << 20, uint64_t{1} << 20}, &hit);
  if (!plan.ok()) std::abort();
  return *plan;
}

}  // namespace shardcast::fuzzing
