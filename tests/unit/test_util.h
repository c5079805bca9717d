// Helpers shared by the planner tests: layouts from JSON text, and resolved element maps.
#pragma once

#include <catch2/catch.hpp>
#include <string>

#include "planner/layout.h"
#include "tests/unit/reference.h"

namespace shardcast::testing {

inline v1::Layout layoutFromJson(const std::string& json) {
  auto l = planner::parseLayoutJson(json, "test");
  if (!l.ok()) FAIL(std::string(l.status().message()));
  return *l;
}

// The element map of a resolved layout, in the reference's terms (duplicates are reported).
inline ElementMap resolvedElements(const planner::ResolvedLayout& r, std::string* duplicate) {
  ElementMap out;
  for (const auto& t : r.tensors) {
    for (const auto& p : t.pieces) {
      const planner::Box& b = t.boxes[p.box];
      const auto& st = r.strides[p.strides];
      const int nd = b.ndim;
      Index idx(nd);
      for (int d = 0; d < nd; ++d) idx[d] = b.lo[d];
      if (b.empty()) continue;
      while (true) {
        int64_t off = p.offset, flat = 0;
        for (int d = 0; d < nd; ++d) {
          off += (idx[d] - b.lo[d]) * st[d];
          flat = flat * t.shape[d] + idx[d];
        }
        auto key = std::make_tuple(p.rank, r.buffer_names[p.buffer], off);
        auto [it, inserted] = out.emplace(key, std::make_pair(t.name, flat));
        if (!inserted && it->second != std::make_pair(t.name, flat) && duplicate)
          *duplicate = "rank " + std::to_string(p.rank) + " offset " + std::to_string(off) + " of " +
                       r.buffer_names[p.buffer] + " written twice";
        int d = nd - 1;
        while (d >= 0 && ++idx[d] == b.hi[d]) idx[d] = b.lo[d], --d;
        if (d < 0) break;
      }
    }
  }
  return out;
}

}  // namespace shardcast::testing
