#include "planner/box.h"

#include <algorithm>
#include <numeric>

namespace shardcast::planner {

Box Box::whole(const std::vector<int64_t>& shape) {
  Box b;
  b.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < b.ndim; ++d) b.hi[d] = shape[d];
  return b;
}

Box Box::fromOffsetsSizes(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  Box b;
  b.ndim = static_cast<int>(offsets.size());
  for (int d = 0; d < b.ndim; ++d) {
    b.lo[d] = offsets[d];
    b.hi[d] = offsets[d] + sizes[d];
  }
  return b;
}

int64_t Box::volume() const {
  int64_t v = 1;
  for (int d = 0; d < ndim; ++d) v *= std::max<int64_t>(0, hi[d] - lo[d]);
  return v;
}

bool Box::empty() const {
  for (int d = 0; d < ndim; ++d)
    if (hi[d] <= lo[d]) return true;
  return false;
}

bool Box::contains(const Box& o) const {
  for (int d = 0; d < ndim; ++d)
    if (o.lo[d] < lo[d] || o.hi[d] > hi[d]) return false;
  return true;
}

bool Box::containsPoint(const int64_t* p) const {
  for (int d = 0; d < ndim; ++d)
    if (p[d] < lo[d] || p[d] >= hi[d]) return false;
  return true;
}

std::vector<int64_t> Box::sizes() const {
  std::vector<int64_t> s(ndim);
  for (int d = 0; d < ndim; ++d) s[d] = hi[d] - lo[d];
  return s;
}

std::string Box::str() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) s += ", ";
    s += std::to_string(lo[d]) + ":" + std::to_string(hi[d]);
  }
  return s + "]";
}

bool operator==(const Box& a, const Box& b) {
  if (a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.lo[d] != b.lo[d] || a.hi[d] != b.hi[d]) return false;
  return true;
}

bool operator<(const Box& a, const Box& b) {
  if (a.ndim != b.ndim) return a.ndim < b.ndim;
  for (int d = 0; d < a.ndim; ++d) {
    if (a.lo[d] != b.lo[d]) return a.lo[d] < b.lo[d];
    if (a.hi[d] != b.hi[d]) return a.hi[d] < b.hi[d];
  }
  return false;
}

Box intersect(const Box& a, const Box& b) {
  Box r;
  r.ndim = a.ndim;
  for (int d = 0; d < a.ndim; ++d) {
    r.lo[d] = std::max(a.lo[d], b.lo[d]);
    r.hi[d] = std::max(r.lo[d], std::min(a.hi[d], b.hi[d]));
  }
  return r;
}

bool overlaps(const Box& a, const Box& b) {
  for (int d = 0; d < a.ndim; ++d)
    if (std::max(a.lo[d], b.lo[d]) >= std::min(a.hi[d], b.hi[d])) return false;
  return true;
}

size_t BoxHash::operator()(const Box& b) const {
  uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(b.ndim);
  for (int d = 0; d < b.ndim; ++d) {
    h = (h ^ static_cast<uint64_t>(b.lo[d])) * 1099511628211ull;
    h = (h ^ static_cast<uint64_t>(b.hi[d])) * 1099511628211ull;
  }
  return static_cast<size_t>(h);
}

namespace {

// Calls fn(cell) for every grid cell whose coordinates lie in [lo, hi) per dim.
template <typename Fn>
void forEachCellIn(int ndim, const int64_t* lo, const int64_t* hi, const int64_t* stride, Fn&& fn) {
  if (ndim == 0) {
    fn(int64_t{0});
    return;
  }
  for (int d = 0; d < ndim; ++d)
    if (hi[d] <= lo[d]) return;
  std::array<int64_t, kMaxDims> idx{};
  for (int d = 0; d < ndim; ++d) idx[d] = lo[d];
  while (true) {
    int64_t cell = 0;
    for (int d = 0; d < ndim; ++d) cell += idx[d] * stride[d];
    fn(cell);
    int d = ndim - 1;
    while (d >= 0 && ++idx[d] == hi[d]) {
      idx[d] = lo[d];
      --d;
    }
    if (d < 0) return;
  }
}

}  // namespace

BoxGrid::BoxGrid(const std::vector<Box>& boxes, const Box* clip) {
  ndim_ = clip ? clip->ndim : (boxes.empty() ? 0 : boxes.front().ndim);
  cuts_.resize(ndim_);
  for (int d = 0; d < ndim_; ++d) {
    auto& c = cuts_[d];
    for (const Box& b : boxes) {
      int64_t lo = b.lo[d], hi = b.hi[d];
      if (clip) {
        lo = std::clamp(lo, clip->lo[d], clip->hi[d]);
        hi = std::clamp(hi, clip->lo[d], clip->hi[d]);
      }
      c.push_back(lo);
      c.push_back(hi);
    }
    if (clip) {
      c.push_back(clip->lo[d]);
      c.push_back(clip->hi[d]);
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  cell_count_ = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    extent_[d] = std::max<int64_t>(0, static_cast<int64_t>(cuts_[d].size()) - 1);
    stride_[d] = cell_count_;
    cell_count_ *= extent_[d];
  }
}

int64_t BoxGrid::countCells(const std::vector<Box>& boxes) {
  if (boxes.empty()) return 0;
  int64_t cells = 1;
  for (int d = 0; d < boxes[0].ndim; ++d) {
    std::vector<int64_t> c;
    c.reserve(2 * boxes.size());
    for (const Box& b : boxes) {
      c.push_back(b.lo[d]);
      c.push_back(b.hi[d]);
    }
    std::sort(c.begin(), c.end());
    const auto distinct = static_cast<int64_t>(std::unique(c.begin(), c.end()) - c.begin());
    if (__builtin_mul_overflow(cells, std::max<int64_t>(0, distinct - 1), &cells)) return -1;
  }
  return cells;
}

void BoxGrid::forEachCover(const std::vector<Box>& boxes, const std::function<void(int64_t, int)>& fn) const {
  for (int i = 0; i < static_cast<int>(boxes.size()); ++i) {
    const Box& b = boxes[i];
    std::array<int64_t, kMaxDims> lo{}, hi{};
    bool empty = false;
    for (int d = 0; d < ndim_; ++d) {
      const auto& c = cuts_[d];
      lo[d] = std::lower_bound(c.begin(), c.end(), b.lo[d]) - c.begin();
      hi[d] = std::min<int64_t>(std::lower_bound(c.begin(), c.end(), b.hi[d]) - c.begin(), extent_[d]);
      if (hi[d] <= lo[d]) empty = true;
    }
    if (empty) continue;
    forEachCellIn(ndim_, lo.data(), hi.data(), stride_.data(), [&](int64_t cell) { fn(cell, i); });
  }
}

Box BoxGrid::cellBox(int64_t cell) const {
  Box b;
  b.ndim = ndim_;
  for (int d = 0; d < ndim_; ++d) {
    const int64_t i = (cell / stride_[d]) % extent_[d];
    b.lo[d] = cuts_[d][i];
    b.hi[d] = cuts_[d][i + 1];
  }
  return b;
}

std::vector<std::pair<Box, int>> BoxGrid::decompose(const std::vector<int>& labels) const {
  std::vector<std::pair<Box, int>> out;
  std::vector<char> taken(cell_count_, 0);
  for (int64_t cell = 0; cell < cell_count_; ++cell) {
    if (taken[cell] || labels[cell] < 0) continue;
    const int label = labels[cell];
    std::array<int64_t, kMaxDims> lo{}, hi{};
    for (int d = 0; d < ndim_; ++d) {
      lo[d] = (cell / stride_[d]) % extent_[d];
      hi[d] = lo[d] + 1;
    }
    // Grow innermost dims first so that the result is a row-major-friendly slab.
    for (int d = ndim_ - 1; d >= 0; --d) {
      while (hi[d] < extent_[d]) {
        std::array<int64_t, kMaxDims> slo = lo, shi = hi;
        slo[d] = hi[d];
        shi[d] = hi[d] + 1;
        bool ok = true;
        forEachCellIn(ndim_, slo.data(), shi.data(), stride_.data(), [&](int64_t c) {
          if (taken[c] || labels[c] != label) ok = false;
        });
        if (!ok) break;
        ++hi[d];
      }
    }
    forEachCellIn(ndim_, lo.data(), hi.data(), stride_.data(), [&](int64_t c) { taken[c] = 1; });
    Box b;
    b.ndim = ndim_;
    for (int d = 0; d < ndim_; ++d) {
      b.lo[d] = cuts_[d][lo[d]];
      b.hi[d] = cuts_[d][hi[d]];
    }
    out.emplace_back(b, label);
  }
  return out;
}

bool isContiguous(const std::vector<int64_t>& strides, const Box& box) {
  int64_t expected = 1;
  for (int d = box.ndim - 1; d >= 0; --d) {
    if (box.size(d) == 1) continue;
    if (strides[d] != expected) return false;
    expected *= box.size(d);
  }
  return true;
}

std::vector<Box> disjointUnion(const std::vector<Box>& boxes) {
  std::vector<Box> nonempty;
  for (const Box& b : boxes)
    if (!b.empty()) nonempty.push_back(b);
  if (nonempty.size() <= 1) return nonempty;
  BoxGrid grid(nonempty);
  std::vector<int> labels(grid.cellCount(), -1);
  grid.forEachCover(nonempty, [&](int64_t cell, int) { labels[cell] = 0; });
  std::vector<Box> out;
  for (auto& [b, label] : grid.decompose(labels)) out.push_back(b);
  return out;
}

int64_t unionVolume(const std::vector<Box>& boxes) {
  int64_t v = 0;
  for (const Box& b : disjointUnion(boxes)) v += b.volume();
  return v;
}

bool pairwiseDisjoint(const std::vector<Box>& boxes) {
  if (boxes.size() < 2) return true;
  const int ndim = boxes.front().ndim;
  if (ndim == 0) return false;  // two scalars always overlap
  // Sweep along the dim whose lower bounds vary most: few boxes share an interval there.
  int best = 0;
  size_t best_distinct = 0;
  for (int d = 0; d < ndim; ++d) {
    std::vector<int64_t> v;
    v.reserve(boxes.size());
    for (const Box& b : boxes) v.push_back(b.lo[d]);
    std::sort(v.begin(), v.end());
    const size_t distinct = std::unique(v.begin(), v.end()) - v.begin();
    if (distinct > best_distinct) best_distinct = distinct, best = d;
  }
  std::vector<int> order(boxes.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return boxes[a].lo[best] < boxes[b].lo[best]; });
  for (size_t i = 0; i < order.size(); ++i) {
    const Box& a = boxes[order[i]];
    for (size_t j = i + 1; j < order.size() && boxes[order[j]].lo[best] < a.hi[best]; ++j)
      if (overlaps(a, boxes[order[j]])) return false;
  }
  return true;
}

namespace {

// The outermost dim d such that one "row" below it (all of dims > d) fits in max_bytes, and how
// many such rows go in one chunk.
std::pair<int, int64_t> chunkShape(const Box& box, int64_t elem_bytes, int64_t max_bytes) {
  int64_t row = elem_bytes;  // bytes of one index step along d, i.e. of dims > d
  for (int d = box.ndim - 1; d >= 0; --d) {
    const int64_t whole = row * box.size(d);
    if (d == 0 || whole > max_bytes) {
      return {d, std::max<int64_t>(1, max_bytes / row)};
    }
    row = whole;
  }
  return {-1, 1};
}

}  // namespace

int64_t chunkCount(const Box& box, int64_t elem_bytes, int64_t max_bytes) {
  if (box.empty()) return 0;
  if (box.ndim == 0 || box.volume() * elem_bytes <= max_bytes) return 1;
  const auto [d, per] = chunkShape(box, elem_bytes, max_bytes);
  int64_t outer = 1;
  for (int j = 0; j < d; ++j) outer *= box.size(j);
  return outer * ((box.size(d) + per - 1) / per);
}

std::vector<Box> splitIntoChunks(const Box& box, int64_t elem_bytes, int64_t max_bytes) {
  if (box.empty()) return {};
  if (box.ndim == 0 || box.volume() * elem_bytes <= max_bytes) return {box};
  const auto [d, per] = chunkShape(box, elem_bytes, max_bytes);
  std::vector<Box> out;
  // Iterate the single-index positions of dims < d, then slabs of `per` along d.
  std::array<int64_t, kMaxDims> idx{};
  for (int j = 0; j < d; ++j) idx[j] = box.lo[j];
  while (true) {
    for (int64_t s = box.lo[d]; s < box.hi[d]; s += per) {
      Box c = box;
      for (int j = 0; j < d; ++j) c.lo[j] = idx[j], c.hi[j] = idx[j] + 1;
      c.lo[d] = s;
      c.hi[d] = std::min(box.hi[d], s + per);
      out.push_back(c);
    }
    int j = d - 1;
    while (j >= 0 && ++idx[j] == box.hi[j]) {
      idx[j] = box.lo[j];
      --j;
    }
    if (j < 0) break;
  }
  return out;
}

}  // namespace shardcast::planner
