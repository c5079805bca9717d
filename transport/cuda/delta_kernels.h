// Delta chunks and their tree hash computed on a GPU (issue 51): the kernels of
// transport/cuda/delta_plan.h (its comment says how the format is written in parallel), their
// launches, and the same work on the host in the kernels' order, which the emulated GPUs run
// (tests/transport/delta_kernels_test.cc checks it against the daemons' own encoder, byte for byte).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/strings.h"
#include "transport/cuda/delta_plan.h"

namespace shardcast::transport {

// Launches on `stream` (a cudaStream_t; every pointer device memory of the stream's GPU). Each
// returns the cudaError_t of the launch (0: launched) or kStridedCopyNotBuilt where the kernels
// were not compiled (delta_kernels_none.cc).
// Step 1: every tile's summary into `tiles` (plan.tiles() of them).
int launchDeltaTilesKernel(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles,
                           void* stream);
// Step 3: every tile's records at `places` (deltaPlaceTiles) into `out`, and `now`'s changed units
// into `base`.
int launchDeltaWriteKernel(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                           std::byte* out, void* stream);
// A parsed delta applied: unit units[i] of `chunk` becomes values[i * unit, (i + 1) * unit).
int launchDeltaScatterKernel(int32_t unit, std::byte* chunk, const int64_t* units, const std::byte* values,
                             int64_t count, void* stream);
// hashLeaf of every leaf of `bytes` at `data` into `leaves` (hashLeaves(bytes) of them).
int launchHashLeavesKernel(const std::byte* data, int64_t bytes, uint64_t* leaves, void* stream);

// The same on the host, tile by tile and thread by thread in the kernels' order.
void emulateDeltaTiles(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles);
void emulateDeltaWrite(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                       std::byte* out);
void emulateDeltaScatter(int32_t unit, std::byte* chunk, const int64_t* units, const std::byte* values, int64_t count);
void emulateHashLeaves(const std::byte* data, int64_t bytes, uint64_t* leaves);

// Walks a delta from a peer (untrusted): fn(u, value) for every changed unit u (< `units`) and its
// `unit` bytes, in order. INVALID_ARGUMENT when a record points past the chunk or is cut short
// (fn has then been called for the records before it).
template <typename Fn>
Status forEachDeltaRecord(const std::byte* delta, size_t delta_bytes, int64_t units, int32_t unit, Fn&& fn) {
  int64_t u = 0;
  size_t p = 0;
  while (p < delta_bytes) {
    const auto g = static_cast<uint8_t>(delta[p++]);
    u += g;
    if (u > units) return absl::InvalidArgumentError(strCat("delta: skips past unit ", units, " of the chunk"));
    if (g == kDeltaSkipByte) continue;
    if (u == units) return absl::InvalidArgumentError(strCat("delta: a value past unit ", units, " of the chunk"));
    if (delta_bytes - p < static_cast<size_t>(unit))
      return absl::InvalidArgumentError(strCat("delta: cut short at byte ", p, " of ", delta_bytes));
    fn(u, delta + p);
    p += static_cast<size_t>(unit);
    ++u;
  }
  return absl::OkStatus();
}

// The units a delta changes and their values, in order (forEachDeltaRecord's checks).
Status parseDelta(const std::byte* delta, size_t delta_bytes, int64_t units, int32_t unit,
                  std::vector<int64_t>* changed, std::vector<std::byte>* values);

}  // namespace shardcast::transport
