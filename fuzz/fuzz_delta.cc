// Delta chunks (daemon/engine/delta.h): a peer's delta applied to a base must never read or write outside
// either, whatever its bytes; and any pair of chunks must encode to a delta that rebuilds the new
// chunk exactly from the old one (and leaves the old one updated to the new). The GPU's way
// (transport/cuda/delta_kernels.h, run here as the emulated GPUs run it) must agree with both:
// the same refusals and bytes for a peer's delta, the same delta for a pair of chunks.
//   byte 0: bits 0-1 the unit (1, 2, 4, 8 bytes), bit 2 which property; then the input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "daemon/engine/delta.h"
#include "transport/cuda/delta_kernels.h"

using namespace shardcast::daemon;
namespace transport = shardcast::transport;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t unit = size_t{1} << (data[0] & 3);
  const auto* in = reinterpret_cast<const std::byte*>(data + 2);
  const size_t n = size - 2;
  if ((data[0] & 4) == 0) {
    // A peer's delta against a base of data[1] units.
    std::vector<std::byte> base(static_cast<size_t>(data[1]) * unit, std::byte{0});
    for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<std::byte>(i * 7);
    std::vector<std::byte> on_gpu = base;
    const bool applied = applyDelta(base.data(), base.size(), unit, in, n).ok();
    std::vector<int64_t> units;
    std::vector<std::byte> values;
    const bool parsed = transport::parseDelta(in, n, data[1], static_cast<int32_t>(unit), &units, &values).ok();
    if (applied != parsed) std::abort();
    if (parsed) {
      transport::emulateDeltaScatter(static_cast<int32_t>(unit), on_gpu.data(), units.data(), values.data(),
                                     static_cast<int64_t>(units.size()));
      if (on_gpu != base) std::abort();
    }
    return 0;
  }
  // Two chunks: the first half is the new bytes, the second the old, scaled up by data[1] so that
  // long runs of equal units (the 255 skips) are reached.
  const size_t half = (n / 2) / unit * unit;
  if (half == 0) return 0;
  const size_t repeat = 1 + data[1] % 64;
  std::vector<std::byte> now(half * repeat), before(half * repeat);
  for (size_t r = 0; r < repeat; ++r) {
    std::memcpy(now.data() + r * half, in, half);
    std::memcpy(before.data() + r * half, in + half, half);
  }
  for (size_t i = 0; i + 1 < repeat; ++i) std::memcpy(now.data() + i * half, before.data() + i * half, half);
  const std::vector<std::byte> old = before;
  std::vector<std::byte> out(now.size() * 2 + 16);
  auto size_out = encodeDelta(now.data(), before.data(), now.size(), unit, out.data(), out.size());
  if (!size_out || before != now) std::abort();
  // The GPU's: tiles summarised, placed, written; the same bytes, its base updated too.
  const transport::DeltaPlan plan{static_cast<int64_t>(now.size() / unit), static_cast<int32_t>(unit)};
  std::vector<transport::DeltaTile> tiles(static_cast<size_t>(plan.tiles()));
  std::vector<transport::DeltaTilePlace> places(tiles.size());
  std::vector<std::byte> gpu_base = old, gpu_out(out.size());
  transport::emulateDeltaTiles(plan, now.data(), gpu_base.data(), tiles.data());
  const int64_t gpu_size = transport::deltaPlaceTiles(tiles.data(), plan.tiles(), plan.unit, places.data(),
                                                      static_cast<int64_t>(gpu_out.size()));
  transport::emulateDeltaWrite(plan, now.data(), gpu_base.data(), places.data(), gpu_out.data());
  if (gpu_size != static_cast<int64_t>(*size_out) || gpu_base != now ||
      std::memcmp(gpu_out.data(), out.data(), *size_out) != 0)
    std::abort();
  std::vector<std::byte> rebuilt = old;
  if (!applyDelta(rebuilt.data(), rebuilt.size(), unit, out.data(), *size_out).ok() || rebuilt != now) std::abort();
  return 0;
}
