// Element conversions the pack stage makes for the destination dtypes a layout may declare
// (planner::convertible): float32 -> bfloat16, rounded to nearest even, bit for bit what torch's
// .to(torch.bfloat16) does for every number (NaN becomes the quiet NaN 0x7fc0; torch's CPU kernel
// writes 0xffff and CUDA 0x7fff: all NaN).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/status.h"
#include "planner/layout.h"
#include "transport/copy_engine.h"

namespace shardcast::daemon {

inline uint16_t bfloat16FromFloat(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: the canonical quiet NaN
  // Round to nearest, ties to even: add half an ulp of bfloat16 minus one, plus the low bit kept.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float floatFromBfloat16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float -> float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinity),
// rounded to nearest even as torch's .to(torch.float8_e4m3fn); |f| beyond 448 saturates to 448,
// NaN stays NaN (0x7f with its sign).
uint8_t e4m3FromFloat(float f);
float floatFromE4m3(uint8_t q);
// The scale of a block whose largest magnitude is `amax`: amax / 448 (1 for an all-zero block),
// rounded up to a power of two with `pow2`. NaN in, NaN out.
float blockScale(float amax, bool pow2);

// The amaxes of a weight's split blocks (planner::TensorLayout::split_blocks), combined across
// the source ranks that hold their pieces: `amax[i]` is block `blocks[i]`'s (row-major index in
// the scale tensor's grid; NaN: the block holds NaN). Sorted by block.
struct SplitAmax {
  std::vector<int64_t> blocks;
  std::vector<float> amax;
  const float* find(int64_t block) const;  // null: the block is not split
};

// The amaxes of one block-scaled weight's blocks, read once per sync on a node: its fp8 values
// and its scale tensor are packed by separate calls (separate transfers, on any packer thread, in
// any order), and whichever comes second takes a block's amax from the first rather than reading
// the block again. Thread-safe; one per weight and sync attempt (the source ranks are held for
// the sync, so a block's values do not change under it).
class BlockAmaxes {
 public:
  explicit BlockAmaxes(size_t blocks) : slots_(blocks) {}
  // Block `block`'s amax (row-major index in the scale tensor's grid), from `read()` the first
  // time (two threads may both read it once: the same value).
  template <class Read>
  float get(int64_t block, Read&& read) {
    auto& slot = slots_[static_cast<size_t>(block)];
    uint64_t v = slot.load(std::memory_order_acquire);
    if (v == 0) {
      const float amax = read();
      uint32_t bits;
      std::memcpy(&bits, &amax, sizeof(bits));
      v = (uint64_t{1} << 32) | bits;
      slot.store(v, std::memory_order_release);
      reads_.fetch_add(1, std::memory_order_relaxed);
    }
    const auto bits = static_cast<uint32_t>(v);
    float amax;
    std::memcpy(&amax, &bits, sizeof(amax));
    return amax;
  }
  size_t blocks() const { return slots_.size(); }
  // How many times a block was read (a block read by two threads at once counts twice).
  uint64_t reads() const { return reads_.load(std::memory_order_relaxed); }

 private:
  std::vector<std::atomic<uint64_t>> slots_;  // 0: not read yet; else 1 << 32 | the amax's bits
  std::atomic<uint64_t> reads_{0};
};

// Block-scaled fp8 (v1::BlockScale), host memory. quantizeBox: box `box` (global indices) of the
// block-scaled tensor `t` from `src` (dtype `from`: float32 or bfloat16, its view's origin at
// box.lo) into `dst` (e4m3); each element divided by the scale of its whole block: from the
// block's amax in `split` when it is split between source ranks, else read from `src` around the
// box (the whole block lies in the source's memory). scaleBox: the scales of the blocks `box`
// (block indices) of scale tensor `scale`, from `split` or from `src`, a view whose element i is
// the first element of block i (strides: the weight's times the block). `amaxes` (the weight's,
// its blocks' count; optional): a block's amax read by the other of the two is not read again.
Status quantizeBox(const transport::StridedView& dst, const transport::StridedView& src, planner::DType from,
                   const planner::Box& box, const planner::TensorLayout& t, const SplitAmax* split = nullptr,
                   BlockAmaxes* amaxes = nullptr);
Status scaleBox(const transport::StridedView& dst, const transport::StridedView& src, planner::DType from,
                const planner::Box& box, const planner::TensorLayout& scale, const SplitAmax* split = nullptr,
                BlockAmaxes* amaxes = nullptr);
// The largest magnitude of the box of `extent` elements of `src` (host memory, float32 or
// bfloat16): one source rank's part of a split block. NaN when one is NaN.
StatusOr<float> amaxBox(const transport::StridedView& src, planner::DType from, const std::vector<int64_t>& extent);

// Converts the box of `extent` elements from `src` (dtype `from`) into `dst` (dtype `to`), both
// host memory, strides in elements of their own dtype. INVALID_ARGUMENT for a pair that is not
// planner::convertible or not a conversion (equal dtypes are a copy, not this).
Status convertBox(const transport::StridedView& dst, planner::DType to, const transport::StridedView& src,
                  planner::DType from, const std::vector<int64_t>& extent);

}  // namespace shardcast::daemon
