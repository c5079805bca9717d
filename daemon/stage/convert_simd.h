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

// The largest |x| of n floats (or bfloat16 bit patterns); sets *nan when one is NaN (the value
// returned is then meaningless).
float amaxRow(const float* in, size_t n, bool* nan);
float amaxRowBf16(const uint16_t* in, size_t n, bool* nan);

// out[i] = the e4m3 of in[i] / scale, clamped to +-448 (NaN stays NaN): what quantizeBox does
// per element.
void quantizeRow(const float* in, uint8_t* out, size_t n, float scale);
void quantizeRowBf16(const uint16_t* in, uint8_t* out, size_t n, float scale);

// The Highway target the dispatch picked on this CPU ("AVX3", "AVX2", ...), for benches and logs.
const char* target();

}  // namespace shardcast::daemon::simd
