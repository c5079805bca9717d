// Device memory for the tests, benchmarks and the device check (not for the daemon, which only
// maps what clients hand it): a cudaMalloc'd buffer with its IPC handle, and blocking copies.
// Built from device_buffer_cuda.cc with the CUDA toolkit, else every call answers UNAVAILABLE;
// callers skip when transport::cudaDeviceCount() is 0.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

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
Status copyToDevice(void* dst, const void* src, size_t n);
Status copyFromDevice(void* dst, const void* src, size_t n);

}  // namespace shardcast::testing
