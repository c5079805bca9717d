// LateAborts (daemon/coordinator/late_aborts.h): the abort of a given-up sync reaches a daemon that
// did not answer it in time, once it answers; and a daemon stopping does not wait for one still out.
#include "daemon/coordinator/late_aborts.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/daemon/served_peer.h"

using namespace shardcast;
using namespace std::chrono_literals;

namespace {

// A peer whose Finish calls answer only once released (a daemon frozen, or too busy to answer).
class FrozenPeer final : public v1::Peer::Service {
 public:
  grpc::Status Finish(grpc::ServerContext* ctx, const v1::FinishRequest* req, v1::FinishResponse*) override {
    std::unique_lock<std::mutex> lock(mu_);
    got_.push_back(*req);
    wake_.notify_all();
    // (polled: a call its client cancelled ends here too)
    while (!thawed_ && !ctx->IsCancelled()) wake_.wait_for(lock, 10ms);
    return ctx->IsCancelled() ? grpc::Status::CANCELLED : grpc::Status::OK;
  }
  void thaw() {
    std::lock_guard<std::mutex> lock(mu_);
    thawed_ = true;
    wake_.notify_all();
  }
  // Waits until a Finish has arrived (at most `within`); the requests so far.
  std::vector<v1::FinishRequest> arrived(std::chrono::milliseconds within) {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait_for(lock, within, [&] { return !got_.empty(); });
    return got_;
  }

 private:
  std::mutex mu_;
  std::condition_variable wake_;
  bool thawed_ = false;
  std::vector<v1::FinishRequest> got_;
};

// The peer served, and a PeerSet of daemon "n0" whose only peer it is.
struct FrozenServed {
  explicit FrozenServed(FrozenPeer& peer) : served(peer), address(served.address) {
    config.node = "n0";
    config.peers = {address};
    peers = std::make_unique<daemon::PeerSet>(config, "n0-instance");
  }
  shardcast::testing::ServedPeer served;
  std::string address;
  daemon::DaemonConfig config;
  std::unique_ptr<daemon::PeerSet> peers;
};

v1::FinishRequest abortOf(const std::string& id, uint64_t fence) {
  v1::FinishRequest f;
  f.set_sync_id(id);
  f.set_fence(fence);
  f.set_commit(false);
  f.set_reason("node \"n1\" stopped answering");
  return f;
}

}  // namespace

TEST_CASE("late aborts: an abort waits for the daemon that did not answer it, and is taken when it does",
          "[daemon][peers]") {
  FrozenPeer peer;
  FrozenServed s(peer);
  daemon::LateAborts aborts(*s.peers);
  aborts.send("n1", s.address, abortOf("sync-7", 42), 10min);
  const auto got = peer.arrived(30s);
  REQUIRE(got.size() == 1);
  CHECK(got[0].sync_id() == "sync-7");
  CHECK(got[0].fence() == 42);
  CHECK_FALSE(got[0].commit());
  CHECK(aborts.inFlight() == 1);  // the daemon has not answered yet
  CHECK(aborts.delivered() == 0);
  peer.thaw();
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (aborts.delivered() == 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  CHECK(aborts.delivered() == 1);
  CHECK(aborts.inFlight() == 0);
}

TEST_CASE("late aborts: a daemon stopping cancels the aborts still waiting rather than waiting for them",
          "[daemon][peers]") {
  // (Waiting would hold the daemon's shutdown for the whole lease: the ctest timeout catches it.)
  FrozenPeer peer;
  FrozenServed s(peer);
  {
    daemon::LateAborts aborts(*s.peers);
    aborts.send("n1", s.address, abortOf("sync-8", 43), 10min);
    aborts.send("n1", s.address, abortOf("sync-9", 44), 10min);
    REQUIRE(!peer.arrived(30s).empty());
    CHECK(aborts.inFlight() == 2);
  }  // the destructor returns once both calls ended, cancelled
  peer.thaw();
}
