// Executes a plan on simulated memory and checks it element by element against the reference:
// source buffers are filled from the brute-force reference, every chain and local source is played
// (packing out of source regions, relaying whole fragments, unpacking into destination regions),
// and then every destination element, every per-node arrival count and every byte figure is checked.
#pragma once

#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "planner/plan.h"
#include "tests/unit/reference.h"

namespace shardcast::testing {

struct SimResult {
  int64_t wrong_elements = 0;      // destination elements with a wrong or missing value
  int64_t duplicate_arrivals = 0;  // an element reaching a node over the network more than once
  int64_t needless_arrivals = 0;   // an element reaching a node that needs it or holds it locally
  int64_t missing_arrivals = 0;    // needed, not held locally, never arrived
  int64_t bad_sources = 0;         // a source rank reading a fragment it does not hold
  int64_t lower_bound_bytes = 0;   // brute force: per node, needed elements no local source holds
  int64_t bytes_needed = 0;        // brute force: per destination rank
  std::string first_problem;
};

inline int64_t valueOf(const std::string& tensor, int64_t flat) {
  return static_cast<int64_t>(std::hash<std::string>{}(tensor) % 100000) * 1000000 + flat;
}

inline SimResult simulate(const planner::Plan& plan, const planner::ResolvedLayout& src,
                          const planner::ResolvedLayout& dst, const v1::Layout& src_proto,
                          const v1::Layout& dst_proto) {
  using planner::Box;
  SimResult res;
  auto note = [&](const std::string& s) {
    if (res.first_problem.empty()) res.first_problem = s;
  };
  const ElementMap src_ref = referenceElements(src_proto), dst_ref = referenceElements(dst_proto);
  std::map<std::string, int64_t> elem_bytes;
  for (const auto& t : dst.tensors) elem_bytes[t.name] = t.elemBytes();

  // Memory: (rank, buffer name) -> elements.
  std::map<std::pair<int32_t, std::string>, std::vector<int64_t>> smem, dmem;
  for (const auto& [key, val] : src_ref) {
    auto& buf = smem[{std::get<0>(key), std::get<1>(key)}];
    if (static_cast<int64_t>(buf.size()) <= std::get<2>(key)) buf.resize(std::get<2>(key) + 1, -7);
    buf[std::get<2>(key)] = valueOf(val.first, val.second);
  }
  for (const auto& [key, val] : dst_ref) {
    auto& buf = dmem[{std::get<0>(key), std::get<1>(key)}];
    if (static_cast<int64_t>(buf.size()) <= std::get<2>(key)) buf.resize(std::get<2>(key) + 1, -1);
  }

  auto forEach = [](const Box& b, auto&& fn) {
    if (b.empty()) return;
    Index idx(b.ndim);
    for (int d = 0; d < b.ndim; ++d) idx[d] = b.lo[d];
    while (true) {
      fn(idx);
      int d = b.ndim - 1;
      while (d >= 0 && ++idx[d] == b.hi[d]) idx[d] = b.lo[d], --d;
      if (d < 0) return;
    }
  };
  auto at = [](const planner::Region& r, const Box& box, const Index& idx) {
    int64_t o = r.offset;
    for (int d = 0; d < box.ndim; ++d) o += (idx[d] - box.lo[d]) * r.strides[d];
    return o;
  };
  // Reads fragment f from source rank `rank`: values in row-major order of the fragment box.
  auto pack = [&](int32_t f, int32_t rank) {
    const auto& frag = plan.fragments[f];
    std::vector<int64_t> out;
    const auto r = planner::sourceRegion(plan, src, f, rank);
    if (r.strides.empty() && frag.box.ndim > 0) {
      ++res.bad_sources;
      note("source rank " + std::to_string(rank) + " does not hold fragment " + std::to_string(f));
      return out;
    }
    auto& buf = smem[{rank, src.buffer_names[r.buffer]}];
    forEach(frag.box, [&](const Index& idx) {
      const int64_t o = at(r, frag.box, idx);
      out.push_back(o < static_cast<int64_t>(buf.size()) ? buf[o] : -9);
    });
    return out;
  };
  auto unpack = [&](int32_t f, int32_t node, const std::vector<int64_t>& payload) {
    const auto& frag = plan.fragments[f];
    if (payload.empty()) return;
    for (const auto& [sub, r] : planner::destinationRegions(plan, dst, f, node)) {
      auto& buf = dmem[{r.rank, dst.buffer_names[r.buffer]}];
      forEach(sub, [&](const Index& idx) {
        int64_t k = 0;  // position of idx in the fragment's row-major order
        for (int d = 0; d < frag.box.ndim; ++d) k = k * frag.box.size(d) + (idx[d] - frag.box.lo[d]);
        const int64_t o = at(r, sub, idx);
        if (o < static_cast<int64_t>(buf.size())) buf[o] = payload[k];
      });
    }
  };
  // Network arrivals per (node, tensor, flat).
  std::map<std::tuple<int32_t, std::string, int64_t>, int> arrivals;
  auto arrive = [&](int32_t f, int32_t node) {
    const auto& frag = plan.fragments[f];
    const auto& t = dst.tensors[plan.tensors[frag.tensor].dst];
    forEach(frag.box, [&](const Index& idx) {
      int64_t flat = 0;
      for (int d = 0; d < frag.box.ndim; ++d) flat = flat * t.shape[d] + idx[d];
      ++arrivals[{node, t.name, flat}];
    });
  };

  for (const auto& tr : plan.transfers) {
    for (int32_t c = tr.chains_begin; c < tr.chains_begin + tr.chains_count; ++c) {
      const auto& ch = plan.chains[c];
      for (int32_t i = tr.fragments_begin; i < tr.fragments_begin + tr.fragments_count; ++i) {
        const int32_t f = plan.transfer_fragments[i];
        const int32_t rank = planner::sourceRank(plan, src, f, ch);
        if (rank < 0 || src.rank_node[rank] != ch.src_node) {
          ++res.bad_sources;
          note("chain source node holds no copy of fragment " + std::to_string(f));
          continue;
        }
        // The payload travels unchanged along the chain: each node relays what it received.
        const auto payload = pack(f, rank);
        for (int32_t k = 0; k < ch.nodes_count; ++k) {
          const int32_t node = plan.chain_nodes[ch.nodes_begin + k];
          arrive(f, node);
          unpack(f, node, payload);
        }
      }
    }
  }
  for (const auto& ls : plan.local_sources) {
    if (src.rank_node[ls.src_rank] != ls.node) {
      ++res.bad_sources;
      note("local source on another node");
    }
    unpack(ls.fragment, ls.node, pack(ls.fragment, ls.src_rank));
  }

  // Destination values.
  for (const auto& [key, val] : dst_ref) {
    const auto& buf = dmem[{std::get<0>(key), std::get<1>(key)}];
    if (buf[std::get<2>(key)] != valueOf(val.first, val.second)) {
      ++res.wrong_elements;
      note("rank " + std::to_string(std::get<0>(key)) + " " + val.first + "[" + std::to_string(val.second) +
           "] has a wrong value");
    }
    res.bytes_needed += elem_bytes[val.first];
  }
  // Arrivals versus what each node needs and what its own sources hold.
  std::set<std::tuple<int32_t, std::string, int64_t>> needed, held;
  for (const auto& [key, val] : dst_ref) needed.insert({dst.rank_node[std::get<0>(key)], val.first, val.second});
  for (const auto& [key, val] : src_ref) held.insert({src.rank_node[std::get<0>(key)], val.first, val.second});
  for (const auto& [key, count] : arrivals) {
    if (count > 1) {
      ++res.duplicate_arrivals;
      note("element of " + std::get<1>(key) + " reached a node twice");
    }
    if (!needed.count(key) || held.count(key)) {
      ++res.needless_arrivals;
      note("element of " + std::get<1>(key) + " sent to a node that does not need it or has it");
    }
  }
  for (const auto& key : needed) {
    if (held.count(key)) continue;
    res.lower_bound_bytes += elem_bytes[std::get<1>(key)];
    if (!arrivals.count(key)) {
      ++res.missing_arrivals;
      note("element of " + std::get<1>(key) + " never reached its node");
    }
  }
  return res;
}

}  // namespace shardcast::testing
