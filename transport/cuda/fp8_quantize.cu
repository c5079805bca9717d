// The fp8 quantisation kernel (transport/cuda/fp8_quantize.h): one CUDA block per fp8 block of
// the box (grid-stride beyond the grid). A block whose rows are contiguous whole vectors
// (fp8VectorBlock) is read 16 bytes at a time, each thread taking every 256th vector in both
// passes, its amax reduced by warp shuffles, its fp8 values stored a vector (8 or 4 bytes) at a
// time; any other block element by element. The per-vector steps are fp8_quantize_plan.h's
// (fp8VectorAmax, fp8VectorQuantize), which emulateFp8Quantize runs on the host in the same order.
#include <cuda_runtime.h>

#include "transport/cuda/fp8_quantize.h"

namespace shardcast::transport {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The block's amax and NaN flag, each thread's part given: every thread gets the result.
__device__ void reduceBlock(float* m, int* has_nan, float* warp_amax, int* warp_nan) {
  for (int o = 16; o > 0; o /= 2) {
    *m = fmaxf(*m, __shfl_xor_sync(0xffffffffu, *m, o));
    *has_nan |= __shfl_xor_sync(0xffffffffu, *has_nan, o);
  }
  const int t = threadIdx.x;
  if (t % 32 == 0) {
    warp_amax[t / 32] = *m;
    warp_nan[t / 32] = *has_nan;
  }
  __syncthreads();
  *m = warp_amax[0];
  *has_nan = warp_nan[0];
  for (int w = 1; w < kWarps; ++w) {
    *m = fmaxf(*m, warp_amax[w]);
    *has_nan |= warp_nan[w];
  }
  __syncthreads();  // read by all before the next block writes them
}

__device__ void scalarAmax(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, const std::byte* src,
                           float* m, int* has_nan) {
  int64_t n = 1, g[kMaxCopyDims];
  for (int d = 0; d < p.dims; ++d) n *= bsize[d];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    fp8Unflatten(p.dims, i, blo, bsize, g);
    const float v = fp8Load(src, fp8SourceOffset(p, g), p.bf16);
    *has_nan |= fp8IsNan(v) ? 1 : 0;
    *m = fmaxf(*m, fabsf(v));
  }
}

__device__ void scalarQuantize(const Fp8QuantizePlan& p, const int64_t* blo, const int64_t* bsize, float scale,
                               std::byte* dst, const std::byte* src) {
  int64_t plo[kMaxCopyDims], psize[kMaxCopyDims], g[kMaxCopyDims];
  int64_t parts = 1;
  for (int d = 0; d < p.dims; ++d) {
    plo[d] = blo[d] > p.lo[d] ? blo[d] : p.lo[d];
    const int64_t end = blo[d] + bsize[d] < p.hi[d] ? blo[d] + bsize[d] : p.hi[d];
    psize[d] = end - plo[d];
    parts *= psize[d];
  }
  for (int64_t i = threadIdx.x; i < parts; i += blockDim.x) {
    fp8Unflatten(p.dims, i, plo, psize, g);
    int64_t out = p.dst_offset;
    for (int d = 0; d < p.dims; ++d) out += (g[d] - p.lo[d]) * p.dst_stride[d];
    dst[out] = static_cast<std::byte>(fp8Quantize(fp8Load(src, fp8SourceOffset(p, g), p.bf16), scale));
  }
}

__global__ void __launch_bounds__(kThreads) fp8QuantizeKernel(Fp8QuantizePlan p, std::byte* dst, const std::byte* src) {
  __shared__ float warp_amax[kWarps];
  __shared__ int warp_nan[kWarps];
  for (int64_t b = blockIdx.x; b < p.blocks; b += gridDim.x) {
    int64_t blo[kMaxCopyDims], bsize[kMaxCopyDims];
    fp8BlockAt(p, b, blo, bsize);
    const bool vectors = fp8VectorBlock(p, blo, bsize);  // the same for every thread of the block
    float scale;
    if (p.given) {
      scale = fp8GivenScale(p);
    } else {
      float m = 0.0f;
      int has_nan = 0;
      if (vectors)
        for (int64_t i = threadIdx.x; i < fp8BlockVectors(p, bsize); i += blockDim.x)
          fp8VectorAmax(p, blo, bsize, i, src, &m, &has_nan);
      else
        scalarAmax(p, blo, bsize, src, &m, &has_nan);
      reduceBlock(&m, &has_nan, warp_amax, warp_nan);
      scale = fp8Scale(m, has_nan != 0, p.pow2);
    }
    if (p.scales) {
      if (threadIdx.x == 0) {
        int64_t out = p.dst_offset;
        for (int d = 0; d < p.dims; ++d) out += (blo[d] / p.block[d] - p.lo[d]) * p.dst_stride[d];
        *reinterpret_cast<float*>(dst + out * 4) = scale;
      }
    } else if (vectors) {
      for (int64_t i = threadIdx.x; i < fp8BlockVectors(p, bsize); i += blockDim.x)
        fp8VectorQuantize(p, blo, bsize, i, scale, dst, src);
    } else {
      scalarQuantize(p, blo, bsize, scale, dst, src);
    }
  }
}

}  // namespace

int launchFp8QuantizeKernel(const Fp8QuantizePlan& plan, std::byte* dst_base, const std::byte* src_base, void* stream) {
  if (plan.blocks == 0) return cudaSuccess;
  cudaGetLastError();  // what follows reports this launch, not an earlier call's error
  fp8QuantizeKernel<<<plan.grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(fp8ForMemory(plan, src_base),
                                                                                   dst_base, src_base);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace shardcast::transport
