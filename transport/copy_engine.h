// Node-local copies between regions of one node: whole ranges, and strided sub-boxes (pack a box
// out of a row-major buffer, unpack it into another, or both at once). Used by the relay fan-out.
// Host memory uses memcpy on the calling thread (done when copy() returns); CUDA memory (when
// built with CUDA and a GPU is present) uses the engine's stream (transport/device_copy.h): a copy
// is issued, not done, when copy() returns; mark() and synchronize() say when it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "common/status.h"
#include "transport/transport.h"

namespace shardcast::transport {

// A box inside a buffer: element (i0, i1, ...) of the box is at
// base + (offset + sum_d i_d * strides[d]) * elem_bytes. Strides are in elements.
struct StridedView {
  std::byte* base = nullptr;
  MemoryKind kind = MemoryKind::kHost;
  int64_t offset = 0;
  std::vector<int64_t> strides;
};

// Row-major strides of a dense box of `extent`.
std::vector<int64_t> denseStrides(const std::vector<int64_t>& extent);

// A point in an engine's order of copies: wait() returns once every copy issued before the mark
// was taken is done.
class CopyMark {
 public:
  virtual ~CopyMark() = default;
  virtual Status wait() = 0;
};

struct Fp8QuantizeBox;  // transport/cuda/fp8_quantize.h

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual const char* name() const = 0;
  virtual bool canCopy(MemoryKind dst, MemoryKind src) const = 0;
  // Copies the box of `extent` elements of elem_bytes each from src to dst. Innermost runs that
  // are contiguous on both sides are merged, so a dense box is one memcpy.
  virtual Status copy(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
                      int64_t elem_bytes) = 0;
  // Waits for every copy issued so far (a no-op for host copies).
  virtual Status synchronize() = 0;
  // A mark after every copy issued so far; null when they are all done already (host copies).
  virtual StatusOr<std::shared_ptr<CopyMark>> mark() { return std::shared_ptr<CopyMark>(); }
  // Quantises `box` (transport/cuda/fp8_quantize.h) from `src`, device memory of this engine's
  // GPU, into `dst` (its offset and strides: the box's output; any memory), in stream order.
  // UNIMPLEMENTED for engines without the kernel.
  virtual Status quantizeFp8(const StridedView& dst, const StridedView& src, const Fp8QuantizeBox& box);

  // Delta chunks of device memory, on this engine's GPU (transport/cuda/delta_kernels.h); each
  // waits for its work. UNIMPLEMENTED for engines without the kernels (deltaKernels() false).
  virtual bool deltaKernels() const { return false; }
  // Encodes `now` against `base` (`bytes` each, on this GPU; units of `unit` bytes) into `out`
  // (host memory with room for `cap` bytes) and writes `now` into `base` either way. The delta's
  // size, or nullopt when it needs more than `cap` (then `out` is undefined: send `now` dense);
  // `*hash`: the tree hash of `now` (delta_plan.h's treeHash).
  virtual StatusOr<std::optional<size_t>> encodeDelta(const std::byte* now, std::byte* base, size_t bytes, size_t unit,
                                                      std::byte* out, size_t cap, uint64_t* hash);
  // Applies `delta` (host memory, a peer's: parsed and bounded first, INVALID_ARGUMENT when
  // malformed) to `chunk` (`bytes` on this GPU). Returns the tree hash of the result.
  virtual StatusOr<uint64_t> applyDelta(std::byte* chunk, size_t bytes, size_t unit, const std::byte* delta,
                                        size_t delta_bytes);
  // The tree hash of `bytes` at `data` on this GPU.
  virtual StatusOr<uint64_t> treeHashOf(const std::byte* data, size_t bytes);
};

// memcpy between host regions.
std::unique_ptr<CopyEngine> makeHostCopyEngine();
// CUDA copies for any pair of host/device memory; UNAVAILABLE when CUDA support was not built or
// no GPU is present (the message says which).
StatusOr<std::unique_ptr<CopyEngine>> makeCudaCopyEngine(int device);

// The runs of a strided box copy: calls fn(dst_byte_offset, src_byte_offset, bytes) for every
// maximal contiguous run (shared by the host and CUDA engines).
template <typename Fn>
void forEachRun(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes,
                Fn&& fn);

}  // namespace shardcast::transport

#include "transport/copy_engine_inl.h"
