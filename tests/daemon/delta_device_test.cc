// Delta chunks on a GPU (transport/cuda/delta_kernels.h) where no GPU is: the copy engine of an
// emulated GPU runs the kernels' steps on the host in their order, and the delta must be the
// daemons' own encoding (daemon/engine/delta.h) byte for byte: every unit size, densities from
// nothing changed to most of the chunk, gaps of more than 255 units across tiles, chunks that end
// inside a tile, a delta larger than its cap. Applying a peer's delta on the GPU rebuilds the
// chunk; the tree hash is the host's; a malformed delta is refused before anything is written.
// The [gpu] case runs the CUDA kernels the same way on a real GPU (scripts/device-check.sh).
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "daemon/engine/delta.h"
#include "tests/support/device_buffer.h"
#include "tests/support/gpu.h"
#include "tests/support/kernel_gpu.h"
#include "transport/cuda/delta_kernels.h"
#include "transport/device_copy.h"
#include "transport/emulated_gpus.h"

using namespace shardcast;
using namespace shardcast::daemon;
using namespace shardcast::transport;

namespace {

using Gpu = testing::KernelGpu;

// `units` units of `unit` bytes, and a version of them with about `density` of the units changed
// (a unit changed in one byte only, where it can be, so partial changes count too).
struct Pair {
  std::vector<std::byte> before, now;
};
Pair versions(int64_t units, size_t unit, double density, std::mt19937_64& rng) {
  Pair p;
  p.before.resize(static_cast<size_t>(units) * unit);
  for (auto& b : p.before) b = static_cast<std::byte>(rng());
  p.now = p.before;
  std::bernoulli_distribution change(density);
  for (int64_t u = 0; u < units; ++u)
    if (change(rng)) {
      const size_t at = static_cast<size_t>(u) * unit + rng() % unit;
      p.now[at] = static_cast<std::byte>(static_cast<uint8_t>(p.now[at]) ^ (1 + rng() % 255));
    }
  return p;
}

// The GPU's encoding of `p` against the host's, byte for byte, with the base and hash after it.
void compareEncoding(Gpu& gpu, const Pair& p, size_t unit, size_t cap) {
  const size_t bytes = p.now.size();
  std::vector<std::byte> host_base = p.before, host_out(cap);
  const auto host = encodeDelta(p.now.data(), host_base.data(), bytes, unit, host_out.data(), cap);

  std::byte* now = gpu.allocate(bytes + 1);
  std::byte* base = gpu.allocate(bytes + 1);
  gpu.upload(now, p.now.data(), bytes);
  gpu.upload(base, p.before.data(), bytes);
  std::vector<std::byte> out(cap);
  uint64_t hash = 0;
  auto got = gpu.engine->encodeDelta(now, base, bytes, unit, out.data(), cap, &hash);
  REQUIRE(got.ok());
  REQUIRE(got->has_value() == host.has_value());
  if (host) {
    REQUIRE(**got == *host);
    CHECK((*host == 0 || std::memcmp(out.data(), host_out.data(), *host) == 0));
  }
  std::vector<std::byte> base_after(bytes);
  gpu.download(base_after.data(), base, bytes);
  CHECK(base_after == p.now);  // the base holds `now` either way
  CHECK(hash == treeHash(p.now.data(), static_cast<int64_t>(bytes)));
}

void everyEncoding(Gpu& gpu) {
  std::mt19937_64 rng(51);
  for (const size_t unit : {1, 2, 4, 8})
    for (const int64_t units :
         {int64_t{1}, int64_t{17}, kDeltaTileUnits - 1, kDeltaTileUnits, 3 * kDeltaTileUnits + 17, int64_t{70001}})
      for (const double density : {0.0, 0.0001, 0.003, 0.05, 0.4, 1.0}) {
        INFO("unit " << unit << ", " << units << " units, density " << density);
        const Pair p = versions(units, unit, density, rng);
        compareEncoding(gpu, p, unit, static_cast<size_t>(static_cast<double>(p.now.size()) * kDeltaWorthFraction));
      }
  // Long unchanged runs on both sides of tile boundaries: skip records (255) spanning tiles.
  for (const size_t unit : {1, 2}) {
    Pair p = versions(5 * kDeltaTileUnits, unit, 0.0, rng);
    for (const int64_t u : {int64_t{0}, int64_t{254}, int64_t{255}, int64_t{511}, kDeltaTileUnits - 1,
                            3 * kDeltaTileUnits + 7, 5 * kDeltaTileUnits - 1})
      p.now[static_cast<size_t>(u) * unit] ^= std::byte{0x5a};
    INFO("sparse, unit " << unit);
    compareEncoding(gpu, p, unit, p.now.size());
  }
  // Caps: just enough, one byte short, nothing changed into no room.
  Pair p = versions(2 * kDeltaTileUnits, 2, 0.01, rng);
  std::vector<std::byte> scratch_base = p.before, scratch_out(p.now.size());
  const size_t exact =
      *encodeDelta(p.now.data(), scratch_base.data(), p.now.size(), 2, scratch_out.data(), scratch_out.size());
  compareEncoding(gpu, p, 2, exact);
  compareEncoding(gpu, p, 2, exact - 1);
  const Pair same = versions(100, 4, 0.0, rng);
  compareEncoding(gpu, same, 4, 0);
}

void everyApply(Gpu& gpu) {
  std::mt19937_64 rng(52);
  for (const size_t unit : {1, 2, 8})
    for (const double density : {0.0, 0.001, 0.2}) {
      INFO("unit " << unit << ", density " << density);
      const Pair p = versions(2 * kDeltaTileUnits + 5, unit, density, rng);
      const size_t bytes = p.now.size();
      std::vector<std::byte> host_base = p.before, delta(bytes);
      const auto size = encodeDelta(p.now.data(), host_base.data(), bytes, unit, delta.data(), delta.size());
      REQUIRE(size.has_value());
      std::byte* chunk = gpu.allocate(bytes);
      gpu.upload(chunk, p.before.data(), bytes);
      auto hash = gpu.engine->applyDelta(chunk, bytes, unit, delta.data(), *size);
      REQUIRE(hash.ok());
      CHECK(*hash == treeHash(p.now.data(), static_cast<int64_t>(bytes)));
      std::vector<std::byte> rebuilt(bytes);
      gpu.download(rebuilt.data(), chunk, bytes);
      CHECK(rebuilt == p.now);
    }
  // A peer's malformed delta: refused, and the chunk untouched.
  const Pair p = versions(1000, 2, 0.0, rng);
  std::byte* chunk = gpu.allocate(p.before.size());
  gpu.upload(chunk, p.before.data(), p.before.size());
  const std::vector<std::vector<std::byte>> bad{
      {std::byte{255}, std::byte{255}, std::byte{255}, std::byte{255}},  // skips past the chunk
      {std::byte{3}, std::byte{1}, std::byte{2}, std::byte{7}},          // cut short
  };
  for (const auto& d : bad) {
    auto hash = gpu.engine->applyDelta(chunk, p.before.size(), 2, d.data(), d.size());
    CHECK(hash.status().code() == absl::StatusCode::kInvalidArgument);
  }
  std::vector<std::byte> after(p.before.size());
  gpu.download(after.data(), chunk, after.size());
  CHECK(after == p.before);
}

}  // namespace

TEST_CASE("tree hash: xxHash64 as the reference computes it, and leaves in chained batches",
          "[daemon][delta][emulated-gpu]") {
  std::mt19937_64 rng(53);
  std::vector<std::byte> data((size_t{3} << 20) + 77);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  for (size_t at = 0; at < 8; ++at)
    for (size_t n = 0; n < 300; ++n)
      REQUIRE(xxHash64(data.data() + at, static_cast<int64_t>(n), at * 77) == XXH64(data.data() + at, n, at * 77));
  CHECK(xxHash64(data.data(), static_cast<int64_t>(data.size()), 5) == XXH64(data.data(), data.size(), 5));
  for (const int64_t n : {int64_t{0}, int64_t{1}, kHashLeafBytes, kHashLeafBytes + 1, kHashChainLeaves * kHashLeafBytes,
                          (kHashChainLeaves + 1) * kHashLeafBytes + 5, static_cast<int64_t>(data.size())}) {
    std::vector<uint64_t> leaves(static_cast<size_t>(hashLeaves(n)));
    emulateHashLeaves(data.data(), n, leaves.data());
    CHECK(treeHash(data.data(), n) == treeHashOfLeaves(leaves.data(), static_cast<int64_t>(leaves.size()), n));
  }
  const uint64_t h = treeHash(data.data(), static_cast<int64_t>(data.size()));
  data[(size_t{2} << 20) + 3] ^= std::byte{1};
  CHECK(treeHash(data.data(), static_cast<int64_t>(data.size())) != h);
  CHECK(treeHash(data.data(), 100) != treeHash(data.data(), 101));
}

TEST_CASE("GPU deltas, emulated: the kernels write the daemons' encoding byte for byte and rebuild what they sent",
          "[daemon][delta][emulated-gpu]") {
  EmulatedGpus gpus(1);
  auto engine = gpus.makeEngine(0);
  REQUIRE(engine.ok());
  Gpu gpu = testing::emulatedKernelGpu(gpus, **engine);
  everyEncoding(gpu);
  everyApply(gpu);
  CHECK(gpus.counts().hazards == 0);
  // Only device memory of the engine's GPU, in whole units.
  std::vector<std::byte> host(64);
  uint64_t hash = 0;
  CHECK(engine->get()->encodeDelta(host.data(), host.data(), 64, 2, host.data(), 64, &hash).status().code() ==
        absl::StatusCode::kInvalidArgument);
  std::byte* dev = gpus.allocate(0, 64);
  CHECK(engine->get()->encodeDelta(dev, dev, 63, 2, host.data(), 64, &hash).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(engine->get()->applyDelta(dev, 64, 3, host.data(), 0).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("GPU deltas: the CUDA kernels write the daemons' encoding byte for byte and rebuild what they sent",
          "[daemon][delta][gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  auto engine = makeCudaCopyEngine(0);
  REQUIRE(engine.ok());
  std::vector<std::unique_ptr<testing::DeviceBuffer>> buffers;
  Gpu gpu = testing::cudaKernelGpu(**engine, buffers);
  everyEncoding(gpu);
  everyApply(gpu);
}
