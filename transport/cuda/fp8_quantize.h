// Block-scaled fp8 e4m3 quantisation of device memory (transport/cuda/fp8_quantize.cu): one CUDA
// block per fp8 block the box touches reduces the block's amax in shared memory, derives its
// scale, then writes the block's elements inside the box (or, for a scale tensor, the scale).
// The plan and the per-element math are plain C++ (fp8_quantize_plan.h): the emulated GPUs run
// them on the host (emulateFp8Quantize), so the geometry and the bits are checked where no GPU is
// (tests/transport/fp8_quantize_test.cc), and the device check runs the kernel on a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "transport/cuda/fp8_quantize_plan.h"

namespace shardcast::transport {

// What to quantise. `lo`/`hi`: the box written (weight elements, or block indices for `scales`).
// The source: the weight's element strides and the element offset of its element `lo` (weights)
// or `lo * block` (scales). The output: strides and offset of its element `lo`, in e4m3 bytes or
// float32 scales.
struct Fp8QuantizeBox {
  std::vector<int64_t> shape, block, lo, hi;
  std::vector<int64_t> src_strides;
  int64_t src_offset = 0;
  std::vector<int64_t> dst_strides;
  int64_t dst_offset = 0;
  bool bf16 = false, pow2 = false, scales = false;
  // The amax of every block the box touches is `amax` (a block split between source ranks:
  // daemon/engine/split_amax.h): nothing around the box is read.
  bool given = false;
  float amax = 0.0f;
};

// INVALID_ARGUMENT when the dims disagree, exceed kMaxCopyDims, or the box leaves the tensor.
StatusOr<Fp8QuantizePlan> planFp8Quantize(const Fp8QuantizeBox& box, uint32_t max_grid = 65535);

// The same work on the host, block by block (the emulated GPUs' kernel).
void emulateFp8Quantize(const Fp8QuantizePlan& plan, std::byte* dst_base, const std::byte* src_base);

// The byte ranges [first, last) of the source the plan reads and of the output it writes
// (offsets from the bases; for the emulated GPUs' hazard checks).
void fp8QuantizeFootprint(const Fp8QuantizePlan& plan, int64_t* src_first, int64_t* src_last, int64_t* dst_first,
                          int64_t* dst_last);

// Launches the kernel on `stream` (a cudaStream_t; both bases on the stream's GPU). Returns the
// cudaError_t of the launch (0: launched) or kStridedCopyNotBuilt where the kernels were not
// compiled (fp8_quantize_none.cc). Defined in fp8_quantize.cu.
int launchFp8QuantizeKernel(const Fp8QuantizePlan& plan, std::byte* dst_base, const std::byte* src_base, void* stream);

}  // namespace shardcast::transport
