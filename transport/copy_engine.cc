#include "transport/copy_engine.h"

#include <cstring>

#include "common/strings.h"
#include "transport/cuda/fp8_quantize.h"

namespace shardcast::transport {

Status CopyEngine::quantizeFp8(const StridedView&, const StridedView&, const Fp8QuantizeBox&) {
  return absl::UnimplementedError(strCat("the ", name(), " copy engine does not quantise fp8"));
}

StatusOr<std::optional<size_t>> CopyEngine::encodeDelta(const std::byte*, std::byte*, size_t, size_t, std::byte*,
                                                        size_t, uint64_t*) {
  return absl::UnimplementedError(strCat("the ", name(), " copy engine does not encode deltas"));
}

StatusOr<uint64_t> CopyEngine::applyDelta(std::byte*, size_t, size_t, const std::byte*, size_t) {
  return absl::UnimplementedError(strCat("the ", name(), " copy engine does not apply deltas"));
}

StatusOr<uint64_t> CopyEngine::treeHashOf(const std::byte*, size_t) {
  return absl::UnimplementedError(strCat("the ", name(), " copy engine does not hash"));
}

std::vector<int64_t> denseStrides(const std::vector<int64_t>& extent) {
  std::vector<int64_t> s(extent.size());
  int64_t acc = 1;
  for (int d = static_cast<int>(extent.size()) - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= extent[d];
  }
  return s;
}

namespace {

class HostCopyEngine final : public CopyEngine {
 public:
  const char* name() const override { return "host-memcpy"; }
  bool canCopy(MemoryKind dst, MemoryKind src) const override {
    return dst == MemoryKind::kHost && src == MemoryKind::kHost;
  }
  Status copy(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
              int64_t elem_bytes) override {
    if (!canCopy(dst.kind, src.kind))
      return absl::FailedPreconditionError(strCat("host copy engine cannot copy ", memoryKindName(src.kind), " to ",
                                                  memoryKindName(dst.kind), " memory"));
    if (dst.strides.size() != extent.size() || src.strides.size() != extent.size())
      return absl::InvalidArgumentError(strCat("copy: extent has ", extent.size(), " dims but strides have ",
                                               src.strides.size(), " (src) and ", dst.strides.size(), " (dst)"));
    forEachRun(dst, src, extent, elem_bytes, [&](int64_t d, int64_t s, int64_t n) {
      std::memcpy(dst.base + d, src.base + s, static_cast<size_t>(n));
    });
    return absl::OkStatus();
  }
  Status synchronize() override { return absl::OkStatus(); }
};

}  // namespace

std::unique_ptr<CopyEngine> makeHostCopyEngine() { return std::make_unique<HostCopyEngine>(); }

}  // namespace shardcast::transport
