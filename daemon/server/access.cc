#include "daemon/server/access.h"

#include <arpa/inet.h>
#include <grpcpp/server_posix.h>
#include <linux/tcp.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/strings.h"
#include "common/tls.h"
#include "daemon/server/ucx_admission.h"
#include "planner/limits.h"

namespace shardcast::daemon {

namespace {

bool startsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Equal without revealing, by the time taken, how long a common prefix was.
bool sameSecret(const std::string& given, const std::string& secret) {
  if (given.size() != secret.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < given.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ secret[i]);
  return diff == 0;
}

std::vector<std::string> property(const grpc::AuthContext& auth, const char* name) {
  std::vector<std::string> out;
  for (const auto& v : auth.FindPropertyValues(name)) out.emplace_back(v.data(), v.size());
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<LocalListener>> LocalListener::bind(const std::string& path, int max_per_uid) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(
        strCat("--socket ", quote(path), " is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(strCat("socket(AF_UNIX): ", std::strerror(errno)));
  ::unlink(path.c_str());  // a stale socket of an earlier run (the caller holds the lock)
  // 0660 from the start (umask), not after a window in which others could connect.
  const mode_t old = ::umask(0117);
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::umask(old);
  // The longest queue the kernel allows (net.core.somaxconn): a burst of connections waits there
  // while the accept loop drains it.
  if (rc != 0 || ::listen(fd, SOMAXCONN) != 0) {
    ::close(fd);
    return absl::UnavailableError(strCat("cannot listen on unix:", path, ": ", std::strerror(rc != 0 ? err : errno)));
  }
  const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    ::close(fd);
    return absl::InternalError(strCat("eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<LocalListener>(new LocalListener(path, fd, wake, max_per_uid));
}

LocalListener::LocalListener(std::string path, int fd, int wake, int max_per_uid)
    : path_(std::move(path)), fd_(fd), wake_(wake), max_per_uid_(max_per_uid) {}

int LocalListener::liveConnections(uid_t uid) {
  int n = 0;
  for (auto it = connections_.begin(); it != connections_.end();) {
    struct stat st {};
    if (::fstat(it->first, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != it->second.inode) {
      it = connections_.erase(it);
      continue;
    }
    n += it->second.cred.uid == uid;
    ++it;
  }
  return n;
}

bool LocalListener::connectAllowed(uid_t uid) {
  const auto now = std::chrono::steady_clock::now();
  if (rates_.size() > 4096) rates_.clear();  // uids are few: a flood of them starts over, never grows
  auto [it, added] = rates_.try_emplace(uid, Rate{kConnectBurst, now});
  Rate& r = it->second;
  if (!added) {
    const double seconds = std::chrono::duration<double>(now - r.at).count();
    r.tokens = std::min<double>(kConnectBurst, r.tokens + seconds * kConnectsPerSecond);
    r.at = now;
  }
  if (r.tokens < 1) return false;
  r.tokens -= 1;
  return true;
}

LocalListener::~LocalListener() {
  stop();
  ::close(fd_);
  ::close(wake_);
}

void LocalListener::serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { run(server); });
}

void LocalListener::stop() {
  const uint64_t one = 1;
  if (::write(wake_, &one, sizeof(one)) < 0) {
    // The eventfd cannot be full: one write is enough to wake the loop.
  }
  if (thread_.joinable()) thread_.join();
}

void LocalListener::run(grpc::Server* server) {
  pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_, POLLIN, 0}};
  while (true) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("unix:{}: poll: {}", path_, std::strerror(errno));
      return;
    }
    if (fds[1].revents) return;
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("unix:{}: accept: {}", path_, std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // EMFILE: do not spin
      }
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      spdlog::warn("unix:{}: SO_PEERCRED: {}; connection refused", path_, std::strerror(errno));
      ::close(c);
      continue;
    }
    struct stat st {};
    ::fstat(c, &st);
    // A uid connecting faster than kConnectsPerSecond (after a burst of kConnectBurst) has the
    // excess closed here, before gRPC sets up a transport for it: one uid reconnecting in a loop
    // costs this loop an accept and a close each, and the queue keeps draining for the others.
    if (cred.uid != 0 && !connectAllowed(cred.uid)) {
      if (++refused_ <= 8 || refused_ % 1000 == 0)
        spdlog::warn("unix:{}: uid {} (pid {}) connects more than {} times a second: one more refused ({} so far)",
                     path_, cred.uid, cred.pid, kConnectsPerSecond, refused_);
      ::close(c);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cred.uid != 0 && liveConnections(cred.uid) >= max_per_uid_) {
        // The first few, then one in a thousand: a flood of connections cannot fill the log either.
        if (++refused_ <= 8 || refused_ % 1000 == 0)
          spdlog::warn("unix:{}: uid {} (pid {}) already holds {} connections: one more refused ({} so far)", path_,
                       cred.uid, cred.pid, max_per_uid_, refused_);
        ::close(c);
        continue;
      }
      connections_[c] = {cred, st.st_ino};
    }
    grpc::AddInsecureChannelFromFd(server, c);  // gRPC owns the descriptor from here
  }
}

StatusOr<std::unique_ptr<TcpListener>> TcpListener::bind(const std::string& listen, int max_per_address,
                                                         int max_handshaking) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 == listen.size())
    return absl::InvalidArgumentError(strCat("--listen ", quote(listen), ": not host:port"));
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return absl::InvalidArgumentError(strCat("--listen ", quote(listen), ": ", ::gai_strerror(rc)));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> hold(found, &::freeaddrinfo);
  std::string why = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // a restart reuses its port at once
    if (a->ai_family == AF_INET6) {
      const int zero = 0;  // "[::]" also takes IPv4, as gRPC's own listener does
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    const int bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    const int wake = ::eventfd(0, EFD_CLOEXEC);
    if (wake < 0) {
      ::close(fd);
      return absl::InternalError(strCat("eventfd: ", std::strerror(errno)));
    }
    return std::unique_ptr<TcpListener>(
        new TcpListener(listen, fd, wake, bound_port, max_per_address, max_handshaking));
  }
  return absl::UnavailableError(strCat("cannot listen on ", listen, ": ", why));
}

TcpListener::TcpListener(std::string listen, int fd, int wake, int port, int max_per_address, int max_handshaking)
    : listen_(std::move(listen)),
      fd_(fd),
      wake_(wake),
      port_(port),
      max_per_address_(max_per_address),
      max_handshaking_(max_handshaking) {}

TcpListener::~TcpListener() {
  stop();
  ::close(fd_);
  ::close(wake_);
}

void TcpListener::serve(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor) {
  acceptor_ = std::move(acceptor);
  thread_ = std::thread([this] { run(); });
}

void TcpListener::stop() {
  const uint64_t one = 1;
  if (::write(wake_, &one, sizeof(one)) < 0) {
    // The eventfd cannot be full: one write is enough to wake the loop.
  }
  if (thread_.joinable()) thread_.join();
}

int TcpListener::liveConnections(const std::string& address) {
  int n = 0;
  for (auto it = connections_.begin(); it != connections_.end();) {
    struct stat st {};
    if (::fstat(it->first, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_ino != it->second.inode) {
      it = connections_.erase(it);
      continue;
    }
    n += it->second.address == address;
    ++it;
  }
  return n;
}

// Whether the connection on `fd` has received no byte yet: one that sent a TLS ClientHello, let
// alone finished its handshake, is never taken for a silent one.
bool silentSoFar(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 ||
      len < offsetof(tcp_info, tcpi_bytes_received) + sizeof(info.tcpi_bytes_received))
    return false;
  return info.tcpi_bytes_received == 0;
}

bool TcpListener::makeRoomForHandshake() {
  const auto young = std::chrono::steady_clock::now() - kHandshakeTimeout;
  std::vector<std::map<int, Connection>::iterator> within;  // accepted within the window, oldest first
  for (auto it = connections_.begin(); it != connections_.end(); ++it)
    if (it->second.accepted >= young) within.push_back(it);
  if (static_cast<int>(within.size()) < max_handshaking_) return true;
  std::sort(within.begin(), within.end(), [](auto a, auto b) { return a->second.accepted < b->second.accepted; });
  // The oldest that has sent nothing at all (a silent connection, no handshake begun) is shut down,
  // not closed: its descriptor is gRPC's. Still the socket accepted here and from its address (gRPC
  // may have closed it since, and the number been reused).
  for (const auto& it : within) {
    struct stat st {};
    if (::fstat(it->first, &st) != 0 || st.st_ino != it->second.inode || !silentSoFar(it->first)) continue;
    ::shutdown(it->first, SHUT_RDWR);
    if (++evicted_ <= 8 || evicted_ % 1000 == 0)
      spdlog::warn(
          "{}: {} connections accepted within {} ms: the oldest silent one, from {}, shut down to make "
          "room ({} so far)",
          listen_, within.size(), kHandshakeTimeout.count(), it->second.address, evicted_);
    connections_.erase(it);
    return true;
  }
  return false;  // every one of them has begun its handshake: the new connection waits its turn
}

void TcpListener::run() {
  pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_, POLLIN, 0}};
  while (true) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("{}: poll: {}", listen_, std::strerror(errno));
      return;
    }
    if (fds[1].revents) return;
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    const int c = ::accept4(fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("{}: accept: {}", listen_, std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // EMFILE: do not spin
      }
      continue;
    }
    char host[INET6_ADDRSTRLEN] = "?";
    if (peer.ss_family == AF_INET)
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&peer)->sin_addr, host, sizeof(host));
    else if (peer.ss_family == AF_INET6)
      ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&peer)->sin6_addr, host, sizeof(host));
    const std::string address = host;
    if (liveConnections(address) >= max_per_address_) {
      // The first few, then one in a thousand: a flood cannot fill the log either.
      if (++refused_ <= 8 || refused_ % 1000 == 0)
        spdlog::warn("{}: {} already holds {} connections: one more refused ({} so far)", listen_, address,
                     max_per_address_, refused_);
      ::close(c);
      continue;
    }
    if (!makeRoomForHandshake()) {
      if (++refused_ <= 8 || refused_ % 1000 == 0)
        spdlog::warn("{}: {} connections are in their handshake: one more, from {}, refused ({} so far)", listen_,
                     max_handshaking_, address, refused_);
      ::close(c);
      continue;
    }
    struct stat st {};
    ::fstat(c, &st);
    connections_[c] = {address, st.st_ino, std::chrono::steady_clock::now()};
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters params;
    params.listener_fd = fd_;
    params.fd = c;
    acceptor_->HandleNewConnection(&params);  // gRPC owns the descriptor from here
  }
}

std::optional<ucred> LocalListener::credentials(const std::string& peer) const {
  if (!startsWith(peer, "fd:")) return std::nullopt;
  int fd = -1;
  try {
    fd = std::stoi(peer.substr(3));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = connections_.find(fd);
  if (it == connections_.end()) return std::nullopt;
  // Still the socket accepted here (a descriptor reused for another connection is not ours).
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_ino != it->second.inode) return std::nullopt;
  return it->second.cred;
}

MemoryCaller Caller::memory(bool insecure) const {
  MemoryCaller m;
  if (local) {
    m.uid = local->uid;
    m.local = true;
    m.any_owner = local->uid == 0;
    m.pid = local->pid;
  } else {
    m.any_owner = insecure;
  }
  return m;
}

StatusOr<Caller> AccessPolicy::identify(const grpc::ServerContext& ctx) const {
  Caller c;
  const std::string peer = ctx.peer();
  if (local_) c.local = local_->credentials(peer);
  if (c.local) {
    c.authenticated = true;
    c.who = strCat("uid ", c.local->uid, " (pid ", c.local->pid, ")");
    return c;
  }
  c.who = peer;
  if (const auto auth = ctx.auth_context(); auth && auth->IsPeerAuthenticated()) {
    const auto cn = property(*auth, GRPC_X509_CN_PROPERTY_NAME);
    c.authenticated = true;
    c.who = strCat("certificate CN=", cn.empty() ? "?" : cn[0], " at ", peer);
    return c;
  }
  if (!token_.empty()) {
    const auto& md = ctx.client_metadata();
    for (auto [it, end] = md.equal_range("authorization"); it != end; ++it) {
      const std::string value(it->second.data(), it->second.size());
      if (startsWith(value, "Bearer ") && sameSecret(value.substr(7), token_)) {
        c.authenticated = true;
        c.who = strCat("token at ", peer);
        return c;
      }
    }
  }
  if (insecure_) return c;
  return absl::UnauthenticatedError(
      strCat("caller ", peer,
             " is not authenticated: over TCP a client needs a certificate of the cluster CA "
             "(SHARDCAST_TLS_CERT/KEY/CA)",
             token_.empty() ? "" : " or the bearer token", "; local clients use the Unix socket"));
}

Status AccessPolicy::isDaemon(const grpc::ServerContext& ctx) const {
  const std::string peer = ctx.peer();
  // A daemon's UCX connections come from where it calls from: UCX's listeners take them.
  if (insecure_) {
    UcxAdmission::instance().notePeer(peer);
    return absl::OkStatus();
  }
  if (local_ && local_->credentials(peer))
    return absl::PermissionDeniedError("the Peer service is for daemons over TCP, not for local clients");
  const auto auth = ctx.auth_context();
  if (auth && auth->IsPeerAuthenticated())
    for (const auto& dns : property(*auth, GRPC_PEER_DNS_PROPERTY_NAME))  // DNS names only, not URI or IP SANs
      if (dns == kDaemonIdentity) {
        UcxAdmission::instance().notePeer(peer);
        return absl::OkStatus();
      }
  return absl::PermissionDeniedError(strCat("caller ", peer,
                                            " is not a daemon of this cluster (its certificate does not "
                                            "name ",
                                            kDaemonIdentity, ")"));
}

StatusOr<Caller> AccessPolicy::client(const grpc::ServerContext& ctx, const google::protobuf::Message& request) const {
  SC_ASSIGN_OR_RETURN(Caller caller, identify(ctx));
  SC_RETURN_IF_ERROR(planner::checkStringLengths(request));
  return caller;
}

Status AccessPolicy::peer(const grpc::ServerContext& ctx, const google::protobuf::Message& request) const {
  SC_RETURN_IF_ERROR(isDaemon(ctx));
  return planner::checkStringLengths(request);
}

}  // namespace shardcast::daemon
