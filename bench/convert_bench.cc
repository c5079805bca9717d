// Conversion throughput on one core, against memcpy in the same run: block-scaled fp8 e4m3 from
// bfloat16 and float32 (128 x 128 blocks, quantizeBox over a whole tensor: each block's amax and
// scale, then its elements) and float32 -> bfloat16 (convertBox), vectorised (Highway, the
// target the CPU dispatches to), beside the scalar element-by-element loops they replace.
// Figures are GB/s of input, best of --repeat runs.
//
//   build/bin/convert_bench [--rows 4096] [--cols 4096] [--repeat 7]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "daemon/stage/convert.h"
#include "daemon/stage/convert_simd.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

// The best of `repeat` runs of fn, in seconds.
double best(int repeat, const std::function<void()>& fn) {
  double out = 1e30;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    out = std::min(out, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return out;
}

// The scalar loops the vectorised rows replaced: per block, its amax element by element, then
// each element's e4m3 (contiguous rows, the same arithmetic as the references).
template <typename T, typename Load>
void scalarQuantize(const T* in, uint8_t* out, int64_t rows, int64_t cols, int64_t block, Load load) {
  for (int64_t br = 0; br < rows; br += block)
    for (int64_t bc = 0; bc < cols; bc += block) {
      float amax = 0.0f;
      for (int64_t r = br; r < std::min(br + block, rows); ++r)
        for (int64_t c = bc; c < std::min(bc + block, cols); ++c)
          amax = std::max(amax, std::fabs(load(in[r * cols + c])));
      const float scale = blockScale(amax, false);
      for (int64_t r = br; r < std::min(br + block, rows); ++r)
        for (int64_t c = bc; c < std::min(bc + block, cols); ++c) {
          const float x = load(in[r * cols + c]) / scale;
          out[r * cols + c] = e4m3FromFloat(std::isnan(x) ? x : std::clamp(x, -448.0f, 448.0f));
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 4096, cols = 4096;
  int repeat = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--rows")
      rows = std::stoll(argv[i + 1]);
    else if (flag == "--cols")
      cols = std::stoll(argv[i + 1]);
    else if (flag == "--repeat")
      repeat = std::stoi(argv[i + 1]);
    else {
      fmt::print(stderr, "unknown flag {} (--rows, --cols, --repeat)\n", flag);
      return 2;
    }
  }
  const int64_t n = rows * cols, block = 128;
  std::vector<float> f32(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : f32) v = normal(rng);
  std::vector<uint16_t> bf16(n);
  simd::bfloat16FromFloatRow(f32.data(), bf16.data(), n);
  std::vector<uint8_t> fp8(n), reference(n);
  std::vector<uint16_t> out16(n);
  std::vector<std::byte> copy(n * 4);

  planner::TensorLayout w;
  w.name = "w";
  w.shape = {rows, cols};
  w.dtype = planner::DType::kFloat8E4M3;
  w.block = {block, block};
  planner::Box box;
  box.ndim = 2;
  box.lo = {0, 0};
  box.hi = {rows, cols};
  const std::vector<int64_t> strides{cols, 1};
  const auto view = [&](void* base) {
    return transport::StridedView{reinterpret_cast<std::byte*>(base), transport::MemoryKind::kHost, 0, strides};
  };
  const auto gbs = [&](double bytes, double s) { return bytes / s / 1e9; };

  fmt::print("convert_bench: {} x {} elements ({:.1f} M), blocks of {} x {}, one core, SIMD target {}\n", rows, cols,
             n / 1e6, block, block, simd::target());
  const double memcpy_bf16 = best(repeat, [&] { std::memcpy(copy.data(), bf16.data(), n * 2); });
  const double memcpy_f32 = best(repeat, [&] { std::memcpy(copy.data(), f32.data(), n * 4); });
  fmt::print("{:<34} {:>9} {:>10}\n", "", "GB/s in", "x memcpy");
  fmt::print("{:<34} {:>9.2f} {:>10}\n", "memcpy (bf16-sized input)", gbs(n * 2.0, memcpy_bf16), "1.00");
  fmt::print("{:<34} {:>9.2f} {:>10}\n", "memcpy (fp32-sized input)", gbs(n * 4.0, memcpy_f32), "1.00");

  const auto report = [&](const char* what, double bytes, double s, double memcpy_s) {
    fmt::print("{:<34} {:>9.2f} {:>10.2f}\n", what, gbs(bytes, s), memcpy_s / s);
  };
  const double q_bf16 = best(repeat, [&] {
    if (!quantizeBox(view(fp8.data()), view(bf16.data()), planner::DType::kBFloat16, box, w).ok()) std::abort();
  });
  report("fp8 e4m3 from bf16, vectorised", n * 2.0, q_bf16, memcpy_bf16);
  const double s_bf16 = best(std::min(repeat, 3), [&] {
    scalarQuantize(bf16.data(), reference.data(), rows, cols, block, [](uint16_t b) { return floatFromBfloat16(b); });
  });
  report("fp8 e4m3 from bf16, scalar loop", n * 2.0, s_bf16, memcpy_bf16);
  if (fp8 != reference) {
    fmt::print(stderr, "convert_bench: the vectorised fp8 bytes differ from the scalar loop's\n");
    return 1;
  }
  // A weight and its scale tensor, as a sync packs them (two calls): the scales reading every
  // block again, or taking the amaxes the values' pass read (BlockAmaxes, one per sync).
  planner::TensorLayout scale;
  scale.name = "w_scale_inv";
  scale.shape = {(rows + block - 1) / block, (cols + block - 1) / block};
  scale.dtype = planner::DType::kFloat32;
  scale.block = w.block;
  scale.scale_of = 0;
  scale.scaled_shape = w.shape;
  std::vector<float> scales(static_cast<size_t>(scale.shape[0] * scale.shape[1])), shared_scales(scales.size());
  planner::Box blocks;
  blocks.ndim = 2;
  blocks.lo = {0, 0};
  blocks.hi = {scale.shape[0], scale.shape[1]};
  const transport::StridedView scale_out{
      reinterpret_cast<std::byte*>(scales.data()), transport::MemoryKind::kHost, 0, {scale.shape[1], 1}};
  const transport::StridedView block_view{
      reinterpret_cast<std::byte*>(bf16.data()), transport::MemoryKind::kHost, 0, {cols * block, block}};
  const double both = best(repeat, [&] {
    if (!quantizeBox(view(fp8.data()), view(bf16.data()), planner::DType::kBFloat16, box, w).ok() ||
        !scaleBox(scale_out, block_view, planner::DType::kBFloat16, blocks, scale).ok())
      std::abort();
  });
  report("fp8 from bf16 + scales, two reads", n * 2.0, both, memcpy_bf16);
  transport::StridedView shared_out = scale_out;
  shared_out.base = reinterpret_cast<std::byte*>(shared_scales.data());
  const double both_shared = best(repeat, [&] {
    BlockAmaxes amaxes(scales.size());
    if (!quantizeBox(view(fp8.data()), view(bf16.data()), planner::DType::kBFloat16, box, w, nullptr, &amaxes).ok() ||
        !scaleBox(shared_out, block_view, planner::DType::kBFloat16, blocks, scale, nullptr, &amaxes).ok())
      std::abort();
  });
  report("fp8 from bf16 + scales, amax shared", n * 2.0, both_shared, memcpy_bf16);
  if (shared_scales != scales) {
    fmt::print(stderr, "convert_bench: the scales from shared amaxes differ from those read again\n");
    return 1;
  }
  const double q_f32 = best(repeat, [&] {
    if (!quantizeBox(view(fp8.data()), view(f32.data()), planner::DType::kFloat32, box, w).ok()) std::abort();
  });
  report("fp8 e4m3 from fp32, vectorised", n * 4.0, q_f32, memcpy_f32);
  const double s_f32 = best(std::min(repeat, 3), [&] {
    scalarQuantize(f32.data(), reference.data(), rows, cols, block, [](float x) { return x; });
  });
  report("fp8 e4m3 from fp32, scalar loop", n * 4.0, s_f32, memcpy_f32);
  if (fp8 != reference) {
    fmt::print(stderr, "convert_bench: the vectorised fp8 bytes differ from the scalar loop's\n");
    return 1;
  }
  const double c_f32 = best(repeat, [&] {
    if (!convertBox(view(out16.data()), planner::DType::kBFloat16, view(f32.data()), planner::DType::kFloat32,
                    {rows, cols})
             .ok())
      std::abort();
  });
  report("fp32 -> bf16, vectorised", n * 4.0, c_f32, memcpy_f32);
  const double cs_f32 = best(std::min(repeat, 3), [&] {
    for (int64_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(copy.data())[i] = bfloat16FromFloat(f32[i]);
  });
  report("fp32 -> bf16, scalar loop", n * 4.0, cs_f32, memcpy_f32);
  if (std::memcmp(copy.data(), out16.data(), n * 2) != 0) {
    fmt::print(stderr, "convert_bench: the vectorised bf16 bytes differ from the scalar loop's\n");
    return 1;
  }
  return 0;
}
