// CUDA support for the data plane, decided at run time: how many GPUs there are, importing a CUDA
// IPC handle or cuMem allocations' descriptors from a client process, pinned host staging buffers. Built from
// cuda_support.cc when the CUDA toolkit is found, else from no_cuda.cc whose functions all answer UNAVAILABLE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/fd_passing.h"
#include "common/status.h"

namespace shardcast::transport {

// Number of usable GPUs; 0 without a driver or without CUDA support in this build.
int cudaDeviceCount();
// Why cudaDeviceCount() is 0, for skip messages ("built without CUDA", "no CUDA driver", ...).
std::string cudaUnavailableReason();
// GPU `device`'s UUID (cudaDeviceProp::uuid, 16 bytes); "" when it cannot be read.
std::string cudaDeviceUuid(int device);

// Device memory of another process, mapped from its cudaIpcMemHandle_t bytes; unmapped on destruction.
class CudaIpcMapping {
 public:
  virtual ~CudaIpcMapping() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
  // Whether the memory is still all there (an emulated GPU's segment may be truncated by its
  // owner, as shm can; a CUDA allocation cannot shrink under its mapping). Checked before use.
  virtual Status check() const { return absl::OkStatus(); }
};
StatusOr<std::unique_ptr<CudaIpcMapping>> importCudaIpcHandle(const std::string& handle, size_t size, int device);
// cuMem allocations of another process from their POSIX file descriptors (DeviceRuntime::
// importAllocations): imported, mapped one after another into one reserved range, made readable
// and writable by GPU `device`; unmapped and released on destruction.
StatusOr<std::unique_ptr<CudaIpcMapping>> importCudaAllocations(std::vector<OwnedFd> fds,
                                                                const std::vector<uint64_t>& allocation_bytes,
                                                                int device);

// The IPC handle of the device allocation holding `device_ptr`, and where the pointer lies in it.
struct ExportedCudaIpc {
  std::string handle;   // cudaIpcMemHandle_t bytes
  uint64_t offset = 0;  // of device_ptr from the allocation's base
  int device = 0;
};
StatusOr<ExportedCudaIpc> exportCudaIpcHandle(const void* device_ptr);

// Device memory of one GPU, freed when destroyed (delta bases kept on the GPU).
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual std::byte* data() const = 0;
  virtual size_t size() const = 0;
};
StatusOr<std::unique_ptr<DeviceMemory>> allocateDeviceMemory(int device, size_t size);
// Whether GPU `device`'s kernels and copies reach GPU `peer`'s memory directly (NVLink or PCIe
// peer access; true for the same GPU).
bool cudaPeerAccess(int device, int peer);

// Page-locked host memory for staging device data when the transport cannot reach the device.
class PinnedBuffer {
 public:
  virtual ~PinnedBuffer() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
};
StatusOr<std::unique_ptr<PinnedBuffer>> allocatePinned(size_t size);

// Host memory allocated elsewhere, page-locked for the GPU's copies until destroyed.
class HostPin {
 public:
  virtual ~HostPin() = default;
};
StatusOr<std::unique_ptr<HostPin>> pinHostMemory(void* data, size_t size);

}  // namespace shardcast::transport
