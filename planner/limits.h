// What a layout (and any request) may ask of a daemon: every size a client or peer controls is
// bounded here, so that no small request costs unbounded memory or CPU and every size computed
// from a valid layout fits an int64 (docs/security.md, "Limits"). The daemon sets them once at
// start (--max-layout-ranks, --max-layout-tensors); everything else resolves against them.
#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <optional>

#include "common/status.h"

namespace shardcast::planner {

// Dims of a device mesh (DTensor meshes have up to 5: PP x DP x FSDP x CP x TP).
inline constexpr int kMaxMeshDims = 16;
// A sync id: shorter than other names (max_string_bytes), for it travels in every notification of
// the data plane (daemon/engine/notification.h), whose wire format fixes it.
inline constexpr size_t kMaxSyncIdBytes = 128;
// Versions: 1 to 2^63 - 1, so that every client language holds them in a signed 64-bit integer
// (0 is none: a rank that holds no version yet, a catch-up to the newest a replica holds).
inline constexpr uint64_t kLastVersion = (uint64_t{1} << 63) - 1;
inline constexpr bool isVersion(uint64_t v) { return v >= 1 && v <= kLastVersion; }
inline constexpr const char* kVersionRange = "[1, 2^63)";

struct Limits {
  int64_t max_ranks = int64_t{1} << 16;            // ranks of one layout's mesh (8,192 nodes x 8 GPUs)
  int64_t max_tensors = int64_t{1} << 17;          // tensors of one layout (a 1T-parameter MoE has ~10^5)
  int64_t max_pieces = int64_t{1} << 23;           // resolved pieces (tensor x rank x box) of one layout
  int64_t max_explicit_pieces = int64_t{1} << 20;  // pieces spelled out in one layout (each rank of a piece counts)
  int64_t max_grid_cells = int64_t{1} << 24;  // cells the distinct boxes of one tensor cut it into, where they overlap
  int64_t max_split_factor = 4096;            // strided_shard split factor (FSDP2 uses the TP degree)
  int64_t max_layout_bytes = int64_t{1} << 46;          // sum of one layout's tensors (64 TiB: 2^62 with every rank)
  size_t max_string_bytes = 512;                        // any name: group, tensor, buffer, node (a sync id: above)
  size_t max_layout_message_bytes = size_t{128} << 20;  // a layout's serialised size
  int max_groups_per_daemon = 12;                       // groups with ranks registered on one daemon
  size_t max_describe_bytes = size_t{1536}
                              << 20;  // what a daemon's registrations cost its Describe (gRPC's ceiling is 2 GiB)
};

// The limits in force (the defaults until setLimits).
const Limits& limits();
// Called once at start-up, before any thread resolves a layout.
void setLimits(const Limits& l);

// a * b and a + b, or nothing when the result leaves [0, INT64_MAX] (inputs are non-negative).
std::optional<int64_t> checkedMul(int64_t a, int64_t b);
std::optional<int64_t> checkedAdd(int64_t a, int64_t b);

// INVALID_ARGUMENT naming the field (e.g. "layout.tensors[3].name") of the first string field of
// `message`, at any depth, longer than `max` bytes. Bytes fields are not strings.
Status checkStringLengths(const google::protobuf::Message& message, size_t max = limits().max_string_bytes);

}  // namespace shardcast::planner
