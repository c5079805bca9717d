#include "transport/cuda/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/strings.h"

namespace shardcast::transport {

StatusOr<Fp8QuantizePlan> planFp8Quantize(const Fp8QuantizeBox& box, uint32_t max_grid) {
  const size_t nd = box.shape.size();
  if (nd == 0 || nd > kMaxCopyDims || box.block.size() != nd || box.lo.size() != nd || box.hi.size() != nd ||
      box.src_strides.size() != nd || box.dst_strides.size() != nd)
    return absl::InvalidArgumentError(strCat("fp8 quantisation: a tensor of ", nd, " dims with a block of ",
                                             box.block.size(), ", a box of ", box.lo.size(), "/", box.hi.size(),
                                             " and strides of ", box.src_strides.size(), "/", box.dst_strides.size(),
                                             " (at most ", kMaxCopyDims, " dims)"));
  Fp8QuantizePlan p;
  p.dims = static_cast<int>(nd);
  p.src_offset = box.src_offset;
  p.dst_offset = box.dst_offset;
  p.bf16 = box.bf16;
  p.pow2 = box.pow2;
  p.scales = box.scales;
  p.given = box.given;
  p.given_amax = box.amax;
  p.blocks = 1;
  for (size_t d = 0; d < nd; ++d) {
    if (box.block[d] <= 0 || box.shape[d] <= 0)
      return absl::InvalidArgumentError(
          strCat("fp8 quantisation: dim ", d, " has shape ", box.shape[d], " and block ", box.block[d]));
    const int64_t limit = box.scales ? (box.shape[d] + box.block[d] - 1) / box.block[d] : box.shape[d];
    if (box.lo[d] < 0 || box.hi[d] > limit || box.lo[d] > box.hi[d])
      return absl::InvalidArgumentError(
          strCat("fp8 quantisation: box [", box.lo[d], ", ", box.hi[d], ") of dim ", d, " leaves [0, ", limit, ")"));
    p.shape[d] = box.shape[d];
    p.block[d] = box.block[d];
    p.lo[d] = box.lo[d];
    p.hi[d] = box.hi[d];
    p.src_stride[d] = box.src_strides[d];
    p.dst_stride[d] = box.dst_strides[d];
    if (box.scales) {
      p.first_block[d] = box.lo[d];
      p.nblocks[d] = box.hi[d] - box.lo[d];
    } else {
      p.first_block[d] = box.lo[d] / box.block[d];
      p.nblocks[d] = box.hi[d] == box.lo[d] ? 0 : (box.hi[d] + box.block[d] - 1) / box.block[d] - p.first_block[d];
    }
    p.blocks *= p.nblocks[d];
  }
  p.grid = static_cast<uint32_t>(std::min<int64_t>(p.blocks, max_grid));
  // (Not with a given amax: only the box is read then, and a vector may reach past it.)
  p.vectors = nd == 2 && !box.given && box.src_strides[1] == 1 && box.src_strides[0] % fp8Vec(p) == 0;
  return p;
}

namespace {

// Block b's amax and NaN flag, its elements in row-major order (a CUDA block's threads reduce
// the same set in another order: max is order-independent).
float blockScaleAt(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, const std::byte* src) {
  int64_t n = 1;
  for (int d = 0; d < p.dims; ++d) n *= bsize[d];
  float amax = 0.0f;
  bool nan = false;
  int64_t g[kMaxCopyDims];
  for (int64_t i = 0; i < n; ++i) {
    fp8Unflatten(p.dims, i, blo, bsize, g);
    const float v = fp8Load(src, fp8SourceOffset(p, g), p.bf16);
    nan = nan || fp8IsNan(v);
    amax = std::fmax(amax, std::fabs(v));
  }
  return fp8Scale(amax, nan, p.pow2);
}

// Calls fn(g, out) for every element g of block b inside the box, out its output offset.
template <typename Fn>
void forEachPart(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, Fn&& fn) {
  int64_t plo[kMaxCopyDims], psize[kMaxCopyDims], g[kMaxCopyDims];
  int64_t n = 1;
  for (int d = 0; d < p.dims; ++d) {
    plo[d] = std::max(blo[d], p.lo[d]);
    psize[d] = std::min(blo[d] + bsize[d], p.hi[d]) - plo[d];
    n *= psize[d];
  }
  for (int64_t i = 0; i < n; ++i) {
    fp8Unflatten(p.dims, i, plo, psize, g);
    int64_t out = p.dst_offset;
    for (int d = 0; d < p.dims; ++d) out += (g[d] - p.lo[d]) * p.dst_stride[d];
    fn(g, out);
  }
}

}  // namespace

namespace {

// The vectorised kernel's two passes over block (blo, bsize), thread by thread as the CUDA block
// runs them (fp8_quantize.cu): the block's scale, and (for weights) its fp8 values in the box.
float vectorScaleAt(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, const std::byte* src) {
  const int64_t n = fp8BlockVectors(p, bsize);
  float amax = 0.0f;
  int nan = 0;
  for (uint32_t t = 0; t < p.threads; ++t)
    for (int64_t i = t; i < n; i += p.threads) fp8VectorAmax(p, blo, bsize, i, src, &amax, &nan);
  return fp8Scale(amax, nan != 0, p.pow2);
}

void vectorQuantize(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, float scale, std::byte* dst,
                    const std::byte* src) {
  const int64_t n = fp8BlockVectors(p, bsize);
  for (uint32_t t = 0; t < p.threads; ++t)
    for (int64_t i = t; i < n; i += p.threads) fp8VectorQuantize(p, blo, bsize, i, scale, dst, src);
}

}  // namespace

void emulateFp8Quantize(const Fp8QuantizePlan& plan, std::byte* dst, const std::byte* src) {
  const Fp8QuantizePlan p = fp8ForMemory(plan, src);
  int64_t blo[kMaxCopyDims], bsize[kMaxCopyDims];
  for (int64_t b = 0; b < p.blocks; ++b) {
    fp8BlockAt(p, b, blo, bsize);
    const bool vectors = fp8VectorBlock(p, blo, bsize);
    const float scale = p.given   ? fp8GivenScale(p)
                        : vectors ? vectorScaleAt(p, blo, bsize, src)
                                  : blockScaleAt(p, blo, bsize, src);
    if (p.scales) {
      int64_t out = p.dst_offset;
      for (int d = 0; d < p.dims; ++d) out += (blo[d] / p.block[d] - p.lo[d]) * p.dst_stride[d];
      std::memcpy(dst + out * 4, &scale, 4);
      continue;
    }
    if (vectors) {
      vectorQuantize(p, blo, bsize, scale, dst, src);
      continue;
    }
    forEachPart(p, blo, bsize, [&](const int64_t* g, int64_t out) {
      dst[out] = static_cast<std::byte>(fp8Quantize(fp8Load(src, fp8SourceOffset(p, g), p.bf16), scale));
    });
  }
}

void fp8QuantizeFootprint(const Fp8QuantizePlan& p, int64_t* src_first, int64_t* src_last, int64_t* dst_first,
                          int64_t* dst_last) {
  // Extremes of an affine map over a box: per dim, the stride times the end that minimises or
  // maximises it.
  // Blocks read whole, or (their amax given) only the box of weights, or nothing (given scales).
  int64_t s_lo = p.src_offset, s_hi = p.src_offset, d_lo = p.dst_offset, d_hi = p.dst_offset;
  const bool reads = !(p.given && p.scales);
  for (int d = 0; d < p.dims; ++d) {
    const int64_t origin = p.scales ? p.lo[d] * p.block[d] : p.lo[d];
    const int64_t first = p.given ? origin : p.first_block[d] * p.block[d];
    const int64_t last = p.given ? (p.scales ? origin : p.hi[d] - 1)
                                 : std::min((p.first_block[d] + p.nblocks[d]) * p.block[d], p.shape[d]) - 1;
    const int64_t a = (first - origin) * p.src_stride[d], b = (last - origin) * p.src_stride[d];
    s_lo += std::min(a, b);
    s_hi += std::max(a, b);
    const int64_t span = (p.hi[d] - p.lo[d] - 1) * p.dst_stride[d];
    d_lo += std::min<int64_t>(0, span);
    d_hi += std::max<int64_t>(0, span);
  }
  const int64_t in = p.bf16 ? 2 : 4, out = p.scales ? 4 : 1;
  *src_first = s_lo * in;
  *src_last = reads ? (s_hi + 1) * in : s_lo * in;
  *dst_first = d_lo * out;
  *dst_last = (d_hi + 1) * out;
}

}  // namespace shardcast::transport
