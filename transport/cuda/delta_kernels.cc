// The delta kernels' work on the host, in their order (the emulated GPUs run it), and the parser
// of a peer's delta (transport/cuda/delta_kernels.h).
#include "transport/cuda/delta_kernels.h"

#include <algorithm>
#include <cstring>

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
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(chunk + units[i] * unit, values + i * unit, static_cast<size_t>(unit));
}

void emulateHashLeaves(const std::byte* data, int64_t bytes, uint64_t* leaves) {
  for (int64_t i = 0; i < hashLeaves(bytes); ++i) leaves[i] = hashLeaf(data, bytes, i);
}

Status parseDelta(const std::byte* delta, size_t delta_bytes, int64_t units, int32_t unit,
                  std::vector<int64_t>* changed, std::vector<std::byte>* values) {
  changed->clear();
  values->clear();
  return forEachDeltaRecord(delta, delta_bytes, units, unit, [&](int64_t u, const std::byte* value) {
    changed->push_back(u);
    values->insert(values->end(), value, value + unit);
  });
}

}  // namespace shardcast::transport
