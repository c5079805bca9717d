// Transport between real processes: two processes over each transport, a peer killed in the
// middle of a transfer, and two network namespaces joined by a veth pair (real separate hosts).
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <future>
#include <thread>

#include "tests/support/binaries.h"
#include "tests/support/skip.h"
#include "tests/transport/process.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::transport;
using namespace shardcast::testing;

namespace {

std::string peerBinary() { return testBinary(TRANSPORT_PEER_PATH); }

struct Receiver {
  Child child;
  std::string address, region, key;
};

Receiver startReceiver(const std::vector<std::string>& prefix, const std::string& tls, size_t size,
                       const std::string& protocol = "auto") {
  std::vector<std::string> argv = prefix;
  for (const auto& a : {peerBinary(), std::string("recv"), std::string("--tls"), tls, std::string("--size"),
                        std::to_string(size), std::string("--protocol"), protocol})
    argv.push_back(a);
  Receiver r{Child::spawn(argv), {}, {}, {}};
  REQUIRE(r.child.pid() > 0);
  const std::string a = r.child.readLine(std::chrono::seconds(30));
  const std::string g = r.child.readLine(std::chrono::seconds(30));
  const std::string k = r.child.readLine(std::chrono::seconds(30));
  INFO("receiver said: " << a << " / " << g << " / " << k);
  REQUIRE(a.rfind("ADDRESS ", 0) == 0);
  REQUIRE(g.rfind("REGION ", 0) == 0);
  REQUIRE(k.rfind("KEY ", 0) == 0);
  r.address = a.substr(8);
  r.region = g.substr(7);
  r.key = k.substr(4);
  return r;
}

}  // namespace

TEST_CASE("a spawned child gets SIGTERM when the thread that started it ends", "[process]") {
  // What keeps a demo's or a test's daemons from outliving it, however it ends.
  Child child;
  std::thread([&] { child = Child::spawn({"sleep", "120"}); }).join();
  REQUIRE(child.pid() > 0);
  const int status = child.wait();  // returns once the child is gone: it does not sleep 120 s
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
  CHECK(Child::spawn({"/no/such/program"}).pid() < 0);  // refused at once, not a child exiting 127
}

TEST_CASE("two processes: 96 MiB arrive intact over each transport", "[transport][process]") {
  for (const char* tls : {"tcp", "posix,sysv,cma,self", ""}) {
    const size_t size = size_t{96} << 20;
    Receiver r = startReceiver({}, tls, size);
    Child sender = Child::spawn({peerBinary(), "send", "--tls", tls, "--size", std::to_string(size), "--seed", "5",
                                 "--address", r.address, "--region", r.region, "--key", r.key});
    INFO("tls " << tls);
    CHECK(sender.readLine(std::chrono::seconds(60)) == "SENT");
    CHECK(r.child.readLine(std::chrono::seconds(60)) == "OK 5");
    CHECK(sender.wait() == 0);
    r.child.closeStdin();
    CHECK(r.child.wait() == 0);
  }
}

TEST_CASE("a peer killed mid-transfer fails in-flight writes with a clear error, no hang", "[transport][process]") {
  for (const char* tls : {"tcp", ""}) {
    INFO("tls " << (*tls ? tls : "default"));
    const size_t size = size_t{64} << 20;
    Receiver r = startReceiver({}, tls, size);
    // What the completions touch outlives the context: one that is still pending when the
    // context goes runs (cancelled) in its destructor.
    std::atomic<int> ok{0}, failed{0}, done{0};
    std::mutex mu;
    std::string first_error;
    std::promise<Status> later;
    TransportOptions o;
    o.name = "killer";
    o.settings["ucx.tls"] = tls;
    // Long enough that the writes before the kill land on a loaded machine (8 x 16 MiB over
    // loopback TCP); a vanished peer on shared memory is detected by this timeout, so the
    // writes after the kill complete within it, well inside the 60 s bound below.
    o.op_timeout = std::chrono::milliseconds(10000);
    auto ctx = createContext(o);
    REQUIRE(ctx.ok());
    std::vector<unsigned char> src(size);
    auto region = (*ctx)->registerMemory(src.data(), src.size(), MemoryKind::kHost);
    REQUIRE(region.ok());
    auto remote = RemoteRegion::parse(fromHex(r.region));
    REQUIRE(remote.ok());
    auto ep = (*ctx)->connect(fromHex(r.address), "doomed-peer");
    REQUIRE(ep.ok());
    auto key = WriteKey::fromBytes(fromHex(r.key));
    REQUIRE(key.ok());

    const int kWrites = 400;
    int landed_before_kill = 0;
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kWrites; ++i) {
      if (i == 8) {
        // Let a few writes land, then kill the receiver while the rest are queued or in flight.
        while (ok < 2 && failed == 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(30))
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        landed_before_kill = ok;
        r.child.kill();
      }
      (*ep)->write({*region, 0, *remote, 0, size / 4, *key}, [&](Status st) {
        if (st.ok()) {
          ++ok;
        } else {
          ++failed;
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.empty()) first_error = std::string(st.message());
        }
        ++done;
      });
    }
    // Bounded: every write completes (most with an error) well within op_timeout plus slack.
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (done < kWrites && std::chrono::steady_clock::now() < limit)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::lock_guard<std::mutex> lock(mu);  // (no completion takes it once all are done)
    INFO("first error: " << first_error);
    REQUIRE(done == kWrites);
    CHECK(failed > 0);
    CHECK(landed_before_kill >= 2);  // (else the first error says why the live peer took none)
    CHECK_THAT(first_error, Catch::Contains("doomed-peer"));
    // Later operations on the dead endpoint fail at once.
    (*ep)->write({*region, 0, *remote, 0, 16, *key}, [&](Status st) { later.set_value(st); });
    auto f = later.get_future();
    REQUIRE(f.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
    CHECK_FALSE(f.get().ok());
  }
}

TEST_CASE("two network namespaces joined by veth, UCX_TLS=tcp", "[transport][process][netns]") {
  if (::geteuid() != 0 || std::system("command -v ip >/dev/null 2>&1") != 0) {
    SHARDCAST_SKIP("creating network namespaces needs root and iproute2");
  }
  const std::string id = std::to_string(::getpid() % 100000);
  const std::string a = "sc-a-" + id, b = "sc-b-" + id, va = "sca" + id, vb = "scb" + id;
  const std::string net = "10.250." + std::to_string(::getpid() % 250) + ".";
  auto sh = [](const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; };
  struct Cleanup {
    std::string a, b;
    ~Cleanup() {
      std::system(("ip netns del " + a + " >/dev/null 2>&1").c_str());
      std::system(("ip netns del " + b + " >/dev/null 2>&1").c_str());
    }
  } cleanup{a, b};
  if (!sh("ip netns add " + a) || !sh("ip netns add " + b)) {
    SHARDCAST_SKIP("cannot create network namespaces here (no CAP_SYS_ADMIN?)");
  }
  REQUIRE(sh("ip link add " + va + " type veth peer name " + vb));
  REQUIRE(sh("ip link set " + va + " netns " + a));
  REQUIRE(sh("ip link set " + vb + " netns " + b));
  REQUIRE(sh("ip -n " + a + " addr add " + net + "1/24 dev " + va));
  REQUIRE(sh("ip -n " + b + " addr add " + net + "2/24 dev " + vb));
  for (const auto& [ns, dev] : {std::pair{a, va}, std::pair{b, vb}}) {
    REQUIRE(sh("ip -n " + ns + " link set " + dev + " up"));
    REQUIRE(sh("ip -n " + ns + " link set lo up"));
  }
  const size_t size = size_t{32} << 20;
  Receiver r = startReceiver({"ip", "netns", "exec", b, "env", "UCX_NET_DEVICES=" + vb}, "tcp", size);
  Child sender = Child::spawn({"ip",         "netns", "exec",      a,         "env",      "UCX_NET_DEVICES=" + va,
                               peerBinary(), "send",  "--tls",     "tcp",     "--size",   std::to_string(size),
                               "--seed",     "9",     "--address", r.address, "--region", r.region,
                               "--key",      r.key});
  CHECK(sender.readLine(std::chrono::seconds(60)) == "SENT");
  CHECK(r.child.readLine(std::chrono::seconds(60)) == "OK 9");
  CHECK(sender.wait() == 0);
  r.child.closeStdin();
  CHECK(r.child.wait() == 0);
}
