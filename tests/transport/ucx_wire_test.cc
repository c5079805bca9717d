// The UCX backend's message headers (transport/ucx/wire.h) and the receiver's admission of a write
// (RegionTable::admit): what a peer or anyone on the network can send the data plane.
#include <ucp/api/ucp.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <future>
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
  auto ack = wire::parseHeader(wire::encodeAck(9, 7, key), wire::MessageType::kAck);
  REQUIRE(ack.ok());
  CHECK(ack->op_id == 9);
  CHECK(ack->code == 7);
  CHECK(ack->key == key);
  CHECK(wire::parseHeader(wire::encodeAck(9, 7, WriteKey{}), wire::MessageType::kAck).ok());  // a refusal
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
  refused(wire::encodeAck(1, 99, key), wire::MessageType::kAck, "status code 99");
  refused(wire::encodeAck(1, 0, key) + "x", wire::MessageType::kAck, "not an ack's size");
  refused(wire::encodeAck(1, 0, WriteKey{}), wire::MessageType::kAck, "an OK without the write's key");
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
  REQUIRE(table.openFence(key, {{base + 4096, 4096}, {base + 8192, 4096}, {base + 100, 0}}));
  CHECK_FALSE(table.openFence(key, {{base, memory.size()}}));  // another attempt naming the same key
  CHECK_FALSE(table.admit(key, base, 16));                     // changed nothing
  CHECK(table.admit(key, base + 4096, 8192));                  // two adjacent ranges merge
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
  REQUIRE(table.openFence(other, {{base, memory.size()}}));
  region.reset();
  CHECK_FALSE(table.admit(other, base, 16));
}

namespace {

// A raw UCX worker of the attacker's, speaking UCX's own protocols (RMA included) to `address`.
struct RawUcxPeer {
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  ucp_mem_h memh = nullptr;
  ucp_rkey_h rkey = nullptr;
  std::vector<unsigned char> mine = std::vector<unsigned char>(4096, 0x66);

  explicit RawUcxPeer(const std::string& address) {
    ucp_config_t* cfg = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &cfg) == UCS_OK);
    REQUIRE(ucp_config_modify(cfg, "TLS", "tcp") == UCS_OK);
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    REQUIRE(ucp_init(&p, cfg, &ctx) == UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp{};
    REQUIRE(ucp_worker_create(ctx, &wp, &worker) == UCS_OK);
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    REQUIRE(ucp_ep_create(worker, &ep_params, &ep) == UCS_OK);
    // Its own memory's key: UCX's emulated RMA trusts the address in the request, not the key.
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = mine.data();
    mp.length = mine.size();
    REQUIRE(ucp_mem_map(ctx, &mp, &memh) == UCS_OK);
    void* packed = nullptr;
    size_t len = 0;
    REQUIRE(ucp_rkey_pack(ctx, memh, &packed, &len) == UCS_OK);
    REQUIRE(ucp_ep_rkey_unpack(ep, packed, &rkey) == UCS_OK);
    ucp_rkey_buffer_release(packed);
  }
  ~RawUcxPeer() {
    if (rkey) ucp_rkey_destroy(rkey);
    if (memh) ucp_mem_unmap(ctx, memh);
    if (ep) {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &rp);
      if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        while (ucp_request_check_status(req) == UCS_INPROGRESS && std::chrono::steady_clock::now() < until)
          ucp_worker_progress(worker);
        ucp_request_free(req);
      }
    }
    if (worker) ucp_worker_destroy(worker);
    if (ctx) ucp_cleanup(ctx);
  }
  // Progresses for `seconds`; the request's status then (UCS_INPROGRESS: never answered).
  ucs_status_t settle(ucs_status_ptr_t req, double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < until) ucp_worker_progress(worker);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    const ucs_status_t st = ucp_request_check_status(req);
    ucp_request_free(req);  // released whatever its state (one never answered is purged at the close)
    return st;
  }
};

}  // namespace

TEST_CASE("a context writing by active messages answers no raw UCX put or get: nothing lands, nothing leaks",
          "[transport][security]") {
  TransportOptions o;
  o.ucx.tls = "tcp";  // auto: active messages (the daemon's choice over TCP)
  o.name = "victim";
  auto victim = createContext(o);
  REQUIRE(victim.ok());
  std::vector<unsigned char> weights(4096, 0x11);
  auto region = (*victim)->registerMemory(weights.data(), weights.size(), MemoryKind::kHost);
  REQUIRE(region.ok());
  RawUcxPeer attacker((*victim)->address());
  ucp_request_param_t rp{};
  // A put to the weights' address (as the attacker forged it), then a get of them.
  const ucs_status_t put = attacker.settle(ucp_put_nbx(attacker.ep, attacker.mine.data(), 64,
                                                       reinterpret_cast<uint64_t>(weights.data()), attacker.rkey, &rp),
                                           1.0);
  attacker.settle(ucp_ep_flush_nbx(attacker.ep, &rp), 1.0);
  std::vector<unsigned char> leaked(64, 0);
  const ucs_status_t get = attacker.settle(
      ucp_get_nbx(attacker.ep, leaked.data(), 64, reinterpret_cast<uint64_t>(weights.data()) + 512, attacker.rkey, &rp),
      1.0);
  INFO("put: " << ucs_status_string(put) << ", get: " << ucs_status_string(get));
  CHECK(std::all_of(weights.begin(), weights.end(), [](unsigned char c) { return c == 0x11; }));
  CHECK(std::none_of(leaked.begin(), leaked.end(), [](unsigned char c) { return c == 0x11; }));
  // The victim still serves its own writes: a legitimate key and range land.
  auto sender = createContext(o);
  REQUIRE(sender.ok());
  std::vector<unsigned char> src(64, 0x22);
  auto rs = (*sender)->registerMemory(src.data(), src.size(), MemoryKind::kHost);
  REQUIRE(rs.ok());
  const WriteKey key = WriteKey::random();
  REQUIRE((*victim)->openFence(key, {{(*region)->remote().base, 64}}));
  auto ep = (*sender)->connect((*victim)->address(), "victim");
  REQUIRE(ep.ok());
  std::promise<Status> done;
  (*ep)->write({*rs, 0, (*region)->remote(), 0, 64, key}, [&](Status st) { done.set_value(st); });
  auto f = done.get_future();
  REQUIRE(f.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  CHECK(f.get().ok());
  CHECK(weights[0] == 0x22);
}
