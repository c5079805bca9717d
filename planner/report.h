// Human-readable and JSON renderings of a plan's statistics (`shardcast plan`, the daemon's dry run).
#pragma once

#include <string>

#include "planner/layout.h"
#include "planner/plan.h"

namespace shardcast::planner {

// One JSON object: tensors, bytes_needed, network_bytes, network_bytes_lower_bound, local_bytes,
// ops, node_ingress_bytes, node_egress_bytes, max_node_*_bytes, predicted_seconds, plan_ms,
// baselines {rank_pull, gather_broadcast}, and plan shape figures. Integers are bytes.
std::string renderJson(const Plan& plan, const NodeTable& nodes, const CostModel& model);
// A readable summary with a per-node ingress/egress table.
std::string renderText(const Plan& plan, const NodeTable& nodes, const CostModel& model, const std::string& src_group,
                       const std::string& dst_group);
// "1.50 GiB"
std::string humanBytes(double bytes);

}  // namespace shardcast::planner
