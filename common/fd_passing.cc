// The side channel's wire format, both ends (common/fd_passing.h).
#include "common/fd_passing.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/strings.h"

namespace shardcast {

namespace {
constexpr char kMagic[4] = {'S', 'C', 'F', 'D'};
constexpr size_t kHeaderBytes = 8;

Status errnoStatus(const std::string& what, int err) {
  return absl::UnavailableError(strCat(what, ": ", std::strerror(err)));
}
}  // namespace

OwnedFd& OwnedFd::operator=(OwnedFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

std::string fdChannelPath(const std::string& socket) { return socket + ".fds"; }

StatusOr<std::string> handOverFds(const std::string& channel_path, const std::vector<int>& fds,
                                  const std::vector<uint32_t>& daemon_uids) {
  if (fds.empty() || fds.size() > static_cast<size_t>(kMaxHandedFds))
    return absl::InvalidArgumentError(strCat(fds.size(), " descriptors to hand over (1 to ", kMaxHandedFds, ")"));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (channel_path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(strCat("socket path ", quote(channel_path), " is too long"));
  std::memcpy(addr.sun_path, channel_path.c_str(), channel_path.size() + 1);
  OwnedFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.get() < 0) return errnoStatus("socket", errno);
  if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0)
    return errnoStatus(strCat("connect to the daemon's descriptor channel ", quote(channel_path)), errno);
  ucred peer{};
  socklen_t len = sizeof(peer);
  if (::getsockopt(s.get(), SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) return errnoStatus("SO_PEERCRED", errno);
  if (peer.uid != 0 && peer.uid != ::getuid() &&
      std::find(daemon_uids.begin(), daemon_uids.end(), peer.uid) == daemon_uids.end())
    return absl::PermissionDeniedError(strCat("the descriptor channel ", quote(channel_path), " is served by uid ",
                                              peer.uid, " (pid ", peer.pid,
                                              "), not by root, this process's uid or a daemon uid allowed: not "
                                              "handing it descriptors"));
  // The answer comes at once unless the channel is busy with other connections: a bounded wait.
  const timeval wait{kAnswerWaitSeconds, 0};
  ::setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
  char header[kHeaderBytes] = {
      kMagic[0], kMagic[1], kMagic[2], kMagic[3], static_cast<char>(kFdChannelVersion), static_cast<char>(fds.size()),
      0,         0};
  iovec iov{header, kHeaderBytes};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  ssize_t sent;
  do sent = ::sendmsg(s.get(), &msg, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  if (sent != static_cast<ssize_t>(kHeaderBytes)) return errnoStatus("sendmsg to the descriptor channel", errno);
  std::string answer;
  char buf[512];
  while (answer.find('\n') == std::string::npos && answer.size() < 4096) {
    const ssize_t n = ::read(s.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return absl::DeadlineExceededError(strCat("the daemon's descriptor channel ", quote(channel_path),
                                                " did not answer within ", kAnswerWaitSeconds, " s"));
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  const auto eol = answer.find('\n');
  if (eol == std::string::npos)
    return absl::UnavailableError("the daemon's descriptor channel closed without an answer");
  answer.resize(eol);
  if (answer.rfind("ok ", 0) == 0) return answer.substr(3);
  if (answer.rfind("error ", 0) == 0) return absl::InvalidArgumentError(answer.substr(6));
  return absl::UnavailableError(strCat("the daemon's descriptor channel answered ", quote(answer)));
}

StatusOr<std::vector<OwnedFd>> receiveHandedFds(int connection) {
  char header[kHeaderBytes];
  iovec iov{header, kHeaderBytes};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxHandedFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do n = ::recvmsg(connection, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  while (n < 0 && errno == EINTR);
  if (n < 0) return errnoStatus("recvmsg", errno);
  // Owned at once: whatever else is wrong with the message, none of them stays open here.
  std::vector<OwnedFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      // A socket handed over with a long SO_LINGER and unsent data would block the close() that
      // ends it here (on the channel's thread): closed at once instead, whatever its sender set.
      // (Not a socket: ENOTSOCK, nothing changes.)
      const linger now{1, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &now, sizeof(now));
      fds.emplace_back(fd);
    }
  }
  if (n != static_cast<ssize_t>(kHeaderBytes) || std::memcmp(header, kMagic, sizeof(kMagic)) != 0)
    return absl::InvalidArgumentError("not a descriptor-channel message (expected \"SCFD\", a version and a count)");
  if (static_cast<uint8_t>(header[4]) != kFdChannelVersion)
    return absl::InvalidArgumentError(strCat("descriptor-channel version ", static_cast<int>(header[4]),
                                             " (this daemon reads version ", static_cast<int>(kFdChannelVersion), ")"));
  if (msg.msg_flags & MSG_CTRUNC)
    return absl::InvalidArgumentError(strCat("more than ", kMaxHandedFds, " descriptors in one message"));
  const size_t count = static_cast<uint8_t>(header[5]);
  if (count == 0 || count != fds.size())
    return absl::InvalidArgumentError(strCat("the message counts ", count, " descriptors but carries ", fds.size()));
  return fds;
}

void answerHandedFds(int connection, const StatusOr<std::string>& token) {
  std::string line = token.ok() ? strCat("ok ", *token) : strCat("error ", token.status().message());
  for (char& c : line)
    if (c == '\n') c = ' ';
  line += '\n';
  (void)::send(connection, line.data(), line.size(), MSG_NOSIGNAL);
}

}  // namespace shardcast
