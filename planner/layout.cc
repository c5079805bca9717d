#include "planner/layout.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/json_util.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_set>

#include "common/strings.h"
#include "planner/limits.h"

namespace shardcast::planner {

namespace {

struct DTypeInfo {
  std::string_view name;
  DType type;
  int64_t bytes;
};

constexpr DTypeInfo kDTypes[] = {
    {"bfloat16", DType::kBFloat16, 2},
    {"float16", DType::kFloat16, 2},
    {"float32", DType::kFloat32, 4},
    {"float64", DType::kFloat64, 8},
    {"float8_e4m3fn", DType::kFloat8E4M3, 1},
    {"float8_e5m2", DType::kFloat8E5M2, 1},
    {"int8", DType::kInt8, 1},
    {"uint8", DType::kUInt8, 1},
    {"int16", DType::kInt16, 2},
    {"int32", DType::kInt32, 4},
    {"int64", DType::kInt64, 8},
    {"bool", DType::kBool, 1},
};

std::string shapeStr(const std::vector<int64_t>& s) { return "[" + strJoin(s, ", ") + "]"; }

// "[lo:hi, ...]" of a piece as given (hi written "lo+size" where it would not fit an int64).
std::string spanStr(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  std::vector<std::string> dims;
  for (size_t d = 0; d < offsets.size(); ++d) {
    const auto hi = checkedAdd(offsets[d], sizes[d]);
    dims.push_back(hi ? strCat(offsets[d], ":", *hi) : strCat(offsets[d], ":", offsets[d], "+", sizes[d]));
  }
  return "[" + strJoin(dims, ", ") + "]";
}

template <typename T>
std::vector<int64_t> toVec(const T& repeated) {
  return std::vector<int64_t>(repeated.begin(), repeated.end());
}

std::vector<int64_t> rowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size());
  int64_t acc = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= shape[d];
  }
  return s;
}

int64_t ceilDiv(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

// The global intervals at local positions [s, e) of the concatenation `iv`.
Intervals slice(const Intervals& iv, int64_t s, int64_t e) {
  Intervals out;
  int64_t pos = 0;
  for (const auto& [lo, hi] : iv) {
    const int64_t len = hi - lo;
    const int64_t a = std::max(s, pos), b = std::min(e, pos + len);
    if (a < b) {
      const int64_t glo = lo + (a - pos), ghi = lo + (b - pos);
      if (!out.empty() && out.back().second == glo)
        out.back().second = ghi;  // globally contiguous: one interval
      else
        out.emplace_back(glo, ghi);
    }
    pos += len;
  }
  return out;
}

int64_t total(const Intervals& iv) {
  int64_t n = 0;
  for (const auto& [lo, hi] : iv) n += hi - lo;
  return n;
}

}  // namespace

StatusOr<DType> parseDType(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  std::vector<std::string_view> names;
  for (const auto& d : kDTypes) names.push_back(d.name);
  return absl::InvalidArgumentError(
      strCat("unknown dtype \"", name, "\" (expected one of ", strJoin(names, ", "), ")"));
}

std::string_view dtypeName(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

bool convertible(DType from, DType to) {
  return from == to || (from == DType::kFloat32 && to == DType::kBFloat16) ||
         ((from == DType::kFloat32 || from == DType::kBFloat16) && to == DType::kFloat8E4M3);
}

int64_t dtypeBytes(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.bytes;
  return 1;
}

int32_t NodeTable::intern(const std::string& name) {
  auto [it, inserted] = ids_.try_emplace(name, static_cast<int32_t>(names_.size()));
  if (inserted) names_.push_back(name);
  return it->second;
}

const TensorLayout* ResolvedLayout::find(const std::string& name) const {
  auto it = tensor_index.find(name);
  return it == tensor_index.end() ? nullptr : &tensors[it->second];
}

Region ResolvedLayout::region(const TensorLayout& t, const PieceRef& piece, const Box& sub) const {
  Region r;
  r.rank = piece.rank;
  r.buffer = piece.buffer;
  r.strides = strides[piece.strides];
  const Box& box = t.boxes[piece.box];
  r.offset = piece.offset;
  for (int d = 0; d < box.ndim; ++d) r.offset += (sub.lo[d] - box.lo[d]) * r.strides[d];
  r.extent = sub.sizes();
  return r;
}

std::vector<std::pair<int32_t, int64_t>> ResolvedLayout::rankBuffers(int32_t rank) const {
  std::map<int32_t, int64_t> bytes;
  for (const auto& t : tensors) {
    auto first = std::lower_bound(t.pieces.begin(), t.pieces.end(), rank,
                                  [](const PieceRef& p, int32_t r) { return p.rank < r; });
    for (auto it = first; it != t.pieces.end() && it->rank == rank; ++it) {
      const Box& b = t.boxes[it->box];
      if (b.empty()) continue;
      int64_t last = it->offset;
      for (int d = 0; d < b.ndim; ++d) last += (b.size(d) - 1) * strides[it->strides][d];
      int64_t& need = bytes[it->buffer];
      need = std::max(need, (last + 1) * t.elemBytes());
    }
  }
  return {bytes.begin(), bytes.end()};
}

StatusOr<v1::Layout> parseLayoutJson(std::string_view json, std::string_view origin) {
  v1::Layout layout;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  auto st = google::protobuf::util::JsonStringToMessage(std::string(json), &layout, opts);
  if (!st.ok()) {
    return absl::InvalidArgumentError(strCat(origin, ": not a valid shardcast.v1.Layout: ", std::string(st.message())));
  }
  return layout;
}

std::string layoutDigest(const v1::Layout& layout) { return layoutDigestOf(serializedLayout(layout)); }

std::string serializedLayout(const v1::Layout& layout) {
  std::string bytes;
  google::protobuf::io::StringOutputStream out(&bytes);
  google::protobuf::io::CodedOutputStream coded(&out);
  coded.SetSerializationDeterministic(true);
  layout.SerializeToCodedStream(&coded);
  return bytes;
}

std::string layoutDigestOf(std::string_view bytes) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH64(bytes.data(), bytes.size(), 0)));
  return hex;
}

StatusOr<v1::Layout> readLayoutFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(strCat(path, ": cannot open layout file"));
  std::stringstream ss;
  ss << in.rdbuf();
  return parseLayoutJson(ss.str(), path);
}

StatusOr<std::vector<Intervals>> placementIntervals(const v1::Tensor& tensor, const std::vector<int64_t>& mesh_shape,
                                                    const std::vector<int64_t>& coords) {
  const int ndim = tensor.shape_size();
  std::vector<Intervals> iv(ndim);
  for (int d = 0; d < ndim; ++d)
    if (tensor.shape(d) > 0) iv[d] = {{0, tensor.shape(d)}};
  for (int m = 0; m < tensor.placements_size(); ++m) {
    const auto& p = tensor.placements(m);
    const int64_t k = mesh_shape[m], c = coords[m];
    if (p.has_shard()) {
      const int d = p.shard().dim();
      const int64_t len = total(iv[d]), chunk = ceilDiv(len, k);
      const int64_t s = std::min(c * chunk, len);
      iv[d] = slice(iv[d], s, std::min(s + chunk, len));
    } else if (p.has_strided_shard()) {
      // DTensor's _StridedShard: split into split_factor chunks, split each over this mesh dim,
      // and keep this coordinate's part of every chunk, in chunk order.
      const int d = p.strided_shard().dim();
      const int64_t sf = p.strided_shard().split_factor();
      const int64_t len = total(iv[d]), chunk1 = ceilDiv(len, sf);
      Intervals kept;
      for (int64_t j = 0; j < sf; ++j) {
        const int64_t js = std::min(j * chunk1, len), je = std::min(js + chunk1, len);
        const int64_t chunk2 = ceilDiv(je - js, k);
        const int64_t s = js + std::min(c * chunk2, je - js);
        const int64_t e = js + std::min(c * chunk2 + chunk2, je - js);
        for (const auto& part : slice(iv[d], s, e)) {
          if (!kept.empty() && kept.back().second == part.first)
            kept.back().second = part.second;
          else
            kept.push_back(part);
        }
      }
      iv[d] = std::move(kept);
    }
  }
  return iv;
}

namespace {

class Resolver {
 public:
  Resolver(const v1::Layout& layout, NodeTable& nodes, std::optional<int32_t> only_rank)
      : in_(layout), nodes_(nodes), only_rank_(only_rank) {}

  StatusOr<ResolvedLayout> run() {
    SC_RETURN_IF_ERROR(checkSizes());
    SC_RETURN_IF_ERROR(resolveMesh());
    if (only_rank_ && (*only_rank_ < 0 || *only_rank_ >= world_))
      return absl::InvalidArgumentError(strCat("rank out of range [0, ", world_, ")"));
    SC_RETURN_IF_ERROR(resolveNodes());
    SC_RETURN_IF_ERROR(assignBuffers());
    out_.tensors.reserve(in_.tensors_size());
    for (const auto& t : in_.tensors()) SC_RETURN_IF_ERROR(resolveTensor(t));
    for (const auto& f : in_.fused()) SC_RETURN_IF_ERROR(resolveFused(f));
    for (int i = 0; i < in_.tensors_size(); ++i)
      if (in_.tensors(i).has_block_scale()) SC_RETURN_IF_ERROR(deriveScale(in_.tensors(i), i));
    return std::move(out_);
  }

 private:
  std::string where() const { return strCat("layout ", quote(in_.group())); }
  std::string where(const std::string& tensor) const { return strCat(where(), ": tensor ", quote(tensor)); }

  // Before anything is allocated for it: the layout's own size, its names and its counts.
  Status checkSizes() {
    const Limits& lim = limits();
    if (auto st = checkStringLengths(in_); !st.ok())
      return absl::InvalidArgumentError(strCat("layout: ", st.message()));
    if (in_.ByteSizeLong() > lim.max_layout_message_bytes)
      return absl::InvalidArgumentError(strCat(where(), " is ", in_.ByteSizeLong(), " bytes serialised (at most ",
                                               lim.max_layout_message_bytes, ")"));
    if (in_.tensors_size() > lim.max_tensors || in_.fused_size() > lim.max_tensors)
      return absl::InvalidArgumentError(strCat(where(), " has ", in_.tensors_size(), " tensors and ", in_.fused_size(),
                                               " fused buffers (at most ", lim.max_tensors,
                                               " each; --max-layout-tensors)"));
    if (in_.mesh().shape_size() > kMaxMeshDims)
      return absl::InvalidArgumentError(
          strCat(where(), ": mesh has ", in_.mesh().shape_size(), " dims (at most ", kMaxMeshDims, ")"));
    int64_t pieces = 0;  // a piece held by several ranks counts once per rank (sums of ints: no overflow)
    for (const auto& t : in_.tensors())
      for (const auto& p : t.pieces()) pieces += std::max(1, p.ranks_size());
    if (pieces > lim.max_explicit_pieces)
      return absl::InvalidArgumentError(
          strCat(where(), " lists ", pieces, " pieces (at most ", lim.max_explicit_pieces, ")"));
    return absl::OkStatus();
  }

  Status resolveMesh() {
    out_.group = in_.group();
    if (in_.group().empty()) return absl::InvalidArgumentError("layout: \"group\" is empty");
    // Group and set names reach logs, metrics and operators' terminals (shardcast top, status).
    for (const auto& [field, name] : {std::pair<const char*, const std::string&>{"group", in_.group()},
                                      std::pair<const char*, const std::string&>{"replica_set", in_.replica_set()}})
      if (hasControlOrInvalidUtf8(name))
        return absl::InvalidArgumentError(
            strCat("layout: \"", field, "\" ", quote(name), " holds a control character or is not UTF-8 text"));
    if (in_.mesh().shape_size() == 0) return absl::InvalidArgumentError(where() + ": mesh.shape is empty");
    // The replica_set name is bounded with every other string, by checkSizes.
    if (in_.replica() < 0)
      return absl::InvalidArgumentError(strCat(where(), ": replica ", in_.replica(), " must be >= 0"));
    if (in_.replica() != 0 && in_.replica_set().empty())
      return absl::InvalidArgumentError(
          strCat(where(), ": replica ", in_.replica(), " is set but replica_set is empty (not a replica)"));
    int64_t world = 1;
    const int64_t max_ranks = limits().max_ranks;
    for (int m = 0; m < in_.mesh().shape_size(); ++m) {
      const int64_t s = in_.mesh().shape(m);
      if (s <= 0)
        return absl::InvalidArgumentError(strCat(where(), ": mesh.shape[", m, "] = ", s, " must be positive"));
      const auto product = checkedMul(world, s);
      if (!product || *product > max_ranks)
        return absl::InvalidArgumentError(strCat(where(), ": mesh ", strJoin(in_.mesh().shape(), "x"),
                                                 " has more than ", max_ranks, " ranks (--max-layout-ranks)"));
      world = *product;
    }
    if (in_.mesh().dim_names_size() != 0 && in_.mesh().dim_names_size() != in_.mesh().shape_size())
      return absl::InvalidArgumentError(strCat(where(), ": mesh.dim_names has ", in_.mesh().dim_names_size(),
                                               " names but mesh.shape has ", in_.mesh().shape_size(), " dims"));
    out_.mesh_shape = toVec(in_.mesh().shape());
    world_ = static_cast<int32_t>(world);
    return absl::OkStatus();
  }

  Status resolveNodes() {
    out_.rank_node.resize(world_);
    if (in_.nodes_size() > 0) {
      if (in_.ranks_per_node() != 0)
        return absl::InvalidArgumentError(where() + ": give either nodes or ranks_per_node, not both");
      if (in_.nodes_size() != world_)
        return absl::InvalidArgumentError(strCat(where(), ": nodes has ", in_.nodes_size(), " entries but the mesh ",
                                                 shapeStr(out_.mesh_shape), " has ", world_, " ranks"));
      for (int32_t r = 0; r < world_; ++r) {
        if (in_.nodes(r).empty()) return absl::InvalidArgumentError(strCat(where(), ": nodes[", r, "] is empty"));
        out_.rank_node[r] = nodes_.intern(in_.nodes(r));
      }
      return absl::OkStatus();
    }
    if (in_.ranks_per_node() <= 0)
      return absl::InvalidArgumentError(
          strCat(where(), ": set nodes (one per rank) or a positive ranks_per_node (got ", in_.ranks_per_node(), ")"));
    for (int32_t r = 0; r < world_; ++r)
      out_.rank_node[r] = nodes_.intern(strCat(in_.node_prefix(), r / in_.ranks_per_node()));
    return absl::OkStatus();
  }

  // Every tensor writes into its own buffer unless a fused buffer claims it.
  Status assignBuffers() {
    std::unordered_map<std::string, int> tensor_pos;
    for (int i = 0; i < in_.tensors_size(); ++i) {
      const auto& name = in_.tensors(i).name();
      if (name.empty()) return absl::InvalidArgumentError(strCat(where(), ": tensors[", i, "] has no name"));
      if (!tensor_pos.emplace(name, i).second) return absl::InvalidArgumentError(where(name) + ": listed twice");
    }
    for (const auto& f : in_.fused()) {
      if (f.name().empty()) return absl::InvalidArgumentError(where() + ": a fused buffer has no name");
      if (tensor_pos.count(f.name()))
        return absl::InvalidArgumentError(
            strCat(where(), ": fused buffer \"", f.name(), "\" has the name of a tensor; pick another"));
      if (f.tensors_size() == 0)
        return absl::InvalidArgumentError(strCat(where(), ": fused buffer \"", f.name(), "\" has no tensors"));
      const int32_t id = addBuffer(f.name());
      if (id < 0)
        return absl::InvalidArgumentError(strCat(where(), ": fused buffer \"", f.name(), "\" is declared twice"));
      for (const auto& member : f.tensors()) {
        if (!tensor_pos.count(member))
          return absl::InvalidArgumentError(
              strCat(where(), ": fused buffer \"", f.name(), "\" names unknown tensor \"", member, "\""));
        if (!fused_of_.emplace(member, id).second)
          return absl::InvalidArgumentError(where(member) + ": belongs to more than one fused buffer");
      }
    }
    return absl::OkStatus();
  }

  // A block-scaled tensor's declaration: fp8 e4m3, a block per dim (default 128 x 128 over the
  // last two), a scale tensor named apart from every tensor and buffer.
  Status checkBlockScale(const v1::Tensor& in, TensorLayout& t) {
    const auto& bs = in.block_scale();
    const int ndim = in.shape_size();
    if (t.dtype != DType::kFloat8E4M3)
      return absl::InvalidArgumentError(
          strCat(where(in.name()), ": block_scale needs dtype float8_e4m3fn, not ", dtypeName(t.dtype)));
    if (ndim == 0) return absl::InvalidArgumentError(where(in.name()) + ": a scalar has no blocks");
    t.block = toVec(bs.block());
    if (t.block.empty()) {
      t.block.assign(static_cast<size_t>(ndim), 1);
      for (int d = std::max(0, ndim - 2); d < ndim; ++d) t.block[static_cast<size_t>(d)] = 128;
    }
    if (static_cast<int>(t.block.size()) != ndim)
      return absl::InvalidArgumentError(
          strCat(where(in.name()), ": block_scale.block has ", t.block.size(), " sizes for ", ndim, " dims"));
    for (const int64_t b : t.block)
      if (b < 1 || b > (int64_t{1} << 20))
        return absl::InvalidArgumentError(
            strCat(where(in.name()), ": block_scale.block ", shapeStr(t.block), ": sizes must be in [1, 2^20]"));
    t.pow2 = bs.pow2();
    if (bs.scale().empty()) return absl::InvalidArgumentError(where(in.name()) + ": block_scale.scale is empty");
    if (buffer_ids_.count(bs.scale()) || fused_of_.count(bs.scale()))
      return absl::InvalidArgumentError(strCat(where(in.name()), ": block_scale.scale \"", bs.scale(),
                                               "\" is already the name of a tensor or buffer"));
    for (const auto& other : in_.tensors())
      if (other.name() == bs.scale())
        return absl::InvalidArgumentError(
            strCat(where(in.name()), ": block_scale.scale \"", bs.scale(), "\" is already the name of a tensor"));
    return absl::OkStatus();
  }

  // The scale tensor of the block-scaled tensor `in` (the i-th): one float32 per block, and on
  // every rank the blocks its piece touches, row-major in a buffer named after the scale tensor.
  Status deriveScale(const v1::Tensor& in, int i) {
    const int32_t wi = out_.tensor_index.at(in.name());
    TensorLayout s;
    s.name = in.block_scale().scale();
    s.dtype = DType::kFloat32;
    s.block = out_.tensors[wi].block;
    s.pow2 = out_.tensors[wi].pow2;
    s.scale_of = wi;
    s.scaled_shape = out_.tensors[wi].shape;
    for (size_t d = 0; d < s.block.size(); ++d) s.shape.push_back((s.scaled_shape[d] + s.block[d] - 1) / s.block[d]);
    const int32_t buffer = addBuffer(s.name);
    if (buffer < 0)
      return absl::InvalidArgumentError(
          strCat(where(in.name()), ": block_scale.scale \"", s.name, "\" is the scale of another tensor too"));
    std::unordered_map<Box, int32_t, BoxHash> box_ids;
    const TensorLayout& w = out_.tensors[wi];
    for (size_t p = 0; p < w.pieces.size(); ++p) {
      if (p > 0 && w.pieces[p].rank == w.pieces[p - 1].rank)
        return absl::InvalidArgumentError(strCat(where(in.name()), ": rank ", w.pieces[p].rank,
                                                 " holds several pieces; a block-scaled tensor takes one per rank"));
      const Box& wb = w.boxes[w.pieces[p].box];
      Box sb;
      sb.ndim = wb.ndim;
      for (int d = 0; d < wb.ndim; ++d) {
        sb.lo[d] = wb.lo[d] / s.block[d];
        sb.hi[d] = (wb.hi[d] + s.block[d] - 1) / s.block[d];
      }
      auto [it, added] = box_ids.try_emplace(sb, static_cast<int32_t>(s.boxes.size()));
      if (added) s.boxes.push_back(sb);
      s.pieces.push_back({w.pieces[p].rank, it->second, buffer, internStrides(rowMajorStrides(sb.sizes())), 0});
    }
    out_.tensors[wi].scale = static_cast<int32_t>(out_.tensors.size());
    out_.tensor_index.emplace(s.name, static_cast<int32_t>(out_.tensors.size()));
    out_.tensors.push_back(std::move(s));
    local_shapes_.emplace_back();
    (void)i;
    return absl::OkStatus();
  }

  int32_t addBuffer(const std::string& name) {
    auto [it, inserted] = buffer_ids_.try_emplace(name, static_cast<int32_t>(out_.buffer_names.size()));
    if (!inserted) return -1;
    out_.buffer_names.push_back(name);
    return it->second;
  }

  int32_t internStrides(std::vector<int64_t> s) {
    auto [it, inserted] = stride_ids_.try_emplace(s, static_cast<int32_t>(out_.strides.size()));
    if (inserted) out_.strides.push_back(std::move(s));
    return it->second;
  }

  int32_t internShape(const std::vector<int64_t>& s) {
    auto [it, inserted] = shape_ids_.try_emplace(s, static_cast<int32_t>(shapes_.size()));
    if (inserted) shapes_.push_back(s);
    return it->second;
  }

  struct Built {
    TensorLayout t;
    std::unordered_map<Box, int32_t, BoxHash> box_ids;
    std::vector<int32_t> local_shape;  // per piece: shape id of the rank's local tensor
    int64_t all_pieces = 0;            // over every rank, also those only_rank leaves out
    int32_t boxId(const Box& b) {
      auto [it, inserted] = box_ids.try_emplace(b, static_cast<int32_t>(t.boxes.size()));
      if (inserted) t.boxes.push_back(b);
      return it->second;
    }
  };

  Status resolveTensor(const v1::Tensor& in) {
    Built b;
    b.t.name = in.name();
    b.t.shape = toVec(in.shape());
    const int ndim = in.shape_size();
    if (ndim > kMaxDims)
      return absl::InvalidArgumentError(
          strCat(where(in.name()), ": ", ndim, " dims; at most ", kMaxDims, " are supported"));
    for (int d = 0; d < ndim; ++d)
      if (in.shape(d) < 0)
        return absl::InvalidArgumentError(
            strCat(where(in.name()), ": shape ", shapeStr(b.t.shape), " has a negative size"));
    auto dt = parseDType(in.dtype());
    if (!dt.ok()) return absl::InvalidArgumentError(where(in.name()) + ": " + std::string(dt.status().message()));
    b.t.dtype = *dt;
    if (in.has_block_scale()) SC_RETURN_IF_ERROR(checkBlockScale(in, b.t));
    // Every size derived from this tensor fits an int64: elements, bytes, and the layout's total.
    std::optional<int64_t> bytes = dtypeBytes(*dt);
    for (int d = 0; d < ndim && bytes; ++d) bytes = checkedMul(*bytes, in.shape(d));
    const auto layout_bytes = bytes ? checkedAdd(layout_bytes_, *bytes) : std::nullopt;
    if (!layout_bytes || *layout_bytes > limits().max_layout_bytes)
      return absl::InvalidArgumentError(strCat(where(in.name()), ": shape ", shapeStr(b.t.shape),
                                               " takes the layout past ", limits().max_layout_bytes, " bytes"));
    layout_bytes_ = *layout_bytes;
    auto fused = fused_of_.find(in.name());
    const int32_t buffer = fused != fused_of_.end() ? fused->second : addBuffer(in.name());
    if (buffer < 0) return absl::InvalidArgumentError(where(in.name()) + ": its buffer name is already taken");

    if (in.pieces_size() > 0 && in.placements_size() > 0)
      return absl::InvalidArgumentError(where(in.name()) + ": give placements or pieces, not both");
    if (in.pieces_size() > 0) {
      explicit_.insert(in.name());
      SC_RETURN_IF_ERROR(resolvePieces(in, buffer, b));
    } else {
      SC_RETURN_IF_ERROR(resolvePlacements(in, buffer, b));
    }
    std::vector<size_t> order(b.t.pieces.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return b.t.pieces[x].rank < b.t.pieces[y].rank; });
    TensorLayout t = std::move(b.t);
    std::vector<PieceRef> sorted(order.size());
    std::vector<int32_t> shapes(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
      sorted[i] = t.pieces[order[i]];
      shapes[i] = b.local_shape[order[i]];
    }
    t.pieces = std::move(sorted);
    if (in.pieces_size() > 0) {
      int64_t next = 0;
      for (size_t i = 0; i < t.pieces.size(); ++i) {
        if (i > 0 && t.pieces[i].rank != t.pieces[i - 1].rank) next = 0;
        t.pieces[i].offset = next;
        next += t.boxes[t.pieces[i].box].volume();
      }
    }
    if (!pairwiseDisjoint(t.boxes)) {
      const int64_t cells = BoxGrid::countCells(t.boxes);
      if (cells < 0 || cells > limits().max_grid_cells)
        return absl::InvalidArgumentError(strCat(where(in.name()), ": its ", t.boxes.size(),
                                                 " overlapping pieces cut it into ",
                                                 cells < 0 ? std::string("more than 2^63") : std::to_string(cells),
                                                 " cells (at most ", limits().max_grid_cells, ")"));
    }
    pieces_ += b.all_pieces;  // the layout's, whichever ranks were made here
    if (pieces_ > limits().max_pieces)
      return absl::InvalidArgumentError(strCat(where(in.name()), ": the layout resolves to more than ",
                                               limits().max_pieces, " pieces (tensor x rank x box)"));
    out_.tensor_index.emplace(t.name, static_cast<int32_t>(out_.tensors.size()));
    out_.tensors.push_back(std::move(t));
    local_shapes_.push_back(std::move(shapes));
    return absl::OkStatus();
  }

  Status resolvePieces(const v1::Tensor& in, int32_t buffer, Built& b) {
    const int ndim = in.shape_size();
    for (int i = 0; i < in.pieces_size(); ++i) {
      const auto& p = in.pieces(i);
      if (p.offsets_size() != ndim || p.sizes_size() != ndim)
        return absl::InvalidArgumentError(strCat(where(in.name()), ": piece ", i, " has ", p.offsets_size(),
                                                 " offsets and ", p.sizes_size(), " sizes but the tensor has ", ndim,
                                                 " dims"));
      const auto offsets = toVec(p.offsets()), sizes = toVec(p.sizes());
      for (int d = 0; d < ndim; ++d) {
        if (offsets[d] < 0 || sizes[d] < 0 || offsets[d] > in.shape(d) || sizes[d] > in.shape(d) - offsets[d])
          return absl::InvalidArgumentError(strCat(where(in.name()), ": piece ", i, " (rank ",
                                                   p.ranks_size() ? p.ranks(0) : p.rank(), ") ",
                                                   spanStr(offsets, sizes), " exceeds shape ", shapeStr(b.t.shape)));
      }
      const Box box = Box::fromOffsetsSizes(offsets, sizes);
      if (p.ranks_size() > 0 && p.rank() != 0)
        return absl::InvalidArgumentError(strCat(where(in.name()), ": piece ", i, " sets both rank and ranks"));
      std::vector<int32_t> ranks(p.ranks().begin(), p.ranks().end());
      if (ranks.empty()) ranks.push_back(p.rank());
      if (box.empty()) continue;
      std::optional<int32_t> box_id, strides, shape_id;  // interned once a rank kept here holds it
      for (int32_t r : ranks) {
        if (r < 0 || r >= world_)
          return absl::InvalidArgumentError(
              strCat(where(in.name()), ": piece ", i, " rank ", r, " is out of range [0, ", world_, ")"));
        ++b.all_pieces;
        if (!keeps(r)) continue;
        if (!box_id) {
          box_id = b.boxId(box);
          strides = internStrides(rowMajorStrides(sizes));
          shape_id = internShape(sizes);
        }
        // Offsets are assigned after sorting by rank: a rank's pieces sit one after another.
        b.t.pieces.push_back({r, *box_id, buffer, *strides, 0});
        b.local_shape.push_back(*shape_id);
      }
    }
    return absl::OkStatus();
  }

  Status resolvePlacements(const v1::Tensor& in, int32_t buffer, Built& b) {
    const int ndim = in.shape_size();
    const int mesh_dims = static_cast<int>(out_.mesh_shape.size());
    if (in.placements_size() != 0 && in.placements_size() != mesh_dims)
      return absl::InvalidArgumentError(
          strCat(where(in.name()), ": ", in.placements_size(), " placements for a mesh of ", mesh_dims, " dims"));
    for (int m = 0; m < in.placements_size(); ++m) {
      const auto& p = in.placements(m);
      int dim = -1;
      if (p.has_shard()) dim = p.shard().dim();
      if (p.has_strided_shard()) {
        dim = p.strided_shard().dim();
        if (p.strided_shard().split_factor() < 1 || p.strided_shard().split_factor() > limits().max_split_factor)
          return absl::InvalidArgumentError(strCat(where(in.name()), ": placement ", m, ": strided_shard split_factor ",
                                                   p.strided_shard().split_factor(), " must be in [1, ",
                                                   limits().max_split_factor, "]"));
      }
      if (p.kind_case() == v1::Placement::KIND_NOT_SET)
        return absl::InvalidArgumentError(
            strCat(where(in.name()), ": placement ", m, " is empty (use replicate, shard or strided_shard)"));
      if (!p.has_replicate() && (dim < 0 || dim >= ndim))
        return absl::InvalidArgumentError(
            strCat(where(in.name()), ": placement ", m, " shards dim ", dim, " but the tensor has ", ndim, " dims"));
    }
    // Tensors of equal shape and placements resolve identically: compute once per key.
    std::string key = in.dtype() + "|" + strJoin(in.shape(), ",") + "|";
    for (const auto& p : in.placements()) key += p.SerializeAsString() + "/";
    auto it = placement_cache_.find(key);
    if (it == placement_cache_.end()) {
      std::vector<CachedRank> per_rank(world_);
      std::vector<int64_t> coords(mesh_dims);
      int64_t boxes = pieces_;  // the pieces this tensor adds to the layout's, counted before they are made
      for (int32_t r = 0; r < world_; ++r) {
        int64_t rem = r;
        for (int m = mesh_dims - 1; m >= 0; --m) {
          coords[m] = rem % out_.mesh_shape[m];
          rem /= out_.mesh_shape[m];
        }
        SC_ASSIGN_OR_RETURN(auto iv, placementIntervals(in, out_.mesh_shape, coords));
        std::optional<int64_t> here = 1;  // the cartesian product of this rank's intervals
        for (const auto& dim : iv) here = here ? checkedMul(*here, static_cast<int64_t>(dim.size())) : std::nullopt;
        const auto sum = here ? checkedAdd(boxes, *here) : std::nullopt;
        if (!sum || *sum > limits().max_pieces)
          return absl::InvalidArgumentError(strCat(where(in.name()), ": its placements cut it into more than ",
                                                   limits().max_pieces, " pieces over the layout's ranks"));
        boxes = *sum;
        if (keeps(r)) per_rank[r] = expand(iv, ndim);
      }
      it = placement_cache_.emplace(key, std::move(per_rank)).first;
      placement_pieces_[key] = boxes - pieces_;
    }
    b.all_pieces = placement_pieces_[key];
    for (int32_t r = only_rank_.value_or(0); r < (only_rank_ ? *only_rank_ + 1 : world_); ++r) {
      const CachedRank& c = it->second[r];
      for (size_t i = 0; i < c.boxes.size(); ++i) {
        b.t.pieces.push_back({r, b.boxId(c.boxes[i]), buffer, c.strides, c.offsets[i]});
        b.local_shape.push_back(c.shape);
      }
    }
    return absl::OkStatus();
  }

  struct CachedRank {
    std::vector<Box> boxes;
    std::vector<int64_t> offsets;
    int32_t strides = 0;
    int32_t shape = 0;
  };

  // The boxes of the cartesian product of per-dim intervals, with their row-major local offsets.
  CachedRank expand(const std::vector<Intervals>& iv, int ndim) {
    CachedRank c;
    std::vector<int64_t> local_shape(ndim);
    for (int d = 0; d < ndim; ++d) {
      local_shape[d] = total(iv[d]);
      if (local_shape[d] == 0) return c;  // this rank holds nothing of the tensor
    }
    const auto strides = rowMajorStrides(local_shape);
    c.strides = internStrides(strides);
    c.shape = internShape(local_shape);
    std::vector<size_t> idx(ndim, 0);
    std::vector<int64_t> pos(ndim, 0);  // local start of interval idx[d]
    while (true) {
      Box box;
      box.ndim = ndim;
      int64_t off = 0;
      for (int d = 0; d < ndim; ++d) {
        box.lo[d] = iv[d][idx[d]].first;
        box.hi[d] = iv[d][idx[d]].second;
        off += pos[d] * strides[d];
      }
      c.boxes.push_back(box);
      c.offsets.push_back(off);
      int d = ndim - 1;
      while (d >= 0) {
        pos[d] += iv[d][idx[d]].second - iv[d][idx[d]].first;
        if (++idx[d] < iv[d].size()) break;
        idx[d] = 0;
        pos[d] = 0;
        --d;
      }
      if (d < 0) break;
    }
    return c;
  }

  // Rewrites the members' pieces to point into the fused buffer: on each rank, the buffer is the
  // concatenation along f.dim() of the members' local tensors in member order.
  Status resolveFused(const v1::FusedBuffer& f) {
    const int32_t buffer = buffer_ids_.at(f.name());
    std::vector<int32_t> members;
    for (const auto& name : f.tensors()) members.push_back(out_.tensor_index.at(name));
    const TensorLayout& first = out_.tensors[members[0]];
    const int ndim = static_cast<int>(first.shape.size());
    const int k = f.dim();
    for (int32_t m : members) {
      const TensorLayout& t = out_.tensors[m];
      if (static_cast<int>(t.shape.size()) != ndim || k < 0 || k >= ndim)
        return absl::InvalidArgumentError(strCat(where(), ": fused buffer \"", f.name(), "\": dim ", k,
                                                 " is invalid for tensor \"", t.name, "\" of shape ", shapeStr(t.shape),
                                                 " (members need the same number of dims as \"", first.name, "\")"));
      if (t.dtype != first.dtype)
        return absl::InvalidArgumentError(strCat(where(), ": fused buffer \"", f.name(), "\": tensor \"", t.name,
                                                 "\" is ", dtypeName(t.dtype), " but \"", first.name, "\" is ",
                                                 dtypeName(first.dtype)));
    }
    // (rank, member, piece) for every member piece, grouped by rank: work proportional to pieces.
    struct Entry {
      int32_t rank;
      int32_t member;
      int32_t piece;
    };
    std::vector<Entry> entries;
    for (int32_t i = 0; i < static_cast<int32_t>(members.size()); ++i) {
      const auto& pieces = out_.tensors[members[i]].pieces;
      for (int32_t p = 0; p < static_cast<int32_t>(pieces.size()); ++p) entries.push_back({pieces[p].rank, i, p});
    }
    std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.member < b.member;
    });
    std::vector<int64_t> start_along_k(members.size(), 0);
    for (size_t lo = 0; lo < entries.size();) {
      size_t hi = lo;
      while (hi < entries.size() && entries[hi].rank == entries[lo].rank) ++hi;
      const int32_t r = entries[lo].rank;
      std::vector<int64_t> fused_shape;
      std::string first_on_rank;
      for (size_t e = lo; e < hi; ++e) {
        if (e > lo && entries[e].member == entries[e - 1].member) {
          const TensorLayout& t = out_.tensors[members[entries[e].member]];
          if (explicit_.count(t.name))
            return absl::InvalidArgumentError(strCat(where(t.name), ": rank ", r,
                                                     " holds several pieces, but a member of fused buffer \"", f.name(),
                                                     "\" must hold one piece per rank"));
          continue;  // further boxes of one placement-resolved local tensor (strided shards)
        }
        const TensorLayout& t = out_.tensors[members[entries[e].member]];
        const auto& local = shapes_[local_shapes_[members[entries[e].member]][entries[e].piece]];
        if (fused_shape.empty()) {
          fused_shape = local;
          fused_shape[k] = 0;
          first_on_rank = t.name;
        }
        for (int d = 0; d < ndim; ++d) {
          if (d != k && local[d] != fused_shape[d])
            return absl::InvalidArgumentError(strCat(where(), ": fused buffer \"", f.name(), "\" on rank ", r,
                                                     ": tensor \"", t.name, "\" has local shape ", shapeStr(local),
                                                     " which does not match \"", first_on_rank, "\" outside dim ", k));
        }
        start_along_k[entries[e].member] = fused_shape[k];
        fused_shape[k] += local[k];
      }
      const auto fstrides = rowMajorStrides(fused_shape);
      const int32_t fstrides_id = internStrides(fstrides);
      for (size_t e = lo; e < hi; ++e) {
        const int32_t i = entries[e].member;
        PieceRef& piece = out_.tensors[members[i]].pieces[entries[e].piece];
        const auto& local = shapes_[local_shapes_[members[i]][entries[e].piece]];
        const auto& old = out_.strides[piece.strides];
        int64_t off = 0;
        for (int d = 0; d < ndim; ++d) {
          const int64_t pos = (piece.offset / old[d]) % local[d] + (d == k ? start_along_k[i] : 0);
          off += pos * fstrides[d];
        }
        piece.offset = off;
        piece.buffer = buffer;
        piece.strides = fstrides_id;
      }
      lo = hi;
    }
    return absl::OkStatus();
  }

  const v1::Layout& in_;
  NodeTable& nodes_;
  ResolvedLayout out_;
  int32_t world_ = 0;
  int64_t layout_bytes_ = 0;  // of the tensors resolved so far
  int64_t pieces_ = 0;
  std::unordered_map<std::string, int32_t> buffer_ids_;
  std::unordered_map<std::string, int32_t> fused_of_;
  std::unordered_map<std::string, std::vector<CachedRank>> placement_cache_;
  std::unordered_map<std::string, int64_t> placement_pieces_;  // per key: pieces over every rank
  std::map<std::vector<int64_t>, int32_t> stride_ids_;
  std::map<std::vector<int64_t>, int32_t> shape_ids_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<std::vector<int32_t>> local_shapes_;  // per tensor, per piece
  std::unordered_set<std::string> explicit_;
  std::optional<int32_t> only_rank_;  // resolveLayout's only_rank
  bool keeps(int32_t rank) const { return !only_rank_ || rank == *only_rank_; }
};

}  // namespace

StatusOr<ResolvedLayout> resolveLayout(const v1::Layout& layout, NodeTable& nodes, std::optional<int32_t> only_rank) {
  return Resolver(layout, nodes, only_rank).run();
}

Status addScaleSources(ResolvedLayout& src, const ResolvedLayout& dst) {
  for (const TensorLayout& ds : dst.tensors) {
    if (ds.scale_of < 0) continue;
    const TensorLayout& dw = dst.tensors[static_cast<size_t>(ds.scale_of)];
    // A source holding the same weight quantised in the same blocks, its scales beside it (a seed
    // replica): both are copied as they are (the planner checks the rest).
    if (const TensorLayout* held = src.find(ds.name);
        held != nullptr && held->scale_of >= 0 && !held->virtual_scale &&
        src.tensors[static_cast<size_t>(held->scale_of)].name == dw.name) {
      if (held->block == ds.block) continue;
      return absl::InvalidArgumentError(strCat("tensor \"", dw.name, "\": layouts \"", src.group, "\" and \"",
                                               dst.group, "\" both hold it block-scaled, in other blocks ([",
                                               strJoin(held->block, ", "), "] and [", strJoin(ds.block, ", "),
                                               "]): quantised bytes are copied as they are, never quantised again"));
    }
    if (src.find(ds.name) != nullptr)  // scales are computed here, never taken from a source
      return absl::FailedPreconditionError(
          strCat("tensor \"", ds.name, "\": layout \"", dst.group, "\" derives it (the block scales of \"",
                 dst.tensors[static_cast<size_t>(ds.scale_of)].name, "\"), but layout \"", src.group,
                 "\" has a tensor of that name: rename one (the daemons quantise and scale at the source)"));
    const TensorLayout* w = src.find(dw.name);
    if (w == nullptr) continue;  // the planner names the missing weight
    if (w->blockScaled())        // quantised already, its scales under another name: nothing to compute them from
      return absl::InvalidArgumentError(strCat(
          "tensor \"", dw.name, "\": layout \"", src.group, "\" holds it block-scaled with its scales in \"",
          src.tensors[static_cast<size_t>(w->scale)].name, "\", layout \"", dst.group, "\" names them \"", ds.name,
          "\": give both the same scale name (quantised bytes are copied with their scales, never quantised again)"));
    if (w->shape != dw.shape)
      return absl::InvalidArgumentError(strCat("tensor \"", dw.name, "\": layout \"", src.group, "\" has shape [",
                                               strJoin(w->shape, ", "), "] but layout \"", dst.group, "\" has [",
                                               strJoin(dw.shape, ", "), "]"));
    TensorLayout v;
    v.name = ds.name;
    v.shape = ds.shape;
    v.dtype = w->dtype;
    v.block = ds.block;
    v.pow2 = dw.pow2;
    v.scale_of = src.tensor_index.at(w->name);
    v.scaled_shape = w->shape;
    v.virtual_scale = true;
    // Each block's scale is read at the piece holding the block's first element (one per distinct
    // box): blocks [ceil(lo / b), ceil(hi / b)) of a piece, its first element's offset moved there.
    std::unordered_map<Box, int32_t, BoxHash> box_ids;
    for (const PieceRef& p : w->pieces) {
      const Box& wb = w->boxes[p.box];
      const std::vector<int64_t>& weight_strides = src.strides[static_cast<size_t>(p.strides)];
      Box vb;
      vb.ndim = wb.ndim;
      int64_t offset = p.offset;
      for (int d = 0; d < wb.ndim; ++d) {
        const int64_t b = v.block[d];
        vb.lo[d] = (wb.lo[d] + b - 1) / b;
        vb.hi[d] = (wb.hi[d] + b - 1) / b;
        offset += (vb.lo[d] * b - wb.lo[d]) * weight_strides[static_cast<size_t>(d)];
      }
      if (vb.empty()) continue;  // the piece holds no block's first element
      auto [it, added] = box_ids.try_emplace(vb, static_cast<int32_t>(v.boxes.size()));
      if (added) v.boxes.push_back(vb);
      std::vector<int64_t> strides = weight_strides;
      for (size_t d = 0; d < strides.size(); ++d) strides[d] *= v.block[d];
      src.strides.push_back(std::move(strides));
      v.pieces.push_back({p.rank, it->second, p.buffer, static_cast<int32_t>(src.strides.size() - 1), offset});
    }
    // A block some box holds only part of is split: its amax is combined across the pieces.
    // Only the blocks on a box's unaligned faces can be: the shell of what it touches.
    std::vector<int64_t> split;
    for (const Box& wb : w->boxes) {
      const Box touched = blocksTouched(wb, v.block);
      for (int d = 0; d < wb.ndim; ++d) {
        const int64_t b = v.block[d];
        const bool cut_lo = wb.lo[d] % b != 0, cut_hi = wb.hi[d] % b != 0 && wb.hi[d] != w->shape[d];
        for (const int64_t k : {touched.lo[d], touched.hi[d] - 1}) {
          if (!(k == touched.lo[d] && cut_lo) && !(k == touched.hi[d] - 1 && cut_hi)) continue;
          Box face = touched;
          face.lo[d] = k;
          face.hi[d] = k + 1;
          forEachIndex(face, [&](const int64_t* idx) { split.push_back(blockIndex(idx, v.shape)); });
        }
      }
    }
    std::sort(split.begin(), split.end());
    split.erase(std::unique(split.begin(), split.end()), split.end());
    v.split_blocks = std::move(split);
    src.tensor_index.emplace(v.name, static_cast<int32_t>(src.tensors.size()));
    src.tensors.push_back(std::move(v));
  }
  return absl::OkStatus();
}

Box blocksTouched(const Box& elements, const std::vector<int64_t>& block) {
  Box out;
  out.ndim = elements.ndim;
  for (int d = 0; d < elements.ndim; ++d) {
    out.lo[d] = elements.lo[d] / block[static_cast<size_t>(d)];
    out.hi[d] = (elements.hi[d] + block[static_cast<size_t>(d)] - 1) / block[static_cast<size_t>(d)];
  }
  return out;
}

Box blockElements(const Box& blocks, const std::vector<int64_t>& block, const std::vector<int64_t>& shape) {
  Box out;
  out.ndim = blocks.ndim;
  for (int d = 0; d < blocks.ndim; ++d) {
    out.lo[d] = blocks.lo[d] * block[static_cast<size_t>(d)];
    out.hi[d] = std::min(blocks.hi[d] * block[static_cast<size_t>(d)], shape[static_cast<size_t>(d)]);
  }
  return out;
}

int64_t blockIndex(const int64_t* k, const std::vector<int64_t>& grid) {
  int64_t index = 0;
  for (size_t d = 0; d < grid.size(); ++d) index = index * grid[d] + k[d];
  return index;
}

void forEachIndex(const Box& box, const std::function<void(const int64_t*)>& fn) {
  if (box.empty()) return;
  std::array<int64_t, kMaxDims> idx = box.lo;
  while (true) {
    fn(idx.data());
    int d = box.ndim;
    while (d > 0 && ++idx[d - 1] == box.hi[d - 1]) {
      idx[d - 1] = box.lo[d - 1];
      --d;
    }
    if (d == 0) return;
  }
}

}  // namespace shardcast::planner
