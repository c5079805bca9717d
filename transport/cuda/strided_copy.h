// One strided box copy as one CUDA kernel launch (transport/cuda/strided_copy.cu): the box is
// flattened into `runs` contiguous runs (trailing dims merged where both sides are contiguous, as
// forEachRun does), each run copied in words of `word` bytes, one word per thread of a grid-stride
// loop. The plan and the index math are plain C++ shared by the kernel and the CPU: tests run
// `stridedCopyWordOffsets` on the host against the host copy engine (tests/transport/
// strided_copy_test.cc), so the geometry is checked where no GPU is.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "transport/copy_engine.h"
#include "transport/cuda/strided_copy_plan.h"

namespace shardcast::transport {

// The plan of copying the box of `extent` elements of `elem_bytes` from src to dst (strides in
// elements, as StridedView). The word is the largest power of two up to 16 that divides the run's
// bytes, both offsets and every outer stride in bytes, so each access is aligned on both sides
// when the bases are 16-byte aligned (cudaMalloc's are 256); `base_alignment` is the alignment
// both bases are known to have. INVALID_ARGUMENT when the ranks disagree or exceed kMaxCopyDims.
StatusOr<StridedCopyPlan> planStridedCopy(const StridedView& dst, const StridedView& src,
                                          const std::vector<int64_t>& extent, int64_t elem_bytes,
                                          int64_t base_alignment = 16, uint32_t max_blocks = 4096);

// Emulates the kernel on the host, word by word, in its order (for tests).
void emulateStridedCopy(const StridedCopyPlan& plan, std::byte* dst_base, const std::byte* src_base);

}  // namespace shardcast::transport
