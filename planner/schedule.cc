#include "planner/schedule.h"

#include <algorithm>

#include "common/strings.h"

namespace shardcast::planner {

namespace {

uint64_t alignUp(uint64_t v) { return (v + 63) & ~uint64_t{63}; }

// Where transfer t lands on `node`: directly when it is one fragment that a rank there needs
// whole and holds contiguously (row-major, as the fragment travels); arena otherwise.
Schedule::Landing landingFor(const Schedule& c, int32_t t, int32_t node) {
  Schedule::Landing l;
  l.node = node;
  const auto& tr = c.plan.transfers[t];
  if (tr.fragments_count != 1) return l;
  const int32_t f = c.plan.transfer_fragments[tr.fragments_begin];
  const auto& frag = c.plan.fragments[f];
  const int64_t elem = c.dst.tensors[c.plan.tensors[frag.tensor].dst].elemBytes();
  for (const auto& [sub, dr] : destinationRegions(c.plan, c.dst, f, node)) {
    if (!(sub == frag.box) || !isContiguous(dr.strides, sub)) continue;
    l.rank = dr.rank;
    l.buffer = dr.buffer;
    l.buffer_offset = static_cast<uint64_t>(dr.offset * elem);
    break;
  }
  return l;
}

}  // namespace

const Schedule::Landing* Schedule::landingOn(int32_t transfer, int32_t node) const {
  for (const Landing& l : landing[static_cast<size_t>(transfer)])
    if (l.node == node) return &l;
  return nullptr;
}

std::string Schedule::landedProblem(int32_t transfer, int32_t chain, int32_t hop, int32_t chunk, int32_t in_wave,
                                    int32_t self) const {
  if (transfer < 0 || static_cast<size_t>(transfer) >= plan.transfers.size()) return "a transfer not in the plan";
  if (wave[static_cast<size_t>(transfer)] != in_wave) return "a transfer of another wave";
  if (chunk < 0 || static_cast<size_t>(chunk) >= chunks[static_cast<size_t>(transfer)].size())
    return "a chunk not in the transfer";
  const auto& tr = plan.transfers[static_cast<size_t>(transfer)];
  if (chain < tr.chains_begin || chain - tr.chains_begin >= tr.chains_count) return "a chain not of the transfer";
  const auto& announced = plan.chains[static_cast<size_t>(chain)];
  if (hop < 0 || hop >= announced.nodes_count ||
      plan.chain_nodes[static_cast<size_t>(announced.nodes_begin + hop)] != self)
    return "a hop that is not this node";
  return "";
}

uint64_t Schedule::offsetOf(const std::vector<std::pair<int32_t, uint64_t>>& list, int32_t node) {
  for (const auto& [n, off] : list)
    if (n == node) return off;
  return UINT64_MAX;
}

StatusOr<Schedule> makeSchedule(const v1::Layout& src, const v1::Layout& dst, uint64_t staging_budget,
                                uint64_t chunk_bytes) {
  if (staging_budget == 0 || chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  Schedule out;
  Schedule* c = &out;
  c->staging_budget = staging_budget;
  SC_ASSIGN_OR_RETURN(c->src, resolveLayout(src, c->nodes));
  SC_ASSIGN_OR_RETURN(c->dst, resolveLayout(dst, c->nodes));
  PlanOptions options;
  options.chunk_bytes = static_cast<int64_t>(chunk_bytes);
  SC_ASSIGN_OR_RETURN(c->plan, makePlan(c->src, c->dst, c->nodes, options));
  const auto& plan = c->plan;
  const size_t n_nodes = static_cast<size_t>(c->nodes.size());
  c->arena_bytes.assign(n_nodes, 0);
  c->staging_bytes.assign(n_nodes, 0);
  c->fragment_offset.assign(plan.fragments.size(), 0);
  c->landing.resize(plan.transfers.size());
  c->heading.resize(plan.transfers.size());
  c->direct.resize(plan.transfers.size());
  c->direct_targets.resize(n_nodes);
  c->wave.assign(plan.transfers.size(), 0);
  c->chunks.resize(plan.transfers.size());
  c->incoming.assign(1, std::vector<int64_t>(n_nodes, 0));
  std::vector<uint64_t> land(n_nodes, 0), stage(n_nodes, 0);  // this wave's use
  bool wave_empty = true;
  for (int32_t t = 0; t < static_cast<int32_t>(plan.transfers.size()); ++t) {
    const auto& tr = plan.transfers[t];
    const uint64_t bytes = alignUp(static_cast<uint64_t>(tr.bytes));
    uint64_t off = 0;
    for (int32_t i = 0; i < tr.fragments_count; ++i) {
      const int32_t f = plan.transfer_fragments[tr.fragments_begin + i];
      c->fragment_offset[f] = off;
      off += static_cast<uint64_t>(plan.fragments[f].bytes);
    }
    auto& chunks = c->chunks[t];
    if (tr.fragments_count == 1) {
      const auto& frag = plan.fragments[plan.transfer_fragments[tr.fragments_begin]];
      const int64_t elem = c->dst.tensors[plan.tensors[frag.tensor].dst].elemBytes();
      uint64_t at = 0;
      for (const Box& b : splitIntoChunks(frag.box, elem, plan.options.chunk_bytes)) {
        const uint64_t n = static_cast<uint64_t>(b.volume() * elem);
        chunks.push_back({b, at, n});
        at += n;
      }
    } else {
      chunks.push_back({Box{}, 0, static_cast<uint64_t>(tr.bytes)});
    }
    auto& direct = c->direct[t];
    direct.assign(static_cast<size_t>(tr.chains_count), 0);
    if (tr.fragments_count == 1) {
      const int32_t f = plan.transfer_fragments[tr.fragments_begin];
      for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
        const auto sr = sourceRegion(plan, c->src, f, sourceRank(plan, c->src, f, plan.chains[ch]));
        direct[static_cast<size_t>(ch - tr.chains_begin)] = isContiguous(sr.strides, plan.fragments[f].box) ? 1 : 0;
      }
    }
    // Staging is needed on a head node only for its chains that are not sent directly.
    auto needs_staging = [&](int32_t node) {
      for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch)
        if (plan.chains[ch].src_node == node && !direct[static_cast<size_t>(ch - tr.chains_begin)]) return true;
      return false;
    };
    // Where it lands on each of its nodes: directly in a rank's buffer, or (arena offset below) not.
    std::vector<Schedule::Landing> lands;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const auto& chain = plan.chains[ch];
      for (int32_t k = 0; k < chain.nodes_count; ++k)
        lands.push_back(landingFor(*c, t, plan.chain_nodes[chain.nodes_begin + k]));
    }
    // Does this transfer still fit in the current wave on every node it touches?
    bool fits = true;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const auto& chain = plan.chains[ch];
      fits = fits && (!needs_staging(chain.src_node) || stage[chain.src_node] + bytes <= staging_budget);
    }
    for (const auto& l : lands) fits = fits && (l.direct() || land[l.node] + bytes <= staging_budget);
    if (!fits && !wave_empty) {
      ++c->waves;
      c->incoming.emplace_back(n_nodes, 0);
      std::fill(land.begin(), land.end(), 0);
      std::fill(stage.begin(), stage.end(), 0);
    }
    wave_empty = false;
    c->wave[t] = c->waves - 1;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const auto& chain = plan.chains[ch];
      if (needs_staging(chain.src_node) && Schedule::offsetOf(c->heading[t], chain.src_node) == UINT64_MAX) {
        c->heading[t].emplace_back(chain.src_node, stage[chain.src_node]);
        stage[chain.src_node] += bytes;
        c->staging_bytes[chain.src_node] = std::max(c->staging_bytes[chain.src_node], stage[chain.src_node]);
      }
    }
    for (auto& l : lands) {
      if (!l.direct()) {
        l.arena_offset = land[l.node];
        land[l.node] += bytes;
        c->arena_bytes[l.node] = std::max(c->arena_bytes[l.node], land[l.node]);
      } else {
        c->direct_targets[l.node].emplace_back(l.rank, l.buffer);
      }
      c->incoming.back()[l.node] += static_cast<int64_t>(chunks.size());
      c->landing[t].push_back(l);
    }
  }
  for (auto& targets : c->direct_targets) {
    std::sort(targets.begin(), targets.end());
    targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  }
  return out;
}

}  // namespace shardcast::planner
