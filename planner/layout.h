// Resolved layouts: a validated shardcast.v1.Layout turned into, per tensor, the boxes each rank
// holds and where each box sits in the rank's local memory (buffer, element offset, strides).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "planner/box.h"
#include "shardcast/v1/layout.pb.h"

namespace shardcast::planner {

enum class DType : uint8_t {
  kBFloat16,
  kFloat16,
  kFloat32,
  kFloat64,
  kFloat8E4M3,
  kFloat8E5M2,
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
};

StatusOr<DType> parseDType(std::string_view torch_name);
std::string_view dtypeName(DType t);
int64_t dtypeBytes(DType t);
// Whether a destination tensor may declare dtype `to` for a source tensor of dtype `from`: the
// same dtype, or a conversion the sync makes at the source (fewer bytes on the wire):
// float32 -> bfloat16 (round to nearest even, as torch's .to(torch.bfloat16)); bfloat16 or
// float32 -> float8_e4m3fn when the destination declares block scales (v1::BlockScale; checked
// by the planner). The daemon's pack stage (daemon/stage/stage.h) converts exactly these.
bool convertible(DType from, DType to);

// Node names are shared by the source and destination layouts of one plan (colocation).
class NodeTable {
 public:
  int32_t intern(const std::string& name);
  const std::string& name(int32_t id) const { return names_[id]; }
  // The id of `name`, -1 when it is not in the table.
  int32_t find(const std::string& name) const {
    const auto it = ids_.find(name);
    return it == ids_.end() ? -1 : it->second;
  }
  int32_t size() const { return static_cast<int32_t>(names_.size()); }

 private:
  std::vector<std::string> names_;
  std::unordered_map<std::string, int32_t> ids_;
};

// One box of one tensor held by one rank. The element at global index x lives in that rank's
// buffer `buffer` at element offset `offset + sum_d (x[d] - box.lo[d]) * strides[d]`.
struct PieceRef {
  int32_t rank = 0;
  int32_t box = 0;      // index into TensorLayout::boxes
  int32_t buffer = 0;   // index into ResolvedLayout::buffer_names
  int32_t strides = 0;  // index into ResolvedLayout::strides
  int64_t offset = 0;   // elements
};

struct TensorLayout {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  std::vector<Box> boxes;        // distinct boxes held by some rank
  std::vector<PieceRef> pieces;  // sorted by rank, then local order
  int64_t elemBytes() const { return dtypeBytes(dtype); }

  // Block-scaled fp8 (v1::BlockScale). A quantised weight: `block` is its block shape and
  // `scale` the index of its scale tensor. A scale tensor (derived, scale_of >= 0): element i
  // scales block i of tensor `scale_of` of the same layout, whose shape is `scaled_shape` (edge
  // blocks are cut there) and whose block shape is `block`. In a source layout a scale tensor is
  // virtual (addScaleSources): its pieces point at the first element of each block in the
  // weight's own buffer, its strides are the weight's times the block, its dtype the weight's.
  std::vector<int64_t> block;
  bool pow2 = false;
  int32_t scale = -1;
  int32_t scale_of = -1;
  std::vector<int64_t> scaled_shape;
  // A source's virtual scale tensor only: the blocks (row-major indices into `shape`) that some
  // source piece holds only part of, sorted. Their amax is combined across the daemons holding
  // their pieces before any rank quantises (daemon/engine/split_amax.h); the piece holding a
  // block's first element sends its scale.
  std::vector<int64_t> split_blocks;
  // A source's virtual scale tensor (addScaleSources): computed from the weight, never read as it
  // is. False for a scale tensor some rank holds in memory (a seed replica's, in a catch-up).
  bool virtual_scale = false;
  bool blockScaled() const { return !block.empty() && scale_of < 0; }
};

// Whether destination tensor `dt` is computed from source tensor `st` (quantised from the
// source's float32 or bfloat16 weight, or its blocks' scales), rather than copied or converted
// element by element. A source that holds them quantised already (a replica seeding a catch-up:
// its fp8 bytes and its scales, in the same blocks) is copied.
inline bool computedFrom(const TensorLayout& st, const TensorLayout& dt) {
  return (dt.blockScaled() && !st.blockScaled()) || (dt.scale_of >= 0 && st.virtual_scale);
}

// A contiguous-or-strided run of elements in one rank's buffer, for one box.
struct Region {
  int32_t rank = 0;
  int32_t buffer = 0;
  int64_t offset = 0;            // elements from the buffer start
  std::vector<int64_t> strides;  // elements, one per tensor dim
  std::vector<int64_t> extent;   // the box sizes
};

struct ResolvedLayout {
  std::string group;
  std::vector<int64_t> mesh_shape;
  std::vector<int32_t> rank_node;  // node id (in the plan's NodeTable) of each rank
  std::vector<TensorLayout> tensors;
  std::unordered_map<std::string, int32_t> tensor_index;
  std::vector<std::string> buffer_names;      // default buffer of a tensor is named after it
  std::vector<std::vector<int64_t>> strides;  // deduplicated stride vectors

  int32_t world() const { return static_cast<int32_t>(rank_node.size()); }
  const TensorLayout* find(const std::string& name) const;
  // The region in piece.rank's memory holding `sub` (which must lie inside the piece's box).
  Region region(const TensorLayout& t, const PieceRef& piece, const Box& sub) const;
  // Every buffer rank `rank` uses, with the bytes it needs (one pass over the tensors).
  std::vector<std::pair<int32_t, int64_t>> rankBuffers(int32_t rank) const;
};

// Parses the JSON form of shardcast.v1.Layout (snake_case or lowerCamel field names; unknown fields
// are errors). `origin` names the input in messages (a file path).
StatusOr<v1::Layout> parseLayoutJson(std::string_view json, std::string_view origin);
StatusOr<v1::Layout> readLayoutFile(const std::string& path);
// A stable digest of a layout (xxHash64 of its deterministic serialisation), 16 hex digits: what
// daemons compare to know two ranks registered the same layout, and what keys cached plans.
std::string layoutDigest(const v1::Layout& layout);
// The deterministic serialisation layoutDigest hashes, and the digest of such bytes.
std::string serializedLayout(const v1::Layout& layout);
std::string layoutDigestOf(std::string_view serialized);

// Validates `layout` and resolves every tensor's pieces; node names are interned into `nodes`.
// A block-scaled tensor's scale tensor is added to the resolved layout (after the declared ones).
// `only_rank`: only that rank's pieces are made (what a registration needs: a 65,536-rank layout
// costs its rank's pieces, not 7.8 million). The layout is validated as a whole all the same,
// except the checks that look at pieces (overlap, fused members), which cover that rank's.
StatusOr<ResolvedLayout> resolveLayout(const v1::Layout& layout, NodeTable& nodes,
                                       std::optional<int32_t> only_rank = std::nullopt);

// Before planning `src` into `dst`: for every scale tensor of `dst`, the virtual source tensor the
// scales are computed from (TensorLayout::scale_of), with the blocks source pieces cut
// (TensorLayout::split_blocks: FSDP shards that are not multiples of the block).
Status addScaleSources(ResolvedLayout& src, const ResolvedLayout& dst);

// Block-scaled weights. The blocks (block indices) a box of weight elements touches; the weight
// elements of the blocks in a box of block indices, cut at the tensor's edge `shape`; the
// row-major index of block `k` among a scale tensor's `grid`; each block index of a box, in
// row-major order.
Box blocksTouched(const Box& elements, const std::vector<int64_t>& block);
Box blockElements(const Box& blocks, const std::vector<int64_t>& block, const std::vector<int64_t>& shape);
int64_t blockIndex(const int64_t* k, const std::vector<int64_t>& grid);
void forEachIndex(const Box& box, const std::function<void(const int64_t*)>& fn);

// Per-dim global index intervals a rank holds under DTensor placements (exposed for tests):
// the rank's local tensor along dim d is the concatenation of intervals[d] in order.
using Intervals = std::vector<std::pair<int64_t, int64_t>>;
StatusOr<std::vector<Intervals>> placementIntervals(const v1::Tensor& tensor, const std::vector<int64_t>& mesh_shape,
                                                    const std::vector<int64_t>& coords);

// Calls fn(tensor index, piece, element offset in the piece's buffer, global row-major index in
// the tensor) for every element rank `rank` holds: how applications and tests fill or check a
// rank's buffers element by element.
template <typename Fn>
void forEachElement(const ResolvedLayout& l, int32_t rank, Fn&& fn) {
  for (size_t ti = 0; ti < l.tensors.size(); ++ti) {
    const auto& t = l.tensors[ti];
    for (const auto& p : t.pieces) {
      if (p.rank != rank) continue;
      const auto& b = t.boxes[p.box];
      if (b.empty()) continue;
      const auto& st = l.strides[p.strides];
      std::vector<int64_t> idx(b.lo.begin(), b.lo.begin() + b.ndim);
      while (true) {
        int64_t off = p.offset, flat = 0;
        for (int d = 0; d < b.ndim; ++d) {
          off += (idx[d] - b.lo[d]) * st[d];
          flat = flat * t.shape[d] + idx[d];
        }
        fn(ti, p, off, flat);
        int d = b.ndim - 1;
        while (d >= 0 && ++idx[d] == b.hi[d]) idx[d] = b.lo[d], --d;
        if (d < 0) break;
      }
    }
  }
}

}  // namespace shardcast::planner
