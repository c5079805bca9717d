// Boxes: half-open hyper-rectangles of tensor indices, and the region algebra the planner needs
// (intersection, volume, disjoint decomposition of a union by grid compression).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shardcast::planner {

inline constexpr int kMaxDims = 8;

struct Box {
  int ndim = 0;
  std::array<int64_t, kMaxDims> lo{};
  std::array<int64_t, kMaxDims> hi{};

  static Box whole(const std::vector<int64_t>& shape);
  static Box fromOffsetsSizes(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes);

  int64_t size(int d) const { return hi[d] - lo[d]; }
  int64_t volume() const;
  bool empty() const;
  bool contains(const Box& other) const;
  bool containsPoint(const int64_t* point) const;
  std::vector<int64_t> sizes() const;
  std::string str() const;  // "[0:512, 0:4096]"

  friend bool operator==(const Box& a, const Box& b);
  friend bool operator<(const Box& a, const Box& b);
};

// The intersection; empty() when the boxes do not overlap.
Box intersect(const Box& a, const Box& b);
bool overlaps(const Box& a, const Box& b);

struct BoxHash {
  size_t operator()(const Box& b) const;
};

// A union of boxes cut into a grid by every box boundary. Cell c of the grid is covered by a
// subset of the input boxes; decompose() merges adjacent cells with equal labels into maximal boxes.
class BoxGrid {
 public:
  // Builds the grid over `boxes`, restricted to `clip` when it is given (non-empty ndim).
  BoxGrid(const std::vector<Box>& boxes, const Box* clip = nullptr);

  int64_t cellCount() const { return cell_count_; }
  // The cells a grid over `boxes` would have, or -1 when that does not fit an int64 (checked
  // before building one: overlapping pieces of a layout can ask for K^ndim cells).
  static int64_t countCells(const std::vector<Box>& boxes);
  // Visits every box index covering each cell: fn(cell_index, box_index).
  void forEachCover(const std::vector<Box>& boxes, const std::function<void(int64_t, int)>& fn) const;
  Box cellBox(int64_t cell) const;
  // Greedy maximal boxes of equal label; cells labelled -1 are skipped. Deterministic (row-major).
  std::vector<std::pair<Box, int>> decompose(const std::vector<int>& labels) const;

 private:
  int ndim_ = 0;
  std::vector<std::vector<int64_t>> cuts_;  // per dim: sorted unique boundaries
  std::array<int64_t, kMaxDims> extent_{};  // intervals per dim
  std::array<int64_t, kMaxDims> stride_{};  // row-major cell strides
  int64_t cell_count_ = 0;
};

// True when `box`, laid out with these element strides, is one contiguous run of elements
// (size-1 dims never break contiguity).
bool isContiguous(const std::vector<int64_t>& strides, const Box& box);

// Disjoint boxes whose union equals the union of `boxes` (all of the same rank).
std::vector<Box> disjointUnion(const std::vector<Box>& boxes);
// Number of elements in the union of `boxes`.
int64_t unionVolume(const std::vector<Box>& boxes);
// True when no two boxes overlap (sweep along the dim with the most distinct lower bounds).
bool pairwiseDisjoint(const std::vector<Box>& boxes);

// Splits `box` into sub-boxes of at most `max_bytes` each (whole rows of the innermost dims first,
// so each chunk is a row-major slab); a single element larger than max_bytes is its own chunk.
std::vector<Box> splitIntoChunks(const Box& box, int64_t elem_bytes, int64_t max_bytes);
int64_t chunkCount(const Box& box, int64_t elem_bytes, int64_t max_bytes);

}  // namespace shardcast::planner
