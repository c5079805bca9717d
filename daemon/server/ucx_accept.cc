// The process's accept(): UCX's listeners (its tcp interface, a tcp sockcm) accept through it, and
// a connection UcxAdmission refuses is closed before UCX reads a byte. Linked into shardcastd only,
// and exported from it (daemon/CMakeLists.txt), so that libucs's calls resolve here before libc.
// The daemon's own listeners call accept4(), which this leaves alone.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "daemon/server/ucx_admission.h"

extern "C" int accept(int fd, sockaddr* address, socklen_t* length) {
  // A blocking listener is no UCX one (UCX's are non-blocking): passed through, so that a refusal
  // never turns into waiting for the next connection.
  const int flags = ::fcntl(fd, F_GETFL);
  const bool filtered = flags >= 0 && (flags & O_NONBLOCK);
  while (true) {
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    const int c = ::accept4(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length, 0);
    if (c < 0 || !filtered) {
      if (c >= 0 && address && length) {
        std::memcpy(address, &peer, std::min<socklen_t>(*length, peer_length));
        *length = peer_length;
      }
      return c;
    }
    sockaddr_storage local{};
    socklen_t local_length = sizeof(local);
    std::string why;
    // Still established after the lookup: a sender that reset its connection meanwhile may have
    // left its four-tuple to another socket, which the lookup would have named instead.
    const auto established = [c] {
      tcp_info info{};
      socklen_t info_length = sizeof(info);
      return ::getsockopt(c, IPPROTO_TCP, TCP_INFO, &info, &info_length) == 0 &&
             info.tcpi_state == shardcast::daemon::kTcpEstablished;
    };
    if (::getsockname(c, reinterpret_cast<sockaddr*>(&local), &local_length) == 0 &&
        shardcast::daemon::UcxAdmission::instance().admit(peer, local, &why) &&
        (established() || (why = "the connection closed while it was looked up", false))) {
      if (address && length) {
        std::memcpy(address, &peer, std::min<socklen_t>(*length, peer_length));
        *length = peer_length;
      }
      return c;
    }
    ::close(c);
    shardcast::daemon::UcxAdmission::instance().countRefusal(why.empty() ? "getsockname failed" : why);
    // The next pending connection, if any; else EAGAIN, as for an empty queue (UCX closes its
    // listener on any other error).
  }
}
