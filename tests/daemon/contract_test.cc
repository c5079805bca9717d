// The version contract between real daemons: rank states, fences, roles and types, leases and
// sessions (docs/daemon.md, "Rank states and fences"). Syncs are driven whole (Shardcast.Sync)
// or phase by phase over the Peer service, as a coordinator would, to stop them at a chosen point.
#include <fcntl.h>
#include <httplib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <future>
#include <set>
#include <thread>

#include "client/lib/client.h"
#include "common/grpc_status.h"
#include "planner/layout.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/rank_memory.h"

using namespace shardcast;
using namespace shardcast::testing;

namespace {

using Clock = std::chrono::steady_clock;

// n0 holds the trainer (2 ranks, rows), n1 the inference group (2 ranks, columns): every byte
// crosses the network.
const char* kSrc = R"({"group":"src","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
  {"name":"w","shape":[64,32],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
const char* kDst = R"({"group":"dst","mesh":{"shape":[2]},"nodes":["n1","n1"],"tensors":[
  {"name":"w","shape":[64,32],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})";

int32_t valueOf(int64_t flat, uint64_t version) {
  return static_cast<int32_t>(flat * 10 + static_cast<int64_t>(version));
}

struct Pair {
  std::vector<int> ports{freePort(), freePort()};
  std::vector<std::unique_ptr<Daemon>> daemons;
  v1::Layout src_proto = *planner::parseLayoutJson(kSrc, "src");
  v1::Layout dst_proto = *planner::parseLayoutJson(kDst, "dst");
  planner::NodeTable nodes;
  planner::ResolvedLayout src = *planner::resolveLayout(src_proto, nodes);
  planner::ResolvedLayout dst = *planner::resolveLayout(dst_proto, nodes);
  std::vector<RankMemory> smem, dmem;

  explicit Pair(std::vector<std::string> extra = {}) {
    std::vector<std::string> peers;
    for (int p : ports) peers.push_back("127.0.0.1:" + std::to_string(p));
    for (int i = 0; i < 2; ++i) {
      daemons.push_back(std::make_unique<Daemon>("n" + std::to_string(i), ports[static_cast<size_t>(i)], peers, extra));
      REQUIRE(daemons.back()->ready());
    }
    for (int32_t r = 0; r < 2; ++r) smem.push_back(allocateRank(src, r, "contract-s" + std::to_string(r)));
    for (int32_t r = 0; r < 2; ++r) dmem.push_back(allocateRank(dst, r, "contract-d" + std::to_string(r)));
  }
  Daemon& n0() { return *daemons[0]; }
  Daemon& n1() { return *daemons[1]; }

  void fill(uint64_t version) {
    for (int32_t r = 0; r < 2; ++r)
      forEachElement(src, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        *smem[r].at<int32_t>(p, off) = valueOf(flat, version);
      });
  }
  int64_t wrong(uint64_t version) {
    int64_t bad = 0;
    for (int32_t r = 0; r < 2; ++r)
      forEachElement(dst, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *dmem[r].at<int32_t>(p, off) != valueOf(flat, version);
      });
    return bad;
  }
  // Sources READY at `version` (their bytes filled), destinations EMPTY.
  void registerAll(uint64_t version) {
    fill(version);
    v1::RegisterResponse resp;
    for (int32_t r = 0; r < 2; ++r) {
      auto st = n0().client()->Register(ctx().get(),
                                        registerRequest(src_proto, r, 2, smem[r], v1::ROLE_SOURCE, version), &resp);
      INFO(st.error_message());
      REQUIRE(st.ok());
      st = n1().client()->Register(ctx().get(), registerRequest(dst_proto, r, 2, dmem[r]), &resp);
      INFO(st.error_message());
      REQUIRE(st.ok());
    }
  }
  // The destination ranks registered again (replacing registerAll's) through `client`,
  // double-buffered: `dmem` the first set, `shadow` the second. Returns each rank's answer.
  std::vector<StatusOr<v1::RegisterResponse>> registerDoubled(Client& client, const std::vector<RankMemory>& shadow) {
    std::vector<StatusOr<v1::RegisterResponse>> out;
    for (int32_t r = 0; r < 2; ++r) {
      const auto live = registerRequest(dst_proto, r, 2, dmem[r]);
      const auto other = registerRequest(dst_proto, r, 2, shadow[r]);
      RegisterOptions doubled = RegisterOptions::doubleBuffered(
          std::vector<v1::MemoryHandle>(other.buffers().begin(), other.buffers().end()));
      doubled.replace = true;
      out.push_back(client.registerRank(
          dst_proto, r, std::vector<v1::MemoryHandle>(live.buffers().begin(), live.buffers().end()), doubled));
    }
    return out;
  }
  // Acquire every source rank, write `version`, publish it.
  void step(uint64_t version) {
    auto c = Client::connect("unix:" + n0().socketPath());
    REQUIRE(c.ok());
    for (int32_t r = 0; r < 2; ++r) REQUIRE(c->acquire("src", r).ok());
    fill(version);
    for (int32_t r = 0; r < 2; ++r) REQUIRE(c->publish("src", r, version).ok());
  }
  grpc::Status sync(uint64_t version, v1::SyncResponse* out = nullptr) {
    v1::SyncRequest s;
    s.set_src_group("src");
    s.set_dst_group("dst");
    s.set_version(version);
    s.mutable_options()->set_timeout_ms(20000);
    v1::SyncResponse o;
    return n0().client()->Sync(ctx(60).get(), s, out ? out : &o);
  }
  // The states of `group`'s ranks on daemon `d`, by rank.
  std::map<int32_t, v1::RankStatus> states(Daemon& d, const std::string& group) {
    v1::StatusResponse st;
    const grpc::Status called = d.client()->Status(ctx().get(), v1::StatusRequest(), &st);
    INFO(called.error_message());
    REQUIRE(called.ok());
    std::map<int32_t, v1::RankStatus> out;
    for (const auto& g : st.groups())
      if (g.group() == group)
        for (const auto& r : g.rank_states()) out[r.rank()] = r;
    return out;
  }

  // Phase by phase, as a coordinator: prepare on both, execute on n0 (which sends every byte).
  std::vector<std::unique_ptr<v1::Peer::Stub>> peers() {
    std::vector<std::unique_ptr<v1::Peer::Stub>> out;
    for (auto& d : daemons) out.push_back(d->peer());
    return out;
  }
  v1::ExecuteRequest prepare(const std::string& id, uint64_t version, uint32_t lease_ms = 0) {
    auto p = peers();
    v1::ExecuteRequest exec;
    exec.set_sync_id(id);
    exec.set_timeout_ms(20000);
    const std::string key(transport::WriteKey::random().view());  // one attempt: one key everywhere
    for (int i = 0; i < 2; ++i) {
      v1::DescribeResponse described;
      REQUIRE(p[i]->Describe(ctx().get(), v1::DescribeRequest(), &described).ok());
      v1::PrepareRequest prep = prepareRequest(id, src_proto, dst_proto, version);
      prep.set_lease_ms(lease_ms);
      prep.set_write_key(key);
      v1::PrepareResponse presp;
      const auto st = p[i]->Prepare(ctx().get(), prep, &presp);
      INFO(st.error_message());
      REQUIRE(st.ok());
      auto* n = exec.add_nodes();
      n->set_node(described.node());
      n->set_transport_address(described.transport_address());
      *n->mutable_targets() = presp.targets();
    }
    return exec;
  }
  void finish(const std::string& id, bool commit, bool executed, const std::string& reason = "") {
    auto p = peers();
    for (int i = 0; i < 2; ++i) {
      v1::FinishRequest f;
      f.set_sync_id(id);
      f.set_commit(commit);
      f.set_executed(executed);
      f.set_reason(reason);
      v1::FinishResponse fr;
      REQUIRE(p[i]->Finish(ctx().get(), f, &fr).ok());
    }
  }
};

v1::WaitVersionResponse waitVersion(Daemon& d, const std::string& group, uint64_t version, uint32_t timeout_ms,
                                    grpc::Status* status) {
  v1::WaitVersionRequest w;
  w.set_group(group);
  w.set_version(version);
  w.set_timeout_ms(timeout_ms);
  v1::WaitVersionResponse out;
  *status = d.client()->WaitVersion(ctx().get(), w, &out);
  return out;
}

}  // namespace

TEST_CASE("rank states: empty, updating, ready - a sync that wrote and failed leaves them dirty until the next commits",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  for (const auto& [r, st] : c.states(c.n1(), "dst")) CHECK(st.state() == v1::RANK_EMPTY);
  for (const auto& [r, st] : c.states(c.n0(), "src")) {
    CHECK(st.state() == v1::RANK_READY);
    CHECK(st.version() == 1);
  }
  grpc::Status gs;
  auto w = waitVersion(c.n1(), "dst", 1, 0, &gs);
  REQUIRE(gs.ok());
  CHECK(w.version() == 0);
  REQUIRE(w.ranks_size() == 2);

  // Prepared: the destination ranks are being written (updating), the group reports no version.
  auto exec = c.prepare("by-hand", 1);
  for (const auto& [r, st] : c.states(c.n1(), "dst")) {
    CHECK(st.state() == v1::RANK_UPDATING);
    CHECK(st.version() == 1);
  }
  // n0 sends every byte into n1's ranks; then the sync is aborted after executing: dirty.
  v1::ExecuteResponse part;
  REQUIRE(c.peers()[0]->Execute(ctx().get(), exec, &part).ok());
  CHECK(part.bytes_sent() > 0);
  c.finish("by-hand", false, true, "the test aborted it");
  for (const auto& [r, st] : c.states(c.n1(), "dst")) {
    CHECK(st.state() == v1::RANK_DIRTY);
    CHECK_THAT(st.detail(), Catch::Contains("sync by-hand wrote part of version 1"));
    CHECK_THAT(st.detail(), Catch::Contains("the test aborted it"));
  }
  // WaitVersion fails at once on a dirty rank, naming it.
  const auto began = Clock::now();
  waitVersion(c.n1(), "dst", 1, 10000, &gs);
  CHECK(gs.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(gs.error_message(), Catch::Contains("group \"dst\" rank 0 on node \"n1\" is DIRTY"));
  CHECK(Clock::now() - began < std::chrono::seconds(5));

  // The next sync of the same version repairs them.
  grpc::Status st = c.sync(1);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(c.wrong(1) == 0);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 1);
  }
  w = waitVersion(c.n1(), "dst", 1, 1000, &gs);
  REQUIRE(gs.ok());
  CHECK(w.version() == 1);

  // Prepared and aborted before anything was sent anywhere: back to where they were.
  c.step(2);
  c.prepare("not-executed", 2);
  c.finish("not-executed", false, false);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 1);
  }

  // Versions do not outlive ranks: registered again, a rank starts empty, and waiting for the
  // old version does not return at once.
  for (int32_t r = 0; r < 2; ++r) {
    v1::UnregisterRequest un;
    un.set_group("dst");
    un.set_rank(r);
    v1::UnregisterResponse ur;
    REQUIRE(c.n1().client()->Unregister(ctx().get(), un, &ur).ok());
    v1::RegisterResponse resp;
    REQUIRE(c.n1().client()->Register(ctx().get(), registerRequest(c.dst_proto, r, 2, c.dmem[r]), &resp).ok());
  }
  w = waitVersion(c.n1(), "dst", 1, 200, &gs);
  REQUIRE(gs.ok());
  CHECK(w.version() == 0);
  for (const auto& r : w.ranks()) CHECK(r.state() == v1::RANK_EMPTY);
}

TEST_CASE("a sync whose coordinator goes silent is aborted on every daemon within its lease, its ranks dirty",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  // A lease long enough for both Prepares and n0's Execute on a loaded machine (at 400 ms a busy
  // CI run saw n0's attempt expire before its Execute began).
  auto exec = c.prepare("orphan", 1, /*lease_ms=*/2000);
  v1::ExecuteResponse part;
  const auto executed = Clock::now();
  REQUIRE(c.peers()[0]->Execute(ctx().get(), exec, &part).ok());
  // Nobody finishes it, nobody asks for progress: the lease runs out, well within 10 s.
  const auto dirty = [&] {
    for (const auto& [r, st] : c.states(c.n1(), "dst"))
      if (st.state() != v1::RANK_DIRTY) return false;
    return true;
  };
  while (!dirty() && Clock::now() - executed < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (const auto& [r, st] : c.states(c.n1(), "dst")) {
    CHECK(st.state() == v1::RANK_DIRTY);
    CHECK_THAT(st.detail(), Catch::Contains("its coordinator went silent"));
  }
  v1::ProgressRequest pr;
  pr.set_sync_id("orphan");
  v1::ProgressResponse prr;
  CHECK(c.peers()[1]->Progress(ctx().get(), pr, &prr).error_code() == grpc::StatusCode::NOT_FOUND);
  // The source ranks were released: their owner can acquire them, and the group takes the next sync.
  c.step(2);
  const grpc::Status st = c.sync(2);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(c.wrong(2) == 0);
  httplib::Client http("127.0.0.1", c.n1().metricsPort());
  auto scrape = http.Get("/metrics");
  REQUIRE(scrape);
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_syncs_expired_total 1"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_ranks{state=\"ready\"} 2"));
}

TEST_CASE("fences: a sync reads only what a source published - owners acquire around their writes and reads",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(0);  // sources registered EMPTY: nothing published yet
  grpc::Status st = c.sync(1);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(),
             Catch::Contains("group \"src\" rank 0 on node \"n0\" has published no version, not 1"));
  c.step(1);
  st = c.sync(2);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("published version 1, not 2"));

  auto client = Client::connect("unix:" + c.n0().socketPath());
  REQUIRE(client.ok());
  // A sync reading the sources holds their owner off until it ends.
  c.prepare("reading", 1);
  auto acquired = std::async(std::launch::async, [&] { return client->acquire("src", 0, std::chrono::seconds(20)); });
  CHECK(acquired.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout);
  auto quick = client->acquire("src", 1, std::chrono::milliseconds(100));
  REQUIRE_FALSE(quick.ok());
  CHECK(absl::IsDeadlineExceeded(quick.status()));
  CHECK_THAT(std::string(quick.status().message()), Catch::Contains("sync reading still uses it"));
  // A caller that gives up waiting does not take the rank later.
  {
    v1::AcquireRequest aq;
    aq.set_group("src");
    aq.set_rank(1);
    aq.set_timeout_ms(20000);
    v1::AcquireResponse ar;
    grpc::ClientContext gone;
    gone.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    CHECK(c.n0().client()->Acquire(&gone, aq, &ar).error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the daemon notices within 100 ms
  }
  c.finish("reading", false, false);
  REQUIRE(acquired.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  auto held = acquired.get();
  REQUIRE(held.ok());
  CHECK_FALSE(c.states(c.n0(), "src")[1].held());  // the caller that went away holds nothing
  CHECK(held->state() == v1::RANK_UPDATING);
  CHECK(held->held());
  // Being written: no sync reads it.
  st = c.sync(1);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("group \"src\" rank 0 on node \"n0\" is being written by its owner"));
  CHECK(absl::IsInvalidArgument(client->publish("src", 0, 0).status()));
  CHECK(absl::IsInvalidArgument(client->publish("src", 0, uint64_t{1} << 63).status()));
  REQUIRE(client->acquire("src", 1).ok());
  c.fill(3);
  for (int32_t r = 0; r < 2; ++r) REQUIRE(client->publish("src", r, 3).ok());
  auto older = client->publish("src", 0, 2);
  CHECK(absl::IsInvalidArgument(older.status()));
  CHECK_THAT(std::string(older.status().message()), Catch::Contains("older than version 3"));
  auto unacquired = client->publish("src", 0, 4);
  CHECK(absl::IsFailedPrecondition(unacquired.status()));
  CHECK_THAT(std::string(unacquired.status().message()), Catch::Contains("acquire first"));

  // A destination rank its engine holds does not take updates until released.
  auto engine = Client::connect("unix:" + c.n1().socketPath());
  REQUIRE(engine.ok());
  auto paused = engine->acquire("dst", 1);
  REQUIRE(paused.ok());
  CHECK(paused->held());
  st = c.sync(3);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("group \"dst\" rank 1 on node \"n1\" does not accept updates"));
  CHECK(absl::IsInvalidArgument(engine->publish("dst", 1, 3).status()));
  REQUIRE(engine->release("dst", 1).ok());
  st = c.sync(3);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(c.wrong(3) == 0);
}

TEST_CASE("roles and types: no sync into a source or out of a destination - dtype, shape and version bounds checked",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  // A second source group on n1 with the destination's layout: a sync into it is refused and it
  // keeps its bytes.
  std::string other_json = kDst;
  other_json.replace(other_json.find("\"dst\""), 5, "\"src2\"");
  const auto other = *planner::parseLayoutJson(other_json, "src2");
  std::vector<RankMemory> omem;
  v1::RegisterResponse resp;
  for (int32_t r = 0; r < 2; ++r) {
    omem.push_back(allocateRank(c.dst, r, "contract-o" + std::to_string(r)));
    std::memset(omem.back().seg->data(), 0x5a, omem.back().seg->size());
    REQUIRE(
        c.n1().client()->Register(ctx().get(), registerRequest(other, r, 2, omem[r], v1::ROLE_SOURCE, 7), &resp).ok());
  }
  v1::SyncRequest s;
  s.set_src_group("src");
  s.set_dst_group("src2");
  s.set_version(9);
  v1::SyncResponse out;
  grpc::Status st = c.n0().client()->Sync(ctx().get(), s, &out);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("\"src2\" is registered as a source"));
  CHECK_THAT(st.error_message(), Catch::Contains("refusing to overwrite it"));
  for (const auto& m : omem) {
    const auto* bytes = static_cast<const unsigned char*>(m.seg->data());
    CHECK(std::all_of(bytes, bytes + m.seg->size(), [](unsigned char b) { return b == 0x5a; }));
  }
  s.set_src_group("dst");
  s.set_dst_group("src2");
  st = c.n0().client()->Sync(ctx().get(), s, &out);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("\"dst\" is registered as a destination"));

  // One group, one role.
  auto mixed = registerRequest(c.src_proto, 1, 2, c.smem[1]);  // a destination, where rank 0 is a source
  mixed.set_replace(true);
  st = c.n0().client()->Register(ctx().get(), mixed, &resp);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("registers as destination but the group's other ranks are source"));

  // What the client says it holds must be what the layout says.
  auto typed = registerRequest(c.dst_proto, 0, 2, c.dmem[0]);
  typed.set_replace(true);
  typed.mutable_buffers(0)->set_dtype("float32");
  st = c.n1().client()->Register(ctx().get(), typed, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("buffer \"w\" is float32 here but int32 in the layout"));
  typed.mutable_buffers(0)->set_dtype("int32");
  typed.mutable_buffers(0)->add_shape(64);
  typed.mutable_buffers(0)->add_shape(32);
  st = c.n1().client()->Register(ctx().get(), typed, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(),
             Catch::Contains("has shape [64, 32] (2048 elements) but the layout gives this rank [64, 16] (1024 "
                             "elements) of it"));
  typed.mutable_buffers(0)->clear_shape();  // as many elements, transposed: refused, not scrambled
  typed.mutable_buffers(0)->add_shape(16);
  typed.mutable_buffers(0)->add_shape(64);
  st = c.n1().client()->Register(ctx().get(), typed, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("buffer \"w\" has shape [16, 64] but the layout gives this rank "
                                                 "[64, 16] of it"));
  typed.mutable_buffers(0)->clear_shape();
  typed.mutable_buffers(0)->add_shape(64);
  typed.mutable_buffers(0)->add_shape(16);
  st = c.n1().client()->Register(ctx().get(), typed, &resp);
  INFO(st.error_message());
  CHECK(st.ok());

  // Two layouts that disagree on a tensor's dtype: the sync names the tensor.
  std::string f32 = kDst;
  f32.replace(f32.find("\"dst\""), 5, "\"dstf\"");
  f32.replace(f32.find("int32"), 5, "float32");
  const auto f32_proto = *planner::parseLayoutJson(f32, "dstf");
  std::vector<RankMemory> fmem;
  for (int32_t r = 0; r < 2; ++r) {
    fmem.push_back(allocateRank(c.dst, r, "contract-f" + std::to_string(r)));
    REQUIRE(c.n1().client()->Register(ctx().get(), registerRequest(f32_proto, r, 2, fmem[r]), &resp).ok());
  }
  s.set_src_group("src");
  s.set_dst_group("dstf");
  s.set_version(1);
  st = c.n0().client()->Sync(ctx().get(), s, &out);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(),
             Catch::Contains("tensor \"w\": layout \"src\" has int32 [64, 32] but layout \"dstf\" has float32"));

  // Versions live below 2^63.
  s.set_dst_group("dst");
  s.set_version(uint64_t{1} << 63);
  st = c.n0().client()->Sync(ctx().get(), s, &out);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("is not in [1, 2^63)"));
  auto huge = registerRequest(c.src_proto, 0, 2, c.smem[0], v1::ROLE_SOURCE, uint64_t{1} << 63);
  CHECK(c.n0().client()->Register(ctx().get(), huge, &resp).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  auto versioned_dst = registerRequest(c.dst_proto, 0, 2, c.dmem[0], v1::ROLE_DESTINATION, 3);
  st = c.n1().client()->Register(ctx().get(), versioned_dst, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("only a source rank may register with a version"));
}

TEST_CASE("sessions: a client's ranks end with it (segments unlinked) - the C++ client re-registers after a restart",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  // A session by hand: its stream open, a rank registered under it, then the client goes.
  auto stub = c.n1().client();
  grpc::ClientContext session;
  auto reader = stub->Session(&session, v1::SessionRequest());
  v1::SessionEvent ev;
  REQUIRE(reader->Read(&ev));
  CHECK(ev.node() == "n1");
  const std::string name = "/shardcast-contract-" + std::to_string(::getpid()) + "-session";
  auto seg = transport::ShmSegment::create(name, 4096, /*unlink_on_close=*/false);
  REQUIRE(seg.ok());
  const char* one = R"({"group":"solo","mesh":{"shape":[1]},"nodes":["n1"],"tensors":[
    {"name":"w","shape":[16],"dtype":"int32"}]})";
  v1::RegisterRequest req;
  req.set_group("solo");
  req.set_world_size(1);
  *req.mutable_layout() = *planner::parseLayoutJson(one, "solo");
  auto* h = req.add_buffers();
  h->set_buffer("w");
  h->mutable_shm()->set_name(name);
  h->mutable_shm()->set_size(64);
  req.set_session_id("no-such-session");
  v1::RegisterResponse resp;
  grpc::Status st = stub->Register(ctx().get(), req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("is not open on node \"n1\""));
  req.set_session_id(ev.session_id());
  st = stub->Register(ctx().get(), req, &resp);
  INFO(st.error_message());
  REQUIRE(st.ok());
  // A torch tensor registered in place, in the same session: torch's own segment, which torch
  // unlinks itself (and aborts the process if its name is gone by then): never unlinked here.
  const std::string torch_name = "/torch_" + std::to_string(::getpid()) + "_contract_session";
  auto torch_seg = transport::ShmSegment::create(torch_name, 4096, /*unlink_on_close=*/true);
  REQUIRE(torch_seg.ok());
  v1::RegisterRequest in_place = req;
  in_place.set_group("solo-torch");
  in_place.mutable_layout()->set_group("solo-torch");
  in_place.mutable_buffers(0)->mutable_shm()->set_name(torch_name);
  st = stub->Register(ctx().get(), in_place, &resp);
  INFO(st.error_message());
  REQUIRE(st.ok());
  session.TryCancel();  // what the kernel does when the client process dies
  reader->Finish().IgnoreError();
  // Whether the daemon dropped every rank of `groups` within 5 s.
  const auto dropped = [&](std::set<std::string> groups) {
    for (int i = 0; i < 50; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      v1::ListResponse l;
      if (!stub->List(ctx().get(), v1::ListRequest(), &l).ok()) return false;
      if (std::none_of(l.ranks().begin(), l.ranks().end(), [&](const auto& r) { return groups.count(r.group()); }))
        return true;
    }
    return false;
  };
  CHECK(dropped({"solo", "solo-torch"}));
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  CHECK(fd < 0);  // unlinked by the daemon
  if (fd >= 0) {
    ::close(fd);
    ::shm_unlink(name.c_str());
  }
  const int torch_fd = ::shm_open(torch_name.c_str(), O_RDONLY, 0);
  CHECK(torch_fd >= 0);  // torch's, of a live process: left for torch to unlink (torch_seg does, as it goes)
  if (torch_fd >= 0) ::close(torch_fd);
  // The same from a process that dies with its session open (a container killed with its
  // torch_shm_manager, which would have unlinked it): once the process is gone, the daemon
  // unlinks torch's segment too.
  const std::string dead_name = "/torch_" + std::to_string(::getpid()) + "_contract_dead";
  Child dead =
      Child::spawn({testBinary(FOREIGN_CALLER_PATH), "torch", c.n1().socketPath(), one, "solo-dead", dead_name});
  REQUIRE(dead.pid() > 0);
  CHECK(dead.readLine(std::chrono::seconds(30)) == "registered OK");
  dead.kill();
  CHECK(dropped({"solo-dead"}));
  const int dead_fd = ::shm_open(dead_name.c_str(), O_RDONLY, 0);
  CHECK(dead_fd < 0);  // unlinked by the daemon
  if (dead_fd >= 0) {
    ::close(dead_fd);
    ::shm_unlink(dead_name.c_str());
  }
  dead.wait();

  // The C++ client with a session: its source rank is back, at its published version, after the
  // daemon restarts.
  auto client = Client::connect("unix:" + c.n1().socketPath());
  REQUIRE(client.ok());
  REQUIRE(client->startSession().ok());
  auto seg2 = transport::ShmSegment::create(name + "-2", 4096);
  REQUIRE(seg2.ok());
  v1::MemoryHandle mh;
  mh.set_buffer("w");
  mh.mutable_shm()->set_name(name + "-2");
  mh.mutable_shm()->set_size(64);
  REQUIRE(client
              ->registerRank(*planner::parseLayoutJson(one, "solo"), 0, std::vector<v1::MemoryHandle>{mh},
                             RegisterOptions::source(5))
              .ok());
  const int port = c.ports[1];
  c.daemons[1]->kill();
  c.daemons[1] = std::make_unique<Daemon>(
      "n1", port,
      std::vector<std::string>{"127.0.0.1:" + std::to_string(c.ports[0]), "127.0.0.1:" + std::to_string(port)});
  REQUIRE(c.n1().ready());
  bool back = false;
  for (int i = 0; i < 100 && !back; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (const auto& [r, s] : c.states(c.n1(), "solo")) back = s.state() == v1::RANK_READY && s.version() == 5;
  }
  CHECK(back);
  CHECK(client->reconnects() == 1);

  // A re-registration that fails (its segment is gone) is not only on stderr: the client's next
  // calls about its ranks say so, naming the rank and the cause.
  ::shm_unlink((name + "-2").c_str());
  c.daemons[1]->kill();
  c.daemons[1] = std::make_unique<Daemon>(
      "n1", port,
      std::vector<std::string>{"127.0.0.1:" + std::to_string(c.ports[0]), "127.0.0.1:" + std::to_string(port)});
  REQUIRE(c.n1().ready());
  for (int i = 0; i < 100 && client->reconnects() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(client->reconnects() == 2);
  Status failed = client->checkSession();
  for (int i = 0; i < 50 && failed.ok(); ++i) {  // the re-registration runs on the session's thread
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    failed = client->checkSession();
  }
  CHECK(absl::IsFailedPrecondition(failed));
  CHECK_THAT(std::string(failed.message()),
             Catch::Contains("re-registering group \"solo\" rank 0 after its daemon restarted failed: "));
  auto publish = client->publish("solo", 0, 6);
  CHECK(absl::IsFailedPrecondition(publish.status()));
  CHECK(absl::IsFailedPrecondition(client->waitReady("solo", 5, std::chrono::milliseconds(10)).status()));
  CHECK(absl::IsNotFound(client->unregisterRank("solo", 0)));  // dealt with: the new daemon never had it
  CHECK(client->checkSession().ok());
}

TEST_CASE("double-buffered destinations: syncs write the set not in use, flip at commit, a failure leaves it untouched",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  // dst rank 0 again, with a second set of its buffers (the engine's other copy of the weights).
  std::vector<RankMemory> shadow;
  for (int32_t r = 0; r < 2; ++r) shadow.push_back(allocateRank(c.dst, r, "contract-shadow" + std::to_string(r)));
  auto engine = Client::connect("unix:" + c.n1().socketPath());
  REQUIRE(engine.ok());
  for (const auto& reg : c.registerDoubled(*engine, shadow)) {
    INFO(reg.status().message());
    REQUIRE(reg.ok());
    CHECK(reg->registered_bytes() == 2 * 64 * 16 * 4);  // twice the memory
  }
  auto set_wrong = [&](std::vector<RankMemory>& set, uint64_t version) {
    int64_t bad = 0;
    for (int32_t r = 0; r < 2; ++r)
      forEachElement(c.dst, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *set[r].at<int32_t>(p, off) != valueOf(flat, version);
      });
    return bad;
  };
  auto active = [&] {
    std::set<uint32_t> sets;
    for (const auto& [r, st] : c.states(c.n1(), "dst")) {
      CHECK(st.double_buffered());
      sets.insert(st.active_set());
    }
    REQUIRE(sets.size() == 1);
    return *sets.begin();
  };
  CHECK(active() == 0);
  // v1 lands in the shadow (set 1) and the ranks flip to it; the live set is untouched.
  grpc::Status st = c.sync(1);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(active() == 1);
  CHECK(set_wrong(shadow, 1) == 0);
  CHECK(set_wrong(c.dmem, 1) == 64 * 32);  // still zeros
  // The engine reads set 1 (pinned); v2 goes into set 0 meanwhile and commits: a flip to set 0.
  auto pinned = engine->acquire("dst", 0);
  REQUIRE(pinned.ok());
  CHECK(pinned->active_set() == 1);
  REQUIRE(engine->acquire("dst", 1).ok());
  c.step(2);
  st = c.sync(2);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(active() == 0);
  CHECK(set_wrong(c.dmem, 2) == 0);
  CHECK(set_wrong(shadow, 1) == 0);  // what the engine is still reading
  // v3 would write set 1, which the engine still reads: refused until it lets go.
  c.step(3);
  st = c.sync(3);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("which still reads the set this sync would write"));
  REQUIRE(engine->release("dst", 0).ok());
  REQUIRE(engine->release("dst", 1).ok());
  // A sync that writes and fails: the set in use (0, at v2) is untouched and stays ready(2).
  auto exec = c.prepare("fails", 3);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 2);
    CHECK(s.writing() == 3);
  }
  v1::ExecuteResponse part;
  REQUIRE(c.peers()[0]->Execute(ctx().get(), exec, &part).ok());
  c.finish("fails", false, true, "the test aborted it");
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 2);
    CHECK(s.active_set() == 0);
  }
  CHECK(set_wrong(c.dmem, 2) == 0);
  st = c.sync(3);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(active() == 1);
  CHECK(set_wrong(shadow, 3) == 0);
}

TEST_CASE(
    "a restarted daemon gets a held rank back held, a double-buffered one with the set its engine used, a held "
    "source above the version it published",
    "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  std::vector<RankMemory> shadow;
  for (int32_t r = 0; r < 2; ++r) shadow.push_back(allocateRank(c.dst, r, "contract-back" + std::to_string(r)));
  auto engine = Client::connect("unix:" + c.n1().socketPath());
  REQUIRE(engine.ok());
  REQUIRE(engine->startSession().ok());
  for (const auto& reg : c.registerDoubled(*engine, shadow)) REQUIRE(reg.ok());
  REQUIRE(c.sync(1).ok());                  // into set 1, now in use
  auto pinned = engine->acquire("dst", 0);  // rank 0 read (and held) in set 1; rank 1 never read
  REQUIRE(pinned.ok());
  CHECK(pinned->active_set() == 1);
  // A trainer on n1 that published version 3 and is writing the next when its daemon restarts.
  const v1::Layout own = *planner::parseLayoutJson(
      R"({"group":"own","mesh":{"shape":[1]},"nodes":["n1"],"tensors":[
          {"name":"w","shape":[8],"dtype":"int32","placements":[{"replicate":{}}]}]})",
      "own");
  RankMemory own_memory = allocateRank(*planner::resolveLayout(own, c.nodes), 0, "contract-own");
  const auto own_buffers = registerRequest(own, 0, 1, own_memory).buffers();
  REQUIRE(engine
              ->registerRank(own, 0, std::vector<v1::MemoryHandle>(own_buffers.begin(), own_buffers.end()),
                             RegisterOptions::source(3))
              .ok());
  REQUIRE(engine->acquire("own", 0).ok());
  const int port = c.ports[1];
  c.daemons[1]->kill();
  c.daemons[1] = std::make_unique<Daemon>(
      "n1", port,
      std::vector<std::string>{"127.0.0.1:" + std::to_string(c.ports[0]), "127.0.0.1:" + std::to_string(port)});
  REQUIRE(c.n1().ready());
  std::map<int32_t, v1::RankStatus> back;
  for (int i = 0; i < 100 && (back.size() < 2 || c.states(c.n1(), "own").empty()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    back.clear();
    for (const auto& [r, st] : c.states(c.n1(), "dst")) back[r] = st;
  }
  REQUIRE(back.size() == 2);
  CHECK(engine->reconnects() == 1);
  CHECK(back[0].held());
  CHECK(back[0].active_set() == 1);  // not set 0, which holds nothing
  CHECK_FALSE(back[1].held());
  CHECK(back[1].active_set() == 0);          // never seen in use: the client knows no other
  CHECK(back[0].state() == v1::RANK_EMPTY);  // a new daemon knows no version of a destination
  // Held in set 1: v2 goes into set 0 and flips to it; set 1, which its engine is reading, keeps v1.
  auto holds = [&](std::vector<RankMemory>& set, int32_t r, uint64_t version) {
    int64_t bad = 0;
    forEachElement(c.dst, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      bad += *set[r].at<int32_t>(p, off) != valueOf(flat, version);
    });
    return bad == 0;
  };
  c.step(2);
  const grpc::Status st = c.sync(2);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(holds(shadow, 0, 1));
  CHECK(holds(c.dmem, 0, 2));
  CHECK(c.states(c.n1(), "dst").at(0).active_set() == 0);
  REQUIRE(engine->release("dst", 0).ok());  // still held: no "not acquired"
  // The trainer: still held, above version 3, which it may not publish again.
  const auto trainer = c.states(c.n1(), "own").at(0);
  CHECK((trainer.state() == v1::RANK_UPDATING && trainer.held() && trainer.version() == 3));
  const auto again = engine->publish("own", 0, 3);
  CHECK(absl::IsInvalidArgument(again.status()));
  CHECK_THAT(std::string(again.status().message()), Catch::Contains("version 3 is not newer than version 3"));
  const auto next = engine->publish("own", 0, 4);
  INFO(next.status().message());
  REQUIRE(next.ok());
  CHECK((next->state() == v1::RANK_READY && next->version() == 4));
}

TEST_CASE(
    "registering memory that is not the rank's own is refused: a destination overlaps nothing, a source no "
    "destination",
    "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  auto stub = c.n1().client();
  v1::RegisterResponse resp;
  // Destination rank 1 on rank 0's memory (its registration with rank 0's segment).
  auto req = registerRequest(c.dst_proto, 1, 2, c.dmem[0]);
  req.set_replace(true);
  grpc::Status st = stub->Register(ctx().get(), req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("group \"dst\" rank 1: buffer") &&
                                     Catch::Contains("of group \"dst\" rank 0 (destination) on node \"n1\"") &&
                                     Catch::Contains("is the same memory as"));
  // Its own memory again with replace: taken back, not compared with the registration it replaces.
  req = registerRequest(c.dst_proto, 0, 2, c.dmem[0]);
  req.set_replace(true);
  st = stub->Register(ctx().get(), req, &resp);
  INFO(st.error_message());
  CHECK(st.ok());
  // A second source group over the sources' memory may register (sources share); over a
  // destination's may not.
  auto src0 = c.n0().client();
  v1::Layout again = c.src_proto;
  again.set_group("src-too");
  auto too = registerRequest(again, 0, 2, c.smem[0]);
  too.set_role(v1::ROLE_SOURCE);
  too.set_version(1);
  st = src0->Register(ctx().get(), too, &resp);
  INFO(st.error_message());
  CHECK(st.ok());
  v1::Layout over = c.src_proto;
  over.set_group("src-over");
  for (auto& node : *over.mutable_nodes()) node = "n1";
  auto onto = registerRequest(over, 0, 2, c.dmem[1]);
  onto.set_role(v1::ROLE_SOURCE);
  onto.set_version(1);
  st = stub->Register(ctx().get(), onto, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("(destination)") && Catch::Contains("write over this source"));
  // A second set in use without one is refused.
  req = registerRequest(c.dst_proto, 0, 2, c.dmem[0]);
  req.set_replace(true);
  req.set_active_set(1);
  st = stub->Register(ctx().get(), req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("active set 1"));
  // A source registered held with a version (its trainer wrote the next one when the daemon
  // restarted): updating above that floor, which it may not publish again.
  too.set_held(true);
  too.set_replace(true);
  st = src0->Register(ctx().get(), too, &resp);
  INFO(st.error_message());
  REQUIRE(st.ok());
  const auto held = c.states(c.n0(), "src-too").at(0);
  CHECK((held.state() == v1::RANK_UPDATING && held.held() && held.version() == 1));
  v1::ReleaseRequest publish;
  publish.set_group("src-too");
  publish.set_rank(0);
  publish.set_version(1);
  v1::ReleaseResponse published;
  st = src0->Release(ctx().get(), publish, &published);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("version 1 is not newer than version 1"));
  publish.set_version(2);
  st = src0->Release(ctx().get(), publish, &published);
  INFO(st.error_message());
  CHECK(st.ok());
  CHECK((published.status().state() == v1::RANK_READY && published.status().version() == 2));
}

TEST_CASE("sync attempts are told apart: a duplicate id, a late Prepare, another layout, ranks in use",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  // A sync prepared by hand under id "dup"; a coordinated sync reusing the id fails to prepare,
  // and its abort (another attempt's fence) must not end the first one.
  c.prepare("dup", 1);
  v1::SyncRequest s;
  s.set_src_group("src");
  s.set_dst_group("dst");
  s.set_version(1);
  s.set_sync_id("dup");
  v1::SyncResponse out;
  grpc::Status st = c.n0().client()->Sync(ctx().get(), s, &out);
  CHECK_FALSE(st.ok());
  v1::ProgressRequest pr;
  pr.set_sync_id("dup");
  v1::ProgressResponse prr;
  CHECK(c.peers()[1]->Progress(ctx().get(), pr, &prr).ok());  // still there
  for (const auto& [r, s2] : c.states(c.n1(), "dst")) CHECK(s2.state() == v1::RANK_UPDATING);
  // A second sync into the ranks "dup" writes is refused where they are, naming the group whose
  // ranks refused (a replica set's coordinator cuts that replica only: common/refusal.h).
  {
    v1::PrepareResponse presp;
    const grpc::Status busy =
        c.peers()[1]->Prepare(ctx().get(), prepareRequest("second", c.src_proto, c.dst_proto, 1, 78), &presp);
    CHECK(busy.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(busy.error_message(), Catch::Contains("(dup) is in progress"));
    CHECK(refusingGroup(busy) == "dst");
    CHECK(refusingGroup(fromGrpc(busy)) == "dst");
    // The same refusal relayed (n0 relaying to n1, as a coordinator above --relay-fanout daemons
    // calls them) names its group too (RelayResult.details); n0's own call, empty, is refused.
    v1::RelayRequest relay;
    relay.set_method("Prepare");
    relay.set_fanout(2);
    for (size_t i = 0; i < 2; ++i) {
      auto* call = relay.add_calls();
      call->set_address("127.0.0.1:" + std::to_string(c.ports[i]));
      if (i == 1) call->set_request(prepareRequest("second", c.src_proto, c.dst_proto, 1, 78).SerializeAsString());
      call->set_timeout_ms(10000);
    }
    v1::RelayResponse relayed;
    REQUIRE(c.peers()[0]->Relay(ctx().get(), relay, &relayed).ok());
    REQUIRE(relayed.results_size() == 2);
    const v1::RelayResult& through = relayed.results(1);
    CHECK(through.code() == static_cast<int32_t>(grpc::StatusCode::FAILED_PRECONDITION));
    CHECK(refusingGroup(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, through.message(), through.details())) ==
          "dst");
  }
  // Ranks a sync uses can be neither registered again nor unregistered meanwhile.
  v1::RegisterResponse resp;
  auto again = registerRequest(c.dst_proto, 0, 2, c.dmem[0]);
  again.set_replace(true);
  st = c.n1().client()->Register(ctx().get(), again, &resp);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("is in use by sync dup"));
  v1::UnregisterRequest un;
  un.set_group("src");
  un.set_rank(0);
  v1::UnregisterResponse ur;
  st = c.n0().client()->Unregister(ctx().get(), un, &ur);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("is in use by sync dup"));
  c.finish("dup", false, false);

  // A Finish that overtook its Prepare: the Prepare, when it comes, is refused.
  v1::FinishRequest f;
  f.set_sync_id("late");
  f.set_fence(77);
  v1::FinishResponse fr;
  CHECK(c.peers()[1]->Finish(ctx().get(), f, &fr).error_code() == grpc::StatusCode::NOT_FOUND);
  v1::PrepareRequest prep = prepareRequest("late", c.src_proto, c.dst_proto, 1, 77);
  v1::PrepareResponse presp;
  st = c.peers()[1]->Prepare(ctx().get(), prep, &presp);
  CHECK(st.error_code() == grpc::StatusCode::ABORTED);
  CHECK(refusingGroup(st).empty());  // the attempt's, not a group's
  for (const auto& [r, s2] : c.states(c.n1(), "dst")) CHECK(s2.state() == v1::RANK_EMPTY);

  // Planned for another layout than the ranks registered: refused where the ranks are.
  prep.set_sync_id("other-layout");
  prep.set_fence(0);
  prep.mutable_dst()->mutable_tensors(0)->mutable_placements(0)->mutable_shard()->set_dim(0);  // rows, not columns
  st = c.peers()[1]->Prepare(ctx().get(), prep, &presp);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("since the sync was planned"));
  CHECK(refusingGroup(st) == "dst");

  // The same id again once the first attempt ended: a fresh attempt that commits.
  st = c.n0().client()->Sync(ctx().get(), s, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(c.wrong(1) == 0);
  // An owner that acquired and wrote publishes a new version, not the old one again.
  auto client = Client::connect("unix:" + c.n0().socketPath());
  REQUIRE(client.ok());
  REQUIRE(client->acquire("src", 0).ok());
  auto same = client->publish("src", 0, 1);
  CHECK(absl::IsInvalidArgument(same.status()));
  CHECK_THAT(std::string(same.status().message()), Catch::Contains("publish a new version"));
  CHECK(absl::IsFailedPrecondition(client->acquire("src", 0).status()));  // once
  REQUIRE(client->publish("src", 0, 2).ok());
}

TEST_CASE("a retried attempt takes over from the earlier attempt of its Sync call whose abort never arrived",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  auto p = c.peers();
  std::vector<v1::DescribeResponse> described(2);
  for (int i = 0; i < 2; ++i) REQUIRE(p[i]->Describe(ctx().get(), v1::DescribeRequest(), &described[i]).ok());
  // Attempt 1 (fence 11) is prepared on both daemons; its coordinator gives it up, and the abort
  // reaches neither (each was too busy to take it within its deadline).
  for (int i = 0; i < 2; ++i) {
    v1::PrepareResponse presp;
    const grpc::Status st =
        p[i]->Prepare(ctx().get(), prepareRequest("retry", c.src_proto, c.dst_proto, 1, 11), &presp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  }
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_UPDATING);
  // A Prepare reusing the id that is not a retry of that Sync call is refused as before.
  {
    v1::PrepareResponse presp;
    const grpc::Status st =
        p[1]->Prepare(ctx().get(), prepareRequest("retry", c.src_proto, c.dst_proto, 1, 13), &presp);
    CHECK(st.error_code() == grpc::StatusCode::ALREADY_EXISTS);
  }
  // Attempt 2 (fence 12, superseding 11): each daemon ends attempt 1 as the abort would have, and
  // attempt 2 prepares, runs and commits.
  v1::ExecuteRequest exec;
  exec.set_sync_id("retry");
  exec.set_fence(12);
  exec.set_timeout_ms(20000);
  const std::string key(transport::WriteKey::random().view());
  for (int i = 0; i < 2; ++i) {
    v1::PrepareRequest prep = prepareRequest("retry", c.src_proto, c.dst_proto, 1, 12);
    prep.add_supersedes(11);
    prep.set_write_key(key);
    v1::PrepareResponse presp;
    const grpc::Status st = p[i]->Prepare(ctx().get(), prep, &presp);
    INFO(st.error_message());
    REQUIRE(st.ok());
    auto* n = exec.add_nodes();
    n->set_node(described[i].node());
    n->set_transport_address(described[i].transport_address());
    *n->mutable_targets() = presp.targets();
  }
  v1::ProgressRequest pr;
  pr.set_sync_id("retry");
  pr.set_fence(11);
  v1::ProgressResponse prr;
  CHECK(p[1]->Progress(ctx().get(), pr, &prr).error_code() == grpc::StatusCode::NOT_FOUND);  // attempt 1 ended
  auto sent = std::async(std::launch::async, [&] {
    v1::ExecuteResponse out;
    return p[0]->Execute(ctx(60).get(), exec, &out);
  });
  v1::ExecuteResponse received_out;
  const grpc::Status received = p[1]->Execute(ctx(60).get(), exec, &received_out);
  const grpc::Status sent_st = sent.get();
  INFO(sent_st.error_message() << " / " << received.error_message());
  REQUIRE(sent_st.ok());
  REQUIRE(received.ok());
  // A late commit of attempt 1 commits nothing; attempt 2's commits.
  for (int i = 0; i < 2; ++i) {
    v1::FinishRequest late;
    late.set_sync_id("retry");
    late.set_fence(11);
    late.set_commit(true);
    late.set_executed(true);
    v1::FinishResponse fr;
    CHECK(p[i]->Finish(ctx().get(), late, &fr).error_code() == grpc::StatusCode::NOT_FOUND);
  }
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_UPDATING);
  for (int i = 0; i < 2; ++i) {
    v1::FinishRequest f;
    f.set_sync_id("retry");
    f.set_fence(12);
    f.set_commit(true);
    f.set_executed(true);
    v1::FinishResponse fr;
    const grpc::Status st = p[i]->Finish(ctx().get(), f, &fr);
    INFO(st.error_message());
    REQUIRE(st.ok());
  }
  CHECK(c.wrong(1) == 0);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 1);
  }
  // Attempt 1 ended on both daemons (not left lingering on the ranks, which would hold them
  // against any other sync): the next version syncs.
  c.step(2);
  v1::SyncResponse next;
  const grpc::Status st = c.sync(2, &next);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(c.wrong(2) == 0);
}

TEST_CASE("an earlier attempt a retry ends is reverted when it never executed, dirty when it may have",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  auto p = c.peers();
  const auto prepare = [&](uint64_t fence, std::vector<uint64_t> supersedes, std::vector<uint64_t> unexecuted) {
    v1::PrepareRequest prep = prepareRequest("retry", c.src_proto, c.dst_proto, 1, fence);
    for (const uint64_t f : supersedes) prep.add_supersedes(f);
    for (const uint64_t f : unexecuted) prep.add_supersedes_unexecuted(f);
    v1::PrepareResponse presp;
    const grpc::Status st = p[1]->Prepare(ctx().get(), prep, &presp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  };
  const auto abort = [&](uint64_t fence) {  // given up before executing, this time heard
    v1::FinishRequest f;
    f.set_sync_id("retry");
    f.set_fence(fence);
    f.set_commit(false);
    f.set_executed(false);
    v1::FinishResponse fr;
    const grpc::Status st = p[1]->Finish(ctx().get(), f, &fr);
    INFO(st.error_message());
    REQUIRE(st.ok());
  };
  // Attempt 21 prepared on n1, given up before any Execute; its abort is missed. Attempt 22 ends
  // it reverted (its coordinator says it never executed), then is given up before executing too:
  // the ranks are as they were before either, never written.
  prepare(21, {}, {});
  prepare(22, {21}, {21});
  abort(22);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_EMPTY);
  // Attempt 31 prepared, then superseded by attempt 32 without that word (it may have executed):
  // ended dirty, and attempt 32's abort restores that.
  prepare(31, {}, {});
  prepare(32, {31}, {});
  abort(32);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_DIRTY);
}

TEST_CASE("a destination commits only what landed: Prepare then Finish(commit) without Execute leaves it dirty",
          "[daemon][contract][security]") {
  Pair c;
  c.registerAll(1);
  REQUIRE(c.sync(1).ok());
  REQUIRE(c.wrong(1) == 0);
  c.step(2);  // sources publish 2; the attacker commits a version that never moved instead
  c.prepare("never-moved", 2);
  auto peers = c.peers();
  v1::FinishRequest f;
  f.set_sync_id("never-moved");
  f.set_commit(true);
  f.set_executed(false);
  v1::FinishResponse fr;
  const grpc::Status st = peers[1]->Finish(ctx().get(), f, &fr);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("commit refused on node \"n1\"") &&
                                     Catch::Contains("wave(s) 0 of 1 not executed here") &&
                                     Catch::Contains("0 of the 1 chunks planned to land here"));
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_DIRTY);  // never READY(2) with version 1's bytes
    CHECK(s.version() != 2);
  }
  // The source side did not execute either: refused too, its ranks untouched (sources never go dirty).
  CHECK(peers[0]->Finish(ctx().get(), f, &fr).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  for (const auto& [r, s] : c.states(c.n0(), "src")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 2);
  }
  // A real sync repairs them.
  REQUIRE(c.sync(2).ok());
  CHECK(c.wrong(2) == 0);
}

TEST_CASE("peer inputs are bounded before use: lease, chunk size, write key, transport addresses",
          "[daemon][contract][security]") {
  Pair c;
  c.registerAll(1);
  auto peers = c.peers();
  v1::PrepareResponse presp;
  auto refused = [&](v1::PrepareRequest prep, const std::string& why) {
    INFO(why);
    const grpc::Status st = peers[1]->Prepare(ctx().get(), prep, &presp);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains(why));
  };
  v1::PrepareRequest prep = prepareRequest("bounded", c.src_proto, c.dst_proto, 1);
  prep.set_lease_ms(UINT32_MAX);  // would hold the ranks for 49 days
  refused(prep, "a lease of 4294967295 ms is outside [200, 60000] ms on node \"n1\"");
  prep.set_lease_ms(10);
  refused(prep, "a lease of 10 ms");
  prep.set_lease_ms(0);
  prep.set_chunk_bytes(4);  // a plan of 4-byte chunks: hundreds of MB per Prepare
  refused(prep, "chunks of 4 bytes (at least 65536)");
  prep.set_chunk_bytes(uint64_t{64} << 20);
  prep.clear_write_key();
  refused(prep, "a write key is 16 bytes, not 0");
  prep.set_write_key(std::string(16, '\0'));
  refused(prep, "a write key of all zero bytes");
  // A zero-copy plan over tcp would hand UCX the clients' segments (which it must not touch in the
  // kernel: docs/security.md, "Truncated segments"), whatever the coordinator says.
  prep.set_write_key(std::string(transport::WriteKey::random().view()));
  prep.set_packed(false);
  const grpc::Status unpacked = peers[1]->Prepare(ctx().get(), prep, &presp);
  CHECK(unpacked.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(unpacked.error_message(),
             Catch::Contains("planned zero-copy, but group \"") && Catch::Contains("travels only packed"));
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_EMPTY);  // nothing held

  // A transport address that is not the one the node describes itself (UCX would abort on "ff").
  auto exec = c.prepare("bad-address", 1);
  for (auto& n : *exec.mutable_nodes())
    if (n.node() == "n1") n.set_transport_address("\xff");
  v1::ExecuteResponse part;
  const grpc::Status st = peers[0]->Execute(ctx().get(), exec, &part);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("the transport address given for node \"n1\" is not the one"));
  v1::StatusResponse alive;
  CHECK(c.n0().client()->Status(ctx().get(), v1::StatusRequest(), &alive).ok());
  c.finish("bad-address", false, false);
  REQUIRE(c.sync(1).ok());  // and both serve on
  CHECK(c.wrong(1) == 0);
}

TEST_CASE("taking over a registered rank needs replace - its holder is told, its segment unlinked, its handle inert",
          "[daemon][contract]") {
  Pair c;
  const v1::Layout solo = *planner::parseLayoutJson(R"({"group":"solo","mesh":{"shape":[1]},"nodes":["n1"],
    "tensors":[{"name":"w","shape":[16],"dtype":"int32"}]})",
                                                    "solo");
  auto first = Client::connect("unix:" + c.n1().socketPath());
  auto second = Client::connect("unix:" + c.n1().socketPath());
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  REQUIRE(first->startSession().ok());
  REQUIRE(second->startSession().ok());
  auto mine = HostTensors::forRank(solo, 0);
  auto theirs = HostTensors::forRank(solo, 0);
  REQUIRE(mine.ok());
  REQUIRE(theirs.ok());
  REQUIRE(first->registerRank(solo, 0, *mine, RegisterOptions::source(4)).ok());
  // A second registration of the rank: refused, naming the holder; the holder keeps it.
  auto refused = second->registerRank(solo, 0, *theirs, RegisterOptions::source(5));
  REQUIRE_FALSE(refused.ok());
  CHECK(absl::IsAlreadyExists(refused.status()));
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("is registered already on node \"n1\", by uid " + std::to_string(::geteuid())) &&
                 Catch::Contains("register with replace to take it over"));
  for (const auto& [r, s] : c.states(c.n1(), "solo")) CHECK(s.version() == 4);
  // With replace: taken over. The holder's next calls about the rank fail naming the new process.
  RegisterOptions take = RegisterOptions::source(5);
  take.replace = true;
  REQUIRE(second->registerRank(solo, 0, *theirs, take).ok());
  Status told = first->checkSession({"solo"});
  for (int i = 0; i < 50 && told.ok(); ++i) {  // the session's event arrives on its own thread
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    told = first->checkSession({"solo"});
  }
  CHECK(absl::IsFailedPrecondition(told));
  CHECK_THAT(std::string(told.message()),
             Catch::Contains("group \"solo\" rank 0 on node \"n1\" was taken over by uid " +
                             std::to_string(::geteuid()) + " (pid " + std::to_string(::getpid()) + ")"));
  CHECK(absl::IsFailedPrecondition(first->publish("solo", 0, 6).status()));
  CHECK(first->checkSession({"other-group"}).ok());  // only calls about its ranks' groups
  // The superseded registration's segment is unlinked (the holder's mapping stays valid).
  const int fd = ::shm_open(mine->segment().c_str(), O_RDONLY, 0);
  CHECK(fd < 0);
  if (fd >= 0) ::close(fd);
  // Its handle never drops the newer registration: unregistering by it is refused, the rank stays.
  auto dropped = first->unregisterRank("solo", 0);
  CHECK(absl::IsFailedPrecondition(dropped));
  CHECK_THAT(std::string(dropped.message()), Catch::Contains("was taken over by"));
  for (const auto& [r, s] : c.states(c.n1(), "solo")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 5);
  }
  CHECK(second->unregisterRank("solo", 0).ok());
}

TEST_CASE("a repeated sync's Prepare names its layouts by digest - the cached plan answers and the registry checks it",
          "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  auto n1 = c.n1().peer();
  v1::DescribeResponse described;
  REQUIRE(n1->Describe(ctx().get(), v1::DescribeRequest(), &described).ok());
  // It relays call parts: a coordinator may give it (and those below it) their own stamps only.
  CHECK(described.relays_call_parts());
  const auto abort = [&](const std::string& id) {  // n1 only: n0 took no part
    v1::FinishRequest f;
    f.set_sync_id(id);
    v1::FinishResponse fr;
    REQUIRE(n1->Finish(ctx().get(), f, &fr).ok());
  };
  // A full Prepare plans and caches the pair; another of a variant of "dst" (rows, not columns)
  // is refused by the registry, but its plan is cached too.
  v1::PrepareResponse full;
  {
    const grpc::Status st = n1->Prepare(ctx().get(), prepareRequest("full", c.src_proto, c.dst_proto, 1), &full);
    INFO(st.error_message());
    REQUIRE(st.ok());
  }
  abort("full");
  auto variant = c.dst_proto;
  variant.mutable_tensors(0)->mutable_placements(0)->mutable_shard()->set_dim(0);
  v1::PrepareResponse ignored;
  CHECK_FALSE(n1->Prepare(ctx().get(), prepareRequest("variant", c.src_proto, variant, 1), &ignored).ok());
  const std::string src_digest = planner::layoutDigest(c.src_proto), dst_digest = planner::layoutDigest(c.dst_proto);
  // By digest: the groups alone, the digests, and the stamps a kept view carries.
  const auto byDigest = [&](const std::string& id, const std::string& sd, const std::string& dd) {
    v1::PrepareRequest p = prepareRequest(id, c.src_proto, c.dst_proto, 1);
    p.mutable_src()->Clear();
    p.mutable_src()->set_group("src");
    p.mutable_dst()->Clear();
    p.mutable_dst()->set_group("dst");
    p.set_src_digest(sd);
    p.set_dst_digest(dd);
    auto* stamp = p.add_expect();
    stamp->set_node("n1");
    stamp->set_instance(described.instance());
    stamp->set_generation(described.generation());
    return p;
  };

  // The cached plan answers: the same plan key and landing targets as the full Prepare's.
  v1::PrepareResponse named;
  grpc::Status st = n1->Prepare(ctx().get(), byDigest("named", src_digest, dst_digest), &named);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(named.plan_key() == full.plan_key());
  CHECK(named.targets().SerializeAsString() == full.targets().SerializeAsString());
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_UPDATING);
  abort("named");

  // A plan never made here: refused as a stale view (its coordinator then runs the sync in full).
  st = n1->Prepare(ctx().get(), byDigest("unknown", src_digest, "0123456789abcdef"), &ignored);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("node \"n1\" no longer caches the plan of layouts " + src_digest +
                                                 " -> 0123456789abcdef (a stale view)"));
  // A plan cached here, of a layout that is not the one "dst" registered: the registry refuses
  // it, as it refuses that layout sent whole.
  st = n1->Prepare(ctx().get(), byDigest("variant-named", src_digest, planner::layoutDigest(variant)), &ignored);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("registered layout " + dst_digest + " since the sync was planned"));
  // The digests of a cached plan under other group names: refused (the sync would fence the
  // groups it names and read or write the plan's), as a stale view: the plan cached under those
  // digests is another sync's (layouts whose digests collide), and the sync runs in full.
  {
    v1::PrepareRequest renamed = byDigest("renamed", src_digest, dst_digest);
    renamed.mutable_src()->set_group("elsewhere");
    st = n1->Prepare(ctx().get(), renamed, &ignored);
    CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(st.error_message(),
               Catch::Contains("node \"n1\" caches the plan of layouts " + src_digest + " -> " + dst_digest +
                               " for groups \"src\" -> \"dst\", not \"elsewhere\" -> "
                               "\"dst\" (a stale view)"));
  }
  // Malformed: one digest, not hex, or without the kept view's stamps.
  for (const auto& [sd, dd] : std::vector<std::pair<std::string, std::string>>{
           {src_digest, ""}, {"", dst_digest}, {src_digest, "0123456789ABCDEF"}, {src_digest, dst_digest + "0"}}) {
    st = n1->Prepare(ctx().get(), byDigest("malformed", sd, dd), &ignored);
    CAPTURE(sd, dd);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  v1::PrepareRequest unstamped = byDigest("unstamped", src_digest, dst_digest);
  unstamped.clear_expect();
  st = n1->Prepare(ctx().get(), unstamped, &ignored);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("a repeated plain sync"));
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_EMPTY);  // nothing was taken
}

TEST_CASE(
    "a Prepare riding on the first wave - writes wait for the peer's readiness word and a stale view is refused "
    "untouched",
    "[daemon][contract]") {
  Pair c;
  c.registerAll(1);
  auto p = c.peers();
  std::vector<v1::DescribeResponse> described(2);
  for (int i = 0; i < 2; ++i) REQUIRE(p[i]->Describe(ctx().get(), v1::DescribeRequest(), &described[i]).ok());
  const auto finish = [&](const std::string& id, uint64_t fence) {
    for (int i = 0; i < 2; ++i) {
      v1::FinishRequest f;
      f.set_sync_id(id);
      f.set_fence(fence);
      f.set_commit(true);
      f.set_executed(true);
      v1::FinishResponse fr;
      const grpc::Status st = p[i]->Finish(ctx().get(), f, &fr);
      INFO(st.error_message());
      REQUIRE(st.ok());
    }
  };
  const auto execute = [&](int i, const v1::ExecuteRequest& e) {
    return std::async(std::launch::async, [&p, i, e] {
      v1::ExecuteResponse out;
      return p[i]->Execute(ctx(60).get(), e, &out);
    });
  };
  // Version 1 in full, phase by phase: each daemon's Prepare answer is what a kept view holds.
  std::vector<v1::PrepareResponse> kept(2);
  v1::ExecuteRequest full;
  full.set_sync_id("v1");
  full.set_fence(11);
  full.set_timeout_ms(20000);
  {
    v1::PrepareRequest prep = prepareRequest("v1", c.src_proto, c.dst_proto, 1, 11);
    for (int i = 0; i < 2; ++i) {
      const grpc::Status st = p[i]->Prepare(ctx().get(), prep, &kept[i]);
      INFO(st.error_message());
      REQUIRE(st.ok());
      auto* n = full.add_nodes();
      n->set_node(described[i].node());
      n->set_transport_address(described[i].transport_address());
      *n->mutable_targets() = kept[i].targets();
    }
    auto sent = execute(0, full), received = execute(1, full);
    REQUIRE(sent.get().ok());
    REQUIRE(received.get().ok());
    finish("v1", 11);
    REQUIRE(c.wrong(1) == 0);
  }
  // Daemon i's wave 0 with its Prepare riding on it, as a coordinator folds it.
  const auto folded = [&](int i, const std::string& id, uint64_t version, uint64_t fence, const std::string& key) {
    v1::ExecuteRequest e;
    e.set_sync_id(id);
    e.set_fence(fence);
    e.set_timeout_ms(20000);
    const int other = 1 - i;
    auto* n = e.add_nodes();  // n0 writes to n1; n1 hears from n0
    n->set_node(described[other].node());
    n->set_transport_address(described[other].transport_address());
    if (i == 0) *n->mutable_targets() = kept[other].targets();
    v1::PrepareRequest prep = prepareRequest(id, c.src_proto, c.dst_proto, version, fence);
    prep.set_write_key(key);
    auto* stamp = prep.add_expect();
    stamp->set_node(described[i].node());
    stamp->set_instance(described[i].instance());
    stamp->set_generation(described[i].generation());
    *e.mutable_prepare() = prep;
    e.set_plan_key(kept[i].plan_key());
    e.mutable_self()->set_node(described[i].node());
    *e.mutable_self()->mutable_targets() = kept[i].targets();
    return e;
  };

  // Version 2: n0 prepares and starts sending while n1 has not prepared. Its readiness word is
  // dropped at n1; its writes wait (without the word they would be refused there, failing it).
  c.step(2);
  const std::string key(transport::WriteKey::random().view());
  auto sender = execute(0, folded(0, "v2", 2, 22, key));
  CHECK(sender.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout);
  auto receiver = execute(1, folded(1, "v2", 2, 22, key));
  const grpc::Status sent = sender.get(), received = receiver.get();
  INFO(sent.error_message() << " / " << received.error_message());
  REQUIRE(sent.ok());
  REQUIRE(received.ok());
  finish("v2", 22);
  CHECK(c.wrong(2) == 0);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 2);
  }

  // Version 3: n1's landing targets are not those its peers were told: it refuses before telling
  // anyone it is open, and its ranks stay as they were.
  c.step(3);
  auto moved = folded(1, "v3", 3, 33, std::string(transport::WriteKey::random().view()));
  moved.mutable_self()->mutable_targets()->add_regions("elsewhere");
  v1::ExecuteResponse ignored;
  grpc::Status st = p[1]->Execute(ctx().get(), moved, &ignored);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("node \"n1\" cannot take the Prepare folded into its first wave: its "
                                                 "landing targets are not those of the kept view (a stale view)"));
  for (const auto& [r, s] : c.states(c.n1(), "dst")) {
    CHECK(s.state() == v1::RANK_READY);
    CHECK(s.version() == 2);
  }
  v1::ProgressRequest pr;
  pr.set_sync_id("v3");
  v1::ProgressResponse prr;
  CHECK(p[1]->Progress(ctx().get(), pr, &prr).error_code() == grpc::StatusCode::NOT_FOUND);
  // A plan other than the coordinator's is refused the same way.
  auto replanned = folded(1, "v3b", 3, 34, std::string(transport::WriteKey::random().view()));
  replanned.set_plan_key("another plan");
  st = p[1]->Execute(ctx().get(), replanned, &ignored);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("not \"another plan\""));
  // A Prepare rides only on wave 0 of its own attempt.
  auto later = folded(1, "v3c", 3, 35, std::string(transport::WriteKey::random().view()));
  later.set_wave(1);
  CHECK(p[1]->Execute(ctx().get(), later, &ignored).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  auto other_fence = folded(1, "v3d", 3, 36, std::string(transport::WriteKey::random().view()));
  other_fence.set_fence(37);
  CHECK(p[1]->Execute(ctx().get(), other_fence, &ignored).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  for (const auto& [r, s] : c.states(c.n1(), "dst")) CHECK(s.state() == v1::RANK_READY);
}
