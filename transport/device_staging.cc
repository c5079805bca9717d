#include "transport/device_staging.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <string>

#include "common/strings.h"
#include "transport/resident.h"

namespace shardcast::transport {

StatusOr<std::unique_ptr<TransferMemory>> TransferMemory::prepare(Context& ctx, void* data, size_t size,
                                                                  MemoryKind kind, CopyEngine* copies) {
  auto m = std::make_unique<TransferMemory>();
  const bool stageable = kind != MemoryKind::kHost && copies && copies->canCopy(MemoryKind::kHost, kind);
  if (ctx.canAccess(kind)) {
    auto region = ctx.registerMemory(data, size, kind);
    if (region.ok() || !stageable) {
      SC_ASSIGN_OR_RETURN(m->region_, std::move(region));
      return m;
    }
    m->fallback_ = strCat("the transport reaches ", memoryKindName(kind), " memory but refused this buffer (",
                          region.status().message(), ")");
    return m;
  }
  if (!stageable)
    return absl::FailedPreconditionError(strCat("transport ", ctx.describe(), " cannot reach ", memoryKindName(kind),
                                                " memory and no copy engine can stage it"));
  return m;
}

StatusOr<std::shared_ptr<MemoryRegion>> allocateHostStaging(Context& ctx, size_t bytes, DeviceRuntime* gpus,
                                                            const char* what) {
  SC_ASSIGN_OR_RETURN(auto region, ctx.allocateMemory(bytes));
  makeResident(region->data(), region->size(), what);
  if (gpus == nullptr) return region;
  auto pin = gpus->pinHost(region->data(), region->size());
  if (!pin.ok()) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      spdlog::warn(
          "{} of {} bytes is not page-locked for the GPU ({}): device copies to and from it are staged "
          "by the driver and do not overlap",
          what, bytes, std::string(pin.status().message()));
    return region;
  }
  // One owner for both; members go in reverse: unpinned before the region is released.
  struct Pinned {
    std::shared_ptr<MemoryRegion> region;
    std::unique_ptr<HostPin> pin;
  };
  auto owner = std::make_shared<Pinned>(Pinned{region, std::move(*pin)});
  return std::shared_ptr<MemoryRegion>(owner, owner->region.get());
}

namespace {

class StagedDeviceMemory final : public ForwardingContext {
 public:
  using ForwardingContext::ForwardingContext;
  std::string describe() const override {
    return strCat(inner().describe(), inner().canAccess(MemoryKind::kCuda) ? ", device memory staged all the same" : "",
                  " (--device-memory staged)");
  }
  bool canAccess(MemoryKind kind) const override { return kind == MemoryKind::kHost; }
  StatusOr<std::shared_ptr<MemoryRegion>> registerMemory(void* data, size_t size, MemoryKind kind) override {
    if (kind != MemoryKind::kHost)
      return absl::FailedPreconditionError(
          strCat(memoryKindName(kind), " memory is staged through host memory here (--device-memory staged)"));
    return inner().registerMemory(data, size, kind);
  }
};

}  // namespace

std::unique_ptr<Context> stageDeviceMemory(std::unique_ptr<Context> inner) {
  return std::make_unique<StagedDeviceMemory>(std::move(inner));
}

}  // namespace shardcast::transport
