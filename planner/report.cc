#include "planner/report.h"

#include <fmt/format.h>

#include <algorithm>

namespace shardcast::planner {

namespace {

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Nodes that take part in the sync, in node-id order (ids follow first appearance in the layouts).
std::vector<int32_t> activeNodes(const PlanStats& s) {
  std::vector<int32_t> out;
  for (int32_t n = 0; n < static_cast<int32_t>(s.node_ingress.size()); ++n)
    if (s.node_ingress[n] || s.node_egress[n] || s.node_local[n]) out.push_back(n);
  return out;
}

std::string nodeMap(const std::vector<int64_t>& v, const std::vector<int32_t>& active, const NodeTable& nodes) {
  std::string out = "{";
  for (size_t i = 0; i < active.size(); ++i)
    out += fmt::format("{}{}: {}", i ? ", " : "", jsonString(nodes.name(active[i])), v[active[i]]);
  return out + "}";
}

}  // namespace

std::string humanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) b /= 1024, ++u;
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.2f} {}", b, units[u]);
}

std::string renderJson(const Plan& plan, const NodeTable& nodes, const CostModel& model) {
  const PlanStats& s = plan.stats;
  const auto active = activeNodes(s);
  std::string out = "{";
  out += fmt::format(
      "\"tensors\": {}, \"bytes_needed\": {}, \"network_bytes\": {}, "
      "\"network_bytes_lower_bound\": {}, \"local_bytes\": {}, \"ops\": {}, "
      "\"network_ops\": {}, \"local_ops\": {}, ",
      s.tensors, s.bytes_needed, s.network_bytes, s.network_lower_bound, s.local_bytes, s.network_ops + s.local_ops,
      s.network_ops, s.local_ops);
  out += "\"node_ingress_bytes\": " + nodeMap(s.node_ingress, active, nodes) + ", ";
  out += "\"node_egress_bytes\": " + nodeMap(s.node_egress, active, nodes) + ", ";
  out += "\"node_local_bytes\": " + nodeMap(s.node_local, active, nodes) + ", ";
  out += fmt::format(
      "\"max_node_ingress_bytes\": {}, \"max_node_egress_bytes\": {}, "
      "\"max_unique_held_bytes\": {}, \"predicted_seconds\": {:.6f}, \"plan_ms\": {:.3f}, ",
      s.maxIngress(), s.maxEgress(), s.max_unique_held, predictSeconds(s, model), s.plan_ms);
  out += fmt::format(
      "\"transfers\": {}, \"buckets\": {}, \"fragments\": {}, \"max_chain\": {}, "
      "\"chunk_bytes\": {}, \"nic_gbps\": {}, \"local_gbps\": {}, ",
      s.transfers, s.buckets, s.fragments, s.max_chain, plan.options.chunk_bytes, model.nic_gbps, model.local_gbps);
  out += fmt::format(
      "\"baselines\": {{\"rank_pull\": {{\"network_bytes\": {}, \"predicted_seconds\": {:.6f}}}, "
      "\"gather_broadcast\": {{\"network_bytes\": {}, \"predicted_seconds\": {:.6f}}}}}",
      s.pull_network_bytes, predictPullSeconds(s, model), s.gather_bytes + s.broadcast_bytes,
      predictGatherBroadcastSeconds(s, model));
  return out + "}";
}

std::string renderText(const Plan& plan, const NodeTable& nodes, const CostModel& model, const std::string& src_group,
                       const std::string& dst_group) {
  const PlanStats& s = plan.stats;
  std::string out;
  out += fmt::format("plan {} -> {}: {} tensors, {} needed by destination ranks ({:.1f} ms to plan)\n", src_group,
                     dst_group, s.tensors, humanBytes(s.bytes_needed), s.plan_ms);
  const double ratio = s.network_lower_bound ? static_cast<double>(s.network_bytes) / s.network_lower_bound : 1.0;
  out += fmt::format("  network   {:>12}  (lower bound {}, {:.3f}x)\n", humanBytes(s.network_bytes),
                     humanBytes(s.network_lower_bound), ratio);
  out += fmt::format("  local     {:>12}  (node-local fan-out and colocated copies)\n", humanBytes(s.local_bytes));
  out += fmt::format(
      "  ops       {:>12}  ({} network sends, {} local copies; {} transfers, {} buckets, "
      "longest relay chain {} nodes)\n",
      s.network_ops + s.local_ops, s.network_ops, s.local_ops, s.transfers, s.buckets, s.max_chain);
  out += fmt::format("  max node  ingress {}, egress {}\n", humanBytes(s.maxIngress()), humanBytes(s.maxEgress()));
  out += fmt::format("  predicted {:.3f} s  at {} Gbit/s NIC per node, {} Gbit/s node-local\n",
                     predictSeconds(s, model), model.nic_gbps, model.local_gbps);
  out += fmt::format("  baselines rank pull: {} network, {:.3f} s; gather+broadcast: {} network, {:.3f} s\n",
                     humanBytes(s.pull_network_bytes), predictPullSeconds(s, model),
                     humanBytes(s.gather_bytes + s.broadcast_bytes), predictGatherBroadcastSeconds(s, model));
  const auto active = activeNodes(s);
  out += fmt::format("\n  {:<24} {:>12} {:>12} {:>12}\n", "node", "ingress", "egress", "local");
  const size_t shown = std::min<size_t>(active.size(), 32);
  for (size_t i = 0; i < shown; ++i) {
    const int32_t n = active[i];
    out += fmt::format("  {:<24} {:>12} {:>12} {:>12}\n", nodes.name(n), humanBytes(s.node_ingress[n]),
                       humanBytes(s.node_egress[n]), humanBytes(s.node_local[n]));
  }
  if (shown < active.size()) out += fmt::format("  ... {} more nodes (--json lists all)\n", active.size() - shown);
  return out;
}

}  // namespace shardcast::planner
