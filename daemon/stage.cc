#include "daemon/stage.h"

#include "common/strings.h"

namespace shardcast::daemon {

Status copyBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
               const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes) {
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost)
    return host.copy(dst, src, extent, elem_bytes);
  if (device == nullptr) return absl::FailedPreconditionError("device memory to copy but no CUDA copy engine");
  SC_RETURN_IF_ERROR(device->copy(dst, src, extent, elem_bytes));
  return device->synchronize();
}

namespace {

class CopyStage final : public Stage {
 public:
  const char* name() const override { return "copy"; }
  Status pack(const TypedView& wire, const TypedView& memory, const std::vector<int64_t>& extent,
              const StageSite& site) override {
    return move(wire, memory, extent, site);
  }
  Status unpack(const TypedView& memory, const TypedView& wire, const std::vector<int64_t>& extent,
                const StageSite& site) override {
    return move(memory, wire, extent, site);
  }
  Status copyLocal(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent,
                   const StageSite& site) override {
    return move(dst, src, extent, site);
  }

 private:
  Status move(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent, const StageSite& site) {
    if (dst.dtype != src.dtype)
      return absl::InvalidArgumentError(strCat("tensor ", quote(site.tensor), ": ", planner::dtypeName(src.dtype),
                                               " -> ", planner::dtypeName(dst.dtype),
                                               " needs a converting stage; stage \"copy\" moves bytes unchanged"));
    return copyBox(*host_, dst.device ? dst.device : src.device, dst.view, src.view, extent,
                   planner::dtypeBytes(dst.dtype));
  }
  std::unique_ptr<transport::CopyEngine> host_ = transport::makeHostCopyEngine();
};

}  // namespace

std::unique_ptr<Stage> makeCopyStage() { return std::make_unique<CopyStage>(); }

}  // namespace shardcast::daemon
