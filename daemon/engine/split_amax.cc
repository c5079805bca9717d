#include "daemon/engine/split_amax.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/strings.h"

namespace shardcast::daemon {

namespace {

// The larger of two amaxes; NaN wins (the block holds NaN: its scale is NaN).
float raised(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return std::max(a, b);
}

// Calls fn(weight, block index, part) for every split block a piece of a rank on `node` touches,
// part being the piece's elements of it (as a region of the rank's memory).
template <typename Fn>
void forEachSplitPart(const planner::ResolvedLayout& src, int32_t node, Fn&& fn) {
  for (const planner::TensorLayout& v : src.tensors) {
    if (v.scale_of < 0 || v.split_blocks.empty()) continue;
    const planner::TensorLayout& w = src.tensors[static_cast<size_t>(v.scale_of)];
    for (const planner::PieceRef& p : w.pieces) {
      if (src.rank_node[static_cast<size_t>(p.rank)] != node) continue;
      const planner::Box& wb = w.boxes[static_cast<size_t>(p.box)];
      planner::forEachIndex(planner::blocksTouched(wb, v.block), [&](const int64_t* k) {
        const int64_t index = planner::blockIndex(k, v.shape);
        if (!std::binary_search(v.split_blocks.begin(), v.split_blocks.end(), index)) return;
        planner::Box one;
        one.ndim = wb.ndim;
        for (int d = 0; d < wb.ndim; ++d) {
          one.lo[d] = k[d];
          one.hi[d] = k[d] + 1;
        }
        fn(w, index, src.region(w, p, planner::intersect(wb, planner::blockElements(one, v.block, w.shape))));
      });
    }
  }
}

SplitAmaxes sorted(const std::map<std::string, std::map<int64_t, float>>& by_block) {
  SplitAmaxes out;
  for (const auto& [weight, blocks] : by_block) {
    SplitAmax& s = out[weight];
    for (const auto& [block, amax] : blocks) {
      s.blocks.push_back(block);
      s.amax.push_back(amax);
    }
  }
  return out;
}

}  // namespace

StatusOr<SplitAmaxes> partialAmaxes(const planner::ResolvedLayout& src, int32_t node, const ReadAmax& read) {
  std::map<std::string, std::map<int64_t, float>> parts;
  Status st;
  forEachSplitPart(src, node, [&](const planner::TensorLayout& w, int64_t block, const planner::Region& part) {
    if (!st.ok()) return;
    auto amax = read(w, part);
    if (!amax.ok()) {
      st = Status(amax.status().code(), strCat("tensor ", quote(w.name), " rank ", part.rank, ", block ", block,
                                               " (split between source ranks): ", amax.status().message()));
      return;
    }
    auto [it, added] = parts[w.name].try_emplace(block, *amax);
    if (!added) it->second = raised(it->second, *amax);
  });
  SC_RETURN_IF_ERROR(st);
  return sorted(parts);
}

StatusOr<std::vector<SplitAmaxes>> combineAmaxes(const planner::ResolvedLayout& src,
                                                 const std::vector<int32_t>& node_ids,
                                                 const std::vector<std::string>& node_names,
                                                 const std::vector<SplitAmaxes>& reports) {
  std::map<std::string, std::map<int64_t, float>> combined;
  for (size_t i = 0; i < reports.size(); ++i) {
    // What node i's ranks touch, against what it reported.
    std::map<std::string, std::vector<int64_t>> expected;
    if (node_ids[i] >= 0)
      forEachSplitPart(src, node_ids[i], [&](const planner::TensorLayout& w, int64_t block, const planner::Region&) {
        expected[w.name].push_back(block);
      });
    for (auto& [weight, blocks] : expected) {
      std::sort(blocks.begin(), blocks.end());
      blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    }
    const auto wrong = [&](const std::string& what) {
      return absl::FailedPreconditionError(strCat("node ", quote(node_names[i]), " reported ", what,
                                                  " of blocks split between source ranks: are the daemons of one "
                                                  "version?"));
    };
    for (const auto& [weight, s] : reports[i]) {
      const auto it = expected.find(weight);
      if (it == expected.end() || it->second != s.blocks)
        return wrong(strCat("other amaxes of tensor ", quote(weight), " than its ranks hold"));
      for (size_t k = 0; k < s.blocks.size(); ++k) {
        auto [at, added] = combined[weight].try_emplace(s.blocks[k], s.amax[k]);
        if (!added) at->second = raised(at->second, s.amax[k]);
      }
    }
    for (const auto& [weight, blocks] : expected)
      if (reports[i].count(weight) == 0) return wrong(strCat("no amaxes of tensor ", quote(weight)));
  }
  std::vector<SplitAmaxes> out(reports.size());
  for (size_t i = 0; i < reports.size(); ++i)
    for (const auto& [weight, s] : reports[i]) {
      SplitAmax& mine = out[i][weight];
      mine.blocks = s.blocks;
      const auto& all = combined[weight];
      for (const int64_t block : s.blocks) mine.amax.push_back(all.at(block));
    }
  return out;
}

Status checkCombined(const SplitAmaxes& own, const SplitAmaxes& combined) {
  for (const auto& [weight, s] : own) {
    const auto it = combined.find(weight);
    if (it == combined.end() || it->second.blocks != s.blocks)
      return absl::FailedPreconditionError(
          strCat("tensor ", quote(weight),
                 ": the coordinator did not send the amaxes of the blocks split between "
                 "source ranks that this node's ranks hold part of"));
    for (size_t k = 0; k < s.blocks.size(); ++k) {
      const float mine = s.amax[k], all = it->second.amax[k];
      if (std::isnan(mine) ? !std::isnan(all) : !(std::isnan(all) || all >= mine))
        return absl::FailedPreconditionError(strCat("tensor ", quote(weight), ", block ", s.blocks[k],
                                                    ": the coordinator's amax ", all,
                                                    " is not the whole block's (this node's part has ", mine, ")"));
    }
  }
  if (combined.size() != own.size())
    return absl::FailedPreconditionError("the coordinator sent amaxes of tensors this node's ranks do not split");
  return absl::OkStatus();
}

void writeAmaxes(const SplitAmaxes& amaxes, google::protobuf::RepeatedPtrField<v1::BlockAmax>* out) {
  for (const auto& [weight, s] : amaxes) {
    auto* m = out->Add();
    m->set_tensor(weight);
    m->mutable_blocks()->Add(s.blocks.begin(), s.blocks.end());
    m->mutable_amax()->Add(s.amax.begin(), s.amax.end());
  }
}

StatusOr<SplitAmaxes> readAmaxes(const google::protobuf::RepeatedPtrField<v1::BlockAmax>& in) {
  SplitAmaxes out;
  for (const auto& m : in) {
    if (m.blocks_size() != m.amax_size())
      return absl::InvalidArgumentError(strCat("amaxes of tensor ", quote(m.tensor()), ": ", m.blocks_size(),
                                               " blocks but ", m.amax_size(), " amaxes"));
    auto [it, added] = out.try_emplace(m.tensor());
    if (!added) return absl::InvalidArgumentError(strCat("amaxes of tensor ", quote(m.tensor()), " twice"));
    it->second.blocks.assign(m.blocks().begin(), m.blocks().end());
    it->second.amax.assign(m.amax().begin(), m.amax().end());
    for (size_t k = 1; k < it->second.blocks.size(); ++k)
      if (it->second.blocks[k] <= it->second.blocks[k - 1])
        return absl::InvalidArgumentError(strCat("amaxes of tensor ", quote(m.tensor()), ": blocks not sorted"));
  }
  return out;
}

}  // namespace shardcast::daemon
