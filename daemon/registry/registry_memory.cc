// The registry's memory: the shm segments, CUDA IPC allocations and handed-over cuMem allocations a
// rank's handles name, checked against what the layout gives the rank and against who calls,
// mapped and registered with the transport once (daemon/registry/registry.h).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/strings.h"
#include "daemon/registry/registry.h"
#include "planner/layout.h"
#include "transport/cuda/cuda_support.h"
#include "transport/resident.h"

namespace shardcast::daemon {

namespace {

// The handles a registration gives against what the layout says the rank holds: one per buffer it
// holds and no other, each of the layout's dtype and, where given, of the rank's shape (as many
// elements in the same order); by buffer name.
StatusOr<std::map<std::string, const v1::MemoryHandle*>> checkHandles(
    const std::string& who, const google::protobuf::RepeatedPtrField<v1::MemoryHandle>& handles,
    const std::map<std::string, int64_t>& needed, const std::map<std::string, const planner::TensorLayout*>& held_by,
    const std::map<std::string, std::vector<int64_t>>& shapes) {
  std::map<std::string, const v1::MemoryHandle*> given;
  for (const auto& h : handles) {
    if (!needed.count(h.buffer()))
      return absl::InvalidArgumentError(
          strCat(who, ": buffer \"", h.buffer(), "\" is not a buffer this rank holds in the layout"));
    if (!given.emplace(h.buffer(), &h).second)
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", h.buffer(), "\" is given twice"));
  }
  for (const auto& [name, bytes] : needed)
    if (!given.count(name))
      return absl::InvalidArgumentError(
          strCat(who, ": no memory handle for buffer \"", name, "\" (", bytes, " bytes)"));
  for (const auto& [name, h] : given) {
    const auto holder = held_by.find(name);
    const planner::TensorLayout* t = holder == held_by.end() ? nullptr : holder->second;
    if (!h->dtype().empty() && t != nullptr && h->dtype() != planner::dtypeName(t->dtype))
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\" is ", h->dtype(), " here but ",
                                               planner::dtypeName(t->dtype), " in the layout (tensor \"", t->name,
                                               "\")"));
    if (h->shape_size() > 0) {
      int64_t elems = 1;
      for (int64_t d : h->shape()) {
        if (d < 0 || (d > 0 && elems > INT64_MAX / d))
          return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": bad shape"));
        elems *= d;
      }
      const int64_t elem = t != nullptr ? t->elemBytes() : 1;
      const auto expected = shapes.find(name);
      if (elems > INT64_MAX / elem || elems * elem != needed.at(name))
        return absl::InvalidArgumentError(
            strCat(who, ": buffer \"", name, "\" has shape [", strJoin(h->shape(), ", "), "] (", elems,
                   " elements) but the layout gives this rank ",
                   expected != shapes.end() ? strCat("[", strJoin(expected->second, ", "), "] (") : std::string(),
                   needed.at(name) / elem, " elements", expected != shapes.end() ? ")" : "", " of it"));
      if (expected != shapes.end() &&
          !std::equal(h->shape().begin(), h->shape().end(), expected->second.begin(), expected->second.end()))
        return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\" has shape [", strJoin(h->shape(), ", "),
                                                 "] but the layout gives this rank [", strJoin(expected->second, ", "),
                                                 "] of it (as many elements, in another order: the bytes would land "
                                                 "scrambled)"));
    }
  }

  return given;
}

}  // namespace

StatusOr<std::vector<Registry::Buffer>> Registry::mapBuffers(
    const std::string& who, const google::protobuf::RepeatedPtrField<v1::MemoryHandle>& handles,
    std::map<std::string, int64_t> needed, const std::map<std::string, const planner::TensorLayout*>& held_by,
    const std::map<std::string, std::vector<int64_t>>& shapes, const MemoryCaller& caller) {
  std::vector<Buffer> out;
  SC_ASSIGN_OR_RETURN(const auto given, checkHandles(who, handles, needed, held_by, shapes));
  // Map each shared-memory segment once, covering every buffer in it, and register it once.
  std::map<std::string, uint64_t> segment_end;
  for (const auto& [name, h] : given) {
    if (!h->has_shm()) continue;
    const auto& s = h->shm();
    if (s.size() < static_cast<uint64_t>(needed[name]))
      return absl::InvalidArgumentError(
          strCat(who, ": buffer \"", name, "\" is given ", s.size(), " bytes but needs ", needed[name]));
    if (s.offset() > UINT64_MAX - s.size())
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": offset overflows"));
    segment_end[s.name()] = std::max(segment_end[s.name()], s.offset() + s.size());
  }
  std::map<std::string, std::pair<std::shared_ptr<transport::ShmSegment>, std::shared_ptr<transport::MemoryRegion>>>
      segments;
  for (const auto& [name, end] : segment_end) {
    const std::string& segment = name;  // (a structured binding is not captured before C++20's clang 16)
    if (std::none_of(std::begin(kShmPrefixes), std::end(kShmPrefixes),
                     [&](const char* p) { return segment.rfind(p, 0) == 0; }))
      return absl::PermissionDeniedError(strCat(who, ": shm segment ", quote(name), " is not named under ",
                                                strJoin(kShmPrefixes, " or "),
                                                " (the names Shardcast's clients and torch use)"));
    auto seg =
        transport::ShmSegment::open(name, end, caller.any_owner ? std::nullopt : std::optional<uid_t>(caller.uid));
    if (!seg.ok()) return Status(seg.status().code(), strCat(who, ": ", seg.status().message()));
    auto shared = std::make_shared<transport::ShmSegment>(std::move(*seg));
    transport::makeResident(shared->data(), end, strCat("shm segment \"", name, "\""));
    auto region = transport_.registerMemory(shared->data(), end, transport::MemoryKind::kHost);
    if (!region.ok())
      return Status(region.status().code(), strCat(who, ": segment \"", name, "\": ", region.status().message()));
    segments[name] = {shared, *region};
  }
  for (const auto& [name, h] : given) {
    Buffer b;
    b.name = name;
    if (h->has_shm()) {
      b.size = h->shm().size();
      b.segment = segments[h->shm().name()].first;
      b.region = segments[h->shm().name()].second;
      b.offset = h->shm().offset();
      b.memory = strCat("shm ", b.segment->fileId());
      b.memory_offset = b.offset;
      b.memory_bytes = static_cast<uint64_t>(needed[name]);
    } else if (h->has_cuda() || h->has_cuda_allocations()) {
      SC_RETURN_IF_ERROR(mapDeviceBuffer(who, name, *h, needed[name], caller, &b));
    } else {
      return absl::InvalidArgumentError(
          strCat(who, ": buffer \"", name, "\" has neither a shm, a cuda nor a cuda_allocations handle"));
    }
    out.push_back(std::move(b));  // in name order, as `given` is: findBuffer searches it
  }
  return out;
}

StatusOr<int> Registry::daemonDevice(int client_device, const std::string& uuid) const {
  if (uuid.empty()) return client_device;  // (a client that does not name it: its number is taken as ours)
  if (uuid.size() != 16)
    return absl::InvalidArgumentError(
        strCat("GPU UUID of ", uuid.size(), " bytes (", transport::gpuUuidText(uuid), "): a CUDA UUID has 16"));
  std::vector<std::string> ours;
  for (int d = 0; d < gpus_.deviceCount(); ++d) {
    const std::string mine = gpus_.uuid(d);
    if (mine == uuid) return d;
    ours.push_back(mine.empty() ? strCat(d, ": (unreadable)") : strCat(d, ": ", transport::gpuUuidText(mine)));
  }
  return absl::FailedPreconditionError(
      strCat("its GPU (the client's device ", client_device, ", ", transport::gpuUuidText(uuid),
             ") is none of this daemon's ", ours.size(), " GPUs (", strJoin(ours, ", "),
             "): run the daemon on the client's node, seeing every GPU of it (NVIDIA_VISIBLE_DEVICES=all)"));
}

Status Registry::mapDeviceBuffer(const std::string& who, const std::string& name, const v1::MemoryHandle& h,
                                 int64_t needed, const MemoryCaller& caller, Buffer* b) {
  const bool handed = h.has_cuda_allocations();
  const uint64_t offset = handed ? h.cuda_allocations().offset() : h.cuda().offset();
  const uint64_t size = handed ? h.cuda_allocations().size() : h.cuda().size();
  const int client_device = handed ? h.cuda_allocations().device() : h.cuda().device();
  const std::string& uuid = handed ? h.cuda_allocations().device_uuid() : h.cuda().device_uuid();
  if (size < static_cast<uint64_t>(needed))
    return absl::InvalidArgumentError(
        strCat(who, ": buffer \"", name, "\" is given ", size, " bytes but needs ", needed));
  if (handed && !caller.local)  // descriptors travel only on the Unix socket's side channel
    return absl::InvalidArgumentError(
        strCat(who, ": buffer \"", name,
               "\" is cuMem allocations handed over by file descriptor (torch's expandable segments), which "
               "register only over the daemon's Unix socket, not over TCP"));
  if (gpus_.deviceCount() == 0)
    return absl::FailedPreconditionError(strCat(
        who, ": buffer \"", name, "\" is CUDA memory but this daemon has no GPU (", gpus_.unavailableReason(), ")"));
  if (offset > UINT64_MAX - size)
    return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": offset overflows"));
  auto found = daemonDevice(client_device, uuid);
  if (!found.ok())
    return Status(found.status().code(), strCat(who, ": buffer \"", name, "\": ", found.status().message()));
  const int device = *found;
  StatusOr<std::unique_ptr<transport::CudaIpcMapping>> mapping = absl::UnknownError("");
  if (handed) {
    const auto& a = h.cuda_allocations();
    // The token is spent here whatever follows: its descriptors are closed with the mapping,
    // or at once when the registration fails.
    auto fds = handed_fds_.take(a.token(), caller.uid, caller.any_owner);
    if (!fds.ok()) return Status(fds.status().code(), strCat(who, ": buffer \"", name, "\": ", fds.status().message()));
    if (fds->size() != static_cast<size_t>(a.allocation_bytes_size()))
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": ", fds->size(),
                                               " descriptors were handed over for ", a.allocation_bytes_size(),
                                               " allocation sizes"));
    mapping =
        gpus_.importAllocations(std::move(*fds), {a.allocation_bytes().begin(), a.allocation_bytes().end()}, device);
    // The buffer must lie inside what was mapped: the allocations' bytes, granularity-checked.
    if (mapping.ok() && offset + size > (*mapping)->size())
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": bytes [", offset, ", ", offset + size,
                                               ") lie outside its ", a.allocation_bytes_size(), " allocation(s) of ",
                                               (*mapping)->size(), " bytes in all"));
  } else {
    mapping = gpus_.importHandle(h.cuda().handle(), offset + size, device,
                                 caller.any_owner ? std::nullopt : std::optional<uid_t>(caller.uid));
  }
  if (!mapping.ok())
    return Status(mapping.status().code(), strCat(who, ": buffer \"", name, "\": ", mapping.status().message()));
  auto engines = deviceEngines(device);
  if (!engines.ok())
    return Status(engines.status().code(), strCat(who, ": buffer \"", name, "\": ", engines.status().message()));
  auto* bytes = static_cast<std::byte*>((*mapping)->data()) + offset;
  auto mem = transport::TransferMemory::prepare(transport_, bytes, size, transport::MemoryKind::kCuda,
                                                (*engines)->outgoing.get());
  if (!mem.ok()) return Status(mem.status().code(), strCat(who, ": buffer \"", name, "\": ", mem.status().message()));
  // Which path this buffer's bytes take, said once per registration: straight from and into
  // device memory (a CUDA-aware UCX: GPUDirect where the NIC has it), or packed on the GPU
  // into pinned host staging and unpacked on it from the landing arena (syncs planned packed).
  const std::string where =
      strCat(who, ": buffer \"", name, "\" (", size, " bytes on GPU ", device,
             device != client_device ? strCat(", the client's GPU ", client_device) : std::string(),
             handed ? strCat(", ", h.cuda_allocations().allocation_bytes_size(), " cuMem allocation(s)") : "", ")");
  if (!(*mem)->staged())
    spdlog::info("{}: registered with the transport directly (device memory, no staging)", where);
  else if ((*mem)->fallback().empty())
    spdlog::info(
        "{}: staged: packed and unpacked on the GPU through pinned host memory (this transport cannot "
        "reach device memory)",
        where);
  else  // the other buffers go direct: this one makes the syncs through it packed (Describe: staged)
    spdlog::warn("{}: staged through pinned host memory, this buffer alone: {}", where, (*mem)->fallback());
  if (!handed) {  // an IPC handle names its allocation (torch's cudaMalloc block); the offset is in it
    b->memory = strCat("cuda ", device, " ", h.cuda().handle());
    b->memory_offset = offset;
    b->memory_bytes = static_cast<uint64_t>(needed);
  }
  b->size = size;
  b->device = bytes;
  b->engines = *engines;
  b->cuda = std::move(*mapping);
  b->region = (*mem)->region();
  b->cuda_memory = std::move(*mem);
  // One owner of both for every LocalBuffer of it: a sync keeps each mapping it uses alive once
  // (Execution::mapped_), however many chunks it copies through it.
  b->cuda_keep = std::make_shared<
      std::pair<std::shared_ptr<transport::CudaIpcMapping>, std::shared_ptr<transport::TransferMemory>>>(
      b->cuda, b->cuda_memory);
  return absl::OkStatus();
}

StatusOr<const Registry::DeviceEngines*> Registry::deviceEngines(int gpu) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = cuda_engines_.find(gpu); it != cuda_engines_.end()) return &it->second;
  }
  // Made without the lock (a GPU's first streams may take the driver a while); a registration
  // racing this one for the same GPU keeps whichever was inserted first.
  DeviceEngines e;
  e.gpu = gpu;
  SC_ASSIGN_OR_RETURN(e.outgoing, gpus_.makeEngine(gpu));
  SC_ASSIGN_OR_RETURN(e.incoming, gpus_.makeEngine(gpu));
  std::lock_guard<std::mutex> lock(mu_);
  return &cuda_engines_.emplace(gpu, std::move(e)).first->second;
}

namespace {

// A buffer's bytes in the memory it is (Registry::Buffer::memory).
struct Span {
  uint64_t begin = 0, end = 0;
  const std::string* name = nullptr;
  const transport::ShmSegment* segment = nullptr;  // null: CUDA memory
  const char* set = "";                            // "" or " (shadow set)"
};

bool overlap(const Span& a, uint64_t begin, uint64_t end) { return a.begin < end && begin < a.end; }

std::string spanText(const Span& s) {
  return strCat("buffer \"", *s.name, "\"", s.set, " (bytes [", s.begin, ", ", s.end, ") of ",
                s.segment ? strCat("shm segment \"", s.segment->name(), "\"") : std::string("its CUDA allocation"),
                ")");
}

}  // namespace

Status Registry::ownsItsMemory(const Rank& r) const {
  const std::string who = strCat("group \"", r.group, "\" rank ", r.rank);
  const bool destination = r.role != v1::ROLE_SOURCE;
  std::map<std::string, std::vector<Span>> mine;  // by memory, sorted by begin
  for (const auto* set : {&r.buffers, &r.shadow})
    for (const auto& b : *set)
      if (!b.memory.empty() && b.memory_bytes > 0)
        mine[b.memory].push_back({b.memory_offset, b.memory_offset + b.memory_bytes, &b.name, b.segment.get(),
                                  set == &r.shadow ? " (shadow set)" : ""});
  const std::string tail =
      destination ? ": a destination rank's memory must be its own, or a sync writes one buffer's bytes over another's "
                    "(give every rank, and each set of a double-buffered rank, tensors of their own)"
                  : ": a sync into that destination would write over this source's weights (a destination's memory "
                    "must be its own)";
  for (auto& [memory, spans] : mine) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    if (!destination) continue;  // a source's own buffers may share memory
    const Span* furthest = nullptr;
    for (const auto& s : spans) {
      if (furthest != nullptr && s.begin < furthest->end)
        return absl::InvalidArgumentError(
            strCat(who, ": ", spanText(s), " is the same memory as its ", spanText(*furthest), tail,
                   s.begin == furthest->begin && s.end == furthest->end && *s.set == *furthest->set
                       ? "; a tied weight registers under one of its names (the layout may leave the other out)"
                       : ""));
      if (furthest == nullptr || s.end > furthest->end) furthest = &s;
    }
  }
  if (mine.empty()) return absl::OkStatus();
  std::map<std::string, std::vector<uint64_t>> furthest_end;  // by memory: the furthest end of its first k spans
  for (const auto& [memory, spans] : mine) {
    auto& ends = furthest_end[memory];
    for (const auto& s : spans) ends.push_back(std::max(ends.empty() ? 0 : ends.back(), s.end));
  }
  for (const auto& [key, other] : ranks_) {
    if (key.first == r.group && key.second == r.rank) continue;  // the registration r replaces
    if (!destination && other->role == v1::ROLE_SOURCE) continue;
    for (const auto* set : {&other->buffers, &other->shadow})
      for (const auto& b : *set) {
        if (b.memory.empty() || b.memory_bytes == 0) continue;
        const auto it = mine.find(b.memory);
        if (it == mine.end()) continue;
        const uint64_t begin = b.memory_offset, end = b.memory_offset + b.memory_bytes;
        // The spans starting before `end`: one of them overlaps when the furthest end among them
        // lies after `begin` (a source's spans may nest), found again only then.
        const auto& spans = it->second;
        const auto last =
            std::lower_bound(spans.begin(), spans.end(), end, [](const Span& s, uint64_t at) { return s.begin < at; });
        if (last == spans.begin() || furthest_end.at(b.memory)[static_cast<size_t>(last - spans.begin()) - 1] <= begin)
          continue;
        for (auto s = spans.begin(); s != last; ++s)
          if (overlap(*s, begin, end))
            return absl::InvalidArgumentError(
                strCat(who, ": ", spanText(*s), " is the same memory as ",
                       spanText({begin, end, &b.name, b.segment.get(), set == &other->shadow ? " (shadow set)" : ""}),
                       " of group \"", other->group, "\" rank ", other->rank, " (", v1::roleName(other->role),
                       ") on node \"", node_, "\"", tail));
      }
  }
  return absl::OkStatus();
}

Status Registry::checkSegments(const Rank& r) const {
  // Each mapping once: a MoE's tens of thousands of buffers share a few segments.
  std::set<const void*> checked;
  for (const auto* set : {&r.buffers, &r.shadow})
    for (const auto& b : *set) {
      const void* mapping = b.segment ? static_cast<const void*>(b.segment.get()) : b.cuda.get();
      if (mapping == nullptr || !checked.insert(mapping).second) continue;
      if (auto st = b.segment ? b.segment->checkSize() : b.cuda->check(); !st.ok())
        return absl::FailedPreconditionError(strCat("group \"", r.group, "\" rank ", r.rank, " on node \"", node_,
                                                    "\" buffer \"", b.name, "\": ", st.message()));
    }
  return absl::OkStatus();
}

}  // namespace shardcast::daemon
