// The delta kernels' work on the host, in their order (the emulated GPUs run it), and the parser
// of a peer's delta (transport/cuda/delta_kernels.h).
#include "transport/cuda/delta_kernels.h"

#include <algorithm>
#include <cstring>

#include "common/strings.h"

namespace shardcast::transport {

namespace {

// Thread `t` of tile `tile`: its units.
void threadUnits(const DeltaPlan& plan, int64_t tile, int t, int64_t* begin, int64_t* end) {
  *begin = std::min(plan.units, tile * kDeltaTileUnits + int64_t{t} * kDeltaThreadUnits);
  *end = std::min(plan.units, *begin + kDeltaThreadUnits);
}

}  // namespace

void emulateDeltaTiles(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles) {
  for (int64_t tile = 0; tile < plan.tiles(); ++tile) {
    DeltaTile sum;  // the kernel's thread 0 combines the threads' summaries in order
    for (int t = 0; t < kDeltaThreads; ++t) {
      int64_t begin, end;
      threadUnits(plan, tile, t, &begin, &end);
      sum = deltaCombine(sum, deltaThreadScan(now, base, begin, end, plan.unit), plan.unit);
    }
    tiles[tile] = sum;
  }
}

void emulateDeltaWrite(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                       std::byte* out) {
  DeltaTile threads[kDeltaThreads];
  for (int64_t tile = 0; tile < plan.tiles(); ++tile) {
    for (int t = 0; t < kDeltaThreads; ++t) {  // every thread scans before any writes the base
      int64_t begin, end;
      threadUnits(plan, tile, t, &begin, &end);
      threads[t] = deltaThreadScan(now, base, begin, end, plan.unit);
    }
    int64_t at = places[tile].offset, prev = places[tile].prev;
    for (int t = 0; t < kDeltaThreads; ++t) {
      int64_t begin, end;
      threadUnits(plan, tile, t, &begin, &end);
      deltaThreadWrite(now, base, begin, end, plan.unit, prev, out + at);
      at += deltaRangeBytes(threads[t], prev, plan.unit);
      if (threads[t].last >= 0) prev = threads[t].last;
    }
  }
}

void emulateDeltaScatter(int32_t unit, std::byte* chunk, const int64_t* units, const std::byte* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) std::memcpy(chunk + units[i] * unit, values + i * unit, static_cast<size_t>(unit));
}

void emulateHashLeaves(const std::byte* data, int64_t bytes, uint64_t* leaves) {
  for (int64_t i = 0; i < hashLeaves(bytes); ++i) leaves[i] = hashLeaf(data, bytes, i);
}

Status parseDelta(const std::byte* delta, size_t delta_bytes, int64_t units, int32_t unit,
                  std::vector<int64_t>* changed, std::vector<std::byte>* values) {
  changed->clear();
  values->clear();
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
    changed->push_back(u);
    values->insert(values->end(), delta + p, delta + p + unit);
    p += static_cast<size_t>(unit);
    ++u;
  }
  return absl::OkStatus();
}

}  // namespace shardcast::transport
