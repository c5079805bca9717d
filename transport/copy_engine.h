// Node-local copies between regions of one node: whole ranges, and strided sub-boxes (pack a box
// out of a row-major buffer, unpack it into another, or both at once). Used by the relay fan-out.
// Host memory uses memcpy on the calling thread; CUDA memory (when built with CUDA and a GPU is
// present) uses cudaMemcpyAsync on the engine's stream, completed by synchronize().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
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
