// shardcast::Client and HostTensors against real daemons: register from host tensors the library
// created, sync, watch, wait for versions, read status; errors carry the daemon's code and message.
#include "client/lib/client.h"

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <future>
#include <thread>

#include "planner/layout.h"
#include "tests/client/client_cluster.h"
#include "tests/support/device_buffer.h"
#include "tests/support/gpu.h"
#include "tests/transport/process.h"
#include "transport/cuda/cuda_support.h"
#include "transport/shm.h"

using namespace shardcast;
using namespace shardcast::testing;

TEST_CASE("HostTensors: buffers sized by the layout, aligned, zeroed, shared with whoever maps the segment",
          "[client]") {
  const auto layout = *planner::parseLayoutJson(kClientTrainer, "trainer");
  auto t = HostTensors::forRank(layout, 1);
  REQUIRE(t.ok());
  // rank 1 of 2 holds rows 8..15 of w [16,8] and rows 4..7 of o [8,16] (int32)
  CHECK(t->bytes("w").size() == 8 * 8 * 4);
  CHECK(t->bytes("o").size() == 4 * 16 * 4);
  CHECK(t->bytes("missing").empty());
  for (const auto& [name, slot] : t->buffers()) CHECK(slot.offset % 64 == 0);
  for (int32_t v : t->as<int32_t>("w")) CHECK(v == 0);
  t->as<int32_t>("o")[3] = 42;

  // Another mapping of the same segment (what the daemon does) sees the application's writes.
  auto other = HostTensors::adopt(t->segment(), t->buffers());
  REQUIRE(other.ok());
  CHECK(other->as<int32_t>("o")[3] == 42);
  other->as<int32_t>("w")[0] = 7;
  CHECK(t->as<int32_t>("w")[0] == 7);

  const auto handles = t->handles();
  REQUIRE(handles.size() == 2);
  for (const auto& h : handles) {
    CHECK(h.shm().name() == t->segment());
    CHECK(h.shm().size() == t->bytes(h.buffer()).size());
  }
}

TEST_CASE("HostTensors: segments are 0600 whatever the umask (no group or other access)", "[client][security]") {
  const auto layout = *planner::parseLayoutJson(kClientTrainer, "trainer");
  const mode_t before = ::umask(0);  // the most permissive umask: 0660 would stay 0660
  auto t = HostTensors::forRank(layout, 0);
  ::umask(before);
  REQUIRE(t.ok());
  struct stat st {};
  REQUIRE(::stat(("/dev/shm" + t->segment()).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
}

TEST_CASE("Client: a process of another uid serving the socket path in the daemon's place is not believed",
          "[client][security]") {
  if (::geteuid() != 0 || ::access("/usr/bin/python3", X_OK) != 0) {
    WARN("needs root (setpriv) and /usr/bin/python3 to run an impostor as another uid: skipped");
    return;
  }
  const std::string dir = "/tmp/shardcast-impostor-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::filesystem::permissions(dir, std::filesystem::perms::all);
  const std::string path = dir + "/shardcast.sock";
  // nobody listens where the daemon's socket would be (it accepts, it could even speak gRPC).
  Child impostor =
      Child::spawn({"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                    "import socket, sys, time\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(64)\n"
                    "print('listening', flush=True)\nwhile True:\n    c, _ = s.accept()\n",
                    path});
  REQUIRE(impostor.readLine(std::chrono::seconds(30)) == "listening");
  auto c = Client::connect("unix:" + path, std::chrono::seconds(2));
  REQUIRE_FALSE(c.ok());
  CHECK(absl::IsPermissionDenied(c.status()));
  CHECK_THAT(std::string(c.status().message()),
             Catch::Contains("runs as uid 65534") && Catch::Contains("not a daemon this client trusts"));
  // Unless it is the uid the deployment says the daemon runs as.
  ConnectOptions trusted;
  trusted.timeout = std::chrono::milliseconds(300);
  trusted.daemon_uids = {65534};
  auto uid = checkDaemonUid(path, trusted.daemon_uids, trusted.timeout);
  REQUIRE(uid.ok());
  CHECK(*uid == 65534);
  impostor.kill();
  impostor.wait();
  std::filesystem::remove_all(dir);
}

TEST_CASE("HostTensors: bad input is refused with the reason", "[client]") {
  const auto layout = *planner::parseLayoutJson(kClientTrainer, "trainer");
  auto out_of_range = HostTensors::forRank(layout, 2);
  REQUIRE_FALSE(out_of_range.ok());
  CHECK_THAT(std::string(out_of_range.status().message()), Catch::Contains("rank 2 is outside 0..1"));
  auto twice = HostTensors::create({{"a", 8}, {"a", 16}});
  REQUIRE_FALSE(twice.ok());
  CHECK_THAT(std::string(twice.status().message()), Catch::Contains("\"a\" is given twice"));
  auto missing = HostTensors::adopt("/shardcast-no-such-segment", {{"a", {0, 64}}});
  CHECK_FALSE(missing.ok());
  auto seg = HostTensors::create({{"a", 100}});
  REQUIRE(seg.ok());
  auto too_big = HostTensors::adopt(seg->segment(), {{"a", {0, 1 << 20}}});  // beyond the segment's end
  CHECK_FALSE(too_big.ok());
}

TEST_CASE("deviceHandle: a pointer CUDA does not know is a clear error", "[client]") {
  auto h = deviceHandle({"w", reinterpret_cast<void*>(0x1000), 64});
  REQUIRE_FALSE(h.ok());
  CHECK_FALSE(h.status().message().empty());
}

TEST_CASE("deviceHandle: CUDA pointers become IPC handles", "[client][gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  auto dev = allocateDevice(1 << 20, 0);
  REQUIRE(dev.ok());
  auto inner = deviceHandle({"w", static_cast<std::byte*>((*dev)->data()) + 4096, 1024});
  REQUIRE(inner.ok());
  CHECK(inner->cuda().offset() == 4096);
  CHECK(inner->cuda().size() == 1024);
  CHECK(inner->cuda().handle().size() == 64);
  // Its GPU by UUID, as the daemon finds it (its device numbers may differ from this process's).
  CHECK(inner->cuda().device_uuid().size() == 16);
  CHECK(inner->cuda().device_uuid() == transport::cudaDeviceUuid(0));
}

TEST_CASE("Client: an unreachable daemon is UNAVAILABLE and named", "[client]") {
  auto c = Client::connect("unix:/tmp/shardcast-nobody-listens.sock", std::chrono::milliseconds(300));
  REQUIRE_FALSE(c.ok());
  CHECK(absl::IsUnavailable(c.status()));
  CHECK_THAT(std::string(c.status().message()), Catch::Contains("/tmp/shardcast-nobody-listens.sock"));
  CHECK(normalizeTarget("/run/x.sock") == "unix:/run/x.sock");
  CHECK(normalizeTarget("10.0.0.1:7070") == "10.0.0.1:7070");
}

TEST_CASE("Client: register, sync with watch, wait for the version, status - every destination element checked",
          "[client][daemon]") {
  ClientCluster cluster;

  auto coordinator = Client::connect("unix:" + cluster.daemons[0]->socketPath());
  REQUIRE(coordinator.ok());
  for (int version = 1; version <= 2; ++version) {
    cluster.fillSource(version);
    SyncOptions o;
    o.sync_id = "client-test-" + std::to_string(version);
    o.verify = true;
    std::vector<v1::SyncProgress> seen;
    auto watcher = std::async(std::launch::async, [&] {
      return coordinator->watch(o.sync_id, [&](const v1::SyncProgress& p) {
        seen.push_back(p);
        return true;
      });
    });
    auto r = coordinator->sync("trainer", "infer", static_cast<uint64_t>(version), o);
    REQUIRE(r.ok());
    CHECK(r->version() == static_cast<uint64_t>(version));
    CHECK(r->sync_id() == o.sync_id);
    CHECK(r->plan_cached() == (version > 1));
    REQUIRE(watcher.get().ok());
    REQUIRE_FALSE(seen.empty());
    CHECK(seen.back().state() == "committed");
    CHECK(seen.back().bytes_done() == seen.back().bytes_total());
    CHECK(cluster.badDestinationElements(version) == 0);

    // An inference process on node n1 waits for the version through its own daemon.
    auto local = Client::connect("unix:" + cluster.daemons[1]->socketPath());
    REQUIRE(local.ok());
    auto v = local->waitVersion("infer", static_cast<uint64_t>(version), std::chrono::seconds(5));
    REQUIRE(v.ok());
    CHECK(*v == static_cast<uint64_t>(version));
  }

  auto st = coordinator->status();
  REQUIRE(st.ok());
  CHECK(st->node() == "n0");
  REQUIRE(st->groups_size() == 1);  // n0 holds the trainer ranks only
  CHECK(st->groups(0).group() == "trainer");
  CHECK(st->groups(0).ranks_size() == 2);

  auto all = coordinator->list(true);
  REQUIRE(all.ok());
  int infer_ranks = 0;
  for (const auto& r : all->ranks())
    if (r.group() == "infer") {
      ++infer_ranks;
      CHECK(r.version() == 2);
      CHECK(r.node() == "n1");
    }
  CHECK(infer_ranks == 2);

  // Errors keep the daemon's code and message.
  auto old = coordinator->sync("trainer", "infer", 1);
  REQUIRE_FALSE(old.ok());
  CHECK(absl::IsFailedPrecondition(old.status()));
  CHECK_THAT(std::string(old.status().message()), Catch::Contains("on node \"n1\" is at version 2"));
  CHECK_THAT(std::string(old.status().message()), Catch::Contains("version 1 is not newer"));
  auto waited = coordinator->waitVersion("nobody", 1, std::chrono::milliseconds(10));
  REQUIRE_FALSE(waited.ok());
  CHECK(absl::IsNotFound(waited.status()));
  // A version that does not arrive in time is an error, never a lower version to serve from.
  auto inference = Client::connect("unix:" + cluster.daemons[1]->socketPath());
  REQUIRE(inference.ok());
  auto stale = inference->waitVersion("infer", 99, std::chrono::milliseconds(10));
  REQUIRE_FALSE(stale.ok());
  CHECK(absl::IsDeadlineExceeded(stale.status()));
  CHECK_THAT(std::string(stale.status().message()),
             Catch::Contains("group \"infer\" is at version 2, not 99") && Catch::Contains("weights are stale"));
  auto query = inference->waitReady("infer", 99, std::chrono::milliseconds(10));  // the query form reports
  REQUIRE(query.ok());
  CHECK(query->version() == 2);
  auto unknown_watch = coordinator->watch("no-such-sync", [](const v1::SyncProgress&) { return true; });
  CHECK(absl::IsNotFound(unknown_watch));
}

TEST_CASE("Client: a registration the daemon refuses comes back as INVALID_ARGUMENT with its reason",
          "[client][daemon]") {
  ClientCluster cluster(/*register_ranks=*/false);
  auto c = Client::connect("unix:" + cluster.daemons[0]->socketPath());
  REQUIRE(c.ok());
  const auto layout = *planner::parseLayoutJson(kClientTrainer, "trainer");
  auto small = HostTensors::create({{"w", 16}, {"o", 4 * 16 * 4}});
  REQUIRE(small.ok());
  auto r = c->registerRank(layout, 0, *small);
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsInvalidArgument(r.status()));
  CHECK_THAT(std::string(r.status().message()), Catch::Contains("\"w\" is given 16 bytes"));

  // A double-buffered registration whose shadow set is empty would sync single-buffered, under the
  // engine's reads: refused by the client before anything is registered.
  auto ok = HostTensors::forRank(layout, 0);
  REQUIRE(ok.ok());
  auto unshadowed = c->registerRank(layout, 0, *ok, RegisterOptions::doubleBuffered({}));
  REQUIRE_FALSE(unshadowed.ok());
  CHECK(absl::IsInvalidArgument(unshadowed.status()));
  CHECK_THAT(std::string(unshadowed.status().message()), Catch::Contains("empty shadow set"));
  CHECK(absl::IsNotFound(c->unregisterRank("trainer", 0)));

  auto reg = c->registerRank(layout, 0, *ok);
  REQUIRE(reg.ok());
  CHECK(reg->node() == "n0");
  CHECK(c->unregisterRank("trainer", 0).ok());
  CHECK(absl::IsNotFound(c->unregisterRank("trainer", 0)));
}
