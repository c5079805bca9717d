// File descriptors handed from a local client to the daemon with SCM_RIGHTS, on the side channel
// beside the daemon's Unix socket (`<socket>.fds`): how cuMem allocations (torch's expandable
// segments) reach the daemon, since gRPC cannot carry descriptors. docs/security.md has the protocol.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace shardcast {

// One owned descriptor, closed on destruction.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& o) noexcept : fd_(o.release()) {}
  OwnedFd& operator=(OwnedFd&& o) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// The protocol, version 1. The client connects (SOCK_STREAM) and sends one message: the 8 bytes
// "SCFD", version (1), count (1 to kMaxHandedFds), two zero bytes, with exactly `count`
// descriptors attached (SCM_RIGHTS). The daemon answers one line, "ok <token>\n" (32 hex digits,
// random, for one registration of the sender's uid) or "error <why>\n", and closes.
inline constexpr uint8_t kFdChannelVersion = 1;
inline constexpr int kMaxHandedFds = 64;
// How long a client waits for the daemon's answer (it may wait behind other connections).
inline constexpr int kAnswerWaitSeconds = 10;
std::string fdChannelPath(const std::string& socket);

// Client side: hands `fds` (duplicated by the kernel; the caller keeps its own) to the daemon
// whose side channel is `channel_path`; returns the token a registration names them by. The
// process serving the channel must run as root, as this process's uid or as one of
// `daemon_uids` (SO_PEERCRED, checked before anything is sent): a process that took the
// daemon's place on the path never receives the descriptors (PERMISSION_DENIED).
StatusOr<std::string> handOverFds(const std::string& channel_path, const std::vector<int>& fds,
                                  const std::vector<uint32_t>& daemon_uids = {});

// Daemon side, on an accepted connection: the descriptors of one message (every descriptor that
// arrived is closed unless returned), then the answer.
StatusOr<std::vector<OwnedFd>> receiveHandedFds(int connection);
void answerHandedFds(int connection, const StatusOr<std::string>& token);

}  // namespace shardcast
