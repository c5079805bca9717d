#include "transport/device_staging.h"

#include "common/strings.h"

namespace shardcast::transport {

StatusOr<std::unique_ptr<TransferMemory>> TransferMemory::prepare(Context& ctx, void* data, size_t size,
                                                                  MemoryKind kind, CopyEngine* copies) {
  auto m = std::make_unique<TransferMemory>();
  m->data_ = data;
  m->size_ = size;
  m->copies_ = copies;
  if (ctx.canAccess(kind)) {
    SC_ASSIGN_OR_RETURN(m->region_, ctx.registerMemory(data, size, kind));
    return m;
  }
  if (!copies || !copies->canCopy(MemoryKind::kHost, kind))
    return absl::FailedPreconditionError(strCat("transport ", ctx.describe(), " cannot reach ", memoryKindName(kind),
                                                " memory and no copy engine can stage it"));
  SC_ASSIGN_OR_RETURN(m->pinned_, allocatePinned(size));
  SC_ASSIGN_OR_RETURN(m->region_, ctx.registerMemory(m->pinned_->data(), size, MemoryKind::kHost));
  return m;
}

namespace {
Status stage(CopyEngine& e, void* dst, MemoryKind dk, const void* src, MemoryKind sk, size_t n) {
  StridedView d{static_cast<std::byte*>(dst), dk, 0, {1}};
  StridedView s{static_cast<std::byte*>(const_cast<void*>(src)), sk, 0, {1}};
  SC_RETURN_IF_ERROR(e.copy(d, s, {static_cast<int64_t>(n)}, 1));
  return e.synchronize();
}
}  // namespace

Status TransferMemory::stageOut(size_t offset, size_t n) {
  if (!pinned_) return absl::OkStatus();
  if (offset > size_ || n > size_ - offset) return absl::OutOfRangeError("stageOut: range outside the memory");
  return stage(*copies_, static_cast<std::byte*>(pinned_->data()) + offset, MemoryKind::kHost,
               static_cast<std::byte*>(data_) + offset, MemoryKind::kCuda, n);
}

Status TransferMemory::stageIn(size_t offset, size_t n) {
  if (!pinned_) return absl::OkStatus();
  if (offset > size_ || n > size_ - offset) return absl::OutOfRangeError("stageIn: range outside the memory");
  return stage(*copies_, static_cast<std::byte*>(data_) + offset, MemoryKind::kCuda,
               static_cast<std::byte*>(pinned_->data()) + offset, MemoryKind::kHost, n);
}

}  // namespace shardcast::transport
