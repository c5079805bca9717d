#include "daemon/stage/convert.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/strings.h"
#include "daemon/stage/convert_simd.h"

namespace shardcast::daemon {

uint8_t e4m3FromFloat(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7f;   // NaN
  if (u >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and infinity): saturated
  if (u < 0x3c800000u) {                     // below 2^-6: a subnormal, steps of 2^-9
    const float a = std::fabs(f) * 512.0f;   // exact: a power-of-two scaling, in [0, 8)
    uint32_t m = static_cast<uint32_t>(a);
    const float frac = a - static_cast<float>(m);        // exact
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;  // ties to even; 8 is the smallest normal
    return sign | static_cast<uint8_t>(m);
  }
  // Normal: exponent rebased to 7, mantissa from 23 bits to 3, ties to even (a carry moves the
  // exponent up, which is the right encoding).
  uint32_t q = (((u >> 23) - 127 + 7) << 3) | ((u >> 20) & 7u);
  const uint32_t rest = u & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) ++q;
  return sign | static_cast<uint8_t>(std::min<uint32_t>(q, 0x7e));
}

float floatFromE4m3(uint8_t q) {
  const float sign = (q & 0x80) ? -1.0f : 1.0f;
  const int e = (q >> 3) & 15, m = q & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
}

float blockScale(float amax, bool pow2) {
  if (std::isnan(amax)) return amax;
  if (amax == 0.0f) return 1.0f;
  const float s = amax / 448.0f;
  if (!pow2 || std::isinf(s)) return s;
  int e = 0;
  const float m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

namespace {

// One element of a float32 or bfloat16 source, as float.
template <planner::DType From>
float load(const std::byte* base, int64_t element) {
  if constexpr (From == planner::DType::kBFloat16) {
    uint16_t b;
    std::memcpy(&b, base + element * 2, 2);
    return floatFromBfloat16(b);
  } else {
    float f;
    std::memcpy(&f, base + element * 4, 4);
    return f;
  }
}

// Calls fn(a, b) for the first element of every innermost row of a box of `sizes` elements, in
// row-major order: `a` its offset in a view at `origin_a` with `strides_a`, `b` in a second view
// (elements); the caller walks each row. forEachRow: one view.
template <typename Fn>
void forEachRowPair(int64_t origin_a, const std::vector<int64_t>& strides_a, int64_t origin_b,
                    const std::vector<int64_t>& strides_b, const std::vector<int64_t>& sizes, Fn&& fn) {
  const size_t nd = sizes.size();
  for (int64_t n : sizes)
    if (n <= 0) return;
  if (nd <= 1) {
    fn(origin_a, origin_b);
    return;
  }
  std::vector<int64_t> idx(nd - 1, 0);
  int64_t a = origin_a, b = origin_b;
  while (true) {
    fn(a, b);
    size_t d = nd - 1;
    while (d > 0) {
      --d;
      a += strides_a[d];
      b += strides_b[d];
      if (++idx[d] < sizes[d]) break;
      a -= idx[d] * strides_a[d];
      b -= idx[d] * strides_b[d];
      idx[d] = 0;
      if (d == 0) return;
    }
  }
}

template <typename Fn>
void forEachRow(int64_t origin, const std::vector<int64_t>& strides, const std::vector<int64_t>& sizes, Fn&& fn) {
  forEachRowPair(origin, strides, origin, strides, sizes, [&](int64_t a, int64_t) { fn(a); });
}

// The scale of the block whose first element is at `origin` in `src` (the weight's strides
// `inner`), `sizes` elements (cut at the tensor's edge).
template <planner::DType From>
float amaxAt(const std::byte* src, int64_t origin, const std::vector<int64_t>& inner,
             const std::vector<int64_t>& sizes) {
  const int64_t n = sizes.empty() ? 1 : sizes.back(), step = inner.empty() ? 1 : inner.back();
  float amax = 0.0f;
  bool nan = false;
  if (step == 1 && sizes.size() >= 2) {  // contiguous rows: vectorised, a plane of rows per call
    const size_t r = sizes.size() - 2;
    std::vector<int64_t> planes = sizes;
    planes[r] = 1;
    const auto rows = static_cast<size_t>(sizes[r]);
    forEachRow(origin, inner, planes, [&](int64_t first) {
      bool plane_nan = false;
      const float m =
          From == planner::DType::kBFloat16
              ? simd::amaxRowsBf16(reinterpret_cast<const uint16_t*>(src) + first, n, rows, inner[r], &plane_nan)
              : simd::amaxRows(reinterpret_cast<const float*>(src) + first, n, rows, inner[r], &plane_nan);
      nan = nan || plane_nan;
      amax = std::max(amax, m);
    });
    return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
  }
  forEachRow(origin, inner, sizes, [&](int64_t row) {
    if (step == 1) {  // a contiguous row: vectorised
      bool row_nan = false;
      const float m = From == planner::DType::kBFloat16
                          ? simd::amaxRowBf16(reinterpret_cast<const uint16_t*>(src) + row, n, &row_nan)
                          : simd::amaxRow(reinterpret_cast<const float*>(src) + row, n, &row_nan);
      nan = nan || row_nan;
      amax = std::max(amax, m);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float v = std::fabs(load<From>(src, row + i * step));
      nan = nan || std::isnan(v);
      amax = std::max(amax, v);
    }
  });
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// The scale grid of a block-scaled weight: its blocks per dim.
std::vector<int64_t> gridOf(const std::vector<int64_t>& shape, const std::vector<int64_t>& block) {
  std::vector<int64_t> grid(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) grid[d] = (shape[d] + block[d] - 1) / block[d];
  return grid;
}

template <planner::DType From>
void quantizeBlocks(const transport::StridedView& dst, const transport::StridedView& src, const planner::Box& box,
                    const planner::TensorLayout& t, const SplitAmax* split, BlockAmaxes* amaxes) {
  const std::vector<int64_t> grid = gridOf(t.shape, t.block);
  const size_t nd = static_cast<size_t>(box.ndim);
  auto* out = reinterpret_cast<uint8_t*>(dst.base);
  // Block by block: its scale from the whole block, then its elements inside the box.
  std::vector<int64_t> first(nd), count(nd), unit(nd, 1);
  for (size_t d = 0; d < nd; ++d) {
    first[d] = box.lo[d] / t.block[d];
    count[d] = (box.hi[d] + t.block[d] - 1) / t.block[d] - first[d];
  }
  std::vector<int64_t> k(nd, 0), blo(nd), bsize(nd), psize(nd), index(nd);
  while (true) {
    int64_t block_origin = src.offset, part_src = src.offset, part_dst = dst.offset;
    for (size_t d = 0; d < nd; ++d) {
      blo[d] = (first[d] + k[d]) * t.block[d];
      bsize[d] = std::min(blo[d] + t.block[d], t.shape[d]) - blo[d];
      const int64_t plo = std::max(blo[d], box.lo[d]);
      psize[d] = std::min(blo[d] + bsize[d], box.hi[d]) - plo;
      block_origin += (blo[d] - box.lo[d]) * src.strides[d];
      part_src += (plo - box.lo[d]) * src.strides[d];
      part_dst += (plo - box.lo[d]) * dst.strides[d];
      index[d] = first[d] + k[d];
    }
    // A split block's amax is given; only its part inside this rank's piece may be read.
    const int64_t at = planner::blockIndex(index.data(), grid);
    const float* given = split ? split->find(at) : nullptr;
    const auto read = [&] { return amaxAt<From>(src.base, block_origin, src.strides, bsize); };
    const float scale = blockScale(given ? *given : amaxes ? amaxes->get(at, read) : read(), t.pow2);
    const int64_t n = psize[nd - 1], ss = src.strides[nd - 1], ds = dst.strides[nd - 1];
    if (ss == 1 && ds == 1 && nd >= 2) {  // contiguous rows: vectorised, a plane of rows per call
      std::vector<int64_t> planes = psize;
      planes[nd - 2] = 1;
      const auto rows = static_cast<size_t>(psize[nd - 2]);
      const int64_t rs = src.strides[nd - 2], rd = dst.strides[nd - 2];
      forEachRowPair(part_src, src.strides, part_dst, dst.strides, planes, [&](int64_t row, int64_t o) {
        if constexpr (From == planner::DType::kBFloat16)
          simd::quantizeRowsBf16(reinterpret_cast<const uint16_t*>(src.base) + row, rs, out + o, rd, n, rows, scale);
        else
          simd::quantizeRows(reinterpret_cast<const float*>(src.base) + row, rs, out + o, rd, n, rows, scale);
      });
    } else {
      forEachRowPair(part_src, src.strides, part_dst, dst.strides, psize, [&](int64_t row, int64_t o) {
        if (ss == 1 && ds == 1) {  // contiguous rows: vectorised
          if constexpr (From == planner::DType::kBFloat16)
            simd::quantizeRowBf16(reinterpret_cast<const uint16_t*>(src.base) + row, out + o, n, scale);
          else
            simd::quantizeRow(reinterpret_cast<const float*>(src.base) + row, out + o, n, scale);
          return;
        }
        for (int64_t i = 0; i < n; ++i) {
          const float x = load<From>(src.base, row + i * ss) / scale;
          out[o + i * ds] = e4m3FromFloat(std::isnan(x) ? x : std::clamp(x, -448.0f, 448.0f));
        }
      });
    }
    size_t d = nd;
    while (d > 0 && ++k[d - 1] == count[d - 1]) k[--d] = 0;
    if (d == 0) return;
  }
}

template <planner::DType From>
void scaleBlocks(const transport::StridedView& dst, const transport::StridedView& src, const planner::Box& box,
                 const planner::TensorLayout& scale, const std::vector<int64_t>& inner, const SplitAmax* split,
                 BlockAmaxes* amaxes) {
  const size_t nd = static_cast<size_t>(box.ndim);
  auto* out = reinterpret_cast<float*>(dst.base);
  std::vector<int64_t> i(nd, 0), bsize(nd), index(nd);
  const auto sizes = box.sizes();
  while (true) {
    int64_t s = src.offset, o = dst.offset;
    for (size_t d = 0; d < nd; ++d) {
      const int64_t lo = (box.lo[d] + i[d]) * scale.block[d];
      bsize[d] = std::min(lo + scale.block[d], scale.scaled_shape[d]) - lo;
      s += i[d] * src.strides[d];
      o += i[d] * dst.strides[d];
      index[d] = box.lo[d] + i[d];
    }
    const int64_t at = planner::blockIndex(index.data(), scale.shape);
    const float* given = split ? split->find(at) : nullptr;
    const auto read = [&] { return amaxAt<From>(src.base, s, inner, bsize); };
    out[o] = blockScale(given ? *given : amaxes ? amaxes->get(at, read) : read(), scale.pow2);
    size_t d = nd;
    while (d > 0 && ++i[d - 1] == sizes[d - 1]) i[--d] = 0;
    if (d == 0) return;
  }
}

Status checkScaled(planner::DType from, size_t nd, const transport::StridedView& dst, const transport::StridedView& src,
                   const std::vector<int64_t>& block) {
  if (from != planner::DType::kFloat32 && from != planner::DType::kBFloat16)
    return absl::InvalidArgumentError(
        strCat("block-scaled fp8 from ", planner::dtypeName(from), ": only float32 and bfloat16 are quantised"));
  if (nd == 0 || dst.strides.size() != nd || src.strides.size() != nd || block.size() != nd)
    return absl::InvalidArgumentError(strCat("block-scaled fp8: a box of ", nd, " dims, strides of ",
                                             src.strides.size(), " and ", dst.strides.size(), ", a block of ",
                                             block.size()));
  return absl::OkStatus();
}

}  // namespace

const float* SplitAmax::find(int64_t block) const {
  const auto it = std::lower_bound(blocks.begin(), blocks.end(), block);
  if (it == blocks.end() || *it != block) return nullptr;
  return &amax[static_cast<size_t>(it - blocks.begin())];
}

Status quantizeBox(const transport::StridedView& dst, const transport::StridedView& src, planner::DType from,
                   const planner::Box& box, const planner::TensorLayout& t, const SplitAmax* split,
                   BlockAmaxes* amaxes) {
  SC_RETURN_IF_ERROR(checkScaled(from, static_cast<size_t>(box.ndim), dst, src, t.block));
  if (box.empty()) return absl::OkStatus();
  if (from == planner::DType::kBFloat16)
    quantizeBlocks<planner::DType::kBFloat16>(dst, src, box, t, split, amaxes);
  else
    quantizeBlocks<planner::DType::kFloat32>(dst, src, box, t, split, amaxes);
  return absl::OkStatus();
}

StatusOr<float> amaxBox(const transport::StridedView& src, planner::DType from, const std::vector<int64_t>& extent) {
  SC_RETURN_IF_ERROR(checkScaled(from, extent.size(), src, src, extent));
  for (int64_t e : extent)
    if (e <= 0) return 0.0f;
  return from == planner::DType::kBFloat16
             ? amaxAt<planner::DType::kBFloat16>(src.base, src.offset, src.strides, extent)
             : amaxAt<planner::DType::kFloat32>(src.base, src.offset, src.strides, extent);
}

Status scaleBox(const transport::StridedView& dst, const transport::StridedView& src, planner::DType from,
                const planner::Box& box, const planner::TensorLayout& scale, const SplitAmax* split,
                BlockAmaxes* amaxes) {
  const size_t nd = static_cast<size_t>(box.ndim);
  SC_RETURN_IF_ERROR(checkScaled(from, nd, dst, src, scale.block));
  if (box.empty()) return absl::OkStatus();
  std::vector<int64_t> inner(nd);
  for (size_t d = 0; d < nd; ++d) {
    if (src.strides[d] % scale.block[d] != 0)
      return absl::InternalError("block scales: the source view's strides are not the weight's times the block");
    inner[d] = src.strides[d] / scale.block[d];
  }
  if (from == planner::DType::kBFloat16)
    scaleBlocks<planner::DType::kBFloat16>(dst, src, box, scale, inner, split, amaxes);
  else
    scaleBlocks<planner::DType::kFloat32>(dst, src, box, scale, inner, split, amaxes);
  return absl::OkStatus();
}

Status convertBox(const transport::StridedView& dst, planner::DType to, const transport::StridedView& src,
                  planner::DType from, const std::vector<int64_t>& extent) {
  if (from != planner::DType::kFloat32 || to != planner::DType::kBFloat16)
    return absl::InvalidArgumentError(
        strCat("no conversion from ", planner::dtypeName(from), " to ", planner::dtypeName(to)));
  const size_t nd = extent.size();
  if (dst.strides.size() != nd || src.strides.size() != nd)
    return absl::InvalidArgumentError(strCat("convert: extent has ", nd, " dims but strides have ", src.strides.size(),
                                             " (src) and ", dst.strides.size(), " (dst)"));
  for (int64_t e : extent)
    if (e <= 0) return absl::OkStatus();
  const auto* in = reinterpret_cast<const float*>(src.base);
  auto* out = reinterpret_cast<uint16_t*>(dst.base);
  if (nd == 0) {
    out[dst.offset] = bfloat16FromFloat(in[src.offset]);
    return absl::OkStatus();
  }
  // Row by row along the innermost dim.
  const int64_t inner = extent[nd - 1], si = src.strides[nd - 1], di = dst.strides[nd - 1];
  forEachRowPair(src.offset, src.strides, dst.offset, dst.strides, extent, [&](int64_t s, int64_t d) {
    if (si == 1 && di == 1) {  // contiguous rows: vectorised
      simd::bfloat16FromFloatRow(in + s, out + d, static_cast<size_t>(inner));
      return;
    }
    for (int64_t i = 0; i < inner; ++i) out[d + i * di] = bfloat16FromFloat(in[s + i * si]);
  });
  return absl::OkStatus();
}

}  // namespace shardcast::daemon
