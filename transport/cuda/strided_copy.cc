#include "transport/cuda/strided_copy.h"

#include <algorithm>
#include <cstring>

#include "common/strings.h"

namespace shardcast::transport {

StatusOr<StridedCopyPlan> planStridedCopy(const StridedView& dst, const StridedView& src,
                                          const std::vector<int64_t>& extent, int64_t elem_bytes,
                                          int64_t base_alignment, uint32_t max_blocks) {
  const int nd = static_cast<int>(extent.size());
  if (dst.strides.size() != extent.size() || src.strides.size() != extent.size())
    return absl::InvalidArgumentError(strCat("strided copy: extent has ", nd, " dims but strides have ",
                                             src.strides.size(), " (src) and ", dst.strides.size(), " (dst)"));
  if (elem_bytes <= 0) return absl::InvalidArgumentError("strided copy: element size must be positive");
  StridedCopyPlan p;
  p.dst_offset = dst.offset * elem_bytes;
  p.src_offset = src.offset * elem_bytes;
  for (int d = 0; d < nd; ++d)
    if (extent[d] <= 0) return p;  // runs = 0
  // Merge trailing dims while both sides are contiguous across them (size-1 dims never break it).
  int inner = nd;
  int64_t run = 1;
  while (inner > 0) {
    const int d = inner - 1;
    if (extent[d] == 1) {
      --inner;
      continue;
    }
    if (dst.strides[d] != run || src.strides[d] != run) break;
    run *= extent[d];
    --inner;
  }
  p.run_bytes = run * elem_bytes;
  p.runs = 1;
  for (int d = 0; d < inner; ++d) {
    if (extent[d] == 1) continue;  // contributes nothing to any offset
    if (p.outer_dims == kMaxCopyDims)
      return absl::InvalidArgumentError(strCat("strided copy: more than ", kMaxCopyDims, " strided dims"));
    p.outer_extent[p.outer_dims] = extent[d];
    p.dst_stride[p.outer_dims] = dst.strides[d] * elem_bytes;
    p.src_stride[p.outer_dims] = src.strides[d] * elem_bytes;
    p.runs *= extent[d];
    ++p.outer_dims;
  }
  auto divides = [](int64_t word, int64_t v) { return v % word == 0; };
  for (int word = 16; word >= 1; word /= 2) {
    bool ok = divides(word, base_alignment) && divides(word, p.run_bytes) && divides(word, p.dst_offset) &&
              divides(word, p.src_offset);
    for (int k = 0; k < p.outer_dims && ok; ++k) ok = divides(word, p.dst_stride[k]) && divides(word, p.src_stride[k]);
    if (ok) {
      p.word = word;
      break;
    }
  }
  const int64_t words = p.words();
  const int64_t blocks = (words + p.threads - 1) / p.threads;
  p.blocks = static_cast<uint32_t>(std::clamp<int64_t>(blocks, 1, max_blocks));
  return p;
}

void emulateStridedCopy(const StridedCopyPlan& plan, std::byte* dst_base, const std::byte* src_base) {
  const int64_t n = plan.words();
  for (int64_t w = 0; w < n; ++w) {
    int64_t d = 0, s = 0;
    stridedCopyWordOffsets(plan, w, &d, &s);
    std::memcpy(dst_base + d, src_base + s, static_cast<size_t>(plan.word));
  }
}

}  // namespace shardcast::transport
