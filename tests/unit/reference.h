// Brute-force reference for layouts: which rank holds which element of a small tensor, and at
// which element offset of which local buffer. Written independently of planner/layout.cc, by
// literally splitting index lists the way PyTorch DTensor splits tensors.
#pragma once

#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shardcast/v1/layout.pb.h"

namespace shardcast::testing {

using Index = std::vector<int64_t>;

// torch.chunk over a list: chunk size ceil(n / k); always returns k lists (trailing ones empty),
// as DTensor's fill_empty_tensor_to_shards does.
inline std::vector<Index> torchChunk(const Index& v, int64_t k) {
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t c = n == 0 ? 0 : (n + k - 1) / k;
  std::vector<Index> out(k);
  for (int64_t i = 0; c > 0 && i < k; ++i)
    for (int64_t j = i * c; j < std::min(n, (i + 1) * c); ++j) out[i].push_back(v[j]);
  return out;
}

// Per rank, per tensor dim: the global indices the rank holds, in local order.
inline std::vector<std::vector<Index>> referenceDims(const v1::Tensor& t, const std::vector<int64_t>& mesh) {
  int64_t world = 1;
  for (int64_t m : mesh) world *= m;
  std::vector<std::vector<Index>> out(world);
  for (int64_t r = 0; r < world; ++r) {
    std::vector<int64_t> coord(mesh.size());
    int64_t rem = r;
    for (int m = static_cast<int>(mesh.size()) - 1; m >= 0; --m) coord[m] = rem % mesh[m], rem /= mesh[m];
    std::vector<Index> dims(t.shape_size());
    for (int d = 0; d < t.shape_size(); ++d)
      for (int64_t i = 0; i < t.shape(d); ++i) dims[d].push_back(i);
    for (int m = 0; m < t.placements_size(); ++m) {
      const auto& p = t.placements(m);
      if (p.has_shard()) {
        dims[p.shard().dim()] = torchChunk(dims[p.shard().dim()], mesh[m])[coord[m]];
      } else if (p.has_strided_shard()) {
        const int d = p.strided_shard().dim();
        Index kept;
        for (const Index& part : torchChunk(dims[d], p.strided_shard().split_factor())) {
          const Index mine = torchChunk(part, mesh[m])[coord[m]];
          kept.insert(kept.end(), mine.begin(), mine.end());
        }
        dims[d] = kept;
      }
    }
    out[r] = dims;
  }
  return out;
}

// (rank, buffer name, local element offset) -> (tensor name, global flat index)
using ElementMap = std::map<std::tuple<int32_t, std::string, int64_t>, std::pair<std::string, int64_t>>;

inline int64_t flatIndex(const v1::Tensor& t, const Index& idx) {
  int64_t f = 0;
  for (int d = 0; d < t.shape_size(); ++d) f = f * t.shape(d) + idx[d];
  return f;
}

// One rank's local tensor of one logical tensor: shape and, per element, (global flat, local pos).
struct RefLocal {
  Index shape;
  std::vector<std::pair<int64_t, Index>> elements;
};

// Visits every index in the product of the per-dim lists.
template <typename Fn>
void forEachProduct(const std::vector<Index>& dims, Fn&& fn) {
  const int nd = static_cast<int>(dims.size());
  for (const auto& d : dims)
    if (d.empty()) return;
  Index pos(nd, 0), g(nd);
  while (true) {
    for (int d = 0; d < nd; ++d) g[d] = dims[d][pos[d]];
    fn(g, pos);
    int d = nd - 1;
    while (d >= 0 && ++pos[d] == static_cast<int64_t>(dims[d].size())) pos[d] = 0, --d;
    if (d < 0) return;
  }
}

inline int64_t rowMajor(const Index& shape, const Index& pos) {
  int64_t o = 0;
  for (size_t d = 0; d < shape.size(); ++d) o = o * shape[d] + pos[d];
  return o;
}

// The full reference map of a layout (small layouts only).
inline ElementMap referenceElements(const v1::Layout& l) {
  std::vector<int64_t> mesh(l.mesh().shape().begin(), l.mesh().shape().end());
  int64_t world = 1;
  for (int64_t m : mesh) world *= m;
  std::map<std::string, std::pair<std::string, int>> fused_of;  // tensor -> (buffer, dim)
  for (const auto& f : l.fused())
    for (const auto& t : f.tensors()) fused_of[t] = {f.name(), f.dim()};
  // Per tensor, per rank: its local tensors (one for placements, one per piece for pieces).
  std::map<std::string, std::vector<std::vector<RefLocal>>> locals;
  for (const auto& t : l.tensors()) {
    auto& per_rank = locals[t.name()];
    per_rank.resize(world);
    if (t.pieces_size() == 0) {
      auto dims = referenceDims(t, mesh);
      for (int64_t r = 0; r < world; ++r) {
        RefLocal loc;
        for (const auto& d : dims[r]) loc.shape.push_back(static_cast<int64_t>(d.size()));
        forEachProduct(dims[r],
                       [&](const Index& g, const Index& pos) { loc.elements.emplace_back(flatIndex(t, g), pos); });
        if (!loc.elements.empty()) per_rank[r].push_back(loc);
      }
    } else {
      for (const auto& p : t.pieces()) {
        std::vector<Index> dims(t.shape_size());
        RefLocal loc;
        for (int d = 0; d < t.shape_size(); ++d) {
          for (int64_t i = 0; i < p.sizes(d); ++i) dims[d].push_back(p.offsets(d) + i);
          loc.shape.push_back(p.sizes(d));
        }
        forEachProduct(dims,
                       [&](const Index& g, const Index& pos) { loc.elements.emplace_back(flatIndex(t, g), pos); });
        if (loc.elements.empty()) continue;
        std::vector<int32_t> ranks(p.ranks().begin(), p.ranks().end());
        if (ranks.empty()) ranks.push_back(p.rank());
        for (int32_t r : ranks) per_rank[r].push_back(loc);
      }
    }
  }
  ElementMap out;
  for (const auto& t : l.tensors()) {
    if (fused_of.count(t.name())) continue;
    for (int64_t r = 0; r < world; ++r) {
      int64_t base = 0;
      for (const RefLocal& loc : locals[t.name()][r]) {
        for (const auto& [flat, pos] : loc.elements)
          out[{static_cast<int32_t>(r), t.name(), base + rowMajor(loc.shape, pos)}] = {t.name(), flat};
        int64_t n = 1;
        for (int64_t s : loc.shape) n *= s;
        base += n;
      }
    }
  }
  for (const auto& f : l.fused()) {
    for (int64_t r = 0; r < world; ++r) {
      Index fshape;
      std::vector<int64_t> start;
      for (const auto& name : f.tensors()) {
        const auto& locs = locals[name][r];
        start.push_back(fshape.empty() ? 0 : fshape[f.dim()]);
        if (locs.empty()) continue;
        if (fshape.empty()) {
          fshape = locs[0].shape;
        } else {
          fshape[f.dim()] += locs[0].shape[f.dim()];
        }
      }
      for (int i = 0; i < f.tensors_size(); ++i) {
        const auto& locs = locals[f.tensors(i)][r];
        if (locs.empty()) continue;
        for (const auto& [flat, pos] : locs[0].elements) {
          Index p = pos;
          p[f.dim()] += start[i];
          out[{static_cast<int32_t>(r), f.name(), rowMajor(fshape, p)}] = {f.tensors(i), flat};
        }
      }
    }
  }
  return out;
}

// ---- random layouts -------------------------------------------------------------------------

struct RandomTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
};

inline std::vector<RandomTensorSpec> randomTensorSpecs(std::mt19937& rng) {
  static const char* dtypes[] = {"bfloat16", "float32", "int8", "float64"};
  std::vector<RandomTensorSpec> out;
  const int n = 1 + static_cast<int>(rng() % 3);
  for (int i = 0; i < n; ++i) {
    RandomTensorSpec s;
    s.name = "t" + std::to_string(i);
    const int nd = 1 + static_cast<int>(rng() % 4);
    for (int d = 0; d < nd; ++d) s.shape.push_back(1 + static_cast<int64_t>(rng() % (nd >= 3 ? 4 : 7)));
    s.dtype = dtypes[rng() % 4];
    out.push_back(s);
  }
  return out;
}

// A random mesh (1-3 dims, up to 12 ranks) with ranks spread over nodes n0..n3 of a shared pool.
inline v1::Layout randomLayoutShell(std::mt19937& rng, const std::string& group) {
  v1::Layout l;
  l.set_group(group);
  const int nd = 1 + static_cast<int>(rng() % 3);
  int64_t world = 1;
  for (int d = 0; d < nd; ++d) {
    const int64_t s = 1 + static_cast<int64_t>(rng() % (world >= 4 ? 2 : 3));
    l.mutable_mesh()->add_shape(s);
    world *= s;
  }
  if (rng() % 3 == 0) {
    l.set_ranks_per_node(1 + static_cast<int32_t>(rng() % 4));
    l.set_node_prefix("n");
  } else {
    for (int64_t r = 0; r < world; ++r) l.add_nodes("n" + std::to_string(rng() % 4));
  }
  return l;
}

inline int64_t worldOf(const v1::Layout& l) {
  int64_t w = 1;
  for (int64_t s : l.mesh().shape()) w *= s;
  return w;
}

// Random placements (replicate / shard / strided_shard) or random explicit pieces. When `cover`
// is set, explicit pieces always tile the whole tensor (a source must hold every element).
inline void addRandomTensor(std::mt19937& rng, v1::Layout& l, const RandomTensorSpec& spec, bool cover) {
  auto* t = l.add_tensors();
  t->set_name(spec.name);
  for (int64_t s : spec.shape) t->add_shape(s);
  t->set_dtype(spec.dtype);
  const int nd = static_cast<int>(spec.shape.size());
  const int64_t world = worldOf(l);
  if (rng() % 3 != 0) {
    for (int m = 0; m < l.mesh().shape_size(); ++m) {
      auto* p = t->add_placements();
      switch (rng() % 4) {
        case 0:
          p->mutable_replicate();
          break;
        case 3:
          p->mutable_strided_shard()->set_dim(static_cast<int32_t>(rng() % nd));
          p->mutable_strided_shard()->set_split_factor(1 + static_cast<int32_t>(rng() % 3));
          break;
        default:
          p->mutable_shard()->set_dim(static_cast<int32_t>(rng() % nd));
      }
    }
    return;
  }
  // Explicit pieces: a random grid over the tensor, each cell held by 1-2 random ranks; without
  // `cover`, some cells are dropped and some pieces are random (possibly overlapping) boxes.
  std::vector<std::vector<int64_t>> cuts(nd);
  for (int d = 0; d < nd; ++d) {
    cuts[d] = {0, spec.shape[d]};
    if (spec.shape[d] > 1 && rng() % 2)
      cuts[d].insert(cuts[d].begin() + 1, 1 + static_cast<int64_t>(rng() % (spec.shape[d] - 1)));
  }
  std::vector<size_t> idx(nd, 0);
  while (true) {
    if (cover || rng() % 4 != 0) {
      auto* p = t->add_pieces();
      for (int d = 0; d < nd; ++d) {
        p->add_offsets(cuts[d][idx[d]]);
        p->add_sizes(cuts[d][idx[d] + 1] - cuts[d][idx[d]]);
      }
      const int copies = 1 + static_cast<int>(rng() % 2);
      if (copies == 1) {
        p->set_rank(static_cast<int32_t>(rng() % world));
      } else {
        for (int c = 0; c < copies; ++c) p->add_ranks(static_cast<int32_t>(rng() % world));
      }
    }
    int d = nd - 1;
    while (d >= 0 && ++idx[d] + 1 == cuts[d].size()) idx[d] = 0, --d;
    if (d < 0) break;
  }
  if (!cover && rng() % 2) {
    auto* p = t->add_pieces();
    for (int d = 0; d < nd; ++d) {
      const int64_t a = static_cast<int64_t>(rng() % spec.shape[d]);
      p->add_offsets(a);
      p->add_sizes(1 + static_cast<int64_t>(rng() % (spec.shape[d] - a)));
    }
    p->set_rank(static_cast<int32_t>(rng() % world));
  }
}

// A random trainer layout holding every tensor and an inference layout needing most of them (the
// shape of the property tests' inputs).
inline std::pair<v1::Layout, v1::Layout> randomLayoutPair(std::mt19937& rng) {
  const auto specs = randomTensorSpecs(rng);
  std::pair<v1::Layout, v1::Layout> out{randomLayoutShell(rng, "trainer"), randomLayoutShell(rng, "inference")};
  for (const auto& s : specs) {
    addRandomTensor(rng, out.first, s, /*cover=*/true);
    if (rng() % 4 != 0) addRandomTensor(rng, out.second, s, /*cover=*/false);
  }
  return out;
}

// A random trainer layout of q, k and v, and a vLLM-like inference layout (mesh [2, tp]) holding
// them fused into qkv along dim 0.
inline std::pair<v1::Layout, v1::Layout> randomFusedLayoutPair(std::mt19937& rng) {
  const int tp = 1 + static_cast<int>(rng() % 4);
  const int cols = 1 + static_cast<int>(rng() % 4);
  std::pair<v1::Layout, v1::Layout> out{randomLayoutShell(rng, "trainer"), {}};
  v1::Layout& dst = out.second;
  dst.set_group("vllm");
  dst.mutable_mesh()->add_shape(2);
  dst.mutable_mesh()->add_shape(tp);
  dst.set_ranks_per_node(1 + static_cast<int32_t>(rng() % 4));
  dst.set_node_prefix("n");
  auto* f = dst.add_fused();
  f->set_name("qkv");
  f->set_dim(0);
  for (const char* name : {"q", "k", "v"}) {
    RandomTensorSpec spec{name, {tp * (1 + static_cast<int64_t>(rng() % 3)), cols}, "bfloat16"};
    addRandomTensor(rng, out.first, spec, true);
    auto* t = dst.add_tensors();
    t->set_name(name);
    t->add_shape(spec.shape[0]);
    t->add_shape(spec.shape[1]);
    t->set_dtype("bfloat16");
    t->add_placements()->mutable_replicate();
    t->add_placements()->mutable_shard()->set_dim(0);
    f->add_tensors(name);
  }
  return out;
}

}  // namespace shardcast::testing
