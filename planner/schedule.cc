#include "planner/schedule.h"

#include <algorithm>

#include "common/strings.h"

namespace shardcast::planner {

namespace {

uint64_t alignUp(uint64_t v) { return (v + 63) & ~uint64_t{63}; }

// Whether a fragment's source memory holds its wire bytes (the wire carries the destination's
// dtype): only then may a chain be sent straight from a source rank's buffer, bypassing the pack
// stage (which converts, daemon/stage/stage.h). Landing straight in a destination rank is always the
// wire's dtype.
bool sameDType(const Schedule& c, const Fragment& frag) {
  const auto& pair = c.plan.tensors[frag.tensor];
  const auto& st = c.src.tensors[pair.src];
  const auto& dt = c.dst.tensors[pair.dst];
  // Block scales computed and weights quantised here are not the source's bytes; a seed's
  // quantised bytes and scales are.
  return st.dtype == dt.dtype && !computedFrom(st, dt);
}

// Where transfer t lands on `node`: directly when it is one fragment that a rank there needs
// whole and holds contiguously (row-major, as the fragment travels); arena otherwise.
Schedule::Landing landingFor(const Schedule& c, int32_t t, int32_t node) {
  Schedule::Landing l;
  l.node = node;
  const auto& tr = c.plan.transfers[t];
  if (!c.zero_copy || tr.fragments_count != 1) return l;
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

// The chunks transfer `tr` travels in (see Schedule::Chunk).
std::vector<Schedule::Chunk> chunksOf(const Schedule& c, const Transfer& tr) {
  std::vector<Schedule::Chunk> chunks;
  if (tr.fragments_count != 1) {
    chunks.push_back({Box{}, 0, static_cast<uint64_t>(tr.bytes)});
    return chunks;
  }
  const auto& frag = c.plan.fragments[c.plan.transfer_fragments[tr.fragments_begin]];
  const int64_t elem = c.dst.tensors[c.plan.tensors[frag.tensor].dst].elemBytes();
  uint64_t at = 0;
  for (const Box& b : splitIntoChunks(frag.box, elem, c.plan.options.chunk_bytes)) {
    const uint64_t n = static_cast<uint64_t>(b.volume() * elem);
    chunks.push_back({b, at, n});
    at += n;
  }
  return chunks;
}

// Per chain of `tr`: can its head send straight from the source rank's buffer?
std::vector<char> directChains(const Schedule& c, const Transfer& tr) {
  std::vector<char> direct(static_cast<size_t>(tr.chains_count), 0);
  if (!c.zero_copy || tr.fragments_count != 1) return direct;
  const int32_t f = c.plan.transfer_fragments[tr.fragments_begin];
  if (!sameDType(c, c.plan.fragments[f])) return direct;
  for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
    const auto sr = sourceRegion(c.plan, c.src, f, sourceRank(c.plan, c.src, f, c.plan.chains[ch]));
    direct[static_cast<size_t>(ch - tr.chains_begin)] = isContiguous(sr.strides, c.plan.fragments[f].box) ? 1 : 0;
  }
  return direct;
}

}  // namespace

const Schedule::Landing* Schedule::TransferSchedule::landingOn(int32_t node) const {
  for (const Landing& l : landings)
    if (l.node == node) return &l;
  return nullptr;
}

uint64_t Schedule::TransferSchedule::stagingOffset(int32_t node) const {
  for (const Heading& h : heading)
    if (h.node == node) return h.staging_offset;
  return UINT64_MAX;
}

std::string Schedule::landedProblem(int32_t t, int32_t chain, int32_t hop, int32_t chunk, int32_t in_wave,
                                    int32_t self) const {
  if (t < 0 || static_cast<size_t>(t) >= plan.transfers.size()) return "a transfer not in the plan";
  const TransferSchedule& ts = transfer(t);
  if (ts.wave != in_wave) return "a transfer of another wave";
  if (chunk < 0 || static_cast<size_t>(chunk) >= ts.chunks.size()) return "a chunk not in the transfer";
  const auto& tr = plan.transfers[static_cast<size_t>(t)];
  if (chain < tr.chains_begin || chain - tr.chains_begin >= tr.chains_count) return "a chain not of the transfer";
  const auto& announced = plan.chains[static_cast<size_t>(chain)];
  if (hop < 0 || hop >= announced.nodes_count ||
      plan.chain_nodes[static_cast<size_t>(announced.nodes_begin + hop)] != self)
    return "a hop that is not this node";
  return "";
}

StatusOr<Schedule> makeSchedule(const v1::Layout& src, const v1::Layout& dst, uint64_t staging_budget,
                                uint64_t chunk_bytes, bool zero_copy, Strategy strategy) {
  if (staging_budget == 0 || chunk_bytes == 0)
    return absl::InvalidArgumentError("staging budget and chunk size must be positive");
  NodeTable nodes;
  SC_ASSIGN_OR_RETURN(auto s, resolveLayout(src, nodes));
  SC_ASSIGN_OR_RETURN(auto d, resolveLayout(dst, nodes));
  SC_RETURN_IF_ERROR(addScaleSources(s, d));
  PlanOptions options;
  options.chunk_bytes = static_cast<int64_t>(chunk_bytes);
  options.strategy = strategy;
  SC_ASSIGN_OR_RETURN(auto plan, makePlan(s, d, nodes, options));
  return scheduleOf(std::move(nodes), std::move(s), std::move(d), std::move(plan), staging_budget, zero_copy);
}

namespace {

// Each node's peers (the nodes it writes to: a chain's head to every landing, a forwarder to the
// next) and direct targets, sorted and once each.
void collectPeers(Schedule& out) {
  const Plan& p = out.plan;
  for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
    const auto& tr = p.transfers[t];
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const auto& ch = p.chains[c];
      auto& head = out.per_node[static_cast<size_t>(ch.src_node)].peers;
      for (const auto& l : out.transfers[static_cast<size_t>(t)].landings) head.push_back(l.node);
      // Forwarders: a star's first node writes to all the others, a chain's every node to the next.
      for (int32_t k = 1; k < ch.nodes_count; ++k) {
        const int32_t from = p.chain_nodes[ch.nodes_begin + (ch.star ? 0 : k - 1)];
        out.per_node[static_cast<size_t>(from)].peers.push_back(p.chain_nodes[ch.nodes_begin + k]);
      }
    }
  }
  for (auto& n : out.per_node) {
    std::sort(n.peers.begin(), n.peers.end());
    n.peers.erase(std::unique(n.peers.begin(), n.peers.end()), n.peers.end());
    std::sort(n.direct_targets.begin(), n.direct_targets.end());
    n.direct_targets.erase(std::unique(n.direct_targets.begin(), n.direct_targets.end()), n.direct_targets.end());
  }
}

}  // namespace

StatusOr<Schedule> scheduleOf(NodeTable nodes, ResolvedLayout src, ResolvedLayout dst, Plan plan,
                              uint64_t staging_budget, bool zero_copy) {
  if (staging_budget == 0) return absl::InvalidArgumentError("staging budget must be positive");
  Schedule out;
  out.staging_budget = staging_budget;
  out.zero_copy = zero_copy;
  out.nodes = std::move(nodes);
  out.src = std::move(src);
  out.dst = std::move(dst);
  out.plan = std::move(plan);
  const Plan& p = out.plan;
  const size_t n_nodes = static_cast<size_t>(out.nodes.size());
  out.per_node.assign(n_nodes, {});
  for (auto& n : out.per_node) n.incoming.assign(1, 0);
  out.fragment_offset.assign(p.fragments.size(), 0);
  out.transfers.resize(p.transfers.size());
  std::vector<uint64_t> land(n_nodes, 0), stage(n_nodes, 0);  // this wave's use per node
  bool wave_empty = true;
  for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
    const auto& tr = p.transfers[t];
    auto& ts = out.transfers[static_cast<size_t>(t)];
    const uint64_t bytes = alignUp(static_cast<uint64_t>(tr.bytes));
    uint64_t off = 0;
    for (int32_t i = 0; i < tr.fragments_count; ++i) {
      const int32_t f = p.transfer_fragments[tr.fragments_begin + i];
      out.fragment_offset[f] = off;
      off += static_cast<uint64_t>(p.fragments[f].bytes);
    }
    ts.chunks = chunksOf(out, tr);
    ts.direct = directChains(out, tr);
    // Staging is needed on a head node only for its chains that are not sent directly.
    auto needs_staging = [&](int32_t node) {
      for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch)
        if (p.chains[ch].src_node == node && !ts.direct[static_cast<size_t>(ch - tr.chains_begin)]) return true;
      return false;
    };
    // Where it lands on each of its nodes: directly in a rank's buffer, or (arena offset below) not.
    std::vector<Schedule::Landing> lands;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const auto& chain = p.chains[ch];
      for (int32_t k = 0; k < chain.nodes_count; ++k)
        lands.push_back(landingFor(out, t, p.chain_nodes[chain.nodes_begin + k]));
    }
    // Does this transfer still fit in the current wave on every node it touches?
    bool fits = true;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const int32_t head = p.chains[ch].src_node;
      fits = fits && (!needs_staging(head) || stage[head] + bytes <= staging_budget);
    }
    for (const auto& l : lands) fits = fits && (l.direct() || land[l.node] + bytes <= staging_budget);
    if (!fits && !wave_empty) {  // a new wave: every node's arena and staging start again at zero
      ++out.waves;
      for (auto& n : out.per_node) n.incoming.push_back(0);
      std::fill(land.begin(), land.end(), 0);
      std::fill(stage.begin(), stage.end(), 0);
    }
    wave_empty = false;
    ts.wave = out.waves - 1;
    for (int32_t ch = tr.chains_begin; ch < tr.chains_begin + tr.chains_count; ++ch) {
      const int32_t head = p.chains[ch].src_node;
      if (needs_staging(head) && ts.stagingOffset(head) == UINT64_MAX) {
        ts.heading.push_back({head, stage[head]});
        stage[head] += bytes;
        out.per_node[head].staging_bytes = std::max(out.per_node[head].staging_bytes, stage[head]);
      }
    }
    for (auto& l : lands) {
      auto& n = out.per_node[static_cast<size_t>(l.node)];
      if (!l.direct()) {
        l.arena_offset = land[l.node];
        land[l.node] += bytes;
        n.arena_bytes = std::max(n.arena_bytes, land[l.node]);
      } else {
        n.direct_targets.emplace_back(l.rank, l.buffer);
      }
      n.incoming.back() += static_cast<int64_t>(ts.chunks.size());
      ts.landings.push_back(l);
    }
  }
  collectPeers(out);
  return out;
}

}  // namespace shardcast::planner
