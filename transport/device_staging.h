// Memory ready for the transport whatever its kind: registered directly when the transport can
// reach it (host memory; device memory with a CUDA-aware UCX), otherwise mirrored by a pinned host
// buffer that is registered instead, with explicit copies to and from the device around transfers.
// The decision is made at run time from Context::canAccess(), never at build time.
#pragma once

#include <memory>

#include "transport/copy_engine.h"
#include "transport/cuda/cuda_support.h"
#include "transport/transport.h"

namespace shardcast::transport {

class TransferMemory {
 public:
  // `data` of `size` bytes of `kind`; `copies` must be able to copy device<->host when staging
  // is needed (a CUDA copy engine), and may be null for host memory.
  static StatusOr<std::unique_ptr<TransferMemory>> prepare(Context& ctx, void* data, size_t size, MemoryKind kind,
                                                           CopyEngine* copies);

  // The region to read from or write into over the network.
  const std::shared_ptr<MemoryRegion>& region() const { return region_; }
  bool staged() const { return pinned_ != nullptr; }
  // Before sending bytes [offset, offset + n): copy them from the device to the staging buffer.
  Status stageOut(size_t offset, size_t n);
  // After receiving bytes [offset, offset + n): copy them from the staging buffer to the device.
  Status stageIn(size_t offset, size_t n);

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  CopyEngine* copies_ = nullptr;
  std::unique_ptr<PinnedBuffer> pinned_;  // before region_: the region is released first
  std::shared_ptr<MemoryRegion> region_;
};

}  // namespace shardcast::transport
