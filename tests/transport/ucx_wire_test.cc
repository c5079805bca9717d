// The UCX backend's message headers (transport/ucx/wire.h) and the receiver's admission of a write
// (RegionTable::admit): what a peer or anyone on the network can send the data plane.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "transport/region_table.h"
#include "transport/ucx/wire.h"

using namespace shardcast;
using namespace shardcast::transport;
namespace wire = shardcast::transport::ucx_wire;

TEST_CASE("UCX headers: each type round-trips through the one parser", "[transport][security]") {
  const WriteKey key = WriteKey::random();
  const std::string data = wire::encodeData(7, 0x1000, 4096, key, "notice");
  CHECK(data.size() == wire::kDataHeaderBytes + 6);
  auto h = wire::parseHeader(data, wire::MessageType::kData);
  REQUIRE(h.ok());
  CHECK(h->op_id == 7);
  CHECK(h->addr == 0x1000);
  CHECK(h->length == 4096);
  CHECK(h->key == key);
  CHECK(h->notice == "notice");
  auto ack = wire::parseHeader(wire::encodeAck(9, 7), wire::MessageType::kAck);
  REQUIRE(ack.ok());
  CHECK(ack->op_id == 9);
  CHECK(ack->code == 7);
  auto note = wire::parseHeader(wire::encodeNotify(key), wire::MessageType::kNotify);
  REQUIRE(note.ok());
  CHECK(note->key == key);
}

TEST_CASE("UCX headers: anything else is refused, never read past its end", "[transport][security]") {
  const WriteKey key = WriteKey::random();
  const std::string data = wire::encodeData(7, 0x1000, 4096, key, "notice");
  auto refused = [](std::string bytes, wire::MessageType type, const char* why) {
    auto h = wire::parseHeader(bytes, type);
    INFO(why);
    REQUIRE_FALSE(h.ok());
    CHECK(h.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(h.status().message()), Catch::Contains(why));
  };
  refused("", wire::MessageType::kData, "shorter than the prefix");
  // The old, unversioned header (op id first, host-endian): not ours.
  std::string old(40, '\0');
  old[0] = 7;
  refused(old, wire::MessageType::kData, "magic");
  std::string v2 = data;
  v2[4] = 2;
  refused(v2, wire::MessageType::kData, "version 2");
  CHECK(wire::foreignOpId(v2) == 7);  // answerable at once
  CHECK(wire::foreignOpId(old) == 0);
  refused(data, wire::MessageType::kAck, "type 1");
  refused(data.substr(0, wire::kDataHeaderBytes - 1), wire::MessageType::kData, "truncated");
  refused(data + "x", wire::MessageType::kData, "6-byte notice, 7 follow");
  refused(data.substr(0, data.size() - 1), wire::MessageType::kData, "6-byte notice, 5 follow");
  refused(wire::encodeAck(1, 99), wire::MessageType::kAck, "status code 99");
  refused(wire::encodeAck(1, 0) + "x", wire::MessageType::kAck, "not an ack's size");
  refused(wire::encodeNotify(key).substr(1), wire::MessageType::kNotify, "magic");
  // Every prefix of a valid header is refused (no read past the end: ASan builds check).
  for (size_t n = 0; n < data.size(); ++n)
    CHECK_FALSE(wire::parseHeader(data.substr(0, n), wire::MessageType::kData).ok());
}

namespace {
class FakeRegion final : public MemoryRegion {
 public:
  FakeRegion(void* data, size_t size) : MemoryRegion(MemoryKind::kHost, data, size) {
    remote_.base = reinterpret_cast<uint64_t>(data);
    remote_.size = size;
  }
};
}  // namespace

TEST_CASE("a write is admitted only under an open key, inside its ranges and registered memory",
          "[transport][security]") {
  std::vector<unsigned char> memory(1 << 16);
  auto region = std::make_shared<FakeRegion>(memory.data(), memory.size());
  RegionTable table;
  table.add(region);
  const uint64_t base = region->remote().base;
  const WriteKey key = WriteKey::random();
  CHECK_FALSE(table.admit(key, base, 16));  // not open
  table.openFence(key, {{base + 4096, 4096}, {base + 8192, 4096}, {base + 100, 0}});
  CHECK(table.admit(key, base + 4096, 8192));  // two adjacent ranges merge
  CHECK(table.admit(key, base + 4096 + 100, 16));
  CHECK_FALSE(table.admit(key, base, 16));                        // registered, but outside the key's ranges
  CHECK_FALSE(table.admit(key, base + 4000, 200));                // straddles the start
  CHECK_FALSE(table.admit(key, base + 12000, 1000));              // straddles the end
  CHECK_FALSE(table.admit(key, ~uint64_t{0} - 4, 16));            // wraps
  CHECK_FALSE(table.admit(WriteKey{}, base + 4096, 16));          // no key ("fence 0")
  CHECK_FALSE(table.admit(WriteKey::random(), base + 4096, 16));  // a guessed key
  {
    auto held = table.admit(key, base + 4096, 16);
    REQUIRE(held);
    // Closing waits for the write landing under it, then refuses.
    CHECK_FALSE(table.closeFence(key, std::chrono::milliseconds(10)));
    CHECK_FALSE(table.admit(key, base + 4096, 16));  // closing
  }
  CHECK(table.closeFence(key, std::chrono::milliseconds(0)));
  CHECK_FALSE(table.admit(key, base + 4096, 16));
  // A key over memory that is no longer registered admits nothing.
  const WriteKey other = WriteKey::random();
  table.openFence(other, {{base, memory.size()}});
  region.reset();
  CHECK_FALSE(table.admit(other, base, 16));
}
