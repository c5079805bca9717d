// Memory ready for the transport whatever its kind. Device memory is registered directly when
// the transport can reach it (a CUDA-aware UCX: GPUDirect where the NIC has it); otherwise it is
// not registered at all, and its bytes travel through host memory a sync allocates for the wave
// in flight (the staging region it packs into, the arena transfers land in), which is pinned for
// the GPU's copies: bounded by the staging budget, never a host mirror of every device buffer.
// The decision is made at run time from Context::canAccess(), never at build time, and per buffer:
// one the transport refuses to register (device memory its NIC cannot read) is staged alone.
#pragma once

#include <memory>
#include <string>

#include "transport/copy_engine.h"
#include "transport/cuda/cuda_support.h"
#include "transport/device_runtime.h"
#include "transport/transport.h"

namespace shardcast::transport {

class TransferMemory {
 public:
  // `data` of `size` bytes of `kind`; `copies` must be able to copy device<->host when the
  // transport cannot reach `kind` (a CUDA copy engine), and may be null for host memory.
  static StatusOr<std::unique_ptr<TransferMemory>> prepare(Context& ctx, void* data, size_t size, MemoryKind kind,
                                                           CopyEngine* copies);

  // The registration peers read from and write into; null when staged.
  const std::shared_ptr<MemoryRegion>& region() const { return region_; }
  // Not reachable by the transport: moved through host staging by the copies around transfers.
  bool staged() const { return region_ == nullptr; }
  // Why memory of a kind the transport reaches is staged all the same ("" when it is not): the
  // transport refused this buffer (a GPU its NIC cannot read), so this buffer alone falls back.
  const std::string& fallback() const { return fallback_; }

 private:
  std::shared_ptr<MemoryRegion> region_;
  std::string fallback_;
};

// `bytes` of host memory registered with the transport for a sync's staging or arena, made
// resident; with `gpus`, also page-locked for their copies (cudaHostRegister: DMA straight from
// and into it, copies that overlap; where that fails, said once in the log and used pageable).
// `what` names it in messages ("a landing arena").
StatusOr<std::shared_ptr<MemoryRegion>> allocateHostStaging(Context& ctx, size_t bytes, DeviceRuntime* gpus,
                                                            const char* what);

// `inner` reaching host memory only: every device buffer is staged through pinned host memory,
// where `inner` would register it directly (shardcastd --device-memory staged: a fabric whose
// GPUDirect path is broken or slower than staging, and the staged pipeline's measurement).
std::unique_ptr<Context> stageDeviceMemory(std::unique_ptr<Context> inner);

}  // namespace shardcast::transport
