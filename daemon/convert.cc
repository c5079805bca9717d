#include "daemon/convert.h"

#include "common/strings.h"

namespace shardcast::daemon {

Status convertBox(const transport::StridedView& dst, planner::DType to, const transport::StridedView& src,
                  planner::DType from, const std::vector<int64_t>& extent) {
  if (from != planner::DType::kFloat32 || to != planner::DType::kBFloat16)
    return absl::InvalidArgumentError(
        strCat("no conversion from ", planner::dtypeName(from), " to ", planner::dtypeName(to)));
  const size_t nd = extent.size();
  if (dst.strides.size() != nd || src.strides.size() != nd)
    return absl::InvalidArgumentError(strCat("convert: extent has ", nd, " dims but strides have ", src.strides.size(),
                                             " (src) and ", dst.strides.size(), " (dst)"));
  for (int64_t e : extent)
    if (e <= 0) return absl::OkStatus();
  const auto* in = reinterpret_cast<const float*>(src.base);
  auto* out = reinterpret_cast<uint16_t*>(dst.base);
  if (nd == 0) {
    out[dst.offset] = bfloat16FromFloat(in[src.offset]);
    return absl::OkStatus();
  }
  // Row by row along the innermost dim; the outer index walks the rest of the box.
  const int64_t inner = extent[nd - 1], si = src.strides[nd - 1], di = dst.strides[nd - 1];
  std::vector<int64_t> idx(nd - 1, 0);
  while (true) {
    int64_t s = src.offset, d = dst.offset;
    for (size_t k = 0; k + 1 < nd; ++k) {
      s += idx[k] * src.strides[k];
      d += idx[k] * dst.strides[k];
    }
    for (int64_t i = 0; i < inner; ++i) out[d + i * di] = bfloat16FromFloat(in[s + i * si]);
    size_t k = nd - 1;
    while (k > 0 && ++idx[k - 1] == extent[k - 1]) idx[--k] = 0;
    if (k == 0) return absl::OkStatus();
  }
}

}  // namespace shardcast::daemon
