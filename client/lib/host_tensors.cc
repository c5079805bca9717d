#include "client/lib/host_tensors.h"

#include <unistd.h>

#include <atomic>

#include "common/strings.h"
#include "planner/layout.h"
#include "transport/cuda/cuda_support.h"
#include "transport/shm.h"

namespace shardcast {

namespace {

constexpr uint64_t kAlign = 64;

std::string defaultSegmentName() {
  static std::atomic<int> counter{0};
  return strCat("/shardcast-", ::getpid(), "-", counter++);
}

}  // namespace

HostTensors::HostTensors(std::unique_ptr<transport::ShmSegment> seg, std::map<std::string, Slot> slots)
    : seg_(std::move(seg)), slots_(std::move(slots)) {}
HostTensors::HostTensors(HostTensors&&) noexcept = default;
HostTensors& HostTensors::operator=(HostTensors&&) noexcept = default;
HostTensors::~HostTensors() = default;

StatusOr<HostTensors> HostTensors::create(const std::vector<std::pair<std::string, uint64_t>>& buffers,
                                          const std::string& segment) {
  std::map<std::string, Slot> slots;
  uint64_t end = 0;
  for (const auto& [name, bytes] : buffers) {
    if (name.empty()) return absl::InvalidArgumentError("a host buffer needs a name");
    if (!slots.emplace(name, Slot{end, bytes}).second)
      return absl::InvalidArgumentError(strCat("host buffer \"", name, "\" is given twice"));
    end += (bytes + kAlign - 1) / kAlign * kAlign;
  }
  SC_ASSIGN_OR_RETURN(auto seg, transport::ShmSegment::create(segment.empty() ? defaultSegmentName() : segment,
                                                              std::max<uint64_t>(end, kAlign)));
  return HostTensors(std::make_unique<transport::ShmSegment>(std::move(seg)), std::move(slots));
}

StatusOr<HostTensors> HostTensors::forRank(const v1::Layout& layout, int32_t rank, const std::string& segment) {
  planner::NodeTable nodes;
  SC_ASSIGN_OR_RETURN(const auto resolved, planner::resolveLayout(layout, nodes));
  if (rank < 0 || rank >= resolved.world())
    return absl::InvalidArgumentError(
        strCat("group \"", layout.group(), "\": rank ", rank, " is outside 0..", resolved.world() - 1));
  std::vector<std::pair<std::string, uint64_t>> buffers;
  for (const auto& [buffer, bytes] : resolved.rankBuffers(rank))
    buffers.emplace_back(resolved.buffer_names[buffer], static_cast<uint64_t>(bytes));
  return create(buffers, segment);
}

StatusOr<HostTensors> HostTensors::adopt(const std::string& segment, std::map<std::string, Slot> buffers) {
  uint64_t end = 0;
  for (const auto& [name, slot] : buffers) {
    if (slot.offset > UINT64_MAX - slot.bytes)
      return absl::InvalidArgumentError(strCat("host buffer \"", name, "\": offset overflows"));
    end = std::max(end, slot.offset + slot.bytes);
  }
  SC_ASSIGN_OR_RETURN(auto seg, transport::ShmSegment::open(segment, end));
  return HostTensors(std::make_unique<transport::ShmSegment>(std::move(seg)), std::move(buffers));
}

std::span<std::byte> HostTensors::bytes(const std::string& name) const {
  const auto it = slots_.find(name);
  if (it == slots_.end()) return {};
  return {static_cast<std::byte*>(seg_->data()) + it->second.offset, it->second.bytes};
}

const std::string& HostTensors::segment() const { return seg_->name(); }

std::vector<v1::MemoryHandle> HostTensors::handles() const {
  std::vector<v1::MemoryHandle> out;
  for (const auto& [name, slot] : slots_) {
    v1::MemoryHandle h;
    h.set_buffer(name);
    h.mutable_shm()->set_name(seg_->name());
    h.mutable_shm()->set_offset(slot.offset);
    h.mutable_shm()->set_size(slot.bytes);
    out.push_back(std::move(h));
  }
  return out;
}

StatusOr<v1::MemoryHandle> deviceHandle(const DeviceTensor& tensor) {
  // The handle is the bare cudaIpcMemHandle_t of the allocation (64 bytes), made here from the
  // pointer: never a PyTorch shareable handle, whose prefixed format the Python client decodes.
  auto exported = transport::exportCudaIpcHandle(tensor.data);
  if (!exported.ok())
    return Status(exported.status().code(),
                  strCat("device tensor \"", tensor.name, "\": ", exported.status().message()));
  v1::MemoryHandle h;
  h.set_buffer(tensor.name);
  h.mutable_cuda()->set_handle(exported->handle);
  h.mutable_cuda()->set_offset(exported->offset);
  h.mutable_cuda()->set_size(tensor.bytes);
  h.mutable_cuda()->set_device(exported->device);
  // The daemon finds the GPU by it: this process's device numbers may not be the daemon's.
  h.mutable_cuda()->set_device_uuid(transport::cudaDeviceUuid(exported->device));
  return h;
}

}  // namespace shardcast
