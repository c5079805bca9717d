// Delta chunks and their hash on a GPU (transport/cuda/delta_kernels.h): the index math and the
// per-thread steps, plain C++ shared by the kernels (delta_kernels.cu, compiled by nvcc without
// the rest of the project's headers) and the host, which runs them in the kernels' order where no
// GPU is (the emulated GPUs), so the bytes are checked in CI.
//
// The format is the daemons' (daemon/engine/delta.h): in units of `unit` bytes (1, 2, 4 or 8), a
// byte g < 255 skips g unchanged units and one changed unit's bytes follow; g = 255 skips 255
// units with no value. A GPU writes it in parallel: the chunk is cut into tiles of
// kDeltaTileUnits units (a CUDA block each, kDeltaThreads threads of kDeltaThreadUnits units).
//  1. Each tile summarises its changes (DeltaTile): its first and last changed unit, and the
//     bytes of its records but the first (whose gap reaches back into earlier tiles).
//  2. The host scans the summaries in order (deltaPlaceTiles): where each tile's records start
//     and the last changed unit before it, and the delta's size (too big: the chunk goes dense).
//  3. Each tile writes its records there: a thread's start is the tile's plus the bytes of the
//     threads before it, found by two scans over the block (the last changed unit before each
//     thread, the bytes before it); the changed units are written into the base as they go.
// The hash a GPU can compute: xxHash64 of every kHashLeafBytes leaf (one thread each), then
// xxHash64 of the leaves' hashes (little-endian) seeded with the chunk's size (treeHash).
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/cuda/strided_copy_plan.h"  // SC_HOST_DEVICE

namespace shardcast::transport {

inline constexpr uint8_t kDeltaSkipByte = 255;  // the format's skip-only record (daemon/engine/delta.h)
inline constexpr int kDeltaThreadUnits = 16;
inline constexpr int kDeltaThreads = 256;
inline constexpr int64_t kDeltaTileUnits = int64_t{kDeltaThreadUnits} * kDeltaThreads;
inline constexpr int64_t kHashLeafBytes = 4096;

struct DeltaPlan {
  int64_t units = 0;  // in the chunk
  int32_t unit = 1;   // bytes per unit: 1, 2, 4 or 8
  SC_HOST_DEVICE int64_t tiles() const { return (units + kDeltaTileUnits - 1) / kDeltaTileUnits; }
};

// What one tile (or thread) changed: the first and last changed unit (-1: none), how many, and the
// bytes of its records after the first one.
struct DeltaTile {
  int64_t first = -1, last = -1, changed = 0, inner_bytes = 0;
};

// Where a tile's records start in the delta, and the last changed unit before the tile (-1: none).
struct DeltaTilePlace {
  int64_t offset = 0, prev = -1;
};

// The bytes of a record `gap` unchanged units after the previous one.
SC_HOST_DEVICE inline int64_t deltaRecordBytes(int64_t gap, int32_t unit) { return gap / kDeltaSkipByte + 1 + unit; }

SC_HOST_DEVICE inline bool deltaUnitChanged(const std::byte* now, const std::byte* base, int64_t u, int32_t unit) {
  for (int32_t b = 0; b < unit; ++b)
    if (now[u * unit + b] != base[u * unit + b]) return true;
  return false;
}

// Units [begin, end) of one thread: its summary (records after its first, gaps within the range).
SC_HOST_DEVICE inline DeltaTile deltaThreadScan(const std::byte* now, const std::byte* base, int64_t begin, int64_t end,
                                                int32_t unit) {
  DeltaTile t;
  for (int64_t u = begin; u < end; ++u) {
    if (!deltaUnitChanged(now, base, u, unit)) continue;
    if (t.last >= 0) t.inner_bytes += deltaRecordBytes(u - t.last - 1, unit);
    if (t.first < 0) t.first = u;
    t.last = u;
    ++t.changed;
  }
  return t;
}

// The bytes a summarised range writes when the last changed unit before it is `prev`.
SC_HOST_DEVICE inline int64_t deltaRangeBytes(const DeltaTile& t, int64_t prev, int32_t unit) {
  return t.first < 0 ? 0 : deltaRecordBytes(t.first - prev - 1, unit) + t.inner_bytes;
}

// Summaries of consecutive ranges combined: `a`, then `b`.
SC_HOST_DEVICE inline DeltaTile deltaCombine(const DeltaTile& a, const DeltaTile& b, int32_t unit) {
  if (a.first < 0) return b;
  if (b.first < 0) return a;
  DeltaTile c;
  c.first = a.first;
  c.last = b.last;
  c.changed = a.changed + b.changed;
  c.inner_bytes = a.inner_bytes + deltaRangeBytes(b, a.last, unit);
  return c;
}

// Writes the records of units [begin, end) at `out` (the last changed unit before them: `prev`)
// and their changed units into `base`. Returns the bytes written.
SC_HOST_DEVICE inline int64_t deltaThreadWrite(const std::byte* now, std::byte* base, int64_t begin, int64_t end,
                                               int32_t unit, int64_t prev, std::byte* out) {
  int64_t o = 0;
  for (int64_t u = begin; u < end; ++u) {
    if (!deltaUnitChanged(now, base, u, unit)) continue;
    int64_t gap = u - prev - 1;
    for (; gap >= kDeltaSkipByte; gap -= kDeltaSkipByte) out[o++] = std::byte{kDeltaSkipByte};
    out[o++] = static_cast<std::byte>(gap);
    for (int32_t b = 0; b < unit; ++b) {
      out[o++] = now[u * unit + b];
      base[u * unit + b] = now[u * unit + b];
    }
    prev = u;
  }
  return o;
}

// Step 2, on the host: each tile's place from the summaries in order. The delta's size, or -1 when
// it is larger than `cap`.
inline int64_t deltaPlaceTiles(const DeltaTile* tiles, int64_t count, int32_t unit, DeltaTilePlace* places,
                               int64_t cap) {
  int64_t at = 0, prev = -1;
  for (int64_t t = 0; t < count; ++t) {
    places[t] = {at, prev};
    at += deltaRangeBytes(tiles[t], prev, unit);
    if (at > cap) return -1;
    if (tiles[t].last >= 0) prev = tiles[t].last;
  }
  return at;
}

// ---- xxHash64 (the public algorithm), for leaves on a GPU and their tree on the host ----

inline constexpr uint64_t kXxPrime1 = 0x9E3779B185EBCA87ull, kXxPrime2 = 0xC2B2AE3D27D4EB4Full,
                          kXxPrime3 = 0x165667B19E3779F9ull, kXxPrime4 = 0x85EBCA77C2B2AE63ull,
                          kXxPrime5 = 0x27D4EB2F165667C5ull;

SC_HOST_DEVICE inline uint64_t xxRotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
SC_HOST_DEVICE inline uint64_t xxRead64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}
SC_HOST_DEVICE inline uint64_t xxRound(uint64_t acc, uint64_t input) {
  return xxRotl(acc + input * kXxPrime2, 31) * kXxPrime1;
}
SC_HOST_DEVICE inline uint64_t xxMerge(uint64_t acc, uint64_t v) {
  return (acc ^ xxRound(0, v)) * kXxPrime1 + kXxPrime4;
}

// xxHash64 of `n` bytes at `p` (byte loads: any alignment), equal to the reference XXH64.
SC_HOST_DEVICE inline uint64_t xxHash64(const std::byte* p, int64_t n, uint64_t seed) {
  const std::byte* end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v1 = seed + kXxPrime1 + kXxPrime2, v2 = seed + kXxPrime2, v3 = seed, v4 = seed - kXxPrime1;
    for (; end - p >= 32; p += 32) {
      v1 = xxRound(v1, xxRead64(p));
      v2 = xxRound(v2, xxRead64(p + 8));
      v3 = xxRound(v3, xxRead64(p + 16));
      v4 = xxRound(v4, xxRead64(p + 24));
    }
    h = xxRotl(v1, 1) + xxRotl(v2, 7) + xxRotl(v3, 12) + xxRotl(v4, 18);
    h = xxMerge(xxMerge(xxMerge(xxMerge(h, v1), v2), v3), v4);
  } else {
    h = seed + kXxPrime5;
  }
  h += static_cast<uint64_t>(n);
  for (; end - p >= 8; p += 8) h = xxRotl(h ^ xxRound(0, xxRead64(p)), 27) * kXxPrime1 + kXxPrime4;
  if (end - p >= 4) {
    uint64_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
    h = xxRotl(h ^ (v * kXxPrime1), 23) * kXxPrime2 + kXxPrime3;
    p += 4;
  }
  for (; p < end; ++p) h = xxRotl(h ^ (static_cast<uint64_t>(*p) * kXxPrime5), 11) * kXxPrime1;
  h ^= h >> 33;
  h *= kXxPrime2;
  h ^= h >> 29;
  h *= kXxPrime3;
  h ^= h >> 32;
  return h;
}

SC_HOST_DEVICE inline int64_t hashLeaves(int64_t bytes) { return (bytes + kHashLeafBytes - 1) / kHashLeafBytes; }

// Leaf i of a chunk of `bytes` at `data`.
SC_HOST_DEVICE inline uint64_t hashLeaf(const std::byte* data, int64_t bytes, int64_t i) {
  const int64_t at = i * kHashLeafBytes;
  const int64_t n = bytes - at < kHashLeafBytes ? bytes - at : kHashLeafBytes;
  return xxHash64(data + at, n, 0);
}

// The tree: the leaves' hashes, little-endian whatever the host, hashed in batches of
// kHashChainLeaves into a chain (each batch seeded with the hash of the ones before, the first
// with the chunk's size), so the host needs no buffer of every leaf.
inline constexpr int64_t kHashChainLeaves = 512;

inline uint64_t chainLeaves(uint64_t h, const uint64_t* leaves, int64_t k) {
  std::byte buf[kHashChainLeaves * 8];
  for (int64_t i = 0; i < k; ++i)
    for (int b = 0; b < 8; ++b) buf[i * 8 + b] = static_cast<std::byte>(leaves[i] >> (8 * b));
  return XXH64(buf, static_cast<size_t>(k * 8), h);  // the library's, on the host (xxHash64's value)
}

// The chunk's hash from its `count` leaves' (the GPU's, copied to the host).
inline uint64_t treeHashOfLeaves(const uint64_t* leaves, int64_t count, int64_t bytes) {
  uint64_t h = chainLeaves(static_cast<uint64_t>(bytes), leaves, count < kHashChainLeaves ? count : kHashChainLeaves);
  for (int64_t at = kHashChainLeaves; at < count; at += kHashChainLeaves)
    h = chainLeaves(h, leaves + at, count - at < kHashChainLeaves ? count - at : kHashChainLeaves);
  return h;
}

// The same hash of `bytes` at `data` in host memory.
inline uint64_t treeHash(const std::byte* data, int64_t bytes) {
  uint64_t leaves[kHashChainLeaves];
  const int64_t count = hashLeaves(bytes);
  uint64_t h = static_cast<uint64_t>(bytes);
  int64_t at = 0;
  do {
    const int64_t k = count - at < kHashChainLeaves ? count - at : kHashChainLeaves;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t from = (at + i) * kHashLeafBytes;
      leaves[i] = XXH64(data + from, static_cast<size_t>(std::min(kHashLeafBytes, bytes - from)), 0);  // hashLeaf
    }
    h = chainLeaves(h, leaves, k);
    at += k;
  } while (at < count);
  return h;
}

}  // namespace shardcast::transport
