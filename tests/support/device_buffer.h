// Device memory for the tests, benchmarks and the device check (not for the daemon, which only
// maps what clients hand it): a cudaMalloc'd buffer with its IPC handle, cuMem allocations with
// their file descriptors, and blocking copies.
// Built from device_buffer_cuda.cc with the CUDA toolkit, else every call answers UNAVAILABLE;
// callers skip when transport::cudaDeviceCount() is 0.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/fd_passing.h"
#include "common/status.h"

namespace shardcast::testing {

class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
  virtual StatusOr<std::string> ipcHandle() const = 0;  // cudaIpcMemHandle_t bytes
};
StatusOr<std::unique_ptr<DeviceBuffer>> allocateDevice(size_t size, int device);

// `count` cuMem allocations (cuMemCreate, exportable as POSIX file descriptors) of the minimum
// granularity each, mapped one after another into one reserved range: what torch's expandable
// segments make. data() is the range; allocationBytes() each allocation's size.
class CuMemBuffer {
 public:
  virtual ~CuMemBuffer() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
  virtual size_t allocationBytes() const = 0;
  // A new descriptor of each allocation (cuMemExportToShareableHandle), in order.
  virtual StatusOr<std::vector<OwnedFd>> exportFds() const = 0;
};
StatusOr<std::unique_ptr<CuMemBuffer>> allocateCuMem(size_t count, int device);
Status copyToDevice(void* dst, const void* src, size_t n);
Status copyFromDevice(void* dst, const void* src, size_t n);

}  // namespace shardcast::testing
