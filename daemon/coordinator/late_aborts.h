// LateAborts: the abort of a given-up sync, delivered to a daemon that did not take it in time.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "daemon/coordinator/cluster.h"
#include "shardcast/v1/service.grpc.pb.h"

namespace shardcast::daemon {

// A coordinator gives a sync up with a short wait for each daemon's abort (commit.cc): a daemon
// frozen or cut off then (the likely reason it was given up) does not get it, and holds its ranks
// under the attempt until its lease runs out. A catch-up of its replica, an unregister, a register
// again: each is refused meanwhile ("a sync ... is in progress"), though the attempt is over. So
// the abort goes again, here, to the daemon the sync was given up for (found silent) when it did
// not answer it: one call, waiting for the daemon to answer (through a reconnect) until its lease
// would have ended the attempt anyway.
// A daemon that comes back takes it as it does: a frozen one as it thaws. Owned by the SyncRunner,
// which outlives its coordinators; thread-safe.
class LateAborts {
 public:
  // At most this many calls in flight (more are dropped, logged: the lease ends those attempts).
  static constexpr size_t kMaxInFlight = 1024;

  explicit LateAborts(const PeerSet& peers) : peers_(peers) {}
  // Cancels the calls still in flight and waits for them to end.
  ~LateAborts();
  LateAborts(const LateAborts&) = delete;
  LateAborts& operator=(const LateAborts&) = delete;

  // Sends `abort` (a FinishRequest with commit false) to `node` at `address`, waiting up to `within`.
  void send(const std::string& node, const std::string& address, const v1::FinishRequest& abort,
            std::chrono::milliseconds within);
  // Calls in flight (for tests).
  size_t inFlight() const;
  // Aborts a daemon took this way (for tests).
  size_t delivered() const;

 private:
  struct Call {
    grpc::ClientContext context;
    v1::FinishRequest request;
    v1::FinishResponse response;
    std::unique_ptr<v1::Peer::Stub> stub;
    std::string node;
    std::chrono::steady_clock::time_point sent;
    bool done = false;     // its callback ran
    bool started = false;  // Finish returned (send() no longer touches it)
  };
  void ended(Call* call, const grpc::Status& st);
  // Frees the calls that have ended (their contexts are not freed inside their own callbacks).
  void reap();

  const PeerSet& peers_;
  mutable std::mutex mu_;
  std::condition_variable ended_;
  bool stopping_ = false;
  size_t delivered_ = 0;
  std::vector<std::unique_ptr<Call>> calls_;
};

}  // namespace shardcast::daemon
