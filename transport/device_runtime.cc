#include "transport/device_runtime.h"

namespace shardcast::transport {

namespace {

// The free functions of cuda/cuda_support.h (the CUDA runtime, or UNAVAILABLE without it).
class Cuda final : public DeviceRuntime {
 public:
  int deviceCount() const override { return cudaDeviceCount(); }
  std::string unavailableReason() const override { return cudaUnavailableReason(); }
  std::string uuid(int device) const override { return cudaDeviceUuid(device); }
  StatusOr<std::unique_ptr<CudaIpcMapping>> importHandle(const std::string& handle, size_t size, int device,
                                                         std::optional<uid_t>) override {
    return importCudaIpcHandle(handle, size, device);
  }
  StatusOr<std::unique_ptr<CudaIpcMapping>> importAllocations(std::vector<OwnedFd> fds,
                                                              const std::vector<uint64_t>& allocation_bytes,
                                                              int device) override {
    return importCudaAllocations(std::move(fds), allocation_bytes, device);
  }
  StatusOr<std::unique_ptr<CopyEngine>> makeEngine(int device) override { return makeCudaCopyEngine(device); }
  StatusOr<std::unique_ptr<HostPin>> pinHost(void* data, size_t size) override { return pinHostMemory(data, size); }
  StatusOr<std::unique_ptr<DeviceMemory>> allocateDevice(int device, size_t size) override {
    return allocateDeviceMemory(device, size);
  }
  bool peerAccess(int device, int peer) const override { return cudaPeerAccess(device, peer); }
};

}  // namespace

DeviceRuntime& cudaRuntime() {
  static Cuda runtime;
  return runtime;
}

std::string gpuUuidText(const std::string& uuid) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = uuid.size() == 16 ? "GPU-" : "";
  for (size_t i = 0; i < uuid.size(); ++i) {
    if (uuid.size() == 16 && (i == 4 || i == 6 || i == 8 || i == 10)) out += '-';
    const auto byte = static_cast<unsigned char>(uuid[i]);
    out += kHex[byte >> 4];
    out += kHex[byte & 15];
  }
  return out;
}

}  // namespace shardcast::transport
