#include "daemon/engine/verify.h"

#include <xxhash.h>

#include "common/strings.h"

namespace shardcast::daemon {

uint64_t checksum(const std::byte* data, uint64_t n) { return XXH64(data, static_cast<size_t>(n), 0); }

StatusOr<uint64_t> checksumOf(transport::CopyEngine& host, transport::CopyEngine* device, const std::byte* data,
                              transport::MemoryKind kind, uint64_t n) {
  if (kind == transport::MemoryKind::kHost) return checksum(data, n);
  std::vector<std::byte> copy(n);
  const std::vector<int64_t> unit{1};
  SC_RETURN_IF_ERROR(copyBox(host, device, {copy.data(), transport::MemoryKind::kHost, 0, unit},
                             {const_cast<std::byte*>(data), kind, 0, unit}, {static_cast<int64_t>(n)}, 1));
  return checksum(copy.data(), n);
}

Status checkChecksum(uint64_t announced, uint64_t landed, const VerifySite& site) {
  if (announced == landed) return absl::OkStatus();
  return absl::DataLossError(strCat("sync ", site.sync, ": chunk ", site.chunk, " of transfer ", site.transfer,
                                    " arrived at node \"", site.node, "\" with a wrong checksum"));
}

Status checkHeld(transport::CopyEngine& host, const std::vector<HeldPiece>& pieces, const VerifySite& site) {
  std::vector<std::byte> held, landed;
  for (const auto& p : pieces) {
    const auto dense = transport::denseStrides(p.sizes);
    int64_t volume = 1;
    for (const int64_t s : p.sizes) volume *= s;
    held.resize(static_cast<size_t>(volume * p.elem_bytes));
    landed.resize(held.size());
    SC_RETURN_IF_ERROR(copyBox(host, p.held.device, {held.data(), transport::MemoryKind::kHost, 0, dense}, p.held.view,
                               p.sizes, p.elem_bytes));
    SC_RETURN_IF_ERROR(copyBox(host, p.wire_device, {landed.data(), transport::MemoryKind::kHost, 0, dense}, p.wire,
                               p.sizes, p.elem_bytes));
    if (held != landed)
      return absl::DataLossError(strCat("sync ", site.sync, ": group \"", site.group, "\" rank ", p.rank, " on node \"",
                                        site.node, "\" does not hold the bytes of tensor \"", p.tensor, "\" ",
                                        p.box.str(), " that landed (chunk ", site.chunk, " of transfer ", site.transfer,
                                        ") after they were copied into it"));
  }
  return absl::OkStatus();
}

}  // namespace shardcast::daemon
