// The one message daemons send each other over the data plane: "these chunks of sync S have
// landed on you" (after the writes they announce, so the receiver may read them). A versioned
// little-endian binary format with one parser; everything a peer sends is untrusted, so parse()
// checks every length and the receiver checks every index against its plan (SyncEngine).
//
//   u32 magic "SCN1" | u16 format version (1) | u16 sync id length (1..kMaxSyncId) | u64 fence
//   | id bytes | u32 count (1..kMaxLanded) | count x { i32 transfer, i32 chain, i32 hop, i32 chunk,
//   u64 checksum }
// The fence names the sync attempt (PrepareRequest.fence): a notification of another attempt of
// the same id is not this attempt's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace shardcast::daemon {

struct LandedChunk {
  int32_t transfer = 0;
  int32_t chain = 0;  // the plan's chain index (not relative to the transfer)
  int32_t hop = 0;    // position of the receiving node in that chain
  int32_t chunk = 0;
  uint64_t checksum = 0;  // xxHash64 of the chunk, or 0 without verify
};

struct Notification {
  std::string sync_id;
  uint64_t fence = 0;
  std::vector<LandedChunk> chunks;
};

inline constexpr uint32_t kNotificationMagic = 0x314e4353;  // "SCN1" little-endian
inline constexpr uint16_t kNotificationVersion = 1;
inline constexpr size_t kMaxSyncId = 128;
inline constexpr size_t kMaxLanded = 4096;
inline constexpr size_t kLandedBytes = 4 * 4 + 8;

std::string encodeNotification(const Notification& n);
// INVALID_ARGUMENT naming what is wrong (bad magic, unknown version, lengths that do not add up).
StatusOr<Notification> parseNotification(std::string_view bytes);
// The encoded size of a notification of `chunks` chunks for sync id `id_bytes` long.
inline size_t notificationBytes(size_t id_bytes, size_t chunks) {
  return 4 + 2 + 2 + 8 + id_bytes + 4 + chunks * kLandedBytes;
}

}  // namespace shardcast::daemon
