// The fp8 quantisation kernel (transport/cuda/fp8_quantize.h): one CUDA block per fp8 block of
// the box (grid-stride beyond the grid), the block's amax reduced in shared memory, then its
// elements inside the box quantised (or its scale written).
#include <cuda_runtime.h>

#include "transport/cuda/fp8_quantize.h"

namespace shardcast::transport {

namespace {

constexpr int kThreads = 256;

__global__ void fp8QuantizeKernel(Fp8QuantizePlan p, std::byte* dst, const std::byte* src) {
  __shared__ float amax[kThreads];
  __shared__ int nan[kThreads];
  const int t = threadIdx.x;
  for (int64_t b = blockIdx.x; b < p.blocks; b += gridDim.x) {
    int64_t blo[kMaxCopyDims], bsize[kMaxCopyDims], g[kMaxCopyDims];
    fp8BlockAt(p, b, blo, bsize);
    int64_t n = 1;
    for (int d = 0; d < p.dims; ++d) n *= bsize[d];
    float m = 0.0f;
    int has_nan = 0;
    for (int64_t i = t; i < n && !p.given; i += blockDim.x) {
      fp8Unflatten(p.dims, i, blo, bsize, g);
      const float v = fp8Load(src, fp8SourceOffset(p, g), p.bf16);
      has_nan |= fp8IsNan(v) ? 1 : 0;
      m = fmaxf(m, fabsf(v));
    }
    amax[t] = m;
    nan[t] = has_nan;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
      if (t < half) {
        amax[t] = fmaxf(amax[t], amax[t + half]);
        nan[t] |= nan[t + half];
      }
      __syncthreads();
    }
    const float scale = p.given ? fp8GivenScale(p) : fp8Scale(amax[0], nan[0] != 0, p.pow2);
    if (p.scales) {
      if (t == 0) {
        int64_t out = p.dst_offset;
        for (int d = 0; d < p.dims; ++d) out += (blo[d] / p.block[d] - p.lo[d]) * p.dst_stride[d];
        *reinterpret_cast<float*>(dst + out * 4) = scale;
      }
    } else {
      int64_t plo[kMaxCopyDims], psize[kMaxCopyDims];
      int64_t parts = 1;
      for (int d = 0; d < p.dims; ++d) {
        plo[d] = blo[d] > p.lo[d] ? blo[d] : p.lo[d];
        const int64_t end = blo[d] + bsize[d] < p.hi[d] ? blo[d] + bsize[d] : p.hi[d];
        psize[d] = end - plo[d];
        parts *= psize[d];
      }
      for (int64_t i = t; i < parts; i += blockDim.x) {
        fp8Unflatten(p.dims, i, plo, psize, g);
        int64_t out = p.dst_offset;
        for (int d = 0; d < p.dims; ++d) out += (g[d] - p.lo[d]) * p.dst_stride[d];
        dst[out] = static_cast<std::byte>(fp8Quantize(fp8Load(src, fp8SourceOffset(p, g), p.bf16), scale));
      }
    }
    __syncthreads();  // amax[0] and nan[0] are read before the next block overwrites them
  }
}

}  // namespace

int launchFp8QuantizeKernel(const Fp8QuantizePlan& plan, std::byte* dst_base, const std::byte* src_base, void* stream) {
  if (plan.blocks == 0) return cudaSuccess;
  cudaGetLastError();  // what follows reports this launch, not an earlier call's error
  fp8QuantizeKernel<<<plan.grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(plan, dst_base, src_base);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace shardcast::transport
