// The copy engine of one GPU stream, written against a small interface of stream operations so
// that its decisions run anywhere: CUDA implements the interface (cuda/cuda_support.cc), tests
// emulate it on the host with deferred work (tests/transport/device_copy_test.cc), and both run
// the same engine code.
//
// How a box is copied:
//  - device to device on the stream's GPU, more than one contiguous run: one launch of the
//    strided-copy kernel (cuda/strided_copy.h);
//  - between the stream's GPU and anything else (host memory, another GPU) when the GPU side has
//    many more runs than the other: bounced through dense device scratch, so the GPU side is one
//    kernel launch and the DMA copies are the other side's runs (a TP column slice packed into
//    the dense wire is one kernel and one copy, not a copy per row);
//  - otherwise one stream copy per contiguous run.
// Nothing waits: copies complete in stream order; mark() records where the stream is, and
// synchronize() waits for everything issued.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/status.h"
#include "transport/copy_engine.h"
#include "transport/cuda/delta_plan.h"
#include "transport/cuda/fp8_quantize_plan.h"
#include "transport/cuda/strided_copy_plan.h"

namespace shardcast::transport {

// The operations of one in-order device stream. Calls are serialised by the engine.
class DeviceStream {
 public:
  virtual ~DeviceStream() = default;
  // "cuda:0", for messages.
  virtual std::string name() const = 0;
  // Whether `p` is memory of this stream's GPU (the kernel may read and write it).
  virtual bool local(const void* p) const = 0;
  // Whether the strided-copy kernel was built (launch() takes plans).
  virtual bool kernels() const = 0;
  virtual Status launch(const StridedCopyPlan& plan, std::byte* dst, const std::byte* src) = 0;
  // The fp8 quantisation kernel (cuda/fp8_quantize.h), both bases on this stream's GPU;
  // UNIMPLEMENTED where it was not built.
  virtual Status quantize(const Fp8QuantizePlan& plan, std::byte* dst, const std::byte* src) {
    (void)plan, (void)dst, (void)src;
    return absl::UnimplementedError(name() + ": the fp8 quantisation kernel was not built");
  }
  // The delta kernels (cuda/delta_kernels.h), every pointer on this stream's GPU; UNIMPLEMENTED
  // where they were not built. `out_bytes` and `chunk_bytes`: what the kernel writes (for the
  // emulated GPUs' hazard checks).
  virtual Status deltaTiles(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles);
  virtual Status deltaWrite(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                            std::byte* out, int64_t out_bytes);
  virtual Status deltaScatter(int32_t unit, std::byte* chunk, int64_t chunk_bytes, const int64_t* units,
                              const std::byte* values, int64_t count);
  virtual Status hashLeaves(const std::byte* data, int64_t bytes, uint64_t* leaves);
  virtual Status copy(void* dst, const void* src, size_t n) = 0;
  // Device memory of at least n bytes for work issued from now on; valid until the next call
  // (memory it replaces is released in stream order, after the work already issued on it).
  virtual StatusOr<std::byte*> scratch(size_t n) = 0;
  // A mark after everything issued so far.
  virtual StatusOr<std::shared_ptr<CopyMark>> record() = 0;
  virtual Status synchronize() = 0;
};

// The engine over `stream`; canCopy() is true for every pair of kinds.
std::unique_ptr<CopyEngine> makeStreamCopyEngine(std::unique_ptr<DeviceStream> stream);

// The largest box bounced through device scratch; bigger ones are copied run by run.
inline constexpr int64_t kMaxBounceBytes = int64_t{256} << 20;

}  // namespace shardcast::transport
