// Template body of forEachRun (see copy_engine.h).
#pragma once

#include <array>

namespace shardcast::transport {

template <typename Fn>
void forEachRun(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes,
                Fn&& fn) {
  const int nd = static_cast<int>(extent.size());
  for (int d = 0; d < nd; ++d)
    if (extent[d] <= 0) return;
  // Merge trailing dims while both sides are contiguous across them.
  int inner = nd;  // dims [inner, nd) form one run
  int64_t run = 1;
  while (inner > 0) {
    const int d = inner - 1;
    if (dst.strides[d] != run || src.strides[d] != run) {
      if (extent[d] == 1) {  // a size-1 dim never breaks contiguity
        --inner;
        continue;
      }
      break;
    }
    run *= extent[d];
    --inner;
  }
  const int64_t run_bytes = run * elem_bytes;
  std::vector<int64_t> idx(inner, 0);
  while (true) {
    int64_t so = src.offset, doff = dst.offset;
    for (int d = 0; d < inner; ++d) {
      so += idx[d] * src.strides[d];
      doff += idx[d] * dst.strides[d];
    }
    fn(doff * elem_bytes, so * elem_bytes, run_bytes);
    int d = inner - 1;
    while (d >= 0 && ++idx[d] == extent[d]) idx[d] = 0, --d;
    if (d < 0) return;
  }
}

}  // namespace shardcast::transport
