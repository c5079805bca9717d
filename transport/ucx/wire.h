// The headers of the UCX backend's active messages (data, ack, notification): explicit
// little-endian fields behind a magic number and a version, written by encode* and read only by
// parseHeader, the one parser every received message goes through (fuzzed: fuzz/fuzz_ucx_header.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transport/transport.h"

namespace shardcast::transport::ucx_wire {

// "SCAM": ShardCast Active Message. A header without it is not ours; one with another version is
// a shardcastd of another release (refused with an ack where the operation can be named).
constexpr uint32_t kMagic = 0x4d414353;
constexpr uint8_t kVersion = 1;

enum class MessageType : uint8_t { kData = 1, kAck = 2, kNotify = 3 };

// Sizes on the wire: every header starts with magic (4), version (1), type (1), reserved (2).
constexpr size_t kPrefixBytes = 8;
constexpr size_t kDataHeaderBytes = kPrefixBytes + 8 + 8 + 8 + WriteKey::kBytes + 4 + 4;  // 56
constexpr size_t kAckHeaderBytes = kPrefixBytes + 8 + 4 + 4 + WriteKey::kBytes;           // 40
constexpr size_t kNotifyHeaderBytes = kPrefixBytes + WriteKey::kBytes;                    // 24

struct Header {
  MessageType type = MessageType::kData;
  uint64_t op_id = 0;       // data, ack: the sender's operation
  uint64_t addr = 0;        // data: where in the target's address space
  uint64_t length = 0;      // data: bytes of payload
  WriteKey key{};           // data, notify: the sync attempt's key; ack: the acked write's (never empty)
  int32_t code = 0;         // ack: an absl::StatusCode (the message text is the payload)
  std::string_view notice;  // data: WriteOp::notice, inside the parsed bytes
};

std::string encodeData(uint64_t op_id, uint64_t addr, uint64_t length, const WriteKey& key, std::string_view notice);
// An ack names the write it answers by the write's id on the wire (random per write) and echoes
// its key: a sender believes an ack only of a write in flight, under that write's key, once.
std::string encodeAck(uint64_t op_id, int32_t code, const WriteKey& key);
std::string encodeNotify(const WriteKey& key);

// The header of one received message of type `expected`. INVALID_ARGUMENT for anything that is
// not a complete header of this version and type: wrong magic, version, type, length, a notice
// length that disagrees with the bytes, an ack code outside absl's, an ack without a key. Never
// reads past `bytes`.
StatusOr<Header> parseHeader(std::string_view bytes, MessageType expected);

// The operation a data header of another version names, and the key where it carries one where
// this version does, where it has our magic (so the sender can be answered at once, under its
// key, instead of timing out); 0 and an empty key otherwise.
uint64_t foreignOpId(std::string_view bytes);
WriteKey foreignKey(std::string_view bytes);

}  // namespace shardcast::transport::ucx_wire
