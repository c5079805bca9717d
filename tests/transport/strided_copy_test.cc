// The strided-copy kernel's geometry and index math (transport/cuda/strided_copy.h), run on the
// CPU word by word exactly as the kernel's threads would, against the host copy engine: random
// boxes inside larger buffers on both sides, every element size, every alignment.
#include "transport/cuda/strided_copy.h"

#include <catch2/catch.hpp>
#include <random>

using namespace shardcast;
using namespace shardcast::transport;

namespace {

struct Side {
  std::vector<int64_t> shape;  // the buffer the box lies in (elements)
  std::vector<int64_t> at;     // the box's corner in it
  int64_t offset() const {
    int64_t o = 0;
    for (size_t d = 0; d < shape.size(); ++d) o = o * shape[d] + at[d];
    return o;
  }
  std::vector<int64_t> strides() const { return denseStrides(shape); }
  int64_t elements() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};

Side randomSide(std::mt19937& rng, const std::vector<int64_t>& extent) {
  Side s;
  for (int64_t e : extent) {
    const int64_t pad = static_cast<int64_t>(rng() % 3 == 0 ? 0 : rng() % 5);
    s.shape.push_back(e + pad);
    s.at.push_back(pad == 0 ? 0 : static_cast<int64_t>(rng() % (pad + 1)));
  }
  return s;
}

}  // namespace

TEST_CASE("strided copy plan: the kernel's words, run on the CPU, copy what the host engine copies",
          "[transport][strided-copy]") {
  std::mt19937 rng(20261201);
  auto host = makeHostCopyEngine();
  for (int it = 0; it < 2000; ++it) {
    const int nd = 1 + static_cast<int>(rng() % 5);
    std::vector<int64_t> extent;
    for (int d = 0; d < nd; ++d) extent.push_back(1 + static_cast<int64_t>(rng() % (d == nd - 1 ? 40 : 6)));
    const int64_t elem = int64_t{1} << (rng() % 4);  // 1, 2, 4, 8 bytes
    const Side ds = randomSide(rng, extent), ss = randomSide(rng, extent);
    std::vector<std::byte> src(static_cast<size_t>(ss.elements() * elem));
    for (auto& b : src) b = static_cast<std::byte>(rng());
    std::vector<std::byte> expect(static_cast<size_t>(ds.elements() * elem), std::byte{0xee});
    std::vector<std::byte> got = expect;
    const StridedView dv{expect.data(), MemoryKind::kHost, ds.offset(), ds.strides()};
    const StridedView sv{src.data(), MemoryKind::kHost, ss.offset(), ss.strides()};
    REQUIRE(host->copy(dv, sv, extent, elem).ok());
    auto plan = planStridedCopy({got.data(), MemoryKind::kCuda, ds.offset(), ds.strides()},
                                {src.data(), MemoryKind::kCuda, ss.offset(), ss.strides()}, extent, elem);
    REQUIRE(plan.ok());
    INFO("extent dims " << nd << ", elem " << elem << ", runs " << plan->runs << " of " << plan->run_bytes
                        << " bytes, word " << plan->word);
    int64_t volume = 1;
    for (int64_t e : extent) volume *= e;
    CHECK(plan->words() * plan->word == volume * elem);
    CHECK(plan->blocks >= 1);
    CHECK(plan->blocks <= 4096);
    // Every access aligned to its word on both sides.
    for (int64_t w = 0; w < plan->words(); w += 7) {
      int64_t d = 0, s = 0;
      stridedCopyWordOffsets(*plan, w, &d, &s);
      CHECK(d % plan->word == 0);
      CHECK(s % plan->word == 0);
    }
    emulateStridedCopy(*plan, got.data(), src.data());
    CHECK(got == expect);
  }
}

TEST_CASE("strided copy plan: merged runs, the widest aligned word, and bad input", "[transport][strided-copy]") {
  // A dense 64 x 32 float box: one run of 8 KiB in 16-byte words.
  auto dense =
      planStridedCopy({nullptr, MemoryKind::kCuda, 0, {32, 1}}, {nullptr, MemoryKind::kCuda, 0, {32, 1}}, {64, 32}, 4);
  REQUIRE(dense.ok());
  CHECK(dense->runs == 1);
  CHECK(dense->run_bytes == 64 * 32 * 4);
  CHECK(dense->word == 16);
  // Columns 8..15 of 64 rows (a TP slice of a fused buffer): 64 runs of 32 bytes.
  auto cols =
      planStridedCopy({nullptr, MemoryKind::kCuda, 0, {8, 1}}, {nullptr, MemoryKind::kCuda, 8, {32, 1}}, {64, 8}, 4);
  REQUIRE(cols.ok());
  CHECK(cols->runs == 64);
  CHECK(cols->run_bytes == 32);
  CHECK(cols->word == 16);
  // An odd offset of bf16 elements: 2-byte words.
  auto odd =
      planStridedCopy({nullptr, MemoryKind::kCuda, 0, {8, 1}}, {nullptr, MemoryKind::kCuda, 3, {32, 1}}, {64, 8}, 2);
  REQUIRE(odd.ok());
  CHECK(odd->word == 2);
  // Bases only 4-byte aligned: at most 4-byte words.
  auto base4 = planStridedCopy({nullptr, MemoryKind::kCuda, 0, {32, 1}}, {nullptr, MemoryKind::kCuda, 0, {32, 1}},
                               {64, 32}, 4, /*base_alignment=*/4);
  REQUIRE(base4.ok());
  CHECK(base4->word == 4);
  // Large: the grid is capped, threads loop.
  auto big = planStridedCopy({nullptr, MemoryKind::kCuda, 0, {1 << 14, 1}},
                             {nullptr, MemoryKind::kCuda, 0, {1 << 15, 1}}, {1 << 14, 1 << 14}, 2);
  REQUIRE(big.ok());
  CHECK(big->blocks == 4096);
  CHECK(big->words() > int64_t{big->blocks} * big->threads);
  // Empty boxes copy nothing; ranks must agree.
  auto empty =
      planStridedCopy({nullptr, MemoryKind::kCuda, 0, {4, 1}}, {nullptr, MemoryKind::kCuda, 0, {4, 1}}, {0, 4}, 4);
  REQUIRE(empty.ok());
  CHECK(empty->words() == 0);
  auto bad = planStridedCopy({nullptr, MemoryKind::kCuda, 0, {1}}, {nullptr, MemoryKind::kCuda, 0, {4, 1}}, {4, 4}, 4);
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
}
