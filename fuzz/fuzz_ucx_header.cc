// What anyone who reaches a daemon's UCX ports can send it: the header of an active message
// (data, ack, notification) through the one parser, transport/ucx/wire.h. The first byte picks
// the type the receiver expects; a parsed header must survive encode -> parse unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "transport/ucx/wire.h"

using namespace shardcast::transport;
namespace wire = shardcast::transport::ucx_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto type = static_cast<wire::MessageType>(1 + data[0] % 3);
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  (void)wire::foreignOpId(bytes);
  (void)wire::foreignKey(bytes);
  auto h = wire::parseHeader(bytes, type);
  if (!h.ok()) return 0;
  std::string again;
  switch (type) {
    case wire::MessageType::kData:
      again = wire::encodeData(h->op_id, h->addr, h->length, h->key, h->notice);
      break;
    case wire::MessageType::kAck:
      again = wire::encodeAck(h->op_id, h->code, h->key);
      break;
    case wire::MessageType::kNotify:
      again = wire::encodeNotify(h->key);
      break;
  }
  auto back = wire::parseHeader(again, type);
  if (!back.ok() || back->op_id != h->op_id || back->addr != h->addr || back->length != h->length ||
      back->key != h->key || back->code != h->code || back->notice != h->notice)
    std::abort();
  return 0;
}
