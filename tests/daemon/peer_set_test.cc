// PeerSet::checkTransportAddresses against a peer daemon that answers its Describe late, with
// another address, or not at all (docs/security.md: a daemon connects to no transport address a
// third party hands it; docs/daemon.md, "A sync": a slow peer is waited for, not refused).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "daemon/coordinator/cluster.h"
#include "tests/daemon/served_peer.h"

using namespace shardcast;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

// A peer daemon's Describe and nothing else: node "n1" at the transport address `transport()`.
// Its first `late` calls answer only after `delay` (past the asker's peer timeout), or once released.
class LatePeer final : public v1::Peer::Service {
 public:
  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*, v1::DescribeResponse* out) override {
    if (++calls_ <= late) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, delay, [&] { return released_; });
    }
    out->set_node(node);
    out->set_instance("late-peer");
    out->set_transport_address(transport());
    return grpc::Status::OK;
  }
  int calls() const { return calls_; }
  std::string transport() const {
    std::lock_guard<std::mutex> lock(mu_);
    return transport_;
  }
  void setTransport(std::string t) {
    std::lock_guard<std::mutex> lock(mu_);
    transport_ = std::move(t);
  }

  // Late calls answer at once from now on.
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    wake_.notify_all();
  }

  std::string node = "n1";
  int late = 0;
  std::chrono::milliseconds delay{0};

 private:
  std::atomic<int> calls_{0};
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool released_ = false;
  std::string transport_ = "transport-1";
};

// The peer served on 127.0.0.1, and a PeerSet of daemon "n0" whose only peer it is (with
// `silent_too`, node "n2" as well, whose Describes answer only once `silent.release()` is called,
// under a peer timeout of 30 s). A peer answering late is asked under a peer timeout of 500 ms; one
// answering at once under 10 s, so that its answer decides however slowly a loaded machine connects
// (200 ms once passed with no Describe reaching it, under the full suite on two cores).
struct Cluster {
  explicit Cluster(int late, std::chrono::milliseconds delay, bool silent_too = false) {
    peer.late = late;
    peer.delay = delay;
    served = std::make_unique<shardcast::testing::ServedPeer>(peer);
    address = served->address;
    config.node = "n0";
    config.peers = {address};
    config.peer_timeout_ms = late > 0 ? 500 : 10000;
    if (silent_too) {
      silent.node = "n2";
      silent.late = 1000000;
      silent.delay = 60s;
      silent_served = std::make_unique<shardcast::testing::ServedPeer>(silent);
      config.peers.push_back(silent_served->address);
      config.peer_timeout_ms = 30000;
    }
    peers = std::make_unique<daemon::PeerSet>(config, "n0-instance");
  }
  ~Cluster() {  // what is still waiting answers now, so the servers shut down at once
    peer.release();
    silent.release();
  }

  Status check(const std::string& transport, std::chrono::milliseconds within, std::string at = "") const {
    return peers->checkTransportAddresses({{"n1", transport, at.empty() ? address : at}}, Clock::now() + within);
  }

  LatePeer peer, silent;
  std::unique_ptr<shardcast::testing::ServedPeer> served, silent_served;  // served before `peers`, shut down after
  std::string address;
  daemon::DaemonConfig config;
  std::unique_ptr<daemon::PeerSet> peers;
};

}  // namespace

TEST_CASE("transport addresses: a peer whose Describe answers late is waited for, within the deadline",
          "[daemon][peers]") {
  // Its first two Describes answer after the 500 ms peer timeout (a peer busy with 63 others at
  // a first sync): the check asks again until the deadline rather than taking the silence for
  // another address (64 daemons failed a sync 14 s into its execute that way).
  // (2 s late: far past the timeout, however late a loaded machine fires the asker's timers. Two,
  // under a 500 ms timeout: the check waits 4 s at most, which three at 200 ms, each asked again
  // under 200 ms, once did not leave enough of on a loaded machine.)
  Cluster c(/*late=*/2, /*delay=*/2s);
  const Status st = c.check("transport-1", 10s);
  INFO(st.message());
  CHECK(st.ok());
  CHECK(c.peer.calls() >= 3);
  // Known from then on: no further Describe.
  const int calls = c.peer.calls();
  CHECK(c.check("transport-1", 1s).ok());
  CHECK(c.peer.calls() == calls);
}

TEST_CASE("transport addresses: a node that answers with another address is refused at once", "[daemon][peers]") {
  Cluster c(0, 0ms);
  const Status st = c.check("\xff", 10s);  // what UCX's parser would abort on
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()),
             Catch::Contains("the transport address given for node \"n1\" is not the one that node describes"));
  CHECK(c.peer.calls() == 1);  // its answer decided: not asked again until the deadline
}

TEST_CASE(
    "transport addresses: a node that never answers is refused by name at the deadline, asked a bounded number "
    "of times",
    "[daemon][peers]") {
  Cluster c(/*late=*/1000, /*delay=*/60s);  // never answers while it runs
  const Status st = c.check("transport-1", 1500ms);
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(st.message()),
             Catch::Contains("node \"n1\" has not described itself to this daemon in time") &&
                 Catch::Contains("its transport address cannot be checked") && Catch::Contains(c.address));
  // Each address at most once per PeerSet::kAskEvery, whoever asks.
  CHECK(c.peer.calls() >= 2);
  CHECK(c.peer.calls() <= 1500ms / daemon::PeerSet::kAskEvery + 1);
}

TEST_CASE("transport addresses: a restarted node's new address is learnt, its old one then refused",
          "[daemon][peers]") {
  Cluster c(0, 0ms);
  REQUIRE(c.check("transport-1", 5s).ok());
  c.peer.setTransport("transport-2");  // restarted: a new UCX worker
  CHECK(c.check("transport-2", 5s).ok());
  const Status old = c.check("transport-1", 5s);
  CHECK(old.code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("transport addresses: a daemon address that is not one of the cluster's peers is not dialled",
          "[daemon][peers]") {
  // The coordinator names where node n1 runs; an address outside the peer list is ignored and
  // the node is found among the peers instead (its answer still decides).
  Cluster c(0, 0ms);
  CHECK(c.check("transport-1", 5s, "127.0.0.1:1").ok());
  CHECK(c.peer.calls() == 1);
  Cluster d(0, 0ms);
  CHECK(d.check("transport-9", 5s, "127.0.0.1:1").code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE(
    "transport addresses: the wait ends after a few peer timeouts whatever the call's deadline, and with its caller",
    "[daemon][peers]") {
  // A node that never answers, asked under a deadline an hour away: refused by name once four peer
  // timeouts (at least 1 s each) have passed, not an hour later.
  Cluster c(/*late=*/1000000, /*delay=*/60s);
  const Status st = c.check("transport-1", std::chrono::hours(1));
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(st.message()), Catch::Contains("node \"n1\" has not described itself"));
  // A caller that has gone ends the wait at the next round.
  Cluster d(/*late=*/1000000, /*delay=*/60s);
  const Status gone = d.peers->checkTransportAddresses({{"n1", "transport-1", d.address}},
                                                       Clock::now() + std::chrono::hours(1), [] { return true; });
  CHECK(gone.code() == absl::StatusCode::kCancelled);
}

TEST_CASE("transport addresses: a node slow to answer holds up only the checks that need it", "[daemon][peers]") {
  // A Prepare whose peers include a frozen node waits for it (up to the deadline); a Prepare of
  // another sync, needing only nodes that answer, must not wait behind it: the frozen node's
  // neighbours were cut as silent from a replica set that way. Both checks need n1, which answers
  // at once; the first needs n2 as well, which answers only when the test lets it: after the
  // second check has returned, so that its returning first is no race.
  Cluster c(0, 0ms, /*silent_too=*/true);
  std::atomic<bool> first_done{false};
  auto first = std::async(std::launch::async, [&] {
    const Status st = c.peers->checkTransportAddresses(
        {{"n1", "transport-1", c.address}, {"n2", "transport-1", c.silent_served->address}}, Clock::now() + 60s);
    first_done = true;
    return st;
  });
  const auto began = Clock::now();
  while (c.silent.calls() == 0 && Clock::now() - began < 30s) std::this_thread::sleep_for(5ms);
  REQUIRE(c.silent.calls() == 1);  // the first check's round asks n2 (and n1)
  CHECK(c.peers->checkTransportAddresses({{"n1", "transport-1", c.address}}, Clock::now() + 20s).ok());
  CHECK_FALSE(first_done);     // answered while the first still waits for n2
  CHECK(c.peer.calls() == 1);  // n1 was asked once, by the first check's round
  c.silent.release();
  CHECK(first.get().ok());  // n2's answer, when it came, has the address given
}
