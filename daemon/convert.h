// Element conversions the pack stage makes for the destination dtypes a layout may declare
// (planner::convertible): float32 -> bfloat16, rounded to nearest even, bit for bit what torch's
// .to(torch.bfloat16) does on the CPU (NaN becomes the quiet NaN 0x7fc0; torch on CUDA writes
// 0x7fff: both NaN).
#pragma once

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

// Converts the box of `extent` elements from `src` (dtype `from`) into `dst` (dtype `to`), both
// host memory, strides in elements of their own dtype. INVALID_ARGUMENT for a pair that is not
// planner::convertible or not a conversion (equal dtypes are a copy, not this).
Status convertBox(const transport::StridedView& dst, planner::DType to, const transport::StridedView& src,
                  planner::DType from, const std::vector<int64_t>& extent);

}  // namespace shardcast::daemon
