// The CUDA copy engine's decisions (transport/device_copy.h) run on an emulated GPU stream
// (transport/emulated_gpus.h): the same engine code as on a GPU, with host memory standing in
// for device memory and every copy deferred until it is waited for.
#include "transport/device_copy.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <numeric>
#include <random>

#include "transport/emulated_gpus.h"

using namespace shardcast;
using namespace shardcast::transport;

namespace {

// A box inside a buffer of `shape` at corner `at` (row-major, elements).
struct Place {
  std::vector<int64_t> shape, at;
  int64_t offset() const {
    int64_t o = 0;
    for (size_t d = 0; d < shape.size(); ++d) o = o * shape[d] + at[d];
    return o;
  }
  int64_t elements() const { return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()); }
};

Place randomPlace(std::mt19937& rng, const std::vector<int64_t>& extent, bool dense) {
  Place p;
  for (int64_t e : extent) {
    const int64_t pad = dense ? 0 : static_cast<int64_t>(rng() % 4);
    p.shape.push_back(e + pad);
    p.at.push_back(pad == 0 ? 0 : static_cast<int64_t>(rng() % (pad + 1)));
  }
  return p;
}

enum class Where { kHost, kThisGpu, kOtherGpu };

}  // namespace

TEST_CASE("the CUDA copy engine, on an emulated GPU, copies every box as the host engine does",
          "[transport][device-copy]") {
  std::mt19937 rng(20261202);
  auto host = makeHostCopyEngine();
  for (const bool kernels : {true, false}) {
    EmulatedGpus gpus(2);  // the engine's stream is GPU 0's; GPU 1 is another GPU
    auto engine = makeStreamCopyEngine(gpus.stream(0, kernels));
    for (int it = 0; it < 600; ++it) {
      const int nd = 1 + static_cast<int>(rng() % 4);
      std::vector<int64_t> extent;
      for (int d = 0; d < nd; ++d) extent.push_back(1 + static_cast<int64_t>(rng() % (d == nd - 1 ? 24 : 7)));
      const int64_t elem = int64_t{1} << (rng() % 4);
      const auto where_dst = static_cast<Where>(rng() % 3), where_src = static_cast<Where>(rng() % 3);
      const Place dp = randomPlace(rng, extent, rng() % 3 == 0), sp = randomPlace(rng, extent, rng() % 3 == 0);
      auto place = [&](Where w, size_t n) -> std::byte* {
        return w == Where::kThisGpu ? gpus.allocate(0, n) : w == Where::kOtherGpu ? gpus.allocate(1, n) : nullptr;
      };
      const size_t dn = static_cast<size_t>(dp.elements() * elem), sn = static_cast<size_t>(sp.elements() * elem);
      std::vector<std::byte> host_src(sn), host_dst(dn, std::byte{0x5a}), expect(dn, std::byte{0x5a});
      for (auto& b : host_src) b = static_cast<std::byte>(rng());
      std::byte* src = place(where_src, sn);
      std::byte* dst = place(where_dst, dn);
      if (src == nullptr)
        src = host_src.data();
      else
        std::memcpy(src, host_src.data(), sn);
      if (dst == nullptr)
        dst = host_dst.data();
      else
        std::memset(dst, 0x5a, dn);
      auto kind = [](Where w) { return w == Where::kHost ? MemoryKind::kHost : MemoryKind::kCuda; };
      const StridedView dv{dst, kind(where_dst), dp.offset(), denseStrides(dp.shape)};
      const StridedView sv{src, kind(where_src), sp.offset(), denseStrides(sp.shape)};
      REQUIRE(engine->copy(dv, sv, extent, elem).ok());
      REQUIRE(engine->synchronize().ok());
      REQUIRE(host->copy({expect.data(), MemoryKind::kHost, dp.offset(), denseStrides(dp.shape)},
                         {host_src.data(), MemoryKind::kHost, sp.offset(), denseStrides(sp.shape)}, extent, elem)
                  .ok());
      INFO("iteration " << it << ", kernels " << kernels << ", element " << elem << " bytes, dst "
                        << static_cast<int>(where_dst) << ", src " << static_cast<int>(where_src));
      CHECK(std::memcmp(dst, expect.data(), dn) == 0);
    }
    CHECK(gpus.queued() == 0);
  }
}

TEST_CASE("a TP column slice packs to the wire as one kernel and one copy, and unpacks likewise",
          "[transport][device-copy]") {
  // A bf16 [512 x 96] shard on the GPU; its column slice [512 x 40] from column 8 (512 runs of 80 B).
  const int64_t rows = 512, cols = 96, width = 40, elem = 2;
  EmulatedGpus gpu(1);
  auto engine = makeStreamCopyEngine(gpu.stream(0));
  std::byte* shard = gpu.allocate(0, static_cast<size_t>(rows * cols * elem));
  for (int64_t i = 0; i < rows * cols * elem; ++i) shard[i] = static_cast<std::byte>(i * 13 + 1);
  std::vector<std::byte> wire(static_cast<size_t>(rows * width * elem));
  const StridedView slice{shard, MemoryKind::kCuda, 8, {cols, 1}};
  const StridedView dense{wire.data(), MemoryKind::kHost, 0, {width, 1}};
  REQUIRE(engine->copy(dense, slice, {rows, width}, elem).ok());
  REQUIRE(engine->synchronize().ok());
  CHECK(gpu.counts().launches == 1);
  CHECK(gpu.counts().copies == 1);
  for (int64_t r = 0; r < rows; ++r)
    REQUIRE(std::memcmp(wire.data() + r * width * elem, shard + (r * cols + 8) * elem,
                        static_cast<size_t>(width * elem)) == 0);

  // Back into another shard's slice: one copy into scratch, one kernel out of it.
  std::byte* target = gpu.allocate(0, static_cast<size_t>(rows * cols * elem));
  std::memset(target, 0, static_cast<size_t>(rows * cols * elem));
  REQUIRE(engine->copy({target, MemoryKind::kCuda, 8, {cols, 1}}, dense, {rows, width}, elem).ok());
  REQUIRE(engine->synchronize().ok());
  CHECK(gpu.counts().launches == 2);
  CHECK(gpu.counts().copies == 2);
  CHECK(gpu.counts().scratch_allocations == 1);  // the same scratch both ways
  for (int64_t r = 0; r < rows; ++r) {
    REQUIRE(std::memcmp(target + (r * cols + 8) * elem, shard + (r * cols + 8) * elem,
                        static_cast<size_t>(width * elem)) == 0);
    REQUIRE(target[r * cols * elem] == std::byte{0});  // outside the slice: untouched
  }

  SECTION("host memory just as strided: a copy per run, no bounce") {
    std::vector<std::byte> host_shard(static_cast<size_t>(rows * cols * elem));
    const auto before = gpu.counts();
    REQUIRE(engine->copy({host_shard.data(), MemoryKind::kHost, 8, {cols, 1}}, slice, {rows, width}, elem).ok());
    REQUIRE(engine->synchronize().ok());
    CHECK(gpu.counts().launches == before.launches);
    CHECK(gpu.counts().copies == before.copies + rows);
  }
  SECTION("without the kernel: a copy per run") {
    EmulatedGpus plain(1);
    auto no_kernels = makeStreamCopyEngine(plain.stream(0, /*kernels=*/false));
    std::byte* s = plain.allocate(0, static_cast<size_t>(rows * cols * elem));
    REQUIRE(no_kernels->copy(dense, {s, MemoryKind::kCuda, 8, {cols, 1}}, {rows, width}, elem).ok());
    REQUIRE(no_kernels->synchronize().ok());
    CHECK(plain.counts().launches == 0);
    CHECK(plain.counts().copies == rows);
  }
}

TEST_CASE("device copies are issued, not done: a mark covers what was issued before it, no more",
          "[transport][device-copy]") {
  EmulatedGpus gpu(1);
  auto engine = makeStreamCopyEngine(gpu.stream(0));
  std::byte* a = gpu.allocate(0, 4096);
  std::byte* b = gpu.allocate(0, 4096);
  std::memset(a, 1, 4096);
  std::memset(b, 2, 4096);
  std::vector<std::byte> first(4096, std::byte{0}), second(4096, std::byte{0});
  REQUIRE(engine->copy({first.data(), MemoryKind::kHost, 0, {1}}, {a, MemoryKind::kCuda, 0, {1}}, {4096}, 1).ok());
  CHECK(first[0] == std::byte{0});  // issued only
  auto mark = engine->mark();
  REQUIRE(mark.ok());
  REQUIRE(*mark != nullptr);
  REQUIRE(engine->copy({second.data(), MemoryKind::kHost, 0, {1}}, {b, MemoryKind::kCuda, 0, {1}}, {4096}, 1).ok());
  REQUIRE((*mark)->wait().ok());
  CHECK(first[4095] == std::byte{1});
  CHECK(second[0] == std::byte{0});  // issued after the mark
  REQUIRE(engine->synchronize().ok());
  CHECK(second[4095] == std::byte{2});
  // The host engine's copies are done when issued: no mark.
  auto host_mark = makeHostCopyEngine()->mark();
  REQUIRE(host_mark.ok());
  CHECK(*host_mark == nullptr);
}

TEST_CASE("device scratch grows under copies still queued on the old one", "[transport][device-copy]") {
  EmulatedGpus gpu(1);
  auto engine = makeStreamCopyEngine(gpu.stream(0));
  const int64_t cols = 64;
  std::vector<std::vector<std::byte>> outs;
  std::vector<std::byte*> shards;
  for (const int64_t rows : {16, 256, 64}) {
    std::byte* s = gpu.allocate(0, static_cast<size_t>(rows * cols * 4));
    for (int64_t i = 0; i < rows * cols * 4; ++i) s[i] = static_cast<std::byte>(i * 7 + rows);
    shards.push_back(s);
    outs.emplace_back(static_cast<size_t>(rows * 8 * 4));
    REQUIRE(engine
                ->copy({outs.back().data(), MemoryKind::kHost, 0, {8, 1}}, {s, MemoryKind::kCuda, 3, {cols, 1}},
                       {rows, 8}, 4)
                .ok());
  }
  CHECK(gpu.counts().scratch_allocations == 2);  // grown once, for 256 rows
  REQUIRE(engine->synchronize().ok());
  int i = 0;
  for (const int64_t rows : {16, 256, 64}) {
    for (int64_t r = 0; r < rows; ++r)
      REQUIRE(std::memcmp(outs[i].data() + r * 32, shards[i] + (r * cols + 3) * 4, 32) == 0);
    ++i;
  }
}

TEST_CASE("emulated GPUs count a hazard where two streams' queued work touches the same bytes",
          "[transport][device-copy]") {
  EmulatedGpus gpus(1);
  auto a = makeStreamCopyEngine(gpus.stream(0));
  auto b = makeStreamCopyEngine(gpus.stream(0));
  std::byte* x = gpus.allocate(0, 8192);
  std::vector<std::byte> host(8192, std::byte{9}), out(8192);
  const StridedView device{x, MemoryKind::kCuda, 0, {1}};
  REQUIRE(a->copy(device, {host.data(), MemoryKind::kHost, 0, {1}}, {4096}, 1).ok());
  // Another stream reading the bytes still being written: a race on a GPU.
  REQUIRE(b->copy({out.data(), MemoryKind::kHost, 0, {1}}, device, {4096}, 1).ok());
  CHECK(gpus.counts().hazards == 1);
  // Disjoint bytes, or once the writer's work was waited for: none.
  REQUIRE(b->copy({out.data(), MemoryKind::kHost, 0, {1}}, {x, MemoryKind::kCuda, 4096, {1}}, {4096}, 1).ok());
  CHECK(gpus.counts().hazards == 1);
  auto mark = a->mark();
  REQUIRE(mark.ok());
  REQUIRE((*mark)->wait().ok());
  REQUIRE(b->copy({out.data(), MemoryKind::kHost, 0, {1}}, device, {4096}, 1).ok());
  CHECK(gpus.counts().hazards == 1);
  // A kernel's footprint is its runs, not their hull: interleaved column slices do not collide.
  std::byte* m = gpus.allocate(0, 64 * 64 * 4);
  std::vector<std::byte> left(32 * 64 * 4), right(32 * 64 * 4);
  REQUIRE(a->copy({m, MemoryKind::kCuda, 0, {64, 1}}, {left.data(), MemoryKind::kHost, 0, {32, 1}}, {64, 32}, 4).ok());
  REQUIRE(
      b->copy({m, MemoryKind::kCuda, 32, {64, 1}}, {right.data(), MemoryKind::kHost, 0, {32, 1}}, {64, 32}, 4).ok());
  CHECK(gpus.counts().hazards == 1);
  REQUIRE(a->synchronize().ok());
  REQUIRE(b->synchronize().ok());
}
