// The delta kernels (transport/cuda/delta_kernels.h): one CUDA block per tile of kDeltaTileUnits
// units, each thread scanning (and writing) kDeltaThreadUnits consecutive units with
// delta_plan.h's steps; thread 0 combines the threads' summaries in order, as the host emulation
// does. Leaves are hashed one per thread, parsed deltas scattered one unit per thread.
#include <cuda_runtime.h>

#include "transport/cuda/delta_kernels.h"

namespace shardcast::transport {

namespace {

constexpr unsigned kMaxGrid = 65535;

__device__ void threadRange(const DeltaPlan& p, int64_t tile, int64_t* begin, int64_t* end) {
  const int64_t b = tile * kDeltaTileUnits + static_cast<int64_t>(threadIdx.x) * kDeltaThreadUnits;
  *begin = b < p.units ? b : p.units;
  *end = *begin + kDeltaThreadUnits < p.units ? *begin + kDeltaThreadUnits : p.units;
}

// Per-thread summaries in shared memory: raw storage (a __shared__ array takes no initializers).
#define SC_SHARED_TILES(name)                                                  \
  __shared__ alignas(DeltaTile) unsigned char name##_raw[sizeof(DeltaTile) * kDeltaThreads]; \
  DeltaTile* name = reinterpret_cast<DeltaTile*>(name##_raw)

__global__ void deltaTiles(DeltaPlan p, const std::byte* now, const std::byte* base, DeltaTile* tiles) {
  SC_SHARED_TILES(threads);
  for (int64_t tile = blockIdx.x; tile < p.tiles(); tile += gridDim.x) {
    int64_t begin, end;
    threadRange(p, tile, &begin, &end);
    threads[threadIdx.x] = deltaThreadScan(now, base, begin, end, p.unit);
    __syncthreads();
    if (threadIdx.x == 0) {
      DeltaTile sum;
      for (int t = 0; t < kDeltaThreads; ++t) sum = deltaCombine(sum, threads[t], p.unit);
      tiles[tile] = sum;
    }
    __syncthreads();  // read before the next tile's scan overwrites them
  }
}

__global__ void deltaWrite(DeltaPlan p, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                           std::byte* out) {
  SC_SHARED_TILES(threads);
  __shared__ int64_t at[kDeltaThreads], prev[kDeltaThreads];
  for (int64_t tile = blockIdx.x; tile < p.tiles(); tile += gridDim.x) {
    int64_t begin, end;
    threadRange(p, tile, &begin, &end);
    threads[threadIdx.x] = deltaThreadScan(now, base, begin, end, p.unit);
    __syncthreads();  // every thread has compared before any writes the base
    if (threadIdx.x == 0) {
      int64_t o = places[tile].offset, last = places[tile].prev;
      for (int t = 0; t < kDeltaThreads; ++t) {
        at[t] = o;
        prev[t] = last;
        o += deltaRangeBytes(threads[t], last, p.unit);
        if (threads[t].last >= 0) last = threads[t].last;
      }
    }
    __syncthreads();
    deltaThreadWrite(now, base, begin, end, p.unit, prev[threadIdx.x], out + at[threadIdx.x]);
    __syncthreads();
  }
}

__global__ void deltaScatter(int32_t unit, std::byte* chunk, const int64_t* units, const std::byte* values,
                             int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    for (int32_t b = 0; b < unit; ++b) chunk[units[i] * unit + b] = values[i * unit + b];
}

__global__ void hashLeavesKernel(const std::byte* data, int64_t bytes, uint64_t* leaves) {
  const int64_t count = hashLeaves(bytes);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    leaves[i] = hashLeaf(data, bytes, i);
}

unsigned gridFor(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > kMaxGrid ? kMaxGrid : blocks);
}

}  // namespace

int launchDeltaTilesKernel(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles,
                           void* stream) {
  if (plan.units == 0) return 0;
  deltaTiles<<<gridFor(plan.tiles(), 1), kDeltaThreads, 0, static_cast<cudaStream_t>(stream)>>>(plan, now, base, tiles);
  return static_cast<int>(cudaGetLastError());
}

int launchDeltaWriteKernel(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                           std::byte* out, void* stream) {
  if (plan.units == 0) return 0;
  deltaWrite<<<gridFor(plan.tiles(), 1), kDeltaThreads, 0, static_cast<cudaStream_t>(stream)>>>(plan, now, base,
                                                                                                places, out);
  return static_cast<int>(cudaGetLastError());
}

int launchDeltaScatterKernel(int32_t unit, std::byte* chunk, const int64_t* units, const std::byte* values,
                             int64_t count, void* stream) {
  if (count == 0) return 0;
  deltaScatter<<<gridFor(count, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(unit, chunk, units, values, count);
  return static_cast<int>(cudaGetLastError());
}

int launchHashLeavesKernel(const std::byte* data, int64_t bytes, uint64_t* leaves, void* stream) {
  if (bytes == 0) return 0;
  hashLeavesKernel<<<gridFor(hashLeaves(bytes), 128), 128, 0, static_cast<cudaStream_t>(stream)>>>(data, bytes,
                                                                                                   leaves);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace shardcast::transport
