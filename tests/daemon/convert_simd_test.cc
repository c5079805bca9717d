// The vectorised conversion rows (daemon/stage/convert_simd.h) against the scalar references of
// convert.h, element by element, on every SIMD target this build compiled and the CPU runs
// (Highway's test hook makes each one the dispatched target in turn): every bfloat16 input,
// float32 bit patterns across the whole range, round-to-even ties, NaN of both signs, infinities,
// saturation, subnormals, power-of-two scales, and row lengths that leave tails shorter than a
// vector.
#include "daemon/stage/convert_simd.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "daemon/stage/convert.h"
#include "hwy/targets.h"

using namespace shardcast::daemon;

namespace {

float fromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Float32 inputs: a stride through every bit pattern, both signs, plus the edges that matter
// (ties of each rounding, the subnormal/normal border of e4m3, saturation, NaN, infinity).
std::vector<float> floatSweep() {
  std::vector<float> out;
  for (uint64_t u = 0; u < (1ull << 32); u += 40961) out.push_back(fromBits(static_cast<uint32_t>(u)));
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t low :
         {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u, 0x7ffffu, 0x80000u, 0x80001u, 0x180000u, 0x7fffffu})
      for (uint32_t sign : {0u, 0x80000000u}) out.push_back(fromBits(sign | (e << 23) | low));
  for (float x : {0.0f, -0.0f, 448.0f, -448.0f, 464.0f, 480.0f, 1e30f, 0x1p-6f, 0x1p-7f, 0x1p-9f, 0x1p-10f, 0x1.8p-10f,
                  0x1.4p-9f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min()})
    out.push_back(x);
  return out;
}

std::vector<uint16_t> everyBfloat16() {
  std::vector<uint16_t> out(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) out[b] = static_cast<uint16_t>(b);
  return out;
}

uint8_t referenceQuantize(float x, float scale) {
  const float q = x / scale;
  return e4m3FromFloat(std::isnan(q) ? q : std::clamp(q, -448.0f, 448.0f));
}

// Runs `check` once per SIMD target compiled here that this CPU supports, each dispatched in turn.
template <typename Fn>
void onEveryTarget(Fn&& check) {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  REQUIRE_FALSE(targets.empty());
  for (const int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    INFO("target " << hwy::TargetName(target) << " (dispatched: " << simd::target() << ")");
    REQUIRE(std::string(simd::target()) == hwy::TargetName(target));
    check();
  }
  hwy::SetSupportedTargetsForTest(0);
}

const std::vector<float> kScales{1.0f, 3.0f / 448.0f, 0x1p-7f, 1e-3f, 0.3f, 7.5f, 1e-30f, 1e30f};

}  // namespace

TEST_CASE("simd conversions: float32 to bfloat16 is bfloat16FromFloat on every input and every target",
          "[daemon][fp8][simd]") {
  const auto in = floatSweep();
  onEveryTarget([&] {
    std::vector<uint16_t> out(in.size() + 1, 0xabcd);
    simd::bfloat16FromFloatRow(in.data(), out.data(), in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      INFO("input bits 0x" << std::hex << [&] {
        uint32_t u;
        std::memcpy(&u, &in[i], 4);
        return u;
      }());
      REQUIRE(out[i] == bfloat16FromFloat(in[i]));
    }
    CHECK(out[in.size()] == 0xabcd);   // nothing written past the row
    for (size_t n = 0; n < 70; ++n) {  // every tail length
      std::vector<uint16_t> row(n + 1, 0xabcd);
      simd::bfloat16FromFloatRow(in.data() + 1000, row.data(), n);
      for (size_t i = 0; i < n; ++i) REQUIRE(row[i] == bfloat16FromFloat(in[1000 + i]));
      REQUIRE(row[n] == 0xabcd);
    }
  });
}

TEST_CASE("simd conversions: e4m3 quantisation equals the scalar reference for every bfloat16 and float input",
          "[daemon][fp8][simd]") {
  const auto bf16 = everyBfloat16();
  const auto floats = floatSweep();
  onEveryTarget([&] {
    for (const float scale : kScales) {
      INFO("scale " << scale);
      std::vector<uint8_t> out(bf16.size() + 1, 0xaa);
      simd::quantizeRowBf16(bf16.data(), out.data(), bf16.size(), scale);
      for (size_t b = 0; b < bf16.size(); ++b) {
        INFO("bfloat16 0x" << std::hex << b);
        REQUIRE(out[b] == referenceQuantize(floatFromBfloat16(bf16[b]), scale));
      }
      CHECK(out[bf16.size()] == 0xaa);
      std::vector<uint8_t> fout(floats.size(), 0xaa);
      simd::quantizeRow(floats.data(), fout.data(), floats.size(), scale);
      for (size_t i = 0; i < floats.size(); ++i) {
        INFO("float " << floats[i]);
        REQUIRE(fout[i] == referenceQuantize(floats[i], scale));
      }
    }
    // A NaN scale (a block holding NaN) makes every element NaN.
    std::vector<uint8_t> out(20);
    simd::quantizeRow(floats.data(), out.data(), out.size(), std::numeric_limits<float>::quiet_NaN());
    for (size_t i = 0; i < out.size(); ++i)
      REQUIRE(out[i] == referenceQuantize(floats[i], std::numeric_limits<float>::quiet_NaN()));
    for (size_t n = 0; n < 70; ++n) {  // every tail length
      std::vector<uint8_t> row(n + 1, 0xaa);
      simd::quantizeRowBf16(bf16.data() + 0x3c00, row.data(), n, 0x1p-3f);
      for (size_t i = 0; i < n; ++i) REQUIRE(row[i] == referenceQuantize(floatFromBfloat16(bf16[0x3c00 + i]), 0x1p-3f));
      REQUIRE(row[n] == 0xaa);
    }
  });
}

// Inputs whose quotient x / scale lies on, or a few ulp either side of, every rounding boundary
// of e4m3 (each midpoint of the normal range, each of the subnormal grid, 2^-10, 448), for scales
// that are not powers of two: where a kernel computing the quotient any other way than the
// reference's one division (a reciprocal, a fused multiply) would round to another value.
TEST_CASE("simd conversions: e4m3 quantisation equals the reference next to every rounding boundary",
          "[daemon][fp8][simd]") {
  std::vector<float> boundaries;
  for (int e = -6; e <= 8; ++e)  // normal range: midpoints between m/8 and (m+1)/8 of each binade
    for (int m = 0; m < 8; ++m) boundaries.push_back(std::ldexp(1.0f + (2.0f * m + 1.0f) / 16.0f, e));
  for (int k = 1; k < 16; k += 2) boundaries.push_back(std::ldexp(static_cast<float>(k), -10));  // subnormal grid
  boundaries.push_back(448.0f);
  std::mt19937 rng(34);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::vector<float> scales{3.0f / 448.0f, 0.3f, 7.5f, 1e-3f, 1e-30f, 1e30f};
  for (int i = 0; i < 24; ++i) scales.push_back(std::ldexp(mantissa(rng), static_cast<int>(rng() % 40) - 20));
  for (const float scale : scales) {
    std::vector<float> in;  // x whose x / scale is each boundary, then x a few ulp either side
    for (const float b : boundaries)
      for (const float sign : {1.0f, -1.0f}) {
        float x = sign * b * scale, below = x, above = x;
        in.push_back(x);
        for (int k = 0; k < 12; ++k) {
          below = std::nextafter(below, 0.0f);
          above = std::nextafter(above, sign * std::numeric_limits<float>::infinity());
          in.push_back(below);
          in.push_back(above);
        }
      }
    onEveryTarget([&] {
      INFO("scale " << scale);
      std::vector<uint8_t> out(in.size());
      simd::quantizeRow(in.data(), out.data(), in.size(), scale);
      for (size_t i = 0; i < in.size(); ++i) {
        INFO("x " << in[i] << " x / scale " << in[i] / scale);
        REQUIRE(out[i] == referenceQuantize(in[i], scale));
      }
    });
  }
}

TEST_CASE("simd conversions: a row's amax is the largest magnitude, and a NaN anywhere is reported",
          "[daemon][fp8][simd]") {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  onEveryTarget([&] {
    for (size_t n : {0, 1, 3, 7, 8, 15, 16, 17, 31, 64, 127, 128, 129, 1000}) {
      std::vector<float> x(n);
      for (auto& v : x) v = normal(rng);
      std::vector<uint16_t> b(n);
      for (size_t i = 0; i < n; ++i) b[i] = bfloat16FromFloat(x[i]);
      float want = 0.0f, want_b = 0.0f;
      for (size_t i = 0; i < n; ++i) {
        want = std::max(want, std::fabs(x[i]));
        want_b = std::max(want_b, std::fabs(floatFromBfloat16(b[i])));
      }
      bool nan = true;
      INFO("n " << n);
      CHECK(simd::amaxRow(x.data(), n, &nan) == want);
      CHECK_FALSE(nan);
      CHECK(simd::amaxRowBf16(b.data(), n, &nan) == want_b);
      CHECK_FALSE(nan);
      for (size_t at = 0; at < n; at += std::max<size_t>(1, n / 5)) {  // a NaN in the body or the tail
        auto y = x;
        y[at] = -std::numeric_limits<float>::quiet_NaN();
        simd::amaxRow(y.data(), n, &nan);
        CHECK(nan);
        auto c = b;
        c[at] = 0x7fc1;
        simd::amaxRowBf16(c.data(), n, &nan);
        CHECK(nan);
      }
      if (n > 0) {  // an infinity is a magnitude like any other
        auto y = x;
        y[n - 1] = -std::numeric_limits<float>::infinity();
        CHECK(std::isinf(simd::amaxRow(y.data(), n, &nan)));
        CHECK_FALSE(nan);
      }
    }
  });
}

TEST_CASE("simd conversions: a block's rows in one call are its rows one by one", "[daemon][fp8][simd]") {
  // Rows of n elements, `stride` apart, in and out: amaxRows is the largest of the rows' amaxes
  // (a NaN in any row reported), quantizeRows writes what quantizeRow writes row by row, and
  // nothing between the rows.
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  onEveryTarget([&] {
    for (size_t n : {1, 7, 16, 33, 128}) {
      for (size_t rows : {1, 2, 5, 128}) {
        const ptrdiff_t stride = static_cast<ptrdiff_t>(n + 3);
        std::vector<float> x(rows * static_cast<size_t>(stride));
        for (auto& v : x) v = normal(rng);
        std::vector<uint16_t> b(x.size());
        for (size_t i = 0; i < x.size(); ++i) b[i] = bfloat16FromFloat(x[i]);
        float want = 0.0f, want_b = 0.0f;
        bool nan = true;
        for (size_t r = 0; r < rows; ++r) {
          want = std::max(want, simd::amaxRow(x.data() + r * stride, n, &nan));
          want_b = std::max(want_b, simd::amaxRowBf16(b.data() + r * stride, n, &nan));
        }
        INFO("n " << n << ", rows " << rows);
        CHECK(simd::amaxRows(x.data(), n, rows, stride, &nan) == want);
        CHECK_FALSE(nan);
        CHECK(simd::amaxRowsBf16(b.data(), n, rows, stride, &nan) == want_b);
        CHECK_FALSE(nan);
        auto y = x;
        y[(rows - 1) * static_cast<size_t>(stride) + n - 1] = std::numeric_limits<float>::quiet_NaN();
        simd::amaxRows(y.data(), n, rows, stride, &nan);
        CHECK(nan);

        const float scale = want_b / 448.0f;
        std::vector<uint8_t> one(x.size(), 0xee), all(x.size(), 0xee);
        for (size_t r = 0; r < rows; ++r)
          simd::quantizeRowBf16(b.data() + r * stride, one.data() + r * stride, n, scale);
        simd::quantizeRowsBf16(b.data(), stride, all.data(), stride, n, rows, scale);
        CHECK(all == one);
        std::fill(one.begin(), one.end(), 0xee);
        std::fill(all.begin(), all.end(), 0xee);
        for (size_t r = 0; r < rows; ++r) simd::quantizeRow(x.data() + r * stride, one.data() + r * stride, n, scale);
        simd::quantizeRows(x.data(), stride, all.data(), stride, n, rows, scale);
        CHECK(all == one);
      }
    }
  });
}
