// Block-scaled fp8 e4m3 quantisation of device memory as one CUDA kernel launch (see
// fp8_quantize.h): plain data and the math, shared by the kernel (fp8_quantize.cu, compiled by
// nvcc without the rest of the project's headers), its host emulation and the tests. Bit for bit
// the host references (daemon/stage/convert.h): per block, amax over the whole block (cut at the
// tensor's edge), scale = amax / 448 (1 for an all-zero block, rounded up to a power of two with
// pow2, NaN when the block holds NaN), then each element of the box x / scale, clamped to +-448
// and rounded to nearest even e4m3; NaN stays NaN with the sign the host's division gives.
#pragma once

#include <math.h>  // frexpf, ldexpf, fminf, fmaxf: the same names on the host and in device code

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/cuda/strided_copy_plan.h"  // SC_HOST_DEVICE, kMaxCopyDims

namespace shardcast::transport {

struct Fp8QuantizePlan {
  int dims = 0;
  int64_t shape[kMaxCopyDims]{};  // the weight's shape, elements
  int64_t block[kMaxCopyDims]{};  // its block
  // The box written: weight elements [lo, hi) or, with `scales`, block indices [lo, hi).
  int64_t lo[kMaxCopyDims]{}, hi[kMaxCopyDims]{};
  // The weight in the source memory: element g at src_offset + sum((g - origin) * src_stride),
  // origin = lo (weights) or lo * block (scales); elements of the source dtype.
  int64_t src_stride[kMaxCopyDims]{};
  int64_t src_offset = 0;
  // The output: element (or block) i of the box at dst_offset + sum((i - lo) * dst_stride), in
  // e4m3 bytes (weights) or float32 scales.
  int64_t dst_stride[kMaxCopyDims]{};
  int64_t dst_offset = 0;
  bool bf16 = false;    // source dtype: bfloat16, else float32
  bool pow2 = false;    // scales rounded up to powers of two
  bool scales = false;  // write the blocks' scales instead of the fp8 values
  bool given = false;   // every block's amax is given_amax (nothing outside the box is read)
  float given_amax = 0.0f;
  // The blocks the box touches: first_block .. first_block + nblocks (row-major), `blocks` of them.
  int64_t first_block[kMaxCopyDims]{}, nblocks[kMaxCopyDims]{};
  int64_t blocks = 0;
  uint32_t threads = 256;  // per CUDA block: one CUDA block per fp8 block, grid-stride beyond
  uint32_t grid = 0;
  // Blocks may be read a vector (16 bytes: 8 bfloat16 or 4 float32) at a time: a 2-D weight whose
  // rows are contiguous in the source, rows a whole number of vectors apart. Set by the plan,
  // cleared for memory whose base is not 16-byte aligned (fp8ForMemory); per block, also its
  // columns whole vectors and its first element at a vector's start (fp8VectorBlock).
  bool vectors = false;
};

SC_HOST_DEVICE inline uint32_t fp8FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
SC_HOST_DEVICE inline float fp8BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

SC_HOST_DEVICE inline bool fp8IsNan(float f) { return (fp8FloatBits(f) & 0x7fffffffu) > 0x7f800000u; }
SC_HOST_DEVICE inline bool fp8IsInf(float f) { return (fp8FloatBits(f) & 0x7fffffffu) == 0x7f800000u; }

// Element `element` of the source (bfloat16 bit patterns or float32), as float.
SC_HOST_DEVICE inline float fp8Load(const std::byte* src, int64_t element, bool bf16) {
  if (bf16) {
    uint16_t b;
    memcpy(&b, src + element * 2, 2);
    return fp8BitsFloat(static_cast<uint32_t>(b) << 16);
  }
  float f;
  memcpy(&f, src + element * 4, 4);
  return f;
}

// The scale of a block whose largest magnitude is `amax` (`nan`: the block holds NaN).
SC_HOST_DEVICE inline float fp8Scale(float amax, bool nan, bool pow2) {
  if (nan) return fp8BitsFloat(0x7fc00000u);
  if (amax == 0.0f) return 1.0f;
  const float s = amax / 448.0f;
  if (!pow2 || fp8IsInf(s)) return s;
  int e = 0;
  const float m = frexpf(s, &e);  // s = m * 2^e, m in [0.5, 1)
  return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

// The e4m3 code of x / scale clamped to +-448. NaN in x keeps its sign, a NaN scale gives a
// positive NaN and inf / inf a negative one, as the host's (x86) division does; a GPU's division
// would give its canonical NaN.
SC_HOST_DEVICE inline uint8_t fp8Quantize(float x, float scale) {
  const uint32_t xb = fp8FloatBits(x);
  if (fp8IsNan(x)) return static_cast<uint8_t>(((xb >> 24) & 0x80u) | 0x7fu);
  if (fp8IsNan(scale)) return 0x7f;
  float q = x / scale;
  if (fp8IsNan(q)) return 0xff;  // inf / inf: the host's default NaN is negative
  const uint32_t sign = (fp8FloatBits(q) >> 24) & 0x80u;
  q = fminf(fmaxf(q, -448.0f), 448.0f);
  const uint32_t a = fp8FloatBits(q) & 0x7fffffffu;
  if (a < 0x3c800000u) {  // below 2^-6: a subnormal, |q| * 2^9 rounded to nearest even (exact)
    const float scaled = fp8BitsFloat(a) * 512.0f;
    uint32_t m = static_cast<uint32_t>(scaled);
    const float frac = scaled - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: exponent rebased from 127 to 7, mantissa from 23 bits to 3, ties to even.
  uint32_t code = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<uint8_t>(sign | code);
}

// The scale of every block when the plan gives their amax.
SC_HOST_DEVICE inline float fp8GivenScale(const Fp8QuantizePlan& p) {
  return fp8Scale(p.given_amax, fp8IsNan(p.given_amax), p.pow2);
}

// Block b (0 <= b < plan.blocks, row-major over nblocks): its first element and its size (cut
// at the tensor's edge).
SC_HOST_DEVICE inline void fp8BlockAt(const Fp8QuantizePlan& p, int64_t b, int64_t* lo, int64_t* size) {
  for (int d = p.dims - 1; d >= 0; --d) {
    const int64_t k = p.first_block[d] + b % p.nblocks[d];
    b /= p.nblocks[d];
    lo[d] = k * p.block[d];
    const int64_t end = lo[d] + p.block[d] < p.shape[d] ? lo[d] + p.block[d] : p.shape[d];
    size[d] = end - lo[d];
  }
}

// The source element offset of weight element g.
SC_HOST_DEVICE inline int64_t fp8SourceOffset(const Fp8QuantizePlan& p, const int64_t* g) {
  int64_t off = p.src_offset;
  for (int d = 0; d < p.dims; ++d) off += (g[d] - (p.scales ? p.lo[d] * p.block[d] : p.lo[d])) * p.src_stride[d];
  return off;
}

// Element i (row-major) of a box of `size` starting at `lo`, into g.
SC_HOST_DEVICE inline void fp8Unflatten(int dims, int64_t i, const int64_t* lo, const int64_t* size, int64_t* g) {
  for (int d = dims - 1; d >= 0; --d) {
    g[d] = lo[d] + i % size[d];
    i /= size[d];
  }
}

// ---- the vectorised path (fp8_quantize.cu; emulateFp8Quantize runs the same index math) ----
//
// A block that qualifies is read as vectors of fp8Vec elements: vector i of the block (row-major
// over its rows and its columns' vectors) is handled by thread i % threads, in both passes (its
// amax, then its fp8 values); a vector wholly inside the box, at an output offset that is a
// multiple of its size, is written with one store, else element by element.

// Elements per 16-byte vector of the source dtype.
SC_HOST_DEVICE inline int fp8Vec(const Fp8QuantizePlan& p) { return p.bf16 ? 8 : 4; }

// The plan for memory at these bases: without vectors where the source base is not 16-byte aligned
// (the output is stored a vector at a time only where its offset allows, fp8VectorOut).
SC_HOST_DEVICE inline Fp8QuantizePlan fp8ForMemory(Fp8QuantizePlan p, const std::byte* src_base) {
  if (reinterpret_cast<uintptr_t>(src_base) % 16 != 0) p.vectors = false;
  return p;
}

// Whether block (blo, bsize) is read as vectors.
SC_HOST_DEVICE inline bool fp8VectorBlock(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize) {
  const int v = fp8Vec(p);
  return p.vectors && bsize[1] % v == 0 && fp8SourceOffset(p, blo) % v == 0;
}

// The vectors of a block that qualifies.
SC_HOST_DEVICE inline int64_t fp8BlockVectors(const Fp8QuantizePlan& p, const int64_t* bsize) {
  return bsize[0] * (bsize[1] / fp8Vec(p));
}

// Vector i of block (blo, bsize): the weight element g it starts at.
SC_HOST_DEVICE inline void fp8VectorAt(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, int64_t i,
                                       int64_t* g) {
  const int64_t per_row = bsize[1] / fp8Vec(p);
  g[0] = blo[0] + i / per_row;
  g[1] = blo[1] + (i % per_row) * fp8Vec(p);
}

// The vector of source elements at element offset `element` (a multiple of fp8Vec), as floats.
SC_HOST_DEVICE inline void fp8LoadVector(const std::byte* src, int64_t element, bool bf16, float* out) {
#ifdef __CUDA_ARCH__
  const uint4 w = *reinterpret_cast<const uint4*>(src + element * (bf16 ? 2 : 4));  // one 16-byte load
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#else
  uint32_t words[4];
  memcpy(words, src + element * (bf16 ? 2 : 4), 16);
#endif
  for (int k = 0; k < 4; ++k) {
    if (bf16) {
      out[2 * k] = fp8BitsFloat(words[k] << 16);
      out[2 * k + 1] = fp8BitsFloat(words[k] & 0xffff0000u);
    } else {
      out[k] = fp8BitsFloat(words[k]);
    }
  }
}

// Of the vector starting at weight element g: how many of its elements, from the first, lie in
// the box's columns (0 when its row is outside the box), and where the first of them is written.
SC_HOST_DEVICE inline int fp8VectorPart(const Fp8QuantizePlan& p, const int64_t* g, int64_t* first_col) {
  if (g[0] < p.lo[0] || g[0] >= p.hi[0]) return 0;
  const int v = fp8Vec(p);
  const int64_t lo = g[1] > p.lo[1] ? g[1] : p.lo[1];
  const int64_t hi = g[1] + v < p.hi[1] ? g[1] + v : p.hi[1];
  *first_col = lo;
  return hi > lo ? static_cast<int>(hi - lo) : 0;
}

// Whether the whole vector at g is written with one store of fp8Vec bytes at output offset `out`.
SC_HOST_DEVICE inline bool fp8VectorOut(const Fp8QuantizePlan& p, const int64_t* g, int part, int64_t first_col,
                                        int64_t out, const std::byte* dst_base) {
  const int v = fp8Vec(p);
  return part == v && first_col == g[1] && p.dst_stride[1] == 1 &&
         (reinterpret_cast<uintptr_t>(dst_base) + static_cast<uintptr_t>(out)) % static_cast<uintptr_t>(v) == 0;
}

// Pass 1 for vector i of block (blo, bsize): its elements into the running amax and NaN flag.
SC_HOST_DEVICE inline void fp8VectorAmax(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, int64_t i,
                                         const std::byte* src, float* amax, int* nan) {
  int64_t g[kMaxCopyDims];
  float v[8];
  fp8VectorAt(p, blo, bsize, i, g);
  fp8LoadVector(src, fp8SourceOffset(p, g), p.bf16, v);
  for (int k = 0; k < fp8Vec(p); ++k) {
    *nan |= fp8IsNan(v[k]) ? 1 : 0;
    *amax = fmaxf(*amax, fabsf(v[k]));
  }
}

// Pass 2 for vector i of block (blo, bsize): its elements inside the box quantised with `scale`
// into the output, with one store where fp8VectorOut allows, else element by element.
SC_HOST_DEVICE inline void fp8VectorQuantize(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize,
                                             int64_t i, float scale, std::byte* dst, const std::byte* src) {
  int64_t g[kMaxCopyDims];
  fp8VectorAt(p, blo, bsize, i, g);
  int64_t first = 0;
  const int part = fp8VectorPart(p, g, &first);
  if (part == 0) return;
  float v[8];
  fp8LoadVector(src, fp8SourceOffset(p, g), p.bf16, v);
  const int64_t out = p.dst_offset + (g[0] - p.lo[0]) * p.dst_stride[0] + (first - p.lo[1]) * p.dst_stride[1];
  if (fp8VectorOut(p, g, part, first, out, dst)) {
    uint32_t words[2] = {0, 0};
    for (int k = 0; k < part; ++k) words[k / 4] |= static_cast<uint32_t>(fp8Quantize(v[k], scale)) << (8 * (k % 4));
#ifdef __CUDA_ARCH__
    if (part == 8)
      *reinterpret_cast<uint2*>(dst + out) = make_uint2(words[0], words[1]);  // one 8-byte store
    else
      *reinterpret_cast<uint32_t*>(dst + out) = words[0];  // one 4-byte store
#else
    memcpy(dst + out, words, static_cast<size_t>(part));
#endif
    return;
  }
  const int skip = static_cast<int>(first - g[1]);
  for (int k = 0; k < part; ++k)
    dst[out + k * p.dst_stride[1]] = static_cast<std::byte>(fp8Quantize(v[skip + k], scale));
}

}  // namespace shardcast::transport
