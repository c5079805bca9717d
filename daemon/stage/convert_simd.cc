// Highway compiles this file once per target (foreach_target.h includes it again for each);
// keep it out of unity builds (daemon/CMakeLists.txt).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "daemon/stage/convert_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// The scalar references (the tails shorter than a vector) come first: foreach_target includes
// this file once per target, and convert.h is guarded.
#include <algorithm>
#include <cmath>

#include "daemon/stage/convert.h"
#include "daemon/stage/convert_simd.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace shardcast::daemon::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;

// A vector of floats from float32 or from bfloat16 bit patterns (their high halves).
HWY_INLINE hn::Vec<DF> loadFloats(DF df, const float* in) { return hn::LoadU(df, in); }
HWY_INLINE hn::Vec<DF> loadFloats(DF df, const uint16_t* in) {
  const DU du;
  const hn::Rebind<uint16_t, DU> du16;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(du16, in))));
}
HWY_INLINE float scalarFloat(float x) { return x; }
HWY_INLINE float scalarFloat(uint16_t b) { return floatFromBfloat16(b); }

void BFloat16FromFloatRow(const float* HWY_RESTRICT in, uint16_t* HWY_RESTRICT out, size_t n) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<uint16_t, DI> du16;
  const size_t lanes = hn::Lanes(df);
  const auto half = hn::Set(du, 0x7fffu), one = hn::Set(du, 1u);
  const auto quiet_nan = hn::Set(di, 0x7fc0);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto x = hn::LoadU(df, in + i);
    const auto u = hn::BitCast(du, x);
    // Round to nearest, ties to even, as bfloat16FromFloat; NaN becomes the quiet NaN 0x7fc0.
    const auto rounded = hn::ShiftRight<16>(hn::Add(hn::Add(u, half), hn::And(hn::ShiftRight<16>(u), one)));
    const auto bits = hn::IfThenElse(hn::RebindMask(di, hn::IsNaN(x)), quiet_nan, hn::BitCast(di, rounded));
    hn::StoreU(hn::DemoteTo(du16, bits), du16, out + i);
  }
  for (; i < n; ++i) out[i] = bfloat16FromFloat(in[i]);
}

// `rows` rows of n elements, row r at in + r * stride: one call per block, the accumulators kept
// across its rows.
template <typename T>
float AmaxRowsT(const T* HWY_RESTRICT in, size_t n, size_t rows, ptrdiff_t stride, bool* nan) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  auto amax = hn::Zero(df);
  auto nans = hn::FirstN(df, 0);
  float out = 0.0f;
  bool any_nan = false;
  for (size_t r = 0; r < rows; ++r) {
    const T* row = in + static_cast<ptrdiff_t>(r) * stride;
    size_t i = 0;
    for (; i + lanes <= n; i += lanes) {
      const auto x = loadFloats(df, row + i);
      nans = hn::Or(nans, hn::IsNaN(x));
      amax = hn::Max(amax, hn::Abs(x));
    }
    for (; i < n; ++i) {
      const float v = std::fabs(scalarFloat(row[i]));
      any_nan = any_nan || std::isnan(v);
      out = std::max(out, v);
    }
  }
  any_nan = any_nan || !hn::AllFalse(df, nans);
  *nan = any_nan;
  return std::max(out, hn::GetLane(hn::MaxOfLanes(df, amax)));
}

float AmaxRows(const float* HWY_RESTRICT in, size_t n, size_t rows, ptrdiff_t stride, bool* nan) {
  return AmaxRowsT(in, n, rows, stride, nan);
}
float AmaxRowsBf16(const uint16_t* HWY_RESTRICT in, size_t n, size_t rows, ptrdiff_t stride, bool* nan) {
  return AmaxRowsT(in, n, rows, stride, nan);
}

// e4m3FromFloat of x / scale clamped to +-448, lane by lane, without branches: the normal
// encoding (exponent rebased from 127 to 7, mantissa rounded from 23 bits to 3, ties to even,
// a carry moving the exponent up) or, below 2^-6, the subnormal one (|x| * 2^9 rounded to
// nearest even, exact), the sign on top; NaN gives 0x7f with its sign.
template <typename T>
void QuantizeRowsT(const T* HWY_RESTRICT in, ptrdiff_t in_stride, uint8_t* HWY_RESTRICT out, ptrdiff_t out_stride,
                   size_t n, size_t rows, float scale) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<uint8_t, DI> du8;
  const size_t lanes = hn::Lanes(df);
  const auto vscale = hn::Set(df, scale), hi = hn::Set(df, 448.0f), lo = hn::Set(df, -448.0f);
  const auto sub_scale = hn::Set(df, 512.0f);
  const auto round_half = hn::Set(du, 0x7ffffu), one = hn::Set(du, 1u), sign_mask = hn::Set(du, 0x80u);
  const auto smallest_normal = hn::Set(di, 0x3c800000), rebias = hn::Set(di, 120 << 3);
  const auto max_finite = hn::Set(di, 0x7e), nan_bits = hn::Set(di, 0x7f);
  for (size_t r = 0; r < rows; ++r, in += in_stride, out += out_stride) {
    size_t i = 0;
    for (; i + lanes <= n; i += lanes) {
      const auto x = hn::Div(loadFloats(df, in + i), vscale);
      const auto sign = hn::BitCast(di, hn::And(hn::ShiftRight<24>(hn::BitCast(du, x)), sign_mask));
      const auto a = hn::Abs(hn::Min(hn::Max(x, lo), hi));  // NaN lanes are replaced below
      const auto ua = hn::BitCast(du, a);
      const auto normal = hn::Min(
          hn::Sub(hn::BitCast(
                      di, hn::ShiftRight<20>(hn::Add(hn::Add(ua, round_half), hn::And(hn::ShiftRight<20>(ua), one)))),
                  rebias),
          max_finite);
      const auto subnormal = hn::ConvertTo(di, hn::Round(hn::Mul(a, sub_scale)));
      auto q = hn::IfThenElse(hn::Lt(hn::BitCast(di, ua), smallest_normal), subnormal, normal);
      q = hn::Or(hn::IfThenElse(hn::RebindMask(di, hn::IsNaN(x)), nan_bits, q), sign);
      hn::StoreU(hn::DemoteTo(du8, q), du8, out + i);
    }
    for (; i < n; ++i) {
      const float x = scalarFloat(in[i]) / scale;
      out[i] = e4m3FromFloat(std::isnan(x) ? x : std::clamp(x, -448.0f, 448.0f));
    }
  }
}

void QuantizeRows(const float* HWY_RESTRICT in, ptrdiff_t in_stride, uint8_t* HWY_RESTRICT out, ptrdiff_t out_stride,
                  size_t n, size_t rows, float scale) {
  QuantizeRowsT(in, in_stride, out, out_stride, n, rows, scale);
}
void QuantizeRowsBf16(const uint16_t* HWY_RESTRICT in, ptrdiff_t in_stride, uint8_t* HWY_RESTRICT out,
                      ptrdiff_t out_stride, size_t n, size_t rows, float scale) {
  QuantizeRowsT(in, in_stride, out, out_stride, n, rows, scale);
}

}  // namespace HWY_NAMESPACE
}  // namespace shardcast::daemon::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace shardcast::daemon::simd {

HWY_EXPORT(BFloat16FromFloatRow);
HWY_EXPORT(AmaxRows);
HWY_EXPORT(AmaxRowsBf16);
HWY_EXPORT(QuantizeRows);
HWY_EXPORT(QuantizeRowsBf16);

void bfloat16FromFloatRow(const float* in, uint16_t* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(BFloat16FromFloatRow)(in, out, n);
}
float amaxRows(const float* in, size_t n, size_t rows, ptrdiff_t stride, bool* nan) {
  return HWY_DYNAMIC_DISPATCH(AmaxRows)(in, n, rows, stride, nan);
}
float amaxRowsBf16(const uint16_t* in, size_t n, size_t rows, ptrdiff_t stride, bool* nan) {
  return HWY_DYNAMIC_DISPATCH(AmaxRowsBf16)(in, n, rows, stride, nan);
}
void quantizeRows(const float* in, ptrdiff_t in_stride, uint8_t* out, ptrdiff_t out_stride, size_t n, size_t rows,
                  float scale) {
  HWY_DYNAMIC_DISPATCH(QuantizeRows)(in, in_stride, out, out_stride, n, rows, scale);
}
void quantizeRowsBf16(const uint16_t* in, ptrdiff_t in_stride, uint8_t* out, ptrdiff_t out_stride, size_t n,
                      size_t rows, float scale) {
  HWY_DYNAMIC_DISPATCH(QuantizeRowsBf16)(in, in_stride, out, out_stride, n, rows, scale);
}

const char* target() {
  // What the dispatch picks: the best target both compiled here and supported by the CPU (better
  // targets are lower bits).
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(targets & -targets);
}

}  // namespace shardcast::daemon::simd
#endif  // HWY_ONCE
