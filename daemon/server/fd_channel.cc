// The descriptor side channel's listener (daemon/server/fd_channel.h).
#include "daemon/server/fd_channel.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/fd_passing.h"
#include "common/strings.h"

namespace shardcast::daemon {

StatusOr<std::unique_ptr<FdChannel>> FdChannel::bind(const std::string& path, HandedFds& handed) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(
        strCat("descriptor channel ", quote(path), " is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  // Non-blocking: a connection that went away between poll and accept never blocks the loop.
  OwnedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return absl::InternalError(strCat("socket(AF_UNIX): ", std::strerror(errno)));
  ::unlink(path.c_str());            // a stale one of an earlier run (the caller holds the socket's lock)
  const mode_t old = ::umask(0117);  // 0660 from the start, as the socket
  const int rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::umask(old);
  if (rc != 0 || ::listen(fd.get(), SOMAXCONN) != 0)
    return absl::UnavailableError(strCat("cannot listen on unix:", path, ": ", std::strerror(rc != 0 ? err : errno)));
  const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) return absl::InternalError(strCat("eventfd: ", std::strerror(errno)));
  return std::unique_ptr<FdChannel>(new FdChannel(path, fd.release(), wake, handed));
}

FdChannel::FdChannel(std::string path, int fd, int wake, HandedFds& handed)
    : path_(std::move(path)), fd_(fd), wake_(wake), handed_(handed) {}

FdChannel::~FdChannel() {
  stop();
  ::close(fd_);
  ::close(wake_);
  ::unlink(path_.c_str());
}

void FdChannel::serve() {
  thread_ = std::thread([this] { run(); });
}

void FdChannel::stop() {
  const uint64_t one = 1;
  if (::write(wake_, &one, sizeof(one)) < 0) {
    // The eventfd cannot be full: one write is enough to wake the loop.
  }
  if (thread_.joinable()) thread_.join();
}

void FdChannel::run() {
  pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_, POLLIN, 0}};
  while (true) {
    const int ready = ::poll(fds, 2, kSweepEveryMs);
    if (ready < 0) {
      if (errno == EINTR) continue;
      spdlog::error("unix:{}: poll: {}", path_, std::strerror(errno));
      return;
    }
    if (ready == 0) {  // idle: tokens unclaimed too long are closed now, not at the next hand-over
      handed_.sweep();
      continue;
    }
    if (fds[1].revents) return;
    OwnedFd c(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC));  // blocking: answered under SO_RCVTIMEO
    if (c.get() < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("unix:{}: accept: {}", path_, std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // EMFILE: do not spin
      }
      continue;
    }
    answer(c.get());
  }
}

void FdChannel::answer(int connection) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    answerHandedFds(connection, absl::InternalError(strCat("SO_PEERCRED: ", std::strerror(errno))));
    return;
  }
  // A sender that connects and says nothing holds this loop for kMessageWaitMs at most.
  timeval wait{kMessageWaitMs / 1000, (kMessageWaitMs % 1000) * 1000};
  ::setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  auto fds = receiveHandedFds(connection);
  if (!fds.ok()) {
    spdlog::warn("unix:{}: uid {} (pid {}): {}", path_, cred.uid, cred.pid, std::string(fds.status().message()));
    answerHandedFds(connection, fds.status());
    return;
  }
  const size_t n = fds->size();
  auto token = handed_.put(cred.uid, std::move(*fds));
  spdlog::debug("unix:{}: uid {} (pid {}) handed over {} descriptor(s)", path_, cred.uid, cred.pid, n);
  answerHandedFds(connection, token);
}

}  // namespace shardcast::daemon
