// What the daemon needs of its node's GPUs: how many there are, a client's device allocation
// mapped from its IPC handle or its cuMem allocations from their descriptors, copy engines (one stream each), host
// memory page-locked for them. cudaRuntime() is the CUDA runtime's (transport/cuda/cuda_support.cc; without the toolkit
// every call answers UNAVAILABLE); EmulatedGpus (transport/emulated_gpus.h) stands host memory in for GPUs, so the
// whole device path of a daemon runs where there is no GPU (shardcastd
// --emulate-gpus, for tests).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/fd_passing.h"
#include "common/status.h"
#include "transport/copy_engine.h"
#include "transport/cuda/cuda_support.h"

namespace shardcast::transport {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  // Usable GPUs; 0 when there are none (unavailableReason() says why).
  virtual int deviceCount() const = 0;
  virtual std::string unavailableReason() const = 0;
  // GPU `device`'s UUID: 16 bytes (cudaDeviceProp::uuid), "" when it cannot be read. Clients name
  // GPUs by it: a container's device numbers are its own, not this process's.
  virtual std::string uuid(int device) const = 0;
  // The allocation a client shared by `handle`, at least `size` bytes, on GPU `device`. `owner`:
  // the calling client's uid where the runtime opens what the handle names by a name (emulated
  // GPUs: a segment of another user is refused); CUDA's driver checks its own handles.
  virtual StatusOr<std::unique_ptr<CudaIpcMapping>> importHandle(const std::string& handle, size_t size, int device,
                                                                 std::optional<uid_t> owner) = 0;
  // cuMem allocations a client handed over as POSIX file descriptors (torch's expandable segments,
  // any cuMemCreate-based allocator), mapped one after another into one range: allocation i at
  // the sum of the sizes before it, `allocation_bytes[i]` of it mapped. Refused (INVALID_ARGUMENT)
  // when an allocation is smaller than its size, is not on GPU `device`, or a size is not a
  // multiple of the allocation granularity. The descriptors are the runtime's to close.
  virtual StatusOr<std::unique_ptr<CudaIpcMapping>> importAllocations(std::vector<OwnedFd> fds,
                                                                      const std::vector<uint64_t>& allocation_bytes,
                                                                      int device) = 0;
  // A copy engine over a new stream of GPU `device` (transport/device_copy.h).
  virtual StatusOr<std::unique_ptr<CopyEngine>> makeEngine(int device) = 0;
  // Host memory page-locked for the GPUs' copies while the returned object lives.
  virtual StatusOr<std::unique_ptr<HostPin>> pinHost(void* data, size_t size) = 0;
  // `size` bytes of GPU `device`'s memory, freed with the returned object.
  virtual StatusOr<std::unique_ptr<DeviceMemory>> allocateDevice(int device, size_t size) = 0;
  // Whether GPU `device`'s stream reads and writes GPU `peer`'s memory directly (peer access).
  virtual bool peerAccess(int device, int peer) const = 0;
};

DeviceRuntime& cudaRuntime();

// A GPU UUID (16 bytes) as nvidia-smi -L prints it: "GPU-" then 8-4-4-4-12 hex digits; anything
// else in hex, as given.
std::string gpuUuidText(const std::string& uuid);

}  // namespace shardcast::transport
