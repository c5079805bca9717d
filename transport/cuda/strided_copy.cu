// The strided box copy kernel (transport/cuda/strided_copy.h): one launch per box, one aligned
// word per thread of a grid-stride loop.
#include <cuda_runtime.h>

#include "transport/cuda/strided_copy_plan.h"

namespace shardcast::transport {

namespace {

template <typename Word>
__global__ void stridedCopyKernel(StridedCopyPlan plan, std::byte* dst, const std::byte* src) {
  const int64_t n = plan.words();
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < n;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t d = 0, s = 0;
    stridedCopyWordOffsets(plan, w, &d, &s);
    *reinterpret_cast<Word*>(dst + d) = *reinterpret_cast<const Word*>(src + s);
  }
}

}  // namespace

int launchStridedCopyKernel(const StridedCopyPlan& plan, std::byte* dst_base, const std::byte* src_base, void* stream) {
  if (plan.words() == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  cudaGetLastError();  // what follows reports this launch, not an earlier call's error
  switch (plan.word) {
    case 16:
      stridedCopyKernel<uint4><<<plan.blocks, plan.threads, 0, s>>>(plan, dst_base, src_base);
      break;
    case 8:
      stridedCopyKernel<uint2><<<plan.blocks, plan.threads, 0, s>>>(plan, dst_base, src_base);
      break;
    case 4:
      stridedCopyKernel<uint32_t><<<plan.blocks, plan.threads, 0, s>>>(plan, dst_base, src_base);
      break;
    case 2:
      stridedCopyKernel<uint16_t><<<plan.blocks, plan.threads, 0, s>>>(plan, dst_base, src_base);
      break;
    default:
      stridedCopyKernel<uint8_t><<<plan.blocks, plan.threads, 0, s>>>(plan, dst_base, src_base);
  }
  return static_cast<int>(cudaGetLastError());
}

bool stridedCopyKernelBuilt() { return true; }

}  // namespace shardcast::transport
