// Device buffers through the CUDA runtime (tests/support/device_buffer.h).
#include <cuda_runtime_api.h>

#include "common/strings.h"
#include "tests/support/device_buffer.h"

namespace shardcast::testing {

namespace {

Status cudaStatus(const std::string& what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(strCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

class Device final : public DeviceBuffer {
 public:
  Device(void* p, size_t n) : p_(p), n_(n) {}
  ~Device() override { cudaFree(p_); }
  void* data() const override { return p_; }
  size_t size() const override { return n_; }
  StatusOr<std::string> ipcHandle() const override {
    cudaIpcMemHandle_t h;
    SC_RETURN_IF_ERROR(cudaStatus("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&h, p_)));
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

 private:
  void* p_;
  size_t n_;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceBuffer>> allocateDevice(size_t size, int device) {
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  void* p = nullptr;
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaMalloc(", size, ")"), cudaMalloc(&p, size)));
  return std::unique_ptr<DeviceBuffer>(std::make_unique<Device>(p, size));
}

Status copyToDevice(void* dst, const void* src, size_t n) {
  return cudaStatus("cudaMemcpy H2D", cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
}

Status copyFromDevice(void* dst, const void* src, size_t n) {
  return cudaStatus("cudaMemcpy D2H", cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
}

}  // namespace shardcast::testing
