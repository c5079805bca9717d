// The verifier of a sync that asked for it (ExecuteRequest.verify): a chunk's bytes hash on the
// wire as its sender hashed them, and after the copies every destination rank holds exactly the
// bytes that landed. Device memory is read through a host copy. Each failure is DATA_LOSS and
// names the chunk, or the rank and the tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/stage/stage.h"
#include "planner/box.h"
#include "transport/copy_engine.h"

namespace shardcast::daemon {

// A chunk's checksum: XXH64 of `n` bytes of host memory at `data` (what a verified sync
// announces per chunk, and what a delta chunk's decoding must give back).
uint64_t checksum(const std::byte* data, uint64_t n);
// The same of memory of any kind (device memory: of a host copy made with `device`, waited for).
StatusOr<uint64_t> checksumOf(transport::CopyEngine& host, transport::CopyEngine* device, const std::byte* data,
                              transport::MemoryKind kind, uint64_t n);

// Which chunk of which sync is checked where (in the errors).
struct VerifySite {
  const std::string& sync;
  const std::string& group;  // the destination group
  const std::string& node;   // this daemon's node
  int32_t transfer = -1;
  int32_t chunk = -1;
};

// A landed chunk's checksum against the one its sender announced.
Status checkChecksum(uint64_t announced, uint64_t landed, const VerifySite& site);

// What one destination rank holds of a landed chunk: its memory (`held`, copied with
// `held.device` when on a GPU) and the chunk's bytes it came from (`wire`, copied with
// `wire_device`), a box of `sizes` elements of `elem_bytes`.
struct HeldPiece {
  TypedView held;
  transport::StridedView wire;
  transport::CopyEngine* wire_device = nullptr;
  std::vector<int64_t> sizes;
  int64_t elem_bytes = 1;
  int32_t rank = -1;
  std::string tensor;  // the destination's tensor, and the box of it
  planner::Box box;
};

// Every piece as its rank holds it against the landed bytes; the first that differs fails,
// naming its rank, its tensor and box.
Status checkHeld(transport::CopyEngine& host, const std::vector<HeldPiece>& pieces, const VerifySite& site);

}  // namespace shardcast::daemon
