// The GPU quantisation kernel's plan and math (transport/cuda/fp8_quantize.h) where no GPU is:
// the copy engine of an emulated GPU runs them on the host as the kernel would, and the bytes
// must be the host quantiser's (daemon/stage/convert.h), bit for bit: bfloat16 and float32
// sources, every bfloat16 value, boxes that cut blocks (a TP slice, chunk rows), edge blocks,
// power-of-two scales, blocks holding NaN or infinity, the scale tensor, output on the GPU or in
// host memory (through the GPU's scratch), blocks whose amax is given (split between source ranks).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "daemon/stage/convert.h"
#include "tests/support/device_buffer.h"
#include "tests/support/gpu.h"
#include "tests/support/kernel_gpu.h"
#include "transport/cuda/fp8_quantize.h"
#include "transport/device_copy.h"
#include "transport/emulated_gpus.h"

using namespace shardcast;
using namespace shardcast::daemon;
using namespace shardcast::transport;

namespace {

using Gpu = testing::KernelGpu;

planner::Box boxOf(std::vector<int64_t> lo, std::vector<int64_t> hi) {
  planner::Box b;
  b.ndim = static_cast<int>(lo.size());
  for (size_t d = 0; d < lo.size(); ++d) {
    b.lo[d] = lo[d];
    b.hi[d] = hi[d];
  }
  return b;
}

struct Case {
  std::vector<int64_t> shape, block;
  bool bf16 = false, pow2 = false;
};

// Quantises `box` of a row-major tensor on `gpu` (output on the GPU or in host memory) and on
// the host; both outputs dense over the box, compared byte for byte, and the blocks' scales too.
// With `given`: every block's amax is *given (blocks split between source ranks), on both sides.
void compare(Gpu& gpu, const Case& c, const std::vector<float>& values, const planner::Box& box, bool out_on_gpu,
             const float* given = nullptr) {
  const size_t nd = c.shape.size();
  SplitAmax split;
  if (given) {
    int64_t blocks = 1;
    for (size_t d = 0; d < nd; ++d) blocks *= (c.shape[d] + c.block[d] - 1) / c.block[d];
    for (int64_t b = 0; b < blocks; ++b) {
      split.blocks.push_back(b);
      split.amax.push_back(*given);
    }
  }
  const SplitAmax* amaxes = given ? &split : nullptr;
  int64_t n = 1;
  for (int64_t s : c.shape) n *= s;
  std::vector<int64_t> strides(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) strides[d - 1] = strides[d] * c.shape[d];
  const int64_t elem = c.bf16 ? 2 : 4;
  std::byte* src = gpu.allocate(static_cast<size_t>(n * elem));
  std::vector<std::byte> host_src(static_cast<size_t>(n * elem));
  for (int64_t i = 0; i < n; ++i) {
    if (c.bf16) {
      const uint16_t b = bfloat16FromFloat(values[i]);
      std::memcpy(host_src.data() + i * 2, &b, 2);
    } else {
      std::memcpy(host_src.data() + i * 4, &values[i], 4);
    }
  }
  gpu.upload(src, host_src.data(), host_src.size());
  planner::TensorLayout w;
  w.name = "w";
  w.shape = c.shape;
  w.dtype = planner::DType::kFloat8E4M3;
  w.block = c.block;
  w.pow2 = c.pow2;
  const auto sizes = box.sizes();
  int64_t count = 1;
  for (int64_t s : sizes) count *= s;
  const auto dense = denseStrides(sizes);
  int64_t origin = 0;
  for (size_t d = 0; d < nd; ++d) origin += box.lo[d] * strides[d];
  const auto from = c.bf16 ? planner::DType::kBFloat16 : planner::DType::kFloat32;
  std::vector<uint8_t> want(static_cast<size_t>(count), 0xaa);
  REQUIRE(quantizeBox({reinterpret_cast<std::byte*>(want.data()), MemoryKind::kHost, 0, dense},
                      {host_src.data(), MemoryKind::kHost, origin, strides}, from, box, w, amaxes)
              .ok());
  Fp8QuantizeBox q;
  q.shape = c.shape;
  q.block = c.block;
  q.lo.assign(box.lo.begin(), box.lo.begin() + nd);
  q.hi.assign(box.hi.begin(), box.hi.begin() + nd);
  q.src_strides = strides;
  q.bf16 = c.bf16;
  q.pow2 = c.pow2;
  q.given = given != nullptr;
  q.amax = given ? *given : 0.0f;
  std::vector<uint8_t> got(static_cast<size_t>(count), 0x55);
  std::byte* on_gpu = gpu.allocate(static_cast<size_t>(count));
  const StridedView out = out_on_gpu
                              ? StridedView{on_gpu, MemoryKind::kCuda, 0, dense}
                              : StridedView{reinterpret_cast<std::byte*>(got.data()), MemoryKind::kHost, 0, dense};
  const Status launched = gpu.engine->quantizeFp8(out, {src, MemoryKind::kCuda, origin, strides}, q);
  INFO(launched.message());
  REQUIRE(launched.ok());
  REQUIRE(gpu.engine->synchronize().ok());
  if (out_on_gpu) gpu.download(got.data(), on_gpu, got.size());
  REQUIRE(got == want);
  // The scales of every block the box touches, through a view whose element i is block i's first.
  planner::TensorLayout s;
  s.name = "w_scale";
  s.dtype = planner::DType::kFloat32;
  s.block = c.block;
  s.scale_of = 0;
  s.scaled_shape = c.shape;
  s.pow2 = c.pow2;
  std::vector<int64_t> blo(nd), bhi(nd), block_strides(nd);
  int64_t blocks = 1, block_origin = 0;
  for (size_t d = 0; d < nd; ++d) {
    blo[d] = box.lo[d] / c.block[d];
    bhi[d] = (box.hi[d] + c.block[d] - 1) / c.block[d];
    blocks *= bhi[d] - blo[d];
    block_strides[d] = strides[d] * c.block[d];
    block_origin += blo[d] * block_strides[d];
  }
  const auto sbox = boxOf(blo, bhi);
  const auto sdense = denseStrides(sbox.sizes());
  std::vector<float> want_scales(static_cast<size_t>(blocks)), got_scales(static_cast<size_t>(blocks), -1.0f);
  REQUIRE(scaleBox({reinterpret_cast<std::byte*>(want_scales.data()), MemoryKind::kHost, 0, sdense},
                   {host_src.data(), MemoryKind::kHost, block_origin, block_strides}, from, sbox, s, amaxes)
              .ok());
  Fp8QuantizeBox qs = q;
  qs.scales = true;
  qs.lo = blo;
  qs.hi = bhi;
  REQUIRE(gpu.engine
              ->quantizeFp8({reinterpret_cast<std::byte*>(got_scales.data()), MemoryKind::kHost, 0, sdense},
                            {src, MemoryKind::kCuda, block_origin, strides}, qs)
              .ok());
  REQUIRE(gpu.engine->synchronize().ok());
  REQUIRE(std::memcmp(got_scales.data(), want_scales.data(), want_scales.size() * 4) == 0);
}

// Every case of the quantiser on `gpu`.
void everyCase(Gpu& gpu) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Case& c : {Case{{40, 52}, {16, 16}, false, false}, Case{{40, 52}, {16, 16}, true, false},
                        Case{{40, 52}, {16, 16}, true, true}, Case{{6, 30, 20}, {1, 8, 8}, false, true},
                        Case{{300}, {128}, true, false}, Case{{384, 640}, {128, 128}, true, false},
                        Case{{256, 520}, {128, 128}, false, true}}) {
    int64_t n = 1;
    for (int64_t s : c.shape) n *= s;
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    v[3] = std::numeric_limits<float>::quiet_NaN();      // a block holding NaN: every element NaN
    v[n / 2] = -std::numeric_limits<float>::infinity();  // a block holding infinity: scale inf
    v[n - 1] = 0.0f;
    const size_t nd = c.shape.size();
    std::vector<int64_t> zero(nd, 0), mid(c.shape), lo(nd), hi(c.shape);
    for (size_t d = 0; d < nd; ++d) {
      mid[d] = c.shape[d] / 2 + 1;  // cuts blocks
      lo[d] = c.shape[d] / 3;
    }
    for (bool on_gpu : {true, false}) {
      INFO("shape dims " << nd << ", bf16 " << c.bf16 << ", pow2 " << c.pow2 << ", output on the GPU " << on_gpu);
      compare(gpu, c, v, boxOf(zero, c.shape), on_gpu);  // the whole tensor
      compare(gpu, c, v, boxOf(zero, mid), on_gpu);      // a box that cuts blocks
      compare(gpu, c, v, boxOf(lo, hi), on_gpu);         // edge blocks
      // Amaxes given (blocks split between source ranks): a value, zero, NaN, infinity.
      for (const float amax :
           {3.5f, 0.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        INFO("given amax " << amax);
        compare(gpu, c, v, boxOf(lo, mid), on_gpu, &amax);
      }
    }
  }
  // Every bfloat16 value, as one row of 65536 in blocks of 256, scales from 1 to tiny.
  std::vector<float> all(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) all[b] = floatFromBfloat16(static_cast<uint16_t>(b));
  compare(gpu, Case{{0x10000}, {256}, true, false}, all, boxOf({0}, {0x10000}), false);
  compare(gpu, Case{{0x10000}, {256}, true, true}, all, boxOf({100}, {0x10000 - 100}), true);
}

}  // namespace

TEST_CASE("fp8 on the GPU: the kernel's plan and math give the host quantiser's bytes and scales, bit for bit",
          "[daemon][fp8][emulated]") {
  EmulatedGpus gpus(1);
  auto engine = makeStreamCopyEngine(gpus.stream(0));
  Gpu gpu = testing::emulatedKernelGpu(gpus, *engine);
  everyCase(gpu);
  CHECK(gpus.counts().hazards == 0);
  CHECK(gpus.counts().launches > 0);
}

TEST_CASE("fp8 on the GPU: blocks of whole 16-byte vectors take the vectorised path, the others element by element",
          "[daemon][fp8][emulated]") {
  // (everyCase checks the bytes of both paths; this checks which path each block takes.)
  const auto plan = [](bool bf16, int64_t cols, int64_t row_stride, bool given) {
    Fp8QuantizeBox b;
    b.shape = {256, cols};
    b.block = {128, 128};
    b.lo = {0, 0};
    b.hi = {256, cols};
    b.src_strides = {row_stride, 1};
    b.dst_strides = {cols, 1};
    b.bf16 = bf16;
    b.given = given;
    return *planFp8Quantize(b);
  };
  alignas(16) static std::byte memory[64];
  const int64_t whole[2] = {0, 0}, full[2] = {128, 128}, edge_lo[2] = {0, 512}, edge[2] = {128, 8};
  const auto p = fp8ForMemory(plan(true, 520, 520, false), memory);
  CHECK(p.vectors);
  CHECK(fp8VectorBlock(p, whole, full));
  CHECK(fp8VectorBlock(p, edge_lo, edge));  // 8 bf16 columns: one vector per row
  CHECK(fp8BlockVectors(p, full) == 128 * 16);
  const int64_t odd[2] = {128, 4};
  CHECK_FALSE(fp8VectorBlock(fp8ForMemory(plan(true, 516, 516, false), memory), edge_lo, odd));
  CHECK(fp8VectorBlock(fp8ForMemory(plan(false, 516, 516, false), memory), edge_lo, odd));  // 4 float32
  CHECK_FALSE(fp8ForMemory(plan(true, 520, 521, false), memory).vectors);      // rows not whole vectors apart
  CHECK_FALSE(fp8ForMemory(plan(true, 520, 520, true), memory).vectors);       // a given amax reads only the box
  CHECK_FALSE(fp8ForMemory(plan(true, 520, 520, false), memory + 2).vectors);  // a source base off 16 bytes
  int64_t g[2];
  fp8VectorAt(p, whole, full, 17, g);  // row 1, second vector
  CHECK((g[0] == 1 && g[1] == 8));
}

TEST_CASE("fp8 on the GPU: the CUDA kernel gives the host quantiser's bytes and scales, bit for bit",
          "[daemon][fp8][gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  auto engine = makeCudaCopyEngine(0);
  REQUIRE(engine.ok());
  std::vector<std::unique_ptr<testing::DeviceBuffer>> buffers;
  Gpu gpu = testing::cudaKernelGpu(**engine, buffers);
  everyCase(gpu);
}

TEST_CASE("fp8 on the GPU: a GPU without the kernel, or a source on another GPU, is refused by name",
          "[daemon][fp8][emulated]") {
  EmulatedGpus gpus(2);
  auto plain = makeStreamCopyEngine(gpus.stream(0, /*kernels=*/false));
  std::byte* src = gpus.allocate(0, 64);
  std::byte* other = gpus.allocate(1, 64);
  std::vector<uint8_t> out(16);
  Fp8QuantizeBox q;
  q.shape = {16};
  q.block = {16};
  q.lo = {0};
  q.hi = {16};
  q.src_strides = {1};
  const StridedView dst{reinterpret_cast<std::byte*>(out.data()), MemoryKind::kHost, 0, {1}};
  const auto not_built = plain->quantizeFp8(dst, {src, MemoryKind::kCuda, 0, {1}}, q);
  CHECK(not_built.code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(not_built.message()), Catch::Contains("was not built"));
  auto engine = makeStreamCopyEngine(gpus.stream(0));
  const auto elsewhere = engine->quantizeFp8(dst, {other, MemoryKind::kCuda, 0, {1}}, q);
  CHECK(elsewhere.code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(elsewhere.message()), Catch::Contains("device memory of this GPU"));
  q.hi = {17};
  CHECK(engine->quantizeFp8(dst, {src, MemoryKind::kCuda, 0, {1}}, q).code() == absl::StatusCode::kInvalidArgument);
}
