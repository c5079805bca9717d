// shardcastd as a process: serving, health, configuration, registration validation, and the
// cluster-wide plan dry run across several daemons on loopback.
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <thread>

#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/report.h"
#include "tests/daemon/daemon_harness.h"
#include "transport/shm.h"

using namespace shardcast;
using namespace shardcast::testing;

namespace {

// Trainer: 2 ranks (nodes n0, n1) shard w [8, 4] float32 by rows; inference: 2 ranks (n0, n1)
// shard it by columns.
v1::Layout layout(const std::string& group, int shard_dim) {
  auto l = planner::parseLayoutJson(R"({"group":")" + group + R"(","mesh":{"shape":[2]},"nodes":["n0","n1"],
    "tensors":[{"name":"w","shape":[8,4],"dtype":"float32","placements":[{"shard":{"dim":)" +
                                        std::to_string(shard_dim) + "}}]}]}",
                                    "test");
  REQUIRE(l.ok());
  return *l;
}

struct Segment {
  transport::ShmSegment seg;
  explicit Segment(const std::string& tag, size_t size = 4096)
      : seg(*transport::ShmSegment::create("/shardcast-dtest-" + std::to_string(::getpid()) + "-" + tag, size)) {}
};

v1::RegisterRequest request(const std::string& group, int rank, const v1::Layout& l, const Segment& s,
                            uint64_t size = 64, uint64_t offset = 0) {
  v1::RegisterRequest r;
  r.set_group(group);
  r.set_rank(rank);
  r.set_world_size(2);
  *r.mutable_layout() = l;
  auto* b = r.add_buffers();
  b->set_buffer("w");
  b->mutable_shm()->set_name(s.seg.name());
  b->mutable_shm()->set_offset(offset);
  b->mutable_shm()->set_size(size);
  return r;
}

grpc::Status registerRank(v1::Shardcast::Stub& stub, const v1::RegisterRequest& r) {
  v1::RegisterResponse resp;
  return stub.Register(ctx().get(), r, &resp);
}

}  // namespace

TEST_CASE("shardcastd serves health, status and a 0660 Unix socket", "[daemon]") {
  Daemon d("n0", freePort(), {});
  INFO(d.readyLine());
  REQUIRE(d.ready());
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  REQUIRE(d.health()->Check(ctx().get(), hreq, &hresp).ok());
  CHECK(hresp.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  for (const char* service : {"shardcast.v1.Shardcast", "shardcast.v1.Peer"}) {  // each service by its name
    hreq.set_service(service);
    INFO(service);
    REQUIRE(d.health()->Check(ctx().get(), hreq, &hresp).ok());
    CHECK(hresp.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  }
  hreq.set_service("shardcast.v1.NoSuchService");
  CHECK(d.health()->Check(ctx().get(), hreq, &hresp).error_code() == grpc::StatusCode::NOT_FOUND);
  struct stat st {};
  REQUIRE(::stat(d.socketPath().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0660);
  CHECK(S_ISSOCK(st.st_mode));
  v1::StatusResponse status;
  REQUIRE(d.client()->Status(ctx().get(), v1::StatusRequest(), &status).ok());
  CHECK(status.node() == "n0");
  CHECK_THAT(status.transport(), Catch::Contains("ucx 1.") && Catch::Contains(" (tls=tcp"));
  CHECK(status.registered_ranks() == 0);
  // Server reflection: client/python/tests/test_client.py asks it with grpcio-reflection.
  CHECK(d.stop() == 0);                                // SIGTERM: clean exit
  CHECK(::access(d.socketPath().c_str(), F_OK) != 0);  // socket removed
}

TEST_CASE("shardcastd flags: environment variables, validation, exit codes", "[daemon]") {
  Child bad = Child::spawn({testBinary(SHARDCASTD_PATH), "--protocol", "bogus"});
  CHECK(WEXITSTATUS(bad.wait()) == 2);
  Child bad_fold = Child::spawn({testBinary(SHARDCASTD_PATH), "--fold-prepare", "sometimes"});
  CHECK(WEXITSTATUS(bad_fold.wait()) == 2);
  Child fold = Child::spawn({"env", "SHARDCAST_FOLD_PREPARE=never", "SHARDCAST_INSECURE=true",
                             testBinary(SHARDCASTD_PATH), "--print-config"});
  CHECK_THAT(fold.readLine(std::chrono::seconds(10)), Catch::Contains("fold_prepare=never"));
  CHECK(WEXITSTATUS(fold.wait()) == 0);
  Child print = Child::spawn({"env", "SHARDCAST_NODE=from-env", "SHARDCAST_PEERS=a:1,b:2", "SHARDCAST_INSECURE=true",
                              testBinary(SHARDCASTD_PATH), "--print-config"});
  const std::string line = print.readLine(std::chrono::seconds(10));
  CHECK_THAT(line, Catch::Contains("node=from-env") && Catch::Contains("peers=a:1,b:2"));
  CHECK(WEXITSTATUS(print.wait()) == 0);
  Child bad_peer = Child::spawn({testBinary(SHARDCASTD_PATH), "--peers", "nohostport", "--socket", ""});
  CHECK(WEXITSTATUS(bad_peer.wait()) == 2);
  // TCP is authenticated: without certificates (or --insecure) a daemon that listens does not start.
  // (sh merges the daemon's stderr into the pipe read here.)
  const auto withStderr = [](std::vector<std::string> args) {
    args.insert(args.begin(), {"sh", "-c", "exec \"$0\" \"$@\" 2>&1", testBinary(SHARDCASTD_PATH)});
    return Child::spawn(args);
  };
  Child plaintext = withStderr({"--node", "x", "--socket", ""});
  CHECK_THAT(plaintext.readLine(std::chrono::seconds(10)), Catch::Contains("--tls-cert"));
  CHECK(WEXITSTATUS(plaintext.wait()) == 2);
  Child both = withStderr({"--insecure", "--tls-ca", "/etc/hostname", "--print-config"});
  CHECK_THAT(both.readLine(std::chrono::seconds(10)), Catch::Contains("not both"));
  CHECK(WEXITSTATUS(both.wait()) == 2);
  Child missing = withStderr(
      {"--tls-cert", "/nonexistent.pem", "--tls-key", "/etc/hostname", "--tls-ca", "/etc/hostname", "--print-config"});
  CHECK_THAT(missing.readLine(std::chrono::seconds(10)), Catch::Contains("/nonexistent.pem"));
  CHECK(WEXITSTATUS(missing.wait()) == 2);
  // A port another process holds is an error at start, never a port two daemons share (gRPC's
  // own listener sets SO_REUSEPORT: a second daemon started "fine" and took half the connections).
  const int port = freePort();
  Daemon first("n0", port, {}, {"--insecure"});
  REQUIRE(first.ready());
  Child second =
      withStderr({"--node", "n1", "--insecure", "--listen", first.address(), "--socket", "", "--metrics", ""});
  std::string said;
  for (int i = 0; i < 40 && said.find("cannot listen") == std::string::npos; ++i)
    said = second.readLine(std::chrono::seconds(10));
  CHECK_THAT(said, Catch::Contains("cannot listen on " + first.address() + ": Address already in use"));
  CHECK(WEXITSTATUS(second.wait()) == 1);
  // With its metrics server started first: it exits too (it hung stopping a metrics server whose
  // thread had not started listening yet).
  Child serving = withStderr(
      {"--node", "n1", "--insecure", "--listen", first.address(), "--socket", "", "--metrics", "127.0.0.1:0"});
  said.clear();
  for (int i = 0; i < 40 && said.find("cannot listen") == std::string::npos; ++i)
    said = serving.readLine(std::chrono::seconds(10));
  CHECK_THAT(said, Catch::Contains("cannot listen on " + first.address()));
  CHECK(WEXITSTATUS(serving.wait()) == 1);
  // Its metrics port too.
  const std::string metrics = "127.0.0.1:" + std::to_string(first.metricsPort());
  Child third = withStderr({"--node", "n2", "--insecure", "--listen", "127.0.0.1:" + std::to_string(freePort()),
                            "--socket", "", "--metrics", metrics});
  said.clear();
  for (int i = 0; i < 40 && said.find("cannot listen") == std::string::npos; ++i)
    said = third.readLine(std::chrono::seconds(10));
  CHECK_THAT(said, Catch::Contains("metrics: cannot listen on " + metrics + ": Address already in use"));
  CHECK(WEXITSTATUS(third.wait()) == 1);
  Child help = Child::spawn({testBinary(SHARDCASTD_PATH), "--help"});
  CHECK_THAT(help.readLine(std::chrono::seconds(10)), Catch::Contains("shardcastd"));
  CHECK(WEXITSTATUS(help.wait()) == 0);
}

TEST_CASE("registration is validated against the layout and the node", "[daemon]") {
  Daemon d("n0", freePort(), {});
  REQUIRE(d.ready());
  auto stub = d.client();
  Segment s0("r0"), s1("r1");
  const auto trainer = layout("trainer", 0);

  grpc::Status st = registerRank(*stub, request("trainer", 1, trainer, s1));
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("places it on node \"n1\" but this daemon is node \"n0\""));

  auto wrong_world = request("trainer", 0, trainer, s0);
  wrong_world.set_world_size(3);
  st = registerRank(*stub, wrong_world);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("world_size 3 but the layout's mesh has 2 ranks"));

  st = registerRank(*stub, request("trainer", 0, trainer, s0, /*size=*/32));
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("buffer \"w\" is given 32 bytes but needs 64"));

  auto missing = request("trainer", 0, trainer, s0);
  missing.clear_buffers();
  st = registerRank(*stub, missing);
  CHECK_THAT(st.error_message(), Catch::Contains("no memory handle for buffer \"w\" (64 bytes)"));

  auto unknown = request("trainer", 0, trainer, s0);
  unknown.mutable_buffers(0)->set_buffer("bias");
  st = registerRank(*stub, unknown);
  CHECK_THAT(st.error_message(), Catch::Contains("buffer \"bias\" is not a buffer this rank holds"));

  auto no_segment = request("trainer", 0, trainer, s0);
  no_segment.mutable_buffers(0)->mutable_shm()->set_name("/shardcast-no-such-segment");
  st = registerRank(*stub, no_segment);
  CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);

  st = registerRank(*stub, request("trainer", 0, trainer, s0, 64, /*offset=*/4090));  // past the segment's end
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);

  auto bad_layout = request("trainer", 0, trainer, s0);
  bad_layout.mutable_layout()->mutable_tensors(0)->set_dtype("bf16");
  st = registerRank(*stub, bad_layout);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(st.error_message(), Catch::Contains("unknown dtype \"bf16\""));

  auto cuda = request("trainer", 0, trainer, s0);
  cuda.mutable_buffers(0)->mutable_cuda()->set_size(64);
  st = registerRank(*stub, cuda);
  CHECK_FALSE(st.ok());

  // A valid registration, listed, then refused for a different layout of the same group.
  REQUIRE(registerRank(*stub, request("trainer", 0, trainer, s0)).ok());
  v1::ListResponse list;
  REQUIRE(stub->List(ctx().get(), v1::ListRequest(), &list).ok());
  REQUIRE(list.ranks_size() == 1);
  CHECK(list.ranks(0).group() == "trainer");
  CHECK(list.ranks(0).registered_bytes() == 64);
  CHECK(list.ranks(0).node() == "n0");
  // Re-registering the same rank: refused unless asked to replace it.
  auto again = request("trainer", 0, trainer, s0);
  CHECK(registerRank(*stub, again).error_code() == grpc::StatusCode::ALREADY_EXISTS);
  again.set_replace(true);
  REQUIRE(registerRank(*stub, again).ok());

  v1::UnregisterRequest un;
  un.set_group("trainer");
  un.set_rank(0);
  v1::UnregisterResponse unr;
  CHECK(stub->Unregister(ctx().get(), un, &unr).ok());
  CHECK(stub->Unregister(ctx().get(), un, &unr).error_code() == grpc::StatusCode::NOT_FOUND);
}

TEST_CASE("two daemons: the plan dry run sees the whole cluster and names missing ranks", "[daemon]") {
  const int p0 = freePort(), p1 = freePort();
  Daemon d0("n0", p0, {"127.0.0.1:" + std::to_string(p1)});
  Daemon d1("n1", p1, {"127.0.0.1:" + std::to_string(p0), "127.0.0.1:" + std::to_string(p1)});
  REQUIRE(d0.ready());
  REQUIRE(d1.ready());
  const auto trainer = layout("trainer", 0), infer = layout("infer", 1);
  Segment t0("t0"), t1("t1"), i0("i0"), i1("i1");
  REQUIRE(registerRank(*d0.client(), request("trainer", 0, trainer, t0)).ok());
  REQUIRE(registerRank(*d0.client(), request("infer", 0, infer, i0)).ok());
  REQUIRE(registerRank(*d1.client(), request("infer", 1, infer, i1)).ok());

  v1::PlanRequest preq;
  preq.set_src_group("trainer");
  preq.set_dst_group("infer");
  v1::PlanResponse presp;
  grpc::Status st = d1.client()->Plan(ctx().get(), preq, &presp);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("group \"trainer\" is incomplete: ranks 1 of 2 are not registered"));

  REQUIRE(registerRank(*d1.client(), request("trainer", 1, trainer, t1)).ok());
  v1::ListRequest all;
  all.set_all_nodes(true);
  v1::ListResponse list;
  REQUIRE(d0.client()->List(ctx().get(), all, &list).ok());
  CHECK(list.ranks_size() == 4);
  // n1's ranks too carry their group's world size, from the layout the List fetched by digest.
  for (const auto& r : list.ranks()) {
    CAPTURE(r.group(), r.rank(), r.node());
    CHECK(r.world_size() == 2);
  }

  REQUIRE(d0.client()->Plan(ctx().get(), preq, &presp).ok());
  // The daemon's plan is the planner's plan for the same layouts.
  planner::NodeTable nodes;
  auto rs = planner::resolveLayout(trainer, nodes);
  auto rd = planner::resolveLayout(infer, nodes);
  auto plan = planner::makePlan(*rs, *rd, nodes);
  REQUIRE(plan.ok());
  CHECK_THAT(presp.summary_json(), Catch::Contains("\"network_bytes\": " + std::to_string(plan->stats.network_bytes)));
  CHECK(plan->stats.network_bytes == 64);  // each node lacks half of its column block: 4 rows x 2 cols x 4 B x 2 nodes
  CHECK_THAT(presp.summary_text(), Catch::Contains("plan trainer -> infer"));

  v1::StatusResponse status;
  REQUIRE(d0.client()->Status(ctx().get(), v1::StatusRequest(), &status).ok());
  REQUIRE(status.peers_size() == 1);
  CHECK(status.peers(0).reachable());
  CHECK(status.peers(0).node() == "n1");

  // A peer that dies makes cluster-wide calls fail, naming it.
  d1.kill();
  st = d0.client()->Plan(ctx().get(), preq, &presp);
  CHECK(st.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK_THAT(st.error_message(), Catch::Contains("127.0.0.1:" + std::to_string(p1)));
}

TEST_CASE("peers found through a DNS name - a sync waits for ranks that register late", "[daemon]") {
  // localhost resolves to this daemon itself (once per address family): no duplicate peers.
  const int port = freePort();
  Daemon d("n0", port, {}, {"--peer-dns", "localhost:" + std::to_string(port)});
  REQUIRE(d.ready());
  v1::StatusResponse status;
  REQUIRE(d.client()->Status(ctx().get(), v1::StatusRequest(), &status).ok());
  REQUIRE(status.peers_size() >= 1);
  for (const auto& p : status.peers()) {
    CHECK(p.reachable());
    CHECK(p.node() == "n0");
  }
  // One node holds everything: trainer ranks 0-1 and inference ranks 0-1, all on n0.
  auto one_node = [](const std::string& group, int dim) {
    auto l = planner::parseLayoutJson(R"({"group":")" + group + R"(","mesh":{"shape":[2]},"nodes":["n0","n0"],
      "tensors":[{"name":"w","shape":[8,4],"dtype":"float32","placements":[{"shard":{"dim":)" +
                                          std::to_string(dim) + "}}]}]}",
                                      "test");
    REQUIRE(l.ok());
    return *l;
  };
  const auto trainer = one_node("trainer", 0), infer = one_node("infer", 1);
  Segment t0("dt0"), t1("dt1"), i0("di0"), i1("di1");
  auto client = d.client();
  auto source = [](v1::RegisterRequest r) {
    r.set_role(v1::ROLE_SOURCE);
    r.set_version(1);
    return r;
  };
  REQUIRE(registerRank(*client, source(request("trainer", 0, trainer, t0))).ok());
  REQUIRE(registerRank(*client, source(request("trainer", 1, trainer, t1))).ok());
  REQUIRE(registerRank(*client, request("infer", 0, infer, i0)).ok());
  // Inference rank 1 registers once the sync is under way (waiting for it).
  std::thread late([&] {
    CHECK(d.waitForSync("late-rank"));
    auto c = d.client();
    CHECK(registerRank(*c, request("infer", 1, infer, i1)).ok());
  });
  v1::SyncRequest sync;
  sync.set_sync_id("late-rank");
  sync.set_src_group("trainer");
  sync.set_dst_group("infer");
  sync.set_version(1);
  sync.mutable_options()->set_wait_for_ranks(true);
  sync.mutable_options()->set_timeout_ms(30000);
  v1::SyncResponse out;
  const grpc::Status st = client->Sync(ctx().get(), sync, &out);
  late.join();
  INFO(st.error_message());
  CHECK(st.ok());
  CHECK(out.network_bytes() == 0);  // everything is on one node: local copies only
}

TEST_CASE("refused syncs are logged once with their reason and caller, handshake failures rate-limited", "[daemon]") {
  const int port = freePort();
  const std::string socket = "/tmp/shardcast-test-" + std::to_string(::getpid()) + "-logs.sock";
  const auto tls = examples::LocalCerts::get().daemon();
  // Its log on the pipe read here (sh merges stderr into it).
  Child d = Child::spawn({"sh",
                          "-c",
                          "exec \"$0\" \"$@\" 2>&1",
                          testBinary(SHARDCASTD_PATH),
                          "--node",
                          "n0",
                          "--listen",
                          "127.0.0.1:" + std::to_string(port),
                          "--socket",
                          socket,
                          "--metrics",
                          "",
                          "--ucx-tls",
                          "tcp",
                          "--tls-cert",
                          tls.cert,
                          "--tls-key",
                          tls.key,
                          "--tls-ca",
                          tls.ca});
  std::string line;
  for (int i = 0; i < 100 && line.rfind("shardcastd ready", 0) != 0; ++i) line = d.readLine(std::chrono::seconds(10));
  REQUIRE(line.rfind("shardcastd ready", 0) == 0);
  auto client = v1::Shardcast::NewStub(Daemon::channel("unix:" + socket));
  v1::SyncRequest sync;
  sync.set_src_group("nosuch");
  sync.set_dst_group("none");
  sync.set_version(3);
  v1::SyncResponse out;
  for (int i = 0; i < 5; ++i) CHECK_FALSE(client->Sync(ctx(10).get(), sync, &out).ok());
  // Plaintext callers on the TLS port: gRPC's handshake errors, 40 of them.
  for (int i = 0; i < 40; ++i) {
    auto plain = v1::Shardcast::NewStub(Daemon::channel("127.0.0.1:" + std::to_string(port)));
    v1::StatusResponse st;
    CHECK_FALSE(plain->Status(ctx(2).get(), v1::StatusRequest(), &st).ok());
  }
  int refused = 0, handshakes = 0;
  std::string first;
  for (line = d.readLine(std::chrono::seconds(3)); !line.empty(); line = d.readLine(std::chrono::seconds(3))) {
    if (line.find("sync \"nosuch\" -> \"none\" version 3 for uid ") != std::string::npos) {
      ++refused;
      if (first.empty()) first = line;
    }
    handshakes += line.find("grpc:") != std::string::npos;
  }
  INFO(first);
  CHECK(refused == 1);  // the first of the five; the rest are counted on its next line
  CHECK_THAT(first, Catch::Contains("warn") && Catch::Contains("(pid ") && Catch::Contains("failed:") &&
                        Catch::Contains("group \"nosuch\" has no registered ranks"));
  CHECK(handshakes >= 1);
  CHECK(handshakes <= 4);  // each kind of gRPC line once per 10 s, not 40 times
  d.kill(SIGTERM);
  d.wait();
  for (const char* suffix : {".owners", ".lock"}) ::unlink((socket + suffix).c_str());
}
