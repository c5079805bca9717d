// CUDA support when the toolkit was not found at build time: nothing is available.
#include "transport/copy_engine.h"
#include "transport/cuda/cuda_support.h"

namespace shardcast::transport {

namespace {
Status unavailable() { return absl::UnavailableError("shardcast was built without the CUDA toolkit"); }
}  // namespace

int cudaDeviceCount() { return 0; }
std::string cudaUnavailableReason() { return "built without the CUDA toolkit"; }
std::string cudaDeviceUuid(int) { return ""; }
StatusOr<std::unique_ptr<CudaIpcMapping>> importCudaIpcHandle(const std::string&, size_t, int) { return unavailable(); }
StatusOr<std::unique_ptr<CudaIpcMapping>> importCudaAllocations(std::vector<OwnedFd>, const std::vector<uint64_t>&,
                                                                int) {
  return unavailable();
}
StatusOr<ExportedCudaIpc> exportCudaIpcHandle(const void*) { return unavailable(); }
StatusOr<std::unique_ptr<PinnedBuffer>> allocatePinned(size_t) { return unavailable(); }
StatusOr<std::unique_ptr<DeviceMemory>> allocateDeviceMemory(int, size_t) { return unavailable(); }
bool cudaPeerAccess(int, int) { return false; }
StatusOr<std::unique_ptr<HostPin>> pinHostMemory(void*, size_t) { return unavailable(); }
StatusOr<std::unique_ptr<CopyEngine>> makeCudaCopyEngine(int) { return unavailable(); }

}  // namespace shardcast::transport
