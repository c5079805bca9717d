#include "daemon/stage/stage.h"

#include "common/strings.h"
#include "daemon/stage/convert.h"

namespace shardcast::daemon {

Status issueBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
                const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes) {
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost)
    return host.copy(dst, src, extent, elem_bytes);
  if (device == nullptr) return absl::FailedPreconditionError("device memory to copy but no CUDA copy engine");
  return device->copy(dst, src, extent, elem_bytes);
}

Status copyBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
               const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes) {
  SC_RETURN_IF_ERROR(issueBox(host, device, dst, src, extent, elem_bytes));
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost) return absl::OkStatus();
  SC_ASSIGN_OR_RETURN(auto mark, device->mark());
  return mark ? mark->wait() : absl::OkStatus();
}

namespace {

// Bytes unchanged where the dtypes agree (a device copy issued, not waited for); the declared
// conversions (planner::convertible) converted on the host: device memory is copied to or from a
// dense host buffer around it, waited for.
class StandardStage final : public Stage {
 public:
  const char* name() const override { return "standard"; }
  Status pack(const TypedView& wire, const TypedView& memory, const std::vector<int64_t>& extent,
              const StageSite& site) override {
    if (computed(site)) return quantize(wire, memory, site);
    return move(wire, memory, extent, site);
  }
  Status unpack(const TypedView& memory, const TypedView& wire, const std::vector<int64_t>& extent,
                const StageSite& site) override {
    return move(memory, wire, extent, site);  // the wire holds the destination's values
  }
  Status copyLocal(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent,
                   const StageSite& site) override {
    if (computed(site)) return quantize(dst, src, site);
    return move(dst, src, extent, site);
  }

 private:
  static bool computed(const StageSite& site) {
    return site.layout != nullptr && (site.layout->blockScaled() || site.layout->scale_of >= 0);
  }
  // A block-scaled weight's fp8 values, or its blocks' scales, from a source rank's memory.
  Status quantize(const TypedView& dst, const TypedView& src, const StageSite& site) {
    if (dst.view.kind != transport::MemoryKind::kHost || src.view.kind != transport::MemoryKind::kHost)
      return absl::UnimplementedError(strCat("tensor ", quote(site.tensor),
                                             ": block-scaled fp8 is quantised from and into host memory only "
                                             "(not yet from or into a GPU)"));
    const Status st = site.layout->scale_of >= 0 ? scaleBox(dst.view, src.view, src.dtype, site.box, *site.layout)
                                                 : quantizeBox(dst.view, src.view, src.dtype, site.box, *site.layout);
    if (!st.ok()) return Status(st.code(), strCat("tensor ", quote(site.tensor), ": ", st.message()));
    return absl::OkStatus();
  }
  Status move(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent, const StageSite& site) {
    transport::CopyEngine* device = src.device ? src.device : dst.device;
    if (dst.dtype == src.dtype)
      return issueBox(*host_, device, dst.view, src.view, extent, planner::dtypeBytes(dst.dtype));
    if (!planner::convertible(src.dtype, dst.dtype))
      return absl::InvalidArgumentError(strCat("tensor ", quote(site.tensor), ": no conversion from ",
                                               planner::dtypeName(src.dtype), " to ", planner::dtypeName(dst.dtype)));
    const auto dense = transport::denseStrides(extent);
    int64_t count = 1;
    for (int64_t e : extent) count *= e;
    // Host on both sides: in place. Otherwise through dense host copies of the device side(s).
    std::vector<std::byte> src_host, dst_host;
    transport::StridedView from = src.view, to = dst.view;
    if (src.view.kind != transport::MemoryKind::kHost) {
      src_host.resize(static_cast<size_t>(count * planner::dtypeBytes(src.dtype)));
      from = {src_host.data(), transport::MemoryKind::kHost, 0, dense};
      SC_RETURN_IF_ERROR(copyBox(*host_, device, from, src.view, extent, planner::dtypeBytes(src.dtype)));
    }
    if (dst.view.kind != transport::MemoryKind::kHost) {
      dst_host.resize(static_cast<size_t>(count * planner::dtypeBytes(dst.dtype)));
      to = {dst_host.data(), transport::MemoryKind::kHost, 0, dense};
    }
    if (Status st = convertBox(to, dst.dtype, from, src.dtype, extent); !st.ok())
      return Status(st.code(), strCat("tensor ", quote(site.tensor), ": ", st.message()));
    if (dst.view.kind != transport::MemoryKind::kHost)
      return copyBox(*host_, device, dst.view, to, extent, planner::dtypeBytes(dst.dtype));
    return absl::OkStatus();
  }
  std::unique_ptr<transport::CopyEngine> host_ = transport::makeHostCopyEngine();
};

}  // namespace

std::unique_ptr<Stage> makeStandardStage() { return std::make_unique<StandardStage>(); }

}  // namespace shardcast::daemon
