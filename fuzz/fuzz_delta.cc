// Delta chunks (daemon/engine/delta.h): a peer's delta applied to a base must never read or write outside
// either, whatever its bytes; and any pair of chunks must encode to a delta that rebuilds the new
// chunk exactly from the old one (and leaves the old one updated to the new).
//   byte 0: bits 0-1 the unit (1, 2, 4, 8 bytes), bit 2 which property; then the input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "daemon/engine/delta.h"

using namespace shardcast::daemon;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t unit = size_t{1} << (data[0] & 3);
  const auto* in = reinterpret_cast<const std::byte*>(data + 2);
  const size_t n = size - 2;
  if ((data[0] & 4) == 0) {
    // A peer's delta against a base of data[1] units.
    std::vector<std::byte> base(static_cast<size_t>(data[1]) * unit, std::byte{0});
    (void)applyDelta(base.data(), base.size(), unit, in, n);
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
  std::vector<std::byte> rebuilt = old;
  if (!applyDelta(rebuilt.data(), rebuilt.size(), unit, out.data(), *size_out).ok() || rebuilt != now) std::abort();
  return 0;
}
