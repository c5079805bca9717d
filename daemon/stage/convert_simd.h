// The conversions' inner loops over contiguous rows, vectorised with Google Highway and
// dispatched at run time to the best target the CPU has (AVX-512, AVX2, SSE4, or scalar
// emulation). Bit for bit what the scalar references in convert.h compute, element by element
// (tests/daemon/fp8_test.cc sweeps every bf16 input, floats across the range, NaN, saturation,
// subnormals and tails shorter than a vector).
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardcast::daemon::simd {

// out[i] = bfloat16FromFloat(in[i]) for i < n.
void bfloat16FromFloatRow(const float* in, uint16_t* out, size_t n);

// The largest |x| of `rows` rows of n floats (or bfloat16 bit patterns), row r at
// in + r * stride (elements); sets *nan when one is NaN (the value returned is then meaningless).
// One call per block: the per-call cost (dispatch, constants, reductions) is paid once for its rows.
float amaxRows(const float* in, size_t n, size_t rows, ptrdiff_t stride, bool* nan);
float amaxRowsBf16(const uint16_t* in, size_t n, size_t rows, ptrdiff_t stride, bool* nan);
inline float amaxRow(const float* in, size_t n, bool* nan) { return amaxRows(in, n, 1, 0, nan); }
inline float amaxRowBf16(const uint16_t* in, size_t n, bool* nan) { return amaxRowsBf16(in, n, 1, 0, nan); }

// out[i] = the e4m3 of in[i] / scale, clamped to +-448 (NaN stays NaN): what quantizeBox does
// per element; `rows` rows of n, row r at in + r * in_stride and out + r * out_stride.
void quantizeRows(const float* in, ptrdiff_t in_stride, uint8_t* out, ptrdiff_t out_stride, size_t n, size_t rows,
                  float scale);
void quantizeRowsBf16(const uint16_t* in, ptrdiff_t in_stride, uint8_t* out, ptrdiff_t out_stride, size_t n,
                      size_t rows, float scale);
inline void quantizeRow(const float* in, uint8_t* out, size_t n, float scale) {
  quantizeRows(in, 0, out, 0, n, 1, scale);
}
inline void quantizeRowBf16(const uint16_t* in, uint8_t* out, size_t n, float scale) {
  quantizeRowsBf16(in, 0, out, 0, n, 1, scale);
}

// The Highway target the dispatch picked on this CPU ("AVX3", "AVX2", ...), for benches and logs.
const char* target();

}  // namespace shardcast::daemon::simd
