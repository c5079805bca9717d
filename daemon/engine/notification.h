// The messages daemons send each other over the data plane: "these chunks of sync S have landed
// on you" (after the writes they announce, so the receiver may read them), and the readiness word
// of a folded attempt ("node N has attempt S open": ExecuteRequest.prepare). A versioned
// little-endian binary format with one parser; everything a peer sends is untrusted, so parse()
// checks every length and the receiver checks every index against its plan (SyncEngine).
//
//   u32 magic "SCN1" | u16 format version (2) | u16 sync id length (1..planner::kMaxSyncIdBytes) | u64 fence
//   | id bytes | u32 count (0..kMaxLanded) | count x { i32 transfer, i32 chain, i32 hop, i32 chunk,
//   i32 encoding, u64 checksum, u64 bytes, u64 result }
//   count 0 (the readiness word): then | i32 node (the sender's index in the plan) | u32 flags
//   (bit 0: an answer to the receiver's own word, which is not answered again)
// The fence names the sync attempt (PrepareRequest.fence): a notification of another attempt of
// the same id is not this attempt's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "planner/limits.h"

namespace shardcast::daemon {

struct LandedChunk {
  int32_t transfer = 0;
  int32_t chain = 0;  // the plan's chain index (not relative to the transfer)
  int32_t hop = 0;    // position of the receiving node in that chain
  int32_t chunk = 0;
  int32_t encoding = 0;   // kDense, kDelta or kDeltaTree (daemon/engine/delta.h)
  uint64_t checksum = 0;  // xxHash64 of the bytes written, or 0 without verify
  uint64_t bytes = 0;     // written: the chunk's size when dense, the delta's when not
  // A delta: the hash of the chunk it decodes to (always checked): xxHash64 (kDelta) or the tree
  // hash (kDeltaTree, transport/cuda/delta_plan.h), which a GPU computes of device memory.
  uint64_t result = 0;
  static constexpr int32_t kDense = 0;
  static constexpr int32_t kDelta = 1;
  static constexpr int32_t kDeltaTree = 2;
  bool delta() const { return encoding == kDelta || encoding == kDeltaTree; }
};

struct Notification {
  std::string sync_id;
  uint64_t fence = 0;
  std::vector<LandedChunk> chunks;  // none: the readiness word
  int32_t ready_node = -1;          // the readiness word's sender (its index in the plan)
  bool answer = false;              // the readiness word answers the receiver's own
};

inline constexpr uint32_t kNotificationMagic = 0x314e4353;  // "SCN1" little-endian
inline constexpr uint16_t kNotificationVersion = 2;
inline constexpr size_t kMaxLanded = 4096;
inline constexpr size_t kLandedBytes = 5 * 4 + 3 * 8;

std::string encodeNotification(const Notification& n);
// INVALID_ARGUMENT naming what is wrong (bad magic, unknown version, lengths that do not add up).
StatusOr<Notification> parseNotification(std::string_view bytes);
// The encoded size of a notification of `chunks` chunks for sync id `id_bytes` long.
inline size_t notificationBytes(size_t id_bytes, size_t chunks) {
  return 4 + 2 + 2 + 8 + id_bytes + 4 + chunks * kLandedBytes;
}

}  // namespace shardcast::daemon
