// Ranks' memory for tests and the local-cluster demo: one shared-memory segment per rank holding
// all its buffers, the Register request that hands it to a daemon, and a walk over every element
// a rank holds (for filling and verifying).
#pragma once

#include <unistd.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "planner/layout.h"
#include "shardcast/v1/service.pb.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace shardcast::testing {

struct RankMemory {
  std::unique_ptr<transport::ShmSegment> seg;
  std::map<int32_t, uint64_t> offset;                          // buffer id -> offset
  std::map<std::string, std::pair<uint64_t, uint64_t>> named;  // buffer name -> (offset, size)

  template <typename T>
  T* at(const planner::PieceRef& p, int64_t element) {
    return reinterpret_cast<T*>(static_cast<std::byte*>(seg->data()) + offset.at(p.buffer)) + element;
  }
};

inline RankMemory allocateRank(const planner::ResolvedLayout& l, int32_t rank, const std::string& tag) {
  RankMemory m;
  uint64_t off = 0;
  for (const auto& [buffer, bytes] : l.rankBuffers(rank)) {
    m.offset[buffer] = off;
    m.named[l.buffer_names[buffer]] = {off, static_cast<uint64_t>(bytes)};
    off += (static_cast<uint64_t>(bytes) + 63) / 64 * 64;
  }
  auto seg = transport::ShmSegment::create("/shardcast-" + std::to_string(::getpid()) + "-" + tag,
                                           std::max<uint64_t>(off, 64));
  if (!seg.ok()) throw std::runtime_error(std::string(seg.status().message()));
  m.seg = std::make_unique<transport::ShmSegment>(std::move(*seg));
  return m;
}

// A destination rank by default; a source rank with role ROLE_SOURCE (READY at `version` when
// given: its bytes already hold that version).
inline v1::RegisterRequest registerRequest(const v1::Layout& layout, int32_t rank, int32_t world, const RankMemory& m,
                                           v1::Role role = v1::ROLE_DESTINATION, uint64_t version = 0) {
  v1::RegisterRequest r;
  r.set_role(role);
  r.set_version(version);
  r.set_group(layout.group());
  r.set_rank(rank);
  r.set_world_size(world);
  *r.mutable_layout() = layout;
  for (const auto& [name, where] : m.named) {
    auto* b = r.add_buffers();
    b->set_buffer(name);
    b->mutable_shm()->set_name(m.seg->name());
    b->mutable_shm()->set_offset(where.first);
    b->mutable_shm()->set_size(where.second);
  }
  return r;
}

// Prepare of a sync driven by hand (as a coordinator would), with the daemons' default budgets.
inline v1::PrepareRequest prepareRequest(const std::string& id, const v1::Layout& src, const v1::Layout& dst,
                                         uint64_t version, uint64_t fence = 0) {
  v1::PrepareRequest p;
  p.set_sync_id(id);
  p.set_fence(fence);
  *p.mutable_src() = src;
  *p.mutable_dst() = dst;
  p.set_version(version);
  p.set_staging_bytes(uint64_t{1} << 30);
  p.set_chunk_bytes(uint64_t{64} << 20);
  p.set_write_key(std::string(transport::WriteKey::random().view()));
  // As a coordinator plans it over tcp: clients' segments travel packed there (the daemons refuse
  // a zero-copy plan that would hand them to the transport; --host-zero-copy on allows it).
  p.set_packed(true);
  return p;
}

using planner::forEachElement;

}  // namespace shardcast::testing
