#include "transport/ucx/wire.h"

#include <cstring>

#include "common/strings.h"

namespace shardcast::transport::ucx_wire {

namespace {

template <typename T>
void put(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}

template <typename T>
T get(std::string_view bytes, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  return static_cast<T>(v);
}

std::string prefix(MessageType type) {
  std::string out;
  put<uint32_t>(out, kMagic);
  put<uint8_t>(out, kVersion);
  put<uint8_t>(out, static_cast<uint8_t>(type));
  put<uint16_t>(out, 0);
  return out;
}

const char* typeName(MessageType t) {
  switch (t) {
    case MessageType::kData:
      return "data";
    case MessageType::kAck:
      return "ack";
    case MessageType::kNotify:
      return "notification";
  }
  return "unknown";
}

}  // namespace

std::string encodeData(uint64_t op_id, uint64_t addr, uint64_t length, const WriteKey& key, std::string_view notice) {
  std::string out = prefix(MessageType::kData);
  out.reserve(kDataHeaderBytes + notice.size());
  put<uint64_t>(out, op_id);
  put<uint64_t>(out, addr);
  put<uint64_t>(out, length);
  out.append(key.view());
  put<uint32_t>(out, static_cast<uint32_t>(notice.size()));
  put<uint32_t>(out, 0);
  out.append(notice);
  return out;
}

std::string encodeAck(uint64_t op_id, int32_t code, const WriteKey& key) {
  std::string out = prefix(MessageType::kAck);
  put<uint64_t>(out, op_id);
  put<int32_t>(out, code);
  put<uint32_t>(out, 0);
  out.append(key.view());
  return out;
}

std::string encodeNotify(const WriteKey& key) {
  std::string out = prefix(MessageType::kNotify);
  out.append(key.view());
  return out;
}

StatusOr<Header> parseHeader(std::string_view bytes, MessageType expected) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        strCat("a ", typeName(expected), " message header of ", bytes.size(), " bytes: ", why));
  };
  if (bytes.size() < kPrefixBytes) return bad("shorter than the prefix");
  if (get<uint32_t>(bytes, 0) != kMagic) return bad("not a shardcast header (magic)");
  if (const int v = get<uint8_t>(bytes, 4); v != kVersion)
    return bad(strCat("version ", v, ", this daemon speaks ", int{kVersion}, " (a shardcastd of another release?)"));
  if (const int type = get<uint8_t>(bytes, 5); type != static_cast<int>(expected)) return bad(strCat("type ", type));
  Header h;
  h.type = expected;
  switch (expected) {
    case MessageType::kData: {
      if (bytes.size() < kDataHeaderBytes) return bad("truncated");
      h.op_id = get<uint64_t>(bytes, 8);
      h.addr = get<uint64_t>(bytes, 16);
      h.length = get<uint64_t>(bytes, 24);
      std::memcpy(h.key.bytes.data(), bytes.data() + 32, WriteKey::kBytes);
      const uint32_t notice = get<uint32_t>(bytes, 48);
      if (notice != bytes.size() - kDataHeaderBytes)
        return bad(strCat("announces a ", notice, "-byte notice, ", bytes.size() - kDataHeaderBytes, " follow"));
      if (notice > kMaxNotifyBytes) return bad(strCat("a notice of ", notice, " bytes"));
      h.notice = bytes.substr(kDataHeaderBytes);
      return h;
    }
    case MessageType::kAck: {
      if (bytes.size() != kAckHeaderBytes) return bad("not an ack's size");
      h.op_id = get<uint64_t>(bytes, 8);
      h.code = get<int32_t>(bytes, 16);
      if (h.code < 0 || h.code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated))
        return bad(strCat("status code ", h.code));
      std::memcpy(h.key.bytes.data(), bytes.data() + 24, WriteKey::kBytes);
      if (h.key.empty()) return bad("an ack without the write's key");
      return h;
    }
    case MessageType::kNotify: {
      if (bytes.size() != kNotifyHeaderBytes) return bad("not a notification header's size");
      std::memcpy(h.key.bytes.data(), bytes.data() + kPrefixBytes, WriteKey::kBytes);
      return h;
    }
  }
  return bad("unknown type");
}

uint64_t foreignOpId(std::string_view bytes) {
  if (bytes.size() < kPrefixBytes + 8 || get<uint32_t>(bytes, 0) != kMagic) return 0;
  return get<uint64_t>(bytes, 8);
}

WriteKey foreignKey(std::string_view bytes) {
  WriteKey key;
  if (bytes.size() >= 32 + WriteKey::kBytes && get<uint32_t>(bytes, 0) == kMagic)
    std::memcpy(key.bytes.data(), bytes.data() + 32, WriteKey::kBytes);
  return key;
}

}  // namespace shardcast::transport::ucx_wire
