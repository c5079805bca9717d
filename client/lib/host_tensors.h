// A rank's host tensors in one POSIX shared-memory segment: the application writes its weights
// through the pointers handed out here, and the daemon reads and writes the same pages (no copy).
// Buffers are 64-byte aligned and named like the layout's tensors or fused buffers.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "shardcast/v1/layout.pb.h"
#include "shardcast/v1/service.pb.h"

namespace shardcast::transport {
class ShmSegment;
}

namespace shardcast {

class HostTensors {
 public:
  struct Slot {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };

  // Creates a zero-filled segment holding `buffers` (name, bytes) one after another. The segment
  // is named `segment` ("" = "/shardcast-<pid>-<n>") and unlinked when this object goes away.
  static StatusOr<HostTensors> create(const std::vector<std::pair<std::string, uint64_t>>& buffers,
                                      const std::string& segment = "");
  // Creates the segment for `rank` of `layout`: one buffer per tensor or fused buffer the rank
  // holds, sized as the layout says.
  static StatusOr<HostTensors> forRank(const v1::Layout& layout, int32_t rank, const std::string& segment = "");
  // Adopts a segment the application created: maps it and describes where each buffer lies.
  // The segment is not unlinked by this object.
  static StatusOr<HostTensors> adopt(const std::string& segment, std::map<std::string, Slot> buffers);

  HostTensors(HostTensors&&) noexcept;
  HostTensors& operator=(HostTensors&&) noexcept;
  ~HostTensors();

  // The bytes of buffer `name`; an empty span when there is no such buffer.
  std::span<std::byte> bytes(const std::string& name) const;
  template <typename T>
  std::span<T> as(const std::string& name) const {
    const auto b = bytes(name);
    return {reinterpret_cast<T*>(b.data()), b.size() / sizeof(T)};
  }
  bool contains(const std::string& name) const { return slots_.count(name) > 0; }
  const std::map<std::string, Slot>& buffers() const { return slots_; }
  const std::string& segment() const;
  // The handles a Register request carries for these buffers.
  std::vector<v1::MemoryHandle> handles() const;

 private:
  HostTensors(std::unique_ptr<transport::ShmSegment> seg, std::map<std::string, Slot> slots);

  std::unique_ptr<transport::ShmSegment> seg_;
  std::map<std::string, Slot> slots_;
};

// A device buffer to register through a CUDA IPC handle: `data` may point inside a larger
// allocation (PyTorch's caching allocator); the handle covers the allocation and carries the offset.
struct DeviceTensor {
  std::string name;
  const void* data = nullptr;
  uint64_t bytes = 0;
};
StatusOr<v1::MemoryHandle> deviceHandle(const DeviceTensor& tensor);

// A device buffer in cuMem (VMM) allocations (cuMemCreate: torch's expandable segments, any
// allocator built on it), registered by the allocations' POSIX file descriptors
// (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR): `fds[i]` is allocation
// i, `allocation_bytes[i]` its size; the allocations lie one after another, the first at 0, and the
// buffer is `bytes` at `offset` there. Client::cuMemHandle hands them to the daemon (docs/gpu.md).
struct CuMemTensor {
  std::string name;
  std::vector<int> fds;
  std::vector<uint64_t> allocation_bytes;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  int device = 0;  // this process's CUDA device number
  // The GPU's UUID (16 bytes), by which the daemon finds it (its device numbers may differ from
  // this container's); "": CUDA's for `device`, where this process can read it.
  std::string device_uuid;
};

}  // namespace shardcast
