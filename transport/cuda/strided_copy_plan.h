// The plan of one strided box copy as one CUDA kernel launch (see strided_copy.h): plain data
// and the index math, shared by the kernel (strided_copy.cu, compiled by nvcc without the rest
// of the project's headers) and the host.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SC_HOST_DEVICE __host__ __device__
#else
#define SC_HOST_DEVICE
#endif

namespace shardcast::transport {

inline constexpr int kMaxCopyDims = 8;

struct StridedCopyPlan {
  int outer_dims = 0;                    // dims iterated over, outermost first (the run is the rest)
  int64_t outer_extent[kMaxCopyDims]{};  // elements per outer dim
  int64_t dst_stride[kMaxCopyDims]{};    // bytes per step of each outer dim
  int64_t src_stride[kMaxCopyDims]{};
  int64_t dst_offset = 0, src_offset = 0;  // bytes of the first element from each base
  int64_t run_bytes = 0;                   // contiguous bytes per run (both sides)
  int64_t runs = 0;                        // product of outer_extent (0: nothing to copy)
  int word = 1;                            // bytes per access: 16, 8, 4, 2 or 1
  SC_HOST_DEVICE int64_t words() const { return runs * (run_bytes / word); }
  // Launch geometry for `words()` (at most `max_blocks` blocks of `threads`, grid-stride beyond).
  uint32_t threads = 256;
  uint32_t blocks = 0;
};

// Byte offsets (from the bases) of word `w` (0 <= w < plan.words()) on both sides: what thread w
// of the kernel copies.
SC_HOST_DEVICE inline void stridedCopyWordOffsets(const StridedCopyPlan& p, int64_t w, int64_t* dst, int64_t* src) {
  const int64_t per_run = p.run_bytes / p.word;
  int64_t run = w / per_run;
  const int64_t in_run = (w - run * per_run) * p.word;
  int64_t d = p.dst_offset + in_run, s = p.src_offset + in_run;
  for (int k = p.outer_dims - 1; k >= 0; --k) {
    const int64_t i = run % p.outer_extent[k];
    run /= p.outer_extent[k];
    d += i * p.dst_stride[k];
    s += i * p.src_stride[k];
  }
  *dst = d;
  *src = s;
}

// Launches the copy on `stream` (a cudaStream_t; both bases device-accessible). Returns the
// cudaError_t of the launch (0: launched), or kStridedCopyNotBuilt where the kernel was not
// compiled (strided_copy_none.cc: the caller copies run by run). Defined in strided_copy.cu.
inline constexpr int kStridedCopyNotBuilt = -1;
int launchStridedCopyKernel(const StridedCopyPlan& plan, std::byte* dst_base, const std::byte* src_base, void* stream);
// Whether launchStridedCopyKernel launches (false: it answers kStridedCopyNotBuilt).
bool stridedCopyKernelBuilt();

}  // namespace shardcast::transport
