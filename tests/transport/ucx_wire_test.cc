// The UCX backend's message headers (transport/ucx/wire.h) and the receiver's admission of a write
// (RegionTable::admit): what a peer or anyone on the network can send the data plane.
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
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
  CHECK(wire::foreignOpId(v2) == 7);  // answerable at once, under its key
  CHECK(wire::foreignKey(v2) == key);
  CHECK(wire::foreignOpId(old) == 0);
  CHECK(wire::foreignKey(old).empty());
  refused(data, wire::MessageType::kAck, "type 1");
  refused(data.substr(0, wire::kDataHeaderBytes - 1), wire::MessageType::kData, "truncated");
  refused(data + "x", wire::MessageType::kData, "6-byte notice, 7 follow");
  refused(data.substr(0, data.size() - 1), wire::MessageType::kData, "6-byte notice, 5 follow");
  refused(wire::encodeAck(1, 99, key), wire::MessageType::kAck, "status code 99");
  refused(wire::encodeAck(1, 0, key) + "x", wire::MessageType::kAck, "not an ack's size");
  refused(wire::encodeAck(1, 0, WriteKey{}), wire::MessageType::kAck, "an ack without the write's key");
  refused(wire::encodeAck(1, 10, WriteKey{}), wire::MessageType::kAck, "an ack without the write's key");
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
  o.settings["ucx.tls"] = "tcp";  // auto: active messages (the daemon's choice over TCP)
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

namespace {

// Sends an active message `id` (eager) on `ep` of `worker`, in order after earlier ones, and
// returns once UCX is done with the buffers.
void sendAm(ucp_worker_h worker, ucp_ep_h ep, unsigned id, const std::string& header, const std::string& payload) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t req = ucp_am_send_nbx(ep, id, header.data(), header.size(), payload.data(), payload.size(), &rp);
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker);
    ucp_request_free(req);
  }
}

// A raw UCX worker that plays the peer a victim writes to: it records every data message's header
// (and the endpoint to answer on) and answers only what the test tells it to. Over tcp.
struct RawAmPeer {
  struct Received {
    wire::Header header;
    ucp_ep_h reply = nullptr;
  };
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;
  std::vector<Received> received;

  RawAmPeer() {
    ucp_config_t* cfg = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &cfg) == UCS_OK);
    REQUIRE(ucp_config_modify(cfg, "TLS", "tcp") == UCS_OK);
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_AM;
    REQUIRE(ucp_init(&p, cfg, &ctx) == UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp{};
    REQUIRE(ucp_worker_create(ctx, &wp, &worker) == UCS_OK);
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    h.id = 1;  // data
    h.arg = this;
    h.cb = [](void* arg, const void* header, size_t hlen, void*, size_t, const ucp_am_recv_param_t* param) {
      auto* self = static_cast<RawAmPeer*>(arg);
      auto parsed = wire::parseHeader({static_cast<const char*>(header), hlen}, wire::MessageType::kData);
      if (parsed.ok() && (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
        self->received.push_back({*parsed, param->reply_ep});
      return UCS_OK;  // the bytes are dropped (eager: nothing to release)
    };
    REQUIRE(ucp_worker_set_am_recv_handler(worker, &h) == UCS_OK);
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    REQUIRE(ucp_worker_query(worker, &attr) == UCS_OK);
    address.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    ucp_worker_release_address(worker, attr.address);
  }
  ~RawAmPeer() {
    if (worker) ucp_worker_destroy(worker);
    if (ctx) ucp_cleanup(ctx);
  }
  // Progresses until `n` data messages arrived (a hang guard of 60 s, not a timing assertion).
  bool awaitData(size_t n) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (received.size() < n && std::chrono::steady_clock::now() < until) ucp_worker_progress(worker);
    return received.size() >= n;
  }
  void send(ucp_ep_h ep, unsigned id, const std::string& header, const std::string& payload = "") {
    sendAm(worker, ep, id, header, payload);
  }
  void ack(const Received& r, int32_t code, const WriteKey& key, const std::string& message, uint64_t op_id = 0) {
    send(r.reply, 2, wire::encodeAck(op_id ? op_id : r.header.op_id, code, key), message);
  }
};

// Sends this process's stdout and stderr to a new file named from `path_template` while it lives.
class OutputCapture {
 public:
  explicit OutputCapture(char* path_template)
      : file_(::mkstemp(path_template)), saved_out_(::dup(1)), saved_err_(::dup(2)) {
    REQUIRE(file_ >= 0);
    std::fflush(stdout);
    std::fflush(stderr);
    ::dup2(file_, 1);
    ::dup2(file_, 2);
  }
  ~OutputCapture() {
    std::fflush(stdout);
    std::fflush(stderr);
    ::dup2(saved_out_, 1);
    ::dup2(saved_err_, 2);
    ::close(saved_out_);
    ::close(saved_err_);
    ::close(file_);
  }
  OutputCapture(const OutputCapture&) = delete;
  OutputCapture& operator=(const OutputCapture&) = delete;

 private:
  int file_, saved_out_, saved_err_;
};

// Completes when `f` is ready, progressing `peer` meanwhile (a hang guard of 60 s).
template <typename F>
bool settle(RawAmPeer& peer, F& f) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready && std::chrono::steady_clock::now() < until)
    ucp_worker_progress(peer.worker);
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

}  // namespace

TEST_CASE("acks without the write's key, guessed operations and replayed acks neither fail nor finish a write",
          "[transport][security]") {
  TransportOptions o;
  o.settings["ucx.tls"] = "tcp";
  o.name = "sender";
  auto sender = createContext(o);
  REQUIRE(sender.ok());
  RawAmPeer peer;
  std::vector<unsigned char> src(128, 0x22);
  auto region = (*sender)->registerMemory(src.data(), src.size(), MemoryKind::kHost);
  REQUIRE(region.ok());
  auto ep = (*sender)->connect(peer.address, "peer");
  REQUIRE(ep.ok());
  RemoteRegion dst;
  dst.base = 0x10000;
  dst.size = 4096;
  const WriteKey key = WriteKey::random();
  std::vector<WriteOp> batch;
  batch.push_back({*region, 0, dst, 0, 64, key});
  batch.push_back({*region, 64, dst, 64, 64, key});
  std::promise<Status> done;
  auto finished = done.get_future();
  (*ep)->writeBatch(std::move(batch), [&](Status st) { done.set_value(st); });
  REQUIRE(peer.awaitData(2));
  const auto first = peer.received[0];
  const auto second = peer.received[1];
  // Operation ids are not guessable: each write has its own, and they do not count from 1.
  CHECK(first.header.op_id != second.header.op_id);
  CHECK(first.header.op_id > uint64_t{1} << 32);
  CHECK(second.header.op_id > uint64_t{1} << 32);
  // The forged acks: refusals without a key for the ids an attacker would guess and for the real
  // ones, and refusals under a key that is not the write's.
  const auto aborted = static_cast<int32_t>(absl::StatusCode::kAborted);
  for (uint64_t id = 1; id <= 64; ++id) peer.ack(first, aborted, WriteKey{}, "forged", id);
  for (const auto& r : {first, second}) {
    peer.ack(r, aborted, WriteKey{}, "forged");
    peer.ack(r, aborted, WriteKey::random(), "forged");
  }
  // The first write's ack, replayed: it completes that write once, never the batch.
  peer.ack(first, 0, key, "");
  peer.ack(first, 0, key, "");
  peer.ack(first, 0, key, "");
  // The second write is refused by its target, under its key: that is the batch's outcome.
  peer.ack(second, aborted, key, "refused by the target");
  REQUIRE(settle(peer, finished));
  const Status st = finished.get();
  INFO(st);
  CHECK(st.code() == absl::StatusCode::kAborted);
  CHECK_THAT(std::string(st.message()), Catch::Contains("refused by the target"));
  // Acks of a finished write change nothing; the endpoint still carries writes.
  peer.ack(second, 0, key, "");
  peer.ack(first, aborted, key, "late");
  std::promise<Status> again;
  auto next = again.get_future();
  (*ep)->write({*region, 0, dst, 0, 64, key}, [&](Status s) { again.set_value(s); });
  REQUIRE(peer.awaitData(3));
  peer.ack(peer.received[2], 0, key, "");
  REQUIRE(settle(peer, next));
  CHECK(next.get().ok());
}

TEST_CASE("a flood of active messages nothing handles costs a bounded number of log lines", "[transport][security]") {
  TransportOptions o;
  o.settings["ucx.tls"] = "tcp";
  o.name = "victim";
  auto victim = createContext(o);
  REQUIRE(victim.ok());
  std::vector<unsigned char> landing(64);
  auto region = (*victim)->registerMemory(landing.data(), landing.size(), MemoryKind::kHost);
  REQUIRE(region.ok());
  const WriteKey key = WriteKey::random();
  REQUIRE((*victim)->openFence(key, {{(*region)->remote().base, 64}}));
  const std::string after_flood = "after the flood";
  std::promise<void> marker;
  auto marked = marker.get_future();
  (*victim)->setNotificationHandler([&](std::string payload, const WriteKey&) {
    if (payload == after_flood) marker.set_value();
  });
  constexpr int kFlood = 20000;
  bool delivered = false;
  char path[] = "/tmp/ucx_log_flood_XXXXXX";
  {
    // Everything this process writes to stdout and stderr during the flood goes to a file.
    const OutputCapture capture(path);
    RawUcxPeer attacker((*victim)->address());
    for (int i = 0; i < kFlood; ++i) sendAm(attacker.worker, attacker.ep, 9, "", "x");
    // In order after the flood on the same endpoint: once it is delivered, every message was handled.
    sendAm(attacker.worker, attacker.ep, 3, wire::encodeNotify(key), after_flood);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (marked.wait_for(std::chrono::seconds(0)) != std::future_status::ready &&
           std::chrono::steady_clock::now() < until)
      ucp_worker_progress(attacker.worker);
    delivered = marked.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  std::ifstream in(path);
  size_t lines = 0, ucx_lines = 0;
  std::string first;
  for (std::string line; std::getline(in, line); ++lines) {
    if (line.find("no registered callback") != std::string::npos && ucx_lines++ == 0) first = line;
  }
  ::unlink(path);
  REQUIRE(delivered);
  INFO("first UCX line: " << first);
  CHECK(ucx_lines >= 1);  // the first is logged, through spdlog
  CHECK(ucx_lines <= 10);
  CHECK(lines <= 40);
}
