#include "daemon/registry.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "common/strings.h"
#include "planner/layout.h"
#include "transport/cuda/cuda_support.h"

namespace shardcast::daemon {

std::string layoutDigest(const v1::Layout& layout) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);
    layout.SerializeToCodedStream(&coded);
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH64(bytes.data(), bytes.size(), 0)));
  return hex;
}

Registry::Registry(std::string node, transport::Context& transport) : node_(std::move(node)), transport_(transport) {}

StatusOr<v1::RegisterResponse> Registry::registerRank(const v1::RegisterRequest& req) {
  const std::string who = strCat("group \"", req.group(), "\" rank ", req.rank());
  if (req.group().empty()) return absl::InvalidArgumentError("register: group is empty");
  if (req.layout().group() != req.group())
    return absl::InvalidArgumentError(strCat(who, ": the layout is for group \"", req.layout().group(), "\""));
  const std::string digest = layoutDigest(req.layout());
  {
    // Every rank of a group must register the same layout (the planner needs one per group).
    std::lock_guard<std::mutex> lock(mu_);
    auto g = groups_.find(req.group());
    if (g != groups_.end() && g->second.digest != digest) {
      bool others = false;
      for (const auto& [key, r] : ranks_) others |= key.first == req.group() && key.second != req.rank();
      if (others)
        return absl::FailedPreconditionError(strCat(who, ": layout digest ", digest, " differs from ", g->second.digest,
                                                    " registered by other ranks of the group"));
    }
  }
  SC_ASSIGN_OR_RETURN(auto rank, build(req, digest));
  v1::RegisterResponse resp;
  resp.set_layout_digest(digest);
  resp.set_registered_bytes(rank->bytes);
  resp.set_node(node_);
  std::lock_guard<std::mutex> lock(mu_);
  groups_[req.group()] = Group{req.layout(), digest};
  ++generation_;
  const bool replaced = ranks_.count({req.group(), req.rank()}) > 0;
  ranks_[{req.group(), req.rank()}] = std::move(rank);
  spdlog::info("{} {}registered: {} buffers, {} bytes, layout {}", who, replaced ? "re-" : "",
               ranks_[{req.group(), req.rank()}]->buffers.size(), resp.registered_bytes(), digest);
  return resp;
}

StatusOr<std::unique_ptr<Registry::Rank>> Registry::build(const v1::RegisterRequest& req, std::string digest) {
  const std::string who = strCat("group \"", req.group(), "\" rank ", req.rank());
  planner::NodeTable nodes;
  auto layout = planner::resolveLayout(req.layout(), nodes);
  if (!layout.ok()) return absl::InvalidArgumentError(strCat(who, ": ", layout.status().message()));
  if (req.world_size() != layout->world())
    return absl::InvalidArgumentError(strCat(who, ": world_size ", req.world_size(), " but the layout's mesh has ",
                                             layout->world(), " ranks"));
  if (req.rank() < 0 || req.rank() >= layout->world())
    return absl::InvalidArgumentError(strCat(who, ": rank out of range [0, ", layout->world(), ")"));
  const std::string& rank_node = nodes.name(layout->rank_node[req.rank()]);
  if (rank_node != node_)
    return absl::FailedPreconditionError(strCat(who, ": the layout places it on node \"", rank_node,
                                                "\" but this daemon is node \"", node_, "\""));
  // The buffers this rank needs and their sizes, against the handles given.
  std::map<std::string, int64_t> needed;
  for (const auto& [buffer, bytes] : layout->rankBuffers(req.rank())) needed[layout->buffer_names[buffer]] = bytes;
  std::map<std::string, const v1::MemoryHandle*> given;
  for (const auto& h : req.buffers()) {
    if (!needed.count(h.buffer()))
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", h.buffer(), "\" is not a buffer this rank holds in the layout"));
    if (!given.emplace(h.buffer(), &h).second)
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", h.buffer(), "\" is given twice"));
  }
  for (const auto& [name, bytes] : needed)
    if (!given.count(name))
      return absl::InvalidArgumentError(strCat(who, ": no memory handle for buffer \"", name, "\" (", bytes, " bytes)"));

  auto rank = std::make_unique<Rank>();
  rank->group = req.group();
  rank->rank = req.rank();
  rank->world = req.world_size();
  rank->digest = std::move(digest);
  // Map each shared-memory segment once, covering every buffer in it, and register it once.
  std::map<std::string, uint64_t> segment_end;
  for (const auto& [name, h] : given) {
    if (!h->has_shm()) continue;
    const auto& s = h->shm();
    if (s.size() < static_cast<uint64_t>(needed[name]))
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\" is given ", s.size(), " bytes but needs ",
                                               needed[name]));
    if (s.offset() > UINT64_MAX - s.size()) return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": offset overflows"));
    segment_end[s.name()] = std::max(segment_end[s.name()], s.offset() + s.size());
  }
  std::map<std::string, std::pair<std::shared_ptr<transport::ShmSegment>, std::shared_ptr<transport::MemoryRegion>>> segments;
  for (const auto& [name, end] : segment_end) {
    auto seg = transport::ShmSegment::open(name, end);
    if (!seg.ok()) return Status(seg.status().code(), strCat(who, ": ", seg.status().message()));
    auto shared = std::make_shared<transport::ShmSegment>(std::move(*seg));
    transport::makeResident(shared->data(), end, strCat("shm segment \"", name, "\""));
    auto region = transport_.registerMemory(shared->data(), end, transport::MemoryKind::kHost);
    if (!region.ok()) return Status(region.status().code(), strCat(who, ": segment \"", name, "\": ", region.status().message()));
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
    } else if (h->has_cuda()) {
      const auto& c = h->cuda();
      if (c.size() < static_cast<uint64_t>(needed[name]))
        return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\" is given ", c.size(), " bytes but needs ", needed[name]));
      if (transport::cudaDeviceCount() == 0)
        return absl::FailedPreconditionError(strCat(who, ": buffer \"", name, "\" is CUDA memory but this daemon has no GPU (",
                                                    transport::cudaUnavailableReason(), ")"));
      if (c.offset() > UINT64_MAX - c.size())
        return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\": offset overflows"));
      auto mapping = transport::importCudaIpcHandle(c.handle(), c.offset() + c.size(), c.device());
      if (!mapping.ok()) return Status(mapping.status().code(), strCat(who, ": buffer \"", name, "\": ", mapping.status().message()));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!cuda_copies_) {
          auto engine = transport::makeCudaCopyEngine(c.device());
          if (!engine.ok()) return engine.status();
          cuda_copies_ = std::move(*engine);
        }
      }
      auto* device = static_cast<std::byte*>((*mapping)->data()) + c.offset();
      auto mem = transport::TransferMemory::prepare(transport_, device, c.size(), transport::MemoryKind::kCuda, cuda_copies_.get());
      if (!mem.ok()) return Status(mem.status().code(), strCat(who, ": buffer \"", name, "\": ", mem.status().message()));
      b.size = c.size();
      b.device = device;
      b.cuda = std::move(*mapping);
      b.region = (*mem)->region();
      b.cuda_memory = std::move(*mem);
    } else {
      return absl::InvalidArgumentError(strCat(who, ": buffer \"", name, "\" has neither a shm nor a cuda handle"));
    }
    rank->bytes += b.size;
    rank->buffers.push_back(std::move(b));
  }
  return rank;
}

Status Registry::unregisterRank(const std::string& group, int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ranks_.erase({group, rank}) == 0)
    return absl::NotFoundError(strCat("group \"", group, "\" rank ", rank, " is not registered on node \"", node_, "\""));
  ++generation_;
  bool any = false;
  for (const auto& [key, r] : ranks_) any |= key.first == group;
  if (!any) groups_.erase(group);
  spdlog::info("group \"{}\" rank {} unregistered", group, rank);
  return absl::OkStatus();
}

std::vector<v1::RankRegistration> Registry::list() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::RankRegistration> out;
  for (const auto& [key, r] : ranks_) {
    v1::RankRegistration reg;
    reg.set_group(r->group);
    reg.set_rank(r->rank);
    reg.set_world_size(r->world);
    reg.set_node(node_);
    reg.set_layout_digest(r->digest);
    reg.set_registered_bytes(r->bytes);
    for (const auto& b : r->buffers) reg.add_buffers(b.name);
    const auto v = versions_.find(r->group);
    reg.set_version(v == versions_.end() ? 0 : v->second);
    out.push_back(std::move(reg));
  }
  return out;
}

std::vector<v1::GroupStatus> Registry::groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, v1::GroupStatus> by_name;
  for (const auto& [key, r] : ranks_) {
    auto& g = by_name[r->group];
    g.set_group(r->group);
    g.set_world_size(r->world);
    g.add_ranks(r->rank);
    g.set_layout_digest(r->digest);
    g.set_registered_bytes(g.registered_bytes() + r->bytes);
    const auto v = versions_.find(r->group);
    g.set_version(v == versions_.end() ? 0 : v->second);
  }
  std::vector<v1::GroupStatus> out;
  for (auto& [name, g] : by_name) out.push_back(std::move(g));
  return out;
}

v1::DescribeResponse Registry::describe() const {
  v1::DescribeResponse d;
  d.set_node(node_);
  d.set_transport_address(transport_.address());
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [group, g] : groups_) *d.add_layouts() = g.layout;
  for (const auto& [key, r] : ranks_) {
    auto* rr = d.add_ranks();
    rr->set_group(r->group);
    rr->set_rank(r->rank);
    rr->set_layout_digest(r->digest);
    if (const auto v = versions_.find(r->group); v != versions_.end()) rr->set_version(v->second);
    for (const auto& b : r->buffers) {
      auto* rb = rr->add_buffers();
      rb->set_buffer(b.name);
      rb->set_region(b.region->remote().serialize());
      rb->set_offset(b.offset);
      rb->set_size(b.size);
    }
  }
  return d;
}

uint64_t Registry::registeredBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (const auto& [key, r] : ranks_) n += r->bytes;
  return n;
}

StatusOr<Registry::LocalBuffer> Registry::localBuffer(const std::string& group, int32_t rank,
                                                      const std::string& buffer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranks_.find({group, rank});
  if (it == ranks_.end())
    return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", rank, " is not registered on node \"", node_, "\""));
  for (const Buffer& b : it->second->buffers) {
    if (b.name != buffer) continue;
    if (b.segment)
      return LocalBuffer{static_cast<std::byte*>(b.segment->data()) + b.offset, b.size, transport::MemoryKind::kHost,
                         b.segment, b.region, b.offset, nullptr, nullptr};
    // Device memory: keep the IPC mapping and its transfer registration alive together.
    auto keep = std::make_shared<std::pair<std::shared_ptr<transport::CudaIpcMapping>, std::shared_ptr<transport::TransferMemory>>>(
        b.cuda, b.cuda_memory);
    return LocalBuffer{b.device, b.size, transport::MemoryKind::kCuda, keep, b.region, 0, b.cuda_memory.get(),
                       cuda_copies_.get()};
  }
  return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", rank, " has no buffer \"", buffer, "\""));
}

uint64_t Registry::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

uint64_t Registry::version(const std::string& group) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = versions_.find(group);
  return it == versions_.end() ? 0 : it->second;
}

void Registry::commitVersion(const std::string& group, uint64_t version) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    versions_[group] = version;
  }
  version_cv_.notify_all();
  spdlog::info("group \"{}\" is at version {}", group, version);
}

uint64_t Registry::waitVersion(const std::string& group, uint64_t version, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  auto current = [&] {
    auto it = versions_.find(group);
    return it == versions_.end() ? uint64_t{0} : it->second;
  };
  version_cv_.wait_for(lock, timeout, [&] { return current() >= version; });
  return current();
}

bool Registry::hasGroup(const std::string& group) const {
  std::lock_guard<std::mutex> lock(mu_);
  return groups_.count(group) > 0;
}

int32_t Registry::registeredRanks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int32_t>(ranks_.size());
}

}  // namespace shardcast::daemon
