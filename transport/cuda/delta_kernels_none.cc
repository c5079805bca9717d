// The delta kernels where the kernels were not compiled (no nvcc, or SHARDCAST_CUDA_KERNELS=OFF):
// delta chunks of device memory are then encoded and rebuilt on the host.
#include "transport/cuda/delta_kernels.h"

namespace shardcast::transport {

int launchDeltaTilesKernel(const DeltaPlan&, const std::byte*, const std::byte*, DeltaTile*, void*) {
  return kStridedCopyNotBuilt;
}
int launchDeltaWriteKernel(const DeltaPlan&, const std::byte*, std::byte*, const DeltaTilePlace*, std::byte*, void*) {
  return kStridedCopyNotBuilt;
}
int launchDeltaScatterKernel(int32_t, std::byte*, const int64_t*, const std::byte*, int64_t, void*) {
  return kStridedCopyNotBuilt;
}
int launchHashLeavesKernel(const std::byte*, int64_t, uint64_t*, void*) { return kStridedCopyNotBuilt; }

}  // namespace shardcast::transport
