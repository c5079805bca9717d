// The side channel beside the daemon's Unix socket (`<socket>.fds`): local clients hand over the
// POSIX file descriptors of cuMem allocations (torch's expandable segments) with SCM_RIGHTS, which
// gRPC cannot carry, and get a one-time token that their registration names (common/fd_passing.h
// has the protocol; docs/security.md the rules). The sender's uid is the kernel's word
// (SO_PEERCRED); the token is good for that uid's registrations only.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/registry/handed_fds.h"

namespace shardcast::daemon {

class FdChannel {
 public:
  // Binds `path` (mode 0660, as the socket; an existing file there is replaced: the caller holds
  // the socket's lock).
  static StatusOr<std::unique_ptr<FdChannel>> bind(const std::string& path, HandedFds& handed);
  ~FdChannel();

  // Serves connections one at a time on a thread of its own: each sends one message within
  // kMessageWait and is answered at once.
  void serve();
  void stop();
  const std::string& path() const { return path_; }

  static constexpr int kMessageWaitMs = 1000;
  static constexpr int kSweepEveryMs = 30000;  // idle: expired tokens closed (HandedFds::sweep)

 private:
  FdChannel(std::string path, int fd, int wake, HandedFds& handed);
  void run();
  void answer(int connection);

  std::string path_;
  int fd_ = -1;
  int wake_ = -1;  // eventfd that ends the accept loop
  HandedFds& handed_;
  std::thread thread_;
};

}  // namespace shardcast::daemon
