// GPUs emulated in host memory, so that the device path of the copy engine and of a whole
// daemon runs where there is no GPU (tests; shardcastd --emulate-gpus). "Device memory" is host
// memory this object knows as some GPU's: buffers it allocates (in-process tests), shared-memory
// segments a client names in an emulated IPC handle (handleOf), or memfds a client hands over
// standing in for cuMem allocations (importAllocations). Kernels are emulated word by word
// as the kernel's threads copy (emulateStridedCopy). Nothing runs when issued: a stream's work
// queues up and runs, in order, only when one of its marks is waited for or it is synchronised,
// as a real stream may run it at any time later; so a caller that reads bytes before waiting for
// them reads stale ones. Two streams never order each other's work: work issued on one stream
// that touches bytes another stream's queued work writes (or writes bytes it reads) is a race on
// a real GPU, and is counted as a hazard (the daemon's emulation aborts on the first, naming it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "transport/device_copy.h"
#include "transport/device_runtime.h"
#include "transport/transport.h"

namespace shardcast::transport {

class EmulatedGpus final : public DeviceRuntime {
 public:
  // `abort_on_hazard`: a hazard is logged and ends the process (a daemon's emulation) instead of
  // only being counted (tests that look for them).
  explicit EmulatedGpus(int count, bool abort_on_hazard = false) : count_(count), abort_on_hazard_(abort_on_hazard) {}
  EmulatedGpus(const EmulatedGpus&) = delete;
  EmulatedGpus& operator=(const EmulatedGpus&) = delete;

  struct Counts {
    int launches = 0, copies = 0, scratch_allocations = 0, pins = 0, hazards = 0;
  };
  // The IPC handle a client registers the shared-memory segment `shm_name` with as device memory.
  static std::string handleOf(const std::string& shm_name);
  // Emulated GPU `device`'s UUID: "shardcast-gpu" and the number in 3 bytes, big-endian.
  static std::string uuidOf(int device);

  // `n` bytes of GPU `device`'s memory (valid while this object lives).
  std::byte* allocate(int device, size_t n);
  // A new stream of GPU `device` (it must not outlive this object).
  std::unique_ptr<DeviceStream> stream(int device, bool kernels = true);
  Counts counts() const;
  size_t queued() const;  // work issued on any stream and not run yet

  // The GPU whose emulated memory holds `p` (nullopt: none of them).
  std::optional<int> deviceOf(const void* p) const;

  int deviceCount() const override { return count_; }
  std::string unavailableReason() const override;
  std::string uuid(int device) const override { return device >= 0 && device < count_ ? uuidOf(device) : ""; }
  StatusOr<std::unique_ptr<CudaIpcMapping>> importHandle(const std::string& handle, size_t size, int device,
                                                         std::optional<uid_t> owner) override;
  // Emulated cuMem allocations are memfds (any file the daemon can map): mapped one after another
  // into one reserved range of host memory, as cuMemAddressReserve and cuMemMap do; the
  // granularity is the page size. A descriptor truncated later is caught by check().
  StatusOr<std::unique_ptr<CudaIpcMapping>> importAllocations(std::vector<OwnedFd> fds,
                                                              const std::vector<uint64_t>& allocation_bytes,
                                                              int device) override;
  StatusOr<std::unique_ptr<CopyEngine>> makeEngine(int device) override;
  StatusOr<std::unique_ptr<HostPin>> pinHost(void* data, size_t size) override;
  // Freed with the returned object (unlike allocate()'s, which live as long as this one).
  StatusOr<std::unique_ptr<DeviceMemory>> allocateDevice(int device, size_t size) override;
  bool peerAccess(int, int) const override { return true; }  // (host memory underneath)

 private:
  class Stream;
  friend class Stream;
  // The bytes one queued piece of work reads and writes: sorted, merged [begin, end) ranges.
  struct Footprint {
    std::vector<std::pair<uintptr_t, uintptr_t>> reads, writes;
  };
  // Checks work about to be queued on stream `stream` against every other stream's queued work,
  // then records it; `done` when it has run.
  void queue(const void* stream, uint64_t seq, Footprint f, const std::string& what);
  void done(const void* stream, uint64_t seq);
  struct Range {
    size_t size = 0;
    int device = 0;
  };
  bool onDevice(const void* p, int device) const;
  void addRange(const std::byte* p, size_t n, int device);
  void removeRange(const std::byte* p);
  void counted(int Counts::*counter, int queued_delta);

  const int count_;
  const bool abort_on_hazard_;
  struct Queued {
    const void* stream;
    uint64_t seq;
    Footprint f;
    std::string what;
  };
  std::vector<Queued> pending_;  // every stream's work not run yet
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> memory_;
  std::map<const std::byte*, Range> ranges_;
  size_t queued_ = 0;
  Counts counts_;
};

// `inner` reaching the emulated GPUs' memory as a CUDA-aware UCX reaches device memory
// (shardcastd --emulate-gpu-reach, tests only), so that the direct path's decisions run without a
// GPU: canAccess(kCuda), and device memory of the GPUs in `reach` (every GPU when empty)
// registered with `inner` as the host memory it really is (rkeys for "device memory"); memory of
// the others is refused (FAILED_PRECONDITION), as a NIC that cannot read a GPU's memory refuses
// it, so those buffers fall back to staging one by one (TransferMemory::prepare). `gpus` must
// outlive the context.
std::unique_ptr<Context> reachEmulatedGpus(std::unique_ptr<Context> inner, const EmulatedGpus& gpus,
                                           std::set<int> reach);

}  // namespace shardcast::transport
