// The data plane's one peer message: its parser refuses everything malformed, and a daemon that
// receives malformed or lying notifications fails the sync, naming the problem, and stays up.
#include "daemon/engine/notification.h"

#include <catch2/catch.hpp>
#include <future>
#include <thread>

#include "planner/layout.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/rank_memory.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::daemon;
using namespace shardcast::testing;

TEST_CASE("notifications: round trip, and every malformed form refused", "[daemon][notification]") {
  Notification n;
  n.sync_id = "step-7";
  n.fence = 0x1234567890abcdefULL;
  n.chunks = {{1, 2, 0, 3, LandedChunk::kDelta, 42, 17, 0xfedcba9876543210ULL}, {4, 5, 1, 0}};
  const std::string bytes = encodeNotification(n);
  CHECK(bytes.size() == notificationBytes(6, 2));
  auto back = parseNotification(bytes);
  REQUIRE(back.ok());
  CHECK(back->sync_id == "step-7");
  CHECK(back->fence == n.fence);
  REQUIRE(back->chunks.size() == 2);
  CHECK(back->chunks[0].chunk == 3);
  CHECK(back->chunks[0].encoding == LandedChunk::kDelta);
  CHECK(back->chunks[0].checksum == 42);
  CHECK(back->chunks[0].bytes == 17);
  CHECK(back->chunks[0].result == 0xfedcba9876543210ULL);
  CHECK(back->chunks[1].hop == 1);
  CHECK(back->chunks[1].encoding == LandedChunk::kDense);
  // Every truncation, and one byte too many.
  for (size_t len = 0; len < bytes.size(); ++len) CHECK_FALSE(parseNotification(bytes.substr(0, len)).ok());
  CHECK_FALSE(parseNotification(bytes + "x").ok());
  // Magic, version, id and count out of bounds.
  auto mutate = [&](size_t at, char v) {
    std::string b = bytes;
    b[at] = v;
    return parseNotification(b);
  };
  CHECK_THAT(std::string(mutate(0, 'X').status().message()), Catch::Contains("not a Shardcast notification"));
  CHECK_THAT(std::string(mutate(4, 9).status().message()), Catch::Contains("format version 9"));
  CHECK_FALSE(mutate(6, 0).ok());                     // id length 0
  CHECK_FALSE(mutate(7, static_cast<char>(1)).ok());  // id length 262: more than allowed
  // No chunks: the readiness word, a node index and an answer flag, nothing else.
  Notification ready = n;
  ready.chunks.clear();
  ready.ready_node = 7;
  ready.answer = true;
  const std::string word = encodeNotification(ready);
  CHECK(word.size() == notificationBytes(6, 0) + 8);
  back = parseNotification(word);
  REQUIRE(back.ok());
  CHECK(back->chunks.empty());
  CHECK(back->ready_node == 7);
  CHECK(back->answer);
  ready.answer = false;
  back = parseNotification(encodeNotification(ready));
  REQUIRE(back.ok());
  CHECK_FALSE(back->answer);
  for (size_t len = notificationBytes(6, 0); len < word.size(); ++len)
    CHECK_FALSE(parseNotification(word.substr(0, len)).ok());
  CHECK_FALSE(parseNotification(word + "x").ok());
  ready.ready_node = -1;  // no node
  CHECK_THAT(std::string(parseNotification(encodeNotification(ready)).status().message()),
             Catch::Contains("a readiness word"));
  std::string flags = word;
  flags[flags.size() - 4] = 2;  // an unknown flag
  CHECK_FALSE(parseNotification(flags).ok());
  Notification many = n;
  many.chunks.resize(kMaxLanded + 1);
  CHECK_FALSE(parseNotification(encodeNotification(many)).ok());
  CHECK_FALSE(parseNotification(std::string(1 << 16, '\xff')).ok());
}

TEST_CASE("a daemon fed lying notifications fails the sync and stays up", "[daemon][notification]") {
  // n0: one source rank; n1: two destination ranks (halves): n0 sends, n1 receives.
  const int p0 = freePort(), p1 = freePort();
  const std::vector<std::string> peers{"127.0.0.1:" + std::to_string(p0), "127.0.0.1:" + std::to_string(p1)};
  Daemon n0("n0", p0, peers), n1("n1", p1, peers);
  REQUIRE(n0.ready());
  REQUIRE(n1.ready());
  const auto src_proto = *planner::parseLayoutJson(R"({"group":"s","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[64,32],"dtype":"int32"}]})",
                                                   "s");
  const auto dst_proto = *planner::parseLayoutJson(R"({"group":"d","mesh":{"shape":[2]},"nodes":["n1","n1"],"tensors":[
    {"name":"w","shape":[64,32],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})",
                                                   "d");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  RankMemory s0 = allocateRank(src, 0, "notify-s0");
  std::vector<RankMemory> d;
  v1::RegisterResponse resp;
  REQUIRE(n0.client()->Register(ctx().get(), registerRequest(src_proto, 0, 1, s0, v1::ROLE_SOURCE, 1), &resp).ok());
  for (int32_t r = 0; r < 2; ++r) {
    d.push_back(allocateRank(dst, r, "notify-d" + std::to_string(r)));
    REQUIRE(n1.client()->Register(ctx().get(), registerRequest(dst_proto, r, 2, d[r]), &resp).ok());
  }
  auto peer1 = n1.peer();
  v1::DescribeResponse described;
  REQUIRE(peer1->Describe(ctx().get(), v1::DescribeRequest(), &described).ok());

  // An impostor on the data plane: garbage, another attempt's notification, then one that lies.
  transport::TransportOptions opts;
  opts.name = "impostor";
  opts.settings["ucx.tls"] = "tcp";
  auto ctx_or = transport::createContext(opts);
  REQUIRE(ctx_or.ok());
  auto ep = (*ctx_or)->connect(described.transport_address(), "n1");
  REQUIRE(ep.ok());
  auto send = [&](std::string payload, const transport::WriteKey& key) {
    std::promise<Status> done;
    (*ep)->notify(std::move(payload), key, [&](Status st) { done.set_value(st); });
    return done.get_future().get();
  };
  // One sync per lie: n1 prepares it, hears the lie, and its execute fails naming it.
  auto lied_to = [&](const std::string& id, LandedChunk lie, const std::string& refused) {
    INFO(id);
    const v1::PrepareRequest prep = prepareRequest(id, src_proto, dst_proto, 1, 99);
    v1::PrepareResponse presp;
    REQUIRE(peer1->Prepare(ctx().get(), prep, &presp).ok());
    // A peer of the attempt (it holds the attempt's key) that lies; an impostor without the key is
    // not heard at all.
    const auto key = *transport::WriteKey::fromBytes(prep.write_key());
    REQUIRE(send(id + " 0 0 0 0 0\n", key).ok());                           // the old text form: not parsed
    REQUIRE(send(encodeNotification({id, 98, {{0, 0, 0, 0}}}), key).ok());  // another attempt's
    REQUIRE(send(encodeNotification({id, 99, {{0, 0, 0, 0, LandedChunk::kDense, 0, 8192}}}),
                 transport::WriteKey::random())
                .ok());  // a true word, but without the key: dropped (else the lie below would be a repeat)
    // (Sent before the Execute; whether it lands before the Execute starts or while it waits for
    // the chunk, the attempt fails on it.)
    REQUIRE(send(encodeNotification({id, 99, {lie}}), key).ok());
    v1::ExecuteRequest exec;
    exec.set_sync_id(id);
    exec.set_fence(99);
    exec.set_timeout_ms(5000);
    auto* me = exec.add_nodes();
    me->set_node("n1");
    me->set_transport_address(described.transport_address());
    *me->mutable_targets() = presp.targets();
    v1::ExecuteResponse part;
    const grpc::Status st = peer1->Execute(ctx().get(), exec, &part);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains(refused));
    v1::StatusResponse status;
    CHECK(n1.client()->Status(ctx().get(), v1::StatusRequest(), &status).ok());  // alive
    v1::FinishRequest fin;
    fin.set_sync_id(id);
    fin.set_fence(99);
    fin.set_executed(true);
    v1::FinishResponse fr;
    REQUIRE(peer1->Finish(ctx().get(), fin, &fr).ok());
    for (const auto& r : fr.ranks()) CHECK(r.state() == v1::RANK_DIRTY);
  };
  const uint64_t chunk_bytes = 64 * 32 * 4;  // w lands on n1 whole: one transfer, one chunk
  lied_to("lied-chain", {0, 7, 3, 0, LandedChunk::kDense, 0, chunk_bytes},
          "a peer announced a chain not of the transfer");
  lied_to("lied-encoding", {0, 0, 0, 0, 7, 0, chunk_bytes}, "a peer announced an unknown encoding 7");
  lied_to("lied-size", {0, 0, 0, 0, LandedChunk::kDense, 0, 3}, "a dense chunk of 3 bytes, not 8192");
  lied_to("lied-delta", {0, 0, 0, 0, LandedChunk::kDelta, 0, 5}, "a delta for a node whose ranks hold no base");
  (*ep)->close();
}
