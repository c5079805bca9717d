#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <unordered_map>

#include "common/strings.h"
#include "planner/plan.h"

namespace shardcast::planner {

int64_t PlanStats::maxIngress() const {
  return node_ingress.empty() ? 0 : *std::max_element(node_ingress.begin(), node_ingress.end());
}
int64_t PlanStats::maxEgress() const {
  return node_egress.empty() ? 0 : *std::max_element(node_egress.begin(), node_egress.end());
}
int64_t PlanStats::maxLocal() const {
  return node_local.empty() ? 0 : *std::max_element(node_local.begin(), node_local.end());
}

namespace {

template <typename T>
std::string bytesKey(const T* data, size_t n) {
  return std::string(reinterpret_cast<const char*>(data), n * sizeof(T));
}

class Planner {
 public:
  Planner(const ResolvedLayout& src, const ResolvedLayout& dst, const NodeTable& nodes, const PlanOptions& options)
      : src_(src), dst_(dst), nodes_(nodes) {
    plan_.options = options;
    const size_t n = nodes.size();
    egress_.assign(n, 0);
    ingress_.assign(n, 0);
    local_.assign(n, 0);
    pull_ingress_.assign(n, 0);
    pull_egress_.assign(n, 0);
    unique_held_.assign(n, 0);
    rank_egress_.assign(src.world(), 0);
    need_in_.assign(n, 0);
    reserve_.assign(n, 0);
    sole_.assign(n, 0);
    if (!src.rank_node.empty()) root_ = src.rank_node[0];
  }

  StatusOr<Plan> run() {
    if (plan_.options.chunk_bytes <= 0 || plan_.options.bucket_bytes <= 0 || plan_.options.max_chain <= 0 ||
        plan_.options.small_bytes < 0)
      return absl::InvalidArgumentError("plan options: chunk_bytes, bucket_bytes and max_chain must be positive");
    const auto start = std::chrono::steady_clock::now();
    reserve();
    for (int32_t j = 0; j < static_cast<int32_t>(dst_.tensors.size()); ++j) SC_RETURN_IF_ERROR(planTensor(j));
    flushBuckets();
    routeChains();
    finishStats();
    plan_.stats.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return std::move(plan_);
  }

 private:
  // Growing these vectors one doubling at a time costs more than planning at 1T scale.
  void reserve() {
    size_t src_boxes = 0, dst_pieces = 0;
    for (const TensorLayout& dt : dst_.tensors) {
      dst_pieces += dt.pieces.size();
      if (const TensorLayout* st = src_.find(dt.name)) src_boxes += st->boxes.size();
    }
    plan_.tensors.reserve(dst_.tensors.size());
    plan_.cells.reserve(src_boxes);
    plan_.fragments.reserve(src_boxes + src_boxes / 2);
    plan_.groups.reserve(dst_.tensors.size() * 2);
    plan_.transfers.reserve(dst_.tensors.size() * 2);
    plan_.transfer_fragments.reserve(src_boxes + src_boxes / 2);
    plan_.chain_nodes.reserve(dst_pieces);
    plan_.group_nodes.reserve(dst_pieces);
  }

  // ---- per tensor -------------------------------------------------------------------------------

  Status planTensor(int32_t j) {
    const TensorLayout& dt = dst_.tensors[j];
    auto it = src_.tensor_index.find(dt.name);
    if (it == src_.tensor_index.end())
      return absl::FailedPreconditionError(
          strCat("tensor \"", dt.name, "\": layout \"", dst_.group, "\" needs it but layout \"", src_.group,
                 "\" has no such tensor",
                 dt.scale_of >= 0 ? strCat(" (the block scales of \"", dst_.tensors[dt.scale_of].name,
                                           "\": planner::addScaleSources derives them)")
                                  : std::string()));
    const TensorLayout& st = src_.tensors[it->second];
    // A destination may declare a dtype its source converts to (planner::convertible): the bytes
    // travel in the destination's dtype, so every size below is the destination's.
    // A scale tensor is computed from its weight's source (addScaleSources), whatever its dtype.
    const bool computed = computedFrom(st, dt);
    if (!computed && st.dtype != dt.dtype && dt.dtype == DType::kFloat8E4M3 && !dt.blockScaled())
      return absl::InvalidArgumentError(strCat("tensor \"", dt.name, "\": layout \"", dst_.group,
                                               "\" converts it to float8_e4m3fn without block scales: declare "
                                               "block_scale (the scales it is quantised with)"));
    if (dt.blockScaled() && st.blockScaled() && (st.dtype != dt.dtype || st.block != dt.block || st.pow2 != dt.pow2))
      return absl::InvalidArgumentError(strCat("tensor \"", dt.name, "\": layouts \"", src_.group, "\" and \"",
                                               dst_.group, "\" both hold it block-scaled, in other blocks or scales (",
                                               dtypeName(st.dtype), " [", strJoin(st.block, ", "), "]",
                                               st.pow2 ? " pow2" : "", " and ", dtypeName(dt.dtype), " [",
                                               strJoin(dt.block, ", "), "]", dt.pow2 ? " pow2" : "",
                                               "): quantised bytes are copied as they are, never quantised again"));
    if (computed && dt.blockScaled() && st.dtype != DType::kFloat32 && st.dtype != DType::kBFloat16)
      return absl::InvalidArgumentError(strCat("tensor \"", dt.name, "\": layout \"", dst_.group,
                                               "\" quantises it per block, from float32 or bfloat16; layout \"",
                                               src_.group, "\" has ", dtypeName(st.dtype)));
    if (dt.scale_of >= 0 && st.scale_of < 0)
      return absl::FailedPreconditionError(strCat("tensor \"", dt.name, "\": layout \"", dst_.group,
                                                  "\" derives it (block scales) but layout \"", src_.group,
                                                  "\" has a tensor of that name (see planner::addScaleSources)"));
    if (dt.scale_of < 0 && st.scale_of >= 0)
      return absl::FailedPreconditionError(strCat("tensor \"", dt.name, "\" of layout \"", dst_.group,
                                                  "\" is a block scale in layout \"", src_.group, "\" only"));
    if (st.shape != dt.shape || (!computed && !convertible(st.dtype, dt.dtype)))
      return absl::InvalidArgumentError(
          strCat("tensor \"", dt.name, "\": layout \"", src_.group, "\" has ", dtypeName(st.dtype), " [",
                 strJoin(st.shape, ", "), "] but layout \"", dst_.group, "\" has ", dtypeName(dt.dtype), " [",
                 strJoin(dt.shape, ", "), "]", st.shape == dt.shape ? " (no conversion between these dtypes)" : ""));
    const int32_t t = static_cast<int32_t>(plan_.tensors.size());
    plan_.tensors.push_back({it->second, j});
    elem_ = dt.elemBytes();
    for (const PieceRef& p : dt.pieces) plan_.stats.bytes_needed += dt.boxes[p.box].volume() * elem_;

    const int32_t cells_begin = static_cast<int32_t>(plan_.cells.size());
    buildCells(st, t);
    const int32_t cells_end = static_cast<int32_t>(plan_.cells.size());
    indexLocalSources(st);
    src_boxes_ = &st.boxes;

    for (Group& g : buildGroups(dt, t)) SC_RETURN_IF_ERROR(planGroup(st, dt, t, g, cells_begin, cells_end));
    return absl::OkStatus();
  }

  // Source cells: disjoint boxes, each with every source piece that covers it.
  void buildCells(const TensorLayout& st, int32_t t) {
    std::vector<std::vector<int32_t>> box_holders(st.boxes.size());
    for (int32_t i = 0; i < static_cast<int32_t>(st.pieces.size()); ++i) box_holders[st.pieces[i].box].push_back(i);
    if (pairwiseDisjoint(st.boxes)) {
      for (size_t b = 0; b < st.boxes.size(); ++b) addCell(st, t, st.boxes[b], box_holders[b]);
      return;
    }
    // Overlapping boxes: cut into grid cells labelled by their set of covering boxes, then merge.
    BoxGrid grid(st.boxes);
    std::vector<std::vector<int32_t>> cover(grid.cellCount());
    grid.forEachCover(st.boxes, [&](int64_t cell, int b) { cover[cell].push_back(b); });
    std::unordered_map<std::string, int> label_of;
    std::vector<std::vector<int32_t>> label_boxes;
    std::vector<int> labels(grid.cellCount(), -1);
    for (int64_t c = 0; c < grid.cellCount(); ++c) {
      if (cover[c].empty()) continue;
      auto [lit, inserted] =
          label_of.try_emplace(bytesKey(cover[c].data(), cover[c].size()), static_cast<int>(label_boxes.size()));
      if (inserted) label_boxes.push_back(cover[c]);
      labels[c] = lit->second;
    }
    for (auto& [box, label] : grid.decompose(labels)) {
      std::vector<int32_t> holders;
      for (int32_t b : label_boxes[label]) holders.insert(holders.end(), box_holders[b].begin(), box_holders[b].end());
      addCell(st, t, box, holders);
    }
  }

  void addCell(const TensorLayout& st, int32_t t, const Box& box, std::vector<int32_t> holders) {
    auto node_of = [&](int32_t piece) { return src_.rank_node[st.pieces[piece].rank]; };
    std::sort(holders.begin(), holders.end(), [&](int32_t a, int32_t b) {
      const int32_t na = node_of(a), nb = node_of(b);
      return na != nb ? na < nb : st.pieces[a].rank < st.pieces[b].rank;
    });
    SourceCell c;
    c.box = box;
    c.tensor = t;
    c.holders_begin = static_cast<int32_t>(plan_.cell_holders.size());
    c.holders_count = static_cast<int32_t>(holders.size());
    plan_.cell_holders.insert(plan_.cell_holders.end(), holders.begin(), holders.end());
    c.nodes_begin = static_cast<int32_t>(plan_.cell_nodes.size());
    for (int32_t h : holders)
      if (plan_.cell_nodes.size() == static_cast<size_t>(c.nodes_begin) || plan_.cell_nodes.back() != node_of(h))
        plan_.cell_nodes.push_back(node_of(h));
    c.nodes_count = static_cast<int32_t>(plan_.cell_nodes.size()) - c.nodes_begin;
    plan_.cells.push_back(c);
  }

  // Source boxes per node, for the lower bound (an independent computation from the routing).
  void indexLocalSources(const TensorLayout& st) {
    local_src_boxes_.clear();
    for (const PieceRef& p : st.pieces) local_src_boxes_.emplace_back(src_.rank_node[p.rank], p.box);
    std::sort(local_src_boxes_.begin(), local_src_boxes_.end());
    local_src_boxes_.erase(std::unique(local_src_boxes_.begin(), local_src_boxes_.end()), local_src_boxes_.end());
  }

  struct Group {
    int32_t id = 0;
    std::vector<int32_t> nodes;
    std::vector<int32_t> boxes;       // multiset of destination box ids per node (sorted)
    std::vector<int32_t> rep_pieces;  // the first node's pieces, parallel to boxes
  };

  // Destination nodes grouped by the multiset of boxes their ranks need (kRankPull: one group
  // per destination rank, whatever the others on its node need).
  std::vector<Group> buildGroups(const TensorLayout& dt, int32_t t) {
    if (plan_.options.strategy == Strategy::kRankPull) return rankGroups(dt, t);
    std::vector<std::pair<int32_t, int32_t>> by_node;  // (node, piece index)
    by_node.reserve(dt.pieces.size());
    for (int32_t i = 0; i < static_cast<int32_t>(dt.pieces.size()); ++i)
      by_node.emplace_back(dst_.rank_node[dt.pieces[i].rank], i);
    std::sort(by_node.begin(), by_node.end(), [&](const auto& a, const auto& b) {
      if (a.first != b.first) return a.first < b.first;
      const int32_t ba = dt.pieces[a.second].box, bb = dt.pieces[b.second].box;
      return ba != bb ? ba < bb : a.second < b.second;
    });
    std::vector<Group> groups;
    bool one_piece_per_node = true;
    for (size_t i = 1; i < by_node.size() && one_piece_per_node; ++i)
      one_piece_per_node = by_node[i].first != by_node[i - 1].first;
    if (one_piece_per_node) {
      // Common for whole experts: group by the node's single box without building keys.
      std::vector<int32_t> group_of_box(dt.boxes.size(), -1);
      for (const auto& [node, piece] : by_node) {
        int32_t& gi = group_of_box[dt.pieces[piece].box];
        if (gi < 0) {
          gi = static_cast<int32_t>(groups.size());
          groups.push_back({0, {}, {dt.pieces[piece].box}, {piece}});
        }
        groups[gi].nodes.push_back(node);
      }
    }
    std::unordered_map<std::string, size_t> index;
    std::vector<int32_t> key;
    for (size_t i = 0; i < by_node.size() && !one_piece_per_node;) {
      size_t e = i;
      key.clear();
      while (e < by_node.size() && by_node[e].first == by_node[i].first)
        key.push_back(dt.pieces[by_node[e++].second].box);
      auto [it, inserted] = index.try_emplace(bytesKey(key.data(), key.size()), groups.size());
      if (inserted) {
        Group g;
        g.boxes = key;
        for (size_t k = i; k < e; ++k) g.rep_pieces.push_back(by_node[k].second);
        groups.push_back(std::move(g));
      }
      groups[it->second].nodes.push_back(by_node[i].first);
      i = e;
    }
    for (Group& g : groups) addGroup(g, t, -1);
    return groups;
  }

  std::vector<Group> rankGroups(const TensorLayout& dt, int32_t t) {
    std::map<int32_t, Group> by_rank;
    for (int32_t i = 0; i < static_cast<int32_t>(dt.pieces.size()); ++i) {
      Group& g = by_rank[dt.pieces[i].rank];
      g.boxes.push_back(dt.pieces[i].box);
      g.rep_pieces.push_back(i);
    }
    std::vector<Group> groups;
    for (auto& [rank, g] : by_rank) {
      g.nodes = {dst_.rank_node[rank]};
      addGroup(g, t, rank);
      groups.push_back(std::move(g));
    }
    return groups;
  }

  void addGroup(Group& g, int32_t t, int32_t rank) {
    g.id = static_cast<int32_t>(plan_.groups.size());
    plan_.groups.push_back(
        {t, static_cast<int32_t>(plan_.group_nodes.size()), static_cast<int32_t>(g.nodes.size()), rank});
    plan_.group_nodes.insert(plan_.group_nodes.end(), g.nodes.begin(), g.nodes.end());
  }

  Status planGroup(const TensorLayout& st, const TensorLayout& dt, int32_t t, const Group& g, int32_t cells_begin,
                   int32_t cells_end) {
    std::vector<Box> distinct;
    for (size_t i = 0; i < g.boxes.size(); ++i)
      if (i == 0 || g.boxes[i] != g.boxes[i - 1]) distinct.push_back(dt.boxes[g.boxes[i]]);
    const std::vector<Box> need = disjointUnion(distinct);
    int64_t need_volume = 0;
    for (const Box& b : need) need_volume += b.volume();
    addLowerBound(g, need, need_volume);

    int64_t group_local = 0, group_local_ops = 0, group_pull = 0;
    for (const Box& b : need) {
      int64_t covered = 0;
      for (int32_t c = cells_begin; c < cells_end; ++c) {
        if (!overlaps(b, plan_.cells[c].box)) continue;
        const Box piece = intersect(b, plan_.cells[c].box);
        covered += piece.volume();
        for (const Box& part : partsThatLandInPlace(dt, g, piece)) {
          const int32_t f = static_cast<int32_t>(plan_.fragments.size());
          plan_.fragments.push_back({part, t, c, g.id, part.volume() * elem_});
          const auto [fanout, pieces_hit, lands_in_place] = fanOut(dt, g, part);
          routeFragment(f, g, fanout, pieces_hit, lands_in_place, group_local, group_local_ops, group_pull);
        }
      }
      if (covered != b.volume()) return uncovered(st, dt, g, b, cells_begin, cells_end);
    }
    for (int32_t n : g.nodes) {
      local_[n] += group_local;
      pull_ingress_[n] += static_cast<double>(group_pull);
    }
    plan_.stats.local_ops += group_local_ops * static_cast<int64_t>(g.nodes.size());
    return absl::OkStatus();
  }

  // `piece` split by the node's ranks when each of them needs a disjoint part of it that it holds
  // contiguously and that is large enough to travel alone: each part is then written straight
  // into its rank, packed once at the source, instead of landing whole in an arena and being
  // unpacked on every node of the group (e.g. row-parallel weights split by columns across TP
  // ranks, against FSDP's row blocks). Otherwise {piece}.
  std::vector<Box> partsThatLandInPlace(const TensorLayout& dt, const Group& g, const Box& piece) {
    std::vector<Box> parts;
    int64_t volume = 0;
    for (size_t i = 0; i < g.boxes.size(); ++i) {
      const Box& b = dt.boxes[g.boxes[i]];
      if (!overlaps(b, piece)) continue;
      parts.push_back(intersect(b, piece));
      volume += parts.back().volume();
      const PieceRef& p = dt.pieces[g.rep_pieces[i]];
      if (parts.back().volume() * elem_ < plan_.options.small_in_place_bytes ||
          !isContiguous(dst_.strides[p.strides], parts.back()))
        return {piece};
    }
    if (parts.size() < 2 || volume != piece.volume() || !pairwiseDisjoint(parts)) return {piece};
    return parts;
  }

  // Bytes the ranks of one node of the group need from `piece`, how many copies that is, and
  // whether the network can write the piece straight into the single rank that needs it.
  std::tuple<int64_t, int64_t, bool> fanOut(const TensorLayout& dt, const Group& g, const Box& piece) {
    int64_t bytes = 0, hits = 0;
    int32_t last_hit = -1;
    for (size_t i = 0; i < g.boxes.size(); ++i) {
      const Box& b = dt.boxes[g.boxes[i]];
      if (!overlaps(b, piece)) continue;
      bytes += intersect(b, piece).volume() * elem_;
      ++hits;
      last_hit = static_cast<int32_t>(i);
    }
    bool in_place = false;
    if (hits == 1) {
      const PieceRef& p = dt.pieces[g.rep_pieces[last_hit]];
      in_place = dt.boxes[p.box].contains(piece) && isContiguous(dst_.strides[p.strides], piece);
    }
    return {bytes, hits, in_place};
  }

  void routeFragment(int32_t f, const Group& g, int64_t fanout, int64_t hits, bool in_place, int64_t& group_local,
                     int64_t& group_local_ops, int64_t& group_pull) {
    const Fragment& frag = plan_.fragments[f];
    const SourceCell& cell = plan_.cells[frag.cell];
    const int32_t* hn = plan_.cell_nodes.data() + cell.nodes_begin;
    net_.clear();
    for (int32_t n : g.nodes) {
      if (std::binary_search(hn, hn + cell.nodes_count, n)) {
        // A source rank on this node holds the fragment: copy locally, never over the network.
        plan_.local_sources.push_back({f, n, holderOnNode(cell, n)});
        local_[n] += fanout;
        plan_.stats.local_ops += hits;
      } else {
        net_.push_back(n);
      }
    }
    // Large fragments travel alone; so do those that land in place from a smaller size. The rest
    // share buckets, which land in an arena: nothing of a bucket lands in place.
    const bool alone =
        frag.bytes >= plan_.options.small_bytes || (in_place && frag.bytes >= plan_.options.small_in_place_bytes);
    in_place = in_place && alone;
    // Figures shared by every network node of the group are added once per group by the caller.
    const int64_t landing = in_place ? frag.bytes : 0;
    if (net_.size() == g.nodes.size()) {
      group_local += fanout - landing;
      group_local_ops += hits - (in_place ? 1 : 0);
      group_pull += fanout;
    } else {
      for (int32_t n : net_) {
        local_[n] += fanout - landing;
        pull_ingress_[n] += static_cast<double>(fanout);
        plan_.stats.local_ops += hits - (in_place ? 1 : 0);
      }
    }
    if (net_.empty()) return;
    plan_.stats.pull_network_bytes += fanout * static_cast<int64_t>(net_.size());
    const double share = static_cast<double>(fanout) * static_cast<double>(net_.size()) / cell.nodes_count;
    for (int32_t i = 0; i < cell.nodes_count; ++i) pull_egress_[hn[i]] += share;
    if (cell.nodes_count == 1) unique_held_[hn[0]] += frag.bytes;

    if (alone) {
      Transfer tr;
      tr.fragments_begin = static_cast<int32_t>(plan_.transfer_fragments.size());
      tr.fragments_count = 1;
      plan_.transfer_fragments.push_back(f);
      tr.bytes = frag.bytes;
      tr.chunks = chunkCount(frag.box, elem_, plan_.options.chunk_bytes);
      plan_.stats.largest_chunk = std::max(plan_.stats.largest_chunk, std::min(frag.bytes, plan_.options.chunk_bytes));
      addChains(tr, cell, net_, f);
      plan_.transfers.push_back(tr);
      return;
    }
    // Small: join the open bucket for the same receivers and the same holder nodes.
    std::string key = bytesKey(net_.data(), net_.size());
    key += '|';
    key += bytesKey(hn, cell.nodes_count);
    auto [it, inserted] = bucket_index_.try_emplace(std::move(key), buckets_.size());
    if (inserted) buckets_.push_back({net_, {}, 0});
    Bucket& b = buckets_[it->second];
    if (b.bytes + frag.bytes > plan_.options.bucket_bytes && !b.fragments.empty()) emitBucket(b);
    b.fragments.push_back(f);
    b.bytes += frag.bytes;
  }

  struct Bucket {
    std::vector<int32_t> nodes;
    std::vector<int32_t> fragments;
    int64_t bytes = 0;
  };

  void emitBucket(Bucket& b) {
    Transfer tr;
    tr.fragments_begin = static_cast<int32_t>(plan_.transfer_fragments.size());
    tr.fragments_count = static_cast<int32_t>(b.fragments.size());
    plan_.transfer_fragments.insert(plan_.transfer_fragments.end(), b.fragments.begin(), b.fragments.end());
    tr.bytes = b.bytes;
    tr.chunks = 1;
    plan_.stats.largest_chunk = std::max(plan_.stats.largest_chunk, b.bytes);
    const SourceCell& cell = plan_.cells[plan_.fragments[b.fragments.front()].cell];
    addChains(tr, cell, b.nodes, b.fragments.front());
    plan_.transfers.push_back(tr);
    ++plan_.stats.buckets;
    b.fragments.clear();
    b.bytes = 0;
  }

  void flushBuckets() {
    for (Bucket& b : buckets_)
      if (!b.fragments.empty()) emitBucket(b);
  }

  // The chains of a transfer to `nodes`. kRankPull sends straight to each node (chains of one),
  // kGatherBroadcast routes through its root (gatherChains); the planned route is chosen once
  // every transfer is known (routeChains), so here it is only noted.
  void addChains(Transfer& tr, const SourceCell& cell, const std::vector<int32_t>& nodes, int32_t rotation) {
    if (plan_.options.strategy == Strategy::kGatherBroadcast) return gatherChains(tr, cell, nodes);
    if (plan_.options.strategy == Strategy::kRankPull)
      return splitChains(tr, cell, nodes, rotation, static_cast<int32_t>(nodes.size()));
    const int32_t k = static_cast<int32_t>(nodes.size());
    const int32_t count_min = (k + plan_.options.max_chain - 1) / plan_.options.max_chain;
    const int32_t* hn = plan_.cell_nodes.data() + cell.nodes_begin;
    pending_.push_back({static_cast<int32_t>(plan_.transfers.size()), static_cast<int32_t>(&cell - plan_.cells.data()),
                        rotation, static_cast<int32_t>(pending_nodes_.size()), k});
    pending_nodes_.insert(pending_nodes_.end(), nodes.begin(), nodes.end());
    for (const int32_t n : nodes) need_in_[n] += tr.bytes;
    if (cell.nodes_count == 1) {
      reserve_[hn[0]] += count_min * tr.bytes;
      sole_[hn[0]] += tr.bytes;
    }
  }

  // Planned routes, in transfer order. Every node receives each transfer it needs once, so the
  // busiest node's ingress (or what one node alone must send) bounds the sync however it is
  // routed; a transfer gets as many chains as its holders' egress affords under that bound, so
  // chains are as short as the bound allows (every hop adds a chunk's store-and-forward to the
  // sync) and never longer than max_chain nodes. A source with spare egress sends straight to
  // every node; one that holds everything relays it along a chain through all of them. A node
  // that alone holds S bytes affords bound / S copies of each: the same for all its transfers,
  // so that no transfer is left with the longest chains (the sync ends with its slowest chain).
  void routeChains() {
    int64_t bound = 0;
    ordinal_.assign(need_in_.size(), 0);
    int32_t sources = 0;
    for (size_t n = 0; n < need_in_.size(); ++n) {
      bound = std::max({bound, need_in_[n], reserve_[n]});
      if (sole_[n] > 0) ordinal_[n] = sources++;
    }
    for (const Pending& p : pending_) {
      Transfer& tr = plan_.transfers[static_cast<size_t>(p.transfer)];
      const SourceCell& cell = plan_.cells[static_cast<size_t>(p.cell)];
      const int32_t* hn = plan_.cell_nodes.data() + cell.nodes_begin;
      const int32_t count_min = (p.nodes_count + plan_.options.max_chain - 1) / plan_.options.max_chain;
      if (cell.nodes_count == 1) reserve_[hn[0]] -= count_min * tr.bytes;  // this one's own minimum
      int64_t spare = 0;  // copies of it the holders can send without passing the bound
      for (int32_t i = 0; i < cell.nodes_count; ++i)
        spare += std::max<int64_t>(0, bound - egress_[hn[i]] - reserve_[hn[i]]) / std::max<int64_t>(1, tr.bytes);
      if (cell.nodes_count == 1) spare = std::min(spare, bound / std::max<int64_t>(1, sole_[hn[0]]));
      const int32_t count = static_cast<int32_t>(std::clamp<int64_t>(spare, count_min, p.nodes_count));
      nodes_scratch_.assign(pending_nodes_.begin() + p.nodes_begin,
                            pending_nodes_.begin() + p.nodes_begin + p.nodes_count);
      // Sole holders start their chains at different nodes (the i-th such node i places into
      // the order): each node then heads about as many sources' chains as the others, instead
      // of a few nodes taking every source's stream at once.
      const int32_t len = (p.nodes_count + count - 1) / count;
      if (cell.nodes_count == 1 && len > 1)
        std::rotate(nodes_scratch_.begin(), nodes_scratch_.begin() + ordinal_[hn[0]] % len, nodes_scratch_.end());
      splitChains(tr, cell, nodes_scratch_, p.rotation, count);
    }
  }

  // Cuts `nodes` into `count` chains (lengths differing by at most one), in their order (a
  // group's, the same for all its transfers: a link carries one ordered stream); each chain
  // starts at the holder node (then rank) with the least egress so far, ties broken by `rotation`.
  void splitChains(Transfer& tr, const SourceCell& cell, const std::vector<int32_t>& nodes, int32_t rotation,
                   int32_t count) {
    const int32_t k = static_cast<int32_t>(nodes.size());
    const int32_t* hn = plan_.cell_nodes.data() + cell.nodes_begin;
    tr.chains_begin = static_cast<int32_t>(plan_.chains.size());
    tr.chains_count = count;
    for (int32_t c = 0; c < count; ++c) {
      int32_t best = -1;
      for (int32_t i = 0; i < cell.nodes_count; ++i) {
        const int32_t n = hn[(i + rotation) % cell.nodes_count];
        if (best < 0 || egress_[n] < egress_[best]) best = n;
      }
      const int32_t lo = static_cast<int32_t>(static_cast<int64_t>(c) * k / count);
      const int32_t hi = static_cast<int32_t>(static_cast<int64_t>(c + 1) * k / count);
      chain_scratch_.assign(nodes.begin() + lo, nodes.begin() + hi);
      addChain(tr, cell, best, chain_scratch_, false);
    }
  }

  // kGatherBroadcast: the root forwards every transfer to the nodes that need it (a star). A
  // transfer the root holds is sent from there straight to each node; any other goes from its
  // least loaded holder node to the root first (a hop of its own where the root needs none of it).
  void gatherChains(Transfer& tr, const SourceCell& cell, const std::vector<int32_t>& nodes) {
    const int32_t* hn = plan_.cell_nodes.data() + cell.nodes_begin;
    tr.chains_begin = static_cast<int32_t>(plan_.chains.size());
    std::vector<int32_t>& chain = chain_scratch_;
    if (std::binary_search(hn, hn + cell.nodes_count, root_)) {
      tr.chains_count = static_cast<int32_t>(nodes.size());
      for (const int32_t n : nodes) {
        chain.assign(1, n);
        addChain(tr, cell, root_, chain, false);
      }
      return;
    }
    int32_t best = -1;
    for (int32_t i = 0; i < cell.nodes_count; ++i)
      if (best < 0 || egress_[hn[i]] < egress_[best]) best = hn[i];
    chain.assign(1, root_);
    for (const int32_t n : nodes)
      if (n != root_) chain.push_back(n);
    tr.chains_count = 1;
    addChain(tr, cell, best, chain, true);
  }

  // One chain of `tr` from `src_node` (its least loaded holder rank there) through `nodes`.
  void addChain(const Transfer& tr, const SourceCell& cell, int32_t src_node, const std::vector<int32_t>& nodes,
                bool star) {
    const int32_t rank = leastLoadedHolder(cell, src_node);
    Chain ch{src_node, rank, static_cast<int32_t>(plan_.chain_nodes.size()), static_cast<int32_t>(nodes.size()), star};
    egress_[src_node] += tr.bytes;
    rank_egress_[rank] += tr.bytes;
    for (size_t i = 0; i < nodes.size(); ++i) {
      plan_.chain_nodes.push_back(nodes[i]);
      ingress_[nodes[i]] += tr.bytes;
    }
    // Forwarding: a star's first node sends to all the others, a chain's every node but the last
    // to the next.
    const int32_t forwards = static_cast<int32_t>(nodes.size()) - 1;
    if (star)
      egress_[nodes.front()] += tr.bytes * forwards;
    else
      for (int32_t i = 0; i < forwards; ++i) egress_[nodes[static_cast<size_t>(i)]] += tr.bytes;
    plan_.stats.max_chain = std::max(plan_.stats.max_chain, star ? std::min(ch.nodes_count, 2) : ch.nodes_count);
    plan_.stats.network_bytes += tr.bytes * ch.nodes_count;
    plan_.stats.network_ops += tr.chunks * ch.nodes_count;
    plan_.chains.push_back(ch);
  }

  int32_t holderOnNode(const SourceCell& cell, int32_t node) const {
    const TensorLayout& st = src_.tensors[plan_.tensors[cell.tensor].src];
    for (int32_t i = 0; i < cell.holders_count; ++i) {
      const int32_t r = st.pieces[plan_.cell_holders[cell.holders_begin + i]].rank;
      if (src_.rank_node[r] == node) return r;
    }
    return -1;
  }

  int32_t leastLoadedHolder(const SourceCell& cell, int32_t node) const {
    const TensorLayout& st = src_.tensors[plan_.tensors[cell.tensor].src];
    int32_t best = -1;
    for (int32_t i = 0; i < cell.holders_count; ++i) {
      const int32_t r = st.pieces[plan_.cell_holders[cell.holders_begin + i]].rank;
      if (src_.rank_node[r] == node && (best < 0 || rank_egress_[r] < rank_egress_[best])) best = r;
    }
    return best;
  }

  void addLowerBound(const Group& g, const std::vector<Box>& need, int64_t need_volume) {
    for (int32_t n : g.nodes) {
      auto [lo, hi] =
          std::equal_range(local_src_boxes_.begin(), local_src_boxes_.end(), std::pair<int32_t, int32_t>{n, -1},
                           [](const auto& a, const auto& b) { return a.first < b.first; });
      int64_t missing = need_volume;
      if (lo != hi) {
        std::vector<Box> held;
        for (const Box& b : need)
          for (auto it = lo; it != hi; ++it)
            if (overlaps(b, src_boxes_->at(it->second))) held.push_back(intersect(b, src_boxes_->at(it->second)));
        missing -= unionVolume(held);
      }
      plan_.stats.network_lower_bound += missing * elem_;
    }
  }

  Status uncovered(const TensorLayout& st, const TensorLayout& dt, const Group& g, const Box& b, int32_t cells_begin,
                   int32_t cells_end) {
    std::vector<Box> cells;
    for (int32_t c = cells_begin; c < cells_end; ++c)
      if (overlaps(b, plan_.cells[c].box)) cells.push_back(intersect(b, plan_.cells[c].box));
    BoxGrid grid(cells, &b);
    std::vector<int> labels(grid.cellCount(), 0);
    grid.forEachCover(cells, [&](int64_t cell, int) { labels[cell] = -1; });
    Box hole = b;
    for (int64_t c = 0; c < grid.cellCount(); ++c)
      if (labels[c] == 0) {
        hole = grid.cellBox(c);
        break;
      }
    int32_t rank = -1;
    for (int32_t p : g.rep_pieces)
      if (overlaps(dt.boxes[dt.pieces[p].box], hole)) rank = dt.pieces[p].rank;
    std::vector<int64_t> point(hole.lo.begin(), hole.lo.begin() + hole.ndim);
    return absl::FailedPreconditionError(
        strCat("tensor \"", dt.name, "\": rank ", rank, " of layout \"", dst_.group, "\" (node \"",
               nodes_.name(dst_.rank_node[rank]), "\") needs element [", strJoin(point, ", "), "] (within ", hole.str(),
               ") but no rank of layout \"", src_.group, "\" holds it (", st.pieces.size(), " source pieces)"));
  }

  void finishStats() {
    PlanStats& s = plan_.stats;
    s.tensors = static_cast<int32_t>(plan_.tensors.size());
    s.node_ingress = ingress_;
    s.node_egress = egress_;
    s.node_local = local_;
    for (int64_t v : local_) s.local_bytes += v;
    s.transfers = static_cast<int64_t>(plan_.transfers.size());
    s.fragments = static_cast<int64_t>(plan_.fragments.size());
    s.pull_max_ingress = pull_ingress_.empty() ? 0 : *std::max_element(pull_ingress_.begin(), pull_ingress_.end());
    s.pull_max_egress = pull_egress_.empty() ? 0 : *std::max_element(pull_egress_.begin(), pull_egress_.end());
    s.max_unique_held = unique_held_.empty() ? 0 : *std::max_element(unique_held_.begin(), unique_held_.end());

    // Gather-then-broadcast baseline: source rank 0 gathers every needed tensor whole, then a
    // pipelined broadcast gives every destination node each whole tensor once.
    const int32_t root = src_.rank_node.empty() ? -1 : src_.rank_node[0];
    std::vector<char> dst_node(nodes_.size(), 0);
    for (int32_t n : dst_.rank_node) dst_node[n] = 1;
    int64_t dst_nodes = 0;
    for (int32_t n = 0; n < nodes_.size(); ++n) dst_nodes += dst_node[n] && n != root;
    for (const TensorPair& tp : plan_.tensors) {
      const TensorLayout& st = src_.tensors[tp.src];
      const int64_t bytes = Box::whole(st.shape).volume() * st.elemBytes();
      std::vector<Box> at_root;
      for (const PieceRef& p : st.pieces)
        if (src_.rank_node[p.rank] == root) at_root.push_back(st.boxes[p.box]);
      s.model_bytes += bytes;
      s.gather_bytes += bytes - unionVolume(at_root) * st.elemBytes();
    }
    s.broadcast_bytes = s.model_bytes * dst_nodes;
  }

  const ResolvedLayout& src_;
  const ResolvedLayout& dst_;
  const NodeTable& nodes_;
  Plan plan_;
  int64_t elem_ = 1;
  std::vector<int64_t> egress_, ingress_, local_, unique_held_, rank_egress_;
  std::vector<double> pull_ingress_, pull_egress_;
  std::vector<std::pair<int32_t, int32_t>> local_src_boxes_;  // (node, source box id), sorted
  const std::vector<Box>* src_boxes_ = nullptr;
  std::vector<int32_t> net_, chain_scratch_, nodes_scratch_;
  // Planned transfers whose chains routeChains chooses: the transfer, its cell, the nodes it goes
  // to (a range of pending_nodes_); per node the bytes it receives and the egress its sole
  // holdings still need (one copy per max_chain nodes).
  struct Pending {
    int32_t transfer, cell, rotation, nodes_begin, nodes_count;
  };
  std::vector<Pending> pending_;
  std::vector<int32_t> pending_nodes_;
  std::vector<int64_t> need_in_, reserve_, sole_;  // sole_: bytes of the transfers a node alone holds
  std::vector<int32_t> ordinal_;                   // per node: its place among the sole holders
  int32_t root_ = -1;  // kGatherBroadcast: the node everything goes through (source rank 0's)
  std::unordered_map<std::string, size_t> bucket_index_;
  std::vector<Bucket> buckets_;
};

}  // namespace

StatusOr<Plan> makePlan(const ResolvedLayout& src, const ResolvedLayout& dst, const NodeTable& nodes,
                        const PlanOptions& options) {
  return Planner(src, dst, nodes, options).run();
}

int32_t sourceRank(const Plan& plan, const ResolvedLayout& src, int32_t f, const Chain& c) {
  const SourceCell& cell = plan.cells[plan.fragments[f].cell];
  const TensorLayout& st = src.tensors[plan.tensors[cell.tensor].src];
  int32_t fallback = -1;
  for (int32_t i = 0; i < cell.holders_count; ++i) {
    const int32_t r = st.pieces[plan.cell_holders[cell.holders_begin + i]].rank;
    if (r == c.src_rank) return r;
    if (fallback < 0 && src.rank_node[r] == c.src_node) fallback = r;
  }
  return fallback;
}

Region sourceRegion(const Plan& plan, const ResolvedLayout& src, int32_t f, int32_t rank) {
  return sourceRegion(plan, src, f, rank, plan.fragments[f].box);
}

Region sourceRegion(const Plan& plan, const ResolvedLayout& src, int32_t f, int32_t rank, const Box& sub) {
  const Fragment& frag = plan.fragments[f];
  const SourceCell& cell = plan.cells[frag.cell];
  const TensorLayout& st = src.tensors[plan.tensors[cell.tensor].src];
  for (int32_t i = 0; i < cell.holders_count; ++i) {
    const PieceRef& p = st.pieces[plan.cell_holders[cell.holders_begin + i]];
    if (p.rank == rank) return src.region(st, p, sub);
  }
  return {};
}

std::vector<std::pair<Box, Region>> destinationRegions(const Plan& plan, const ResolvedLayout& dst, int32_t f,
                                                       int32_t node) {
  const Fragment& frag = plan.fragments[f];
  const TensorLayout& dt = dst.tensors[plan.tensors[frag.tensor].dst];
  std::vector<std::pair<Box, Region>> out;
  const int32_t only = plan.groups[static_cast<size_t>(frag.group)].rank;
  for (const PieceRef& p : dt.pieces) {
    if (dst.rank_node[p.rank] != node || (only >= 0 && p.rank != only) || !overlaps(dt.boxes[p.box], frag.box))
      continue;
    const Box sub = intersect(dt.boxes[p.box], frag.box);
    out.emplace_back(sub, dst.region(dt, p, sub));
  }
  return out;
}

namespace {
double bytesPerSecond(double gbps) { return gbps * 1e9 / 8; }
}  // namespace

double predictSeconds(const PlanStats& s, const CostModel& m) {
  const double nic = bytesPerSecond(m.nic_gbps), local = bytesPerSecond(m.local_gbps);
  const double net = static_cast<double>(std::max(s.maxIngress(), s.maxEgress())) / nic;
  const double copies = static_cast<double>(s.maxLocal()) / local;
  // Pipelining: the last chain node starts one chunk per hop late; the last chunk's fan-out ends last.
  const double chunk = static_cast<double>(s.largest_chunk);
  const double fill = s.max_chain * (chunk / nic + m.op_latency_s) + chunk / local;
  const int64_t nodes = std::max<int64_t>(
      1, std::count_if(s.node_ingress.begin(), s.node_ingress.end(), [](int64_t v) { return v > 0; }));
  const double ops = static_cast<double>(s.network_ops) / nodes * m.op_latency_s;
  return std::max(net + ops, copies) + fill;
}

double predictPullSeconds(const PlanStats& s, const CostModel& m) {
  const double nic = bytesPerSecond(m.nic_gbps);
  return std::max(s.pull_max_ingress, s.pull_max_egress) / nic;
}

double predictGatherBroadcastSeconds(const PlanStats& s, const CostModel& m) {
  const double nic = bytesPerSecond(m.nic_gbps);
  return static_cast<double>(s.gather_bytes + (s.broadcast_bytes > 0 ? s.model_bytes : 0)) / nic;
}

}  // namespace shardcast::planner
