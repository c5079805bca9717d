// The admission check of UCX's incoming connections (ucx_admission.h).
#include "daemon/server/ucx_admission.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/fd_passing.h"
#include "common/strings.h"

namespace shardcast::daemon {
namespace {

IpAddress mapped(const in_addr& v4) {
  IpAddress ip{};
  ip[10] = ip[11] = 0xff;
  std::memcpy(ip.data() + 12, &v4, 4);
  return ip;
}

IpAddress fromV6(const in6_addr& v6) {
  IpAddress ip{};
  std::memcpy(ip.data(), &v6, 16);
  return ip;
}

bool isMappedV4(const IpAddress& ip) {
  return std::all_of(ip.begin(), ip.begin() + 10, [](uint8_t b) { return b == 0; }) && ip[10] == 0xff && ip[11] == 0xff;
}

uint16_t portOf(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return 0;
}

// The IPv4 address of a mapped one.
in_addr unmapped(const IpAddress& ip) {
  in_addr v4;
  std::memcpy(&v4, ip.data() + 12, 4);
  return v4;
}

}  // namespace

bool IpRange::contains(const IpAddress& ip) const {
  for (int bit = 0; bit < prefix; ++bit) {
    const uint8_t mask = static_cast<uint8_t>(0x80 >> (bit % 8));
    if ((ip[bit / 8] & mask) != (base[bit / 8] & mask)) return false;
  }
  return true;
}

StatusOr<IpRange> parseIpRange(const std::string& text) {
  const size_t slash = text.find('/');
  const std::string host = text.substr(0, slash);
  IpRange range;
  int max_prefix = 128;
  in_addr v4;
  in6_addr v6;
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    range.base = mapped(v4);
    max_prefix = 32;
  } else if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    range.base = fromV6(v6);
  } else {
    return absl::InvalidArgumentError(
        strCat("address range ", quote(text), ": ", quote(host), " is not an IPv4 or IPv6 address"));
  }
  int prefix = max_prefix;
  if (slash != std::string::npos) {
    const std::string bits = text.substr(slash + 1);
    if (bits.empty() || bits.size() > 3 || !std::all_of(bits.begin(), bits.end(), ::isdigit) ||
        std::stoi(bits) > max_prefix)
      return absl::InvalidArgumentError(
          strCat("address range ", quote(text), ": the prefix length must be 0 to ", max_prefix));
    prefix = std::stoi(bits);
  }
  range.prefix = prefix + (max_prefix == 32 ? 96 : 0);
  return range;
}

std::optional<IpAddress> ipOf(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return mapped(reinterpret_cast<const sockaddr_in&>(address).sin_addr);
  if (address.ss_family == AF_INET6) return fromV6(reinterpret_cast<const sockaddr_in6&>(address).sin6_addr);
  return std::nullopt;
}

std::optional<IpAddress> ipOfGrpcPeer(const std::string& peer) {
  in_addr v4;
  in6_addr v6;
  if (peer.rfind("ipv4:", 0) == 0) {
    const std::string host = peer.substr(5, peer.rfind(':') - 5);
    if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return mapped(v4);
  } else if (peer.rfind("ipv6:[", 0) == 0) {
    const size_t end = peer.find(']');
    if (end == std::string::npos) return std::nullopt;
    std::string host = peer.substr(6, end - 6);
    host = host.substr(0, host.find('%'));  // a zone ("fe80::1%eth0")
    if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) return fromV6(v6);
  }
  return std::nullopt;
}

std::string toString(const IpAddress& ip) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (isMappedV4(ip))
    ::inet_ntop(AF_INET, ip.data() + 12, text, sizeof(text));
  else
    ::inet_ntop(AF_INET6, ip.data(), text, sizeof(text));
  return text;
}

std::optional<LocalSocket> findLocalSocket(const sockaddr_storage& from, const sockaddr_storage& to) {
  const auto from_ip = ipOf(from), to_ip = ipOf(to);
  if (!from_ip || !to_ip) return std::nullopt;
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } ask{};
  ask.header.nlmsg_len = sizeof(ask);
  ask.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  ask.header.nlmsg_flags = NLM_F_REQUEST;  // one socket, looked up by its four-tuple (no dump)
  inet_diag_req_v2& r = ask.request;
  r.sdiag_protocol = IPPROTO_TCP;
  r.idiag_states = ~0u;
  r.id.idiag_sport = htons(portOf(from));
  r.id.idiag_dport = htons(portOf(to));
  r.id.idiag_cookie[0] = r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  // An IPv4 peer of an IPv6 listener (::ffff:a.b.c.d) connected from an IPv4 socket.
  if (isMappedV4(*from_ip) && isMappedV4(*to_ip)) {
    r.sdiag_family = AF_INET;
    const in_addr src = unmapped(*from_ip), dst = unmapped(*to_ip);
    std::memcpy(r.id.idiag_src, &src, 4);
    std::memcpy(r.id.idiag_dst, &dst, 4);
  } else {
    r.sdiag_family = AF_INET6;
    std::memcpy(r.id.idiag_src, from_ip->data(), 16);
    std::memcpy(r.id.idiag_dst, to_ip->data(), 16);
  }
  const OwnedFd diag(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (diag.get() < 0) return std::nullopt;
  timeval timeout{1, 0};  // the kernel answers at once; never a reason to hold UCX's thread
  ::setsockopt(diag.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  ssize_t sent = 0;
  do {
    sent = ::sendto(diag.get(), &ask, sizeof(ask), 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel));
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) return std::nullopt;
  alignas(nlmsghdr) char reply[8192];
  ssize_t n = 0;
  do {
    n = ::recv(diag.get(), reply, sizeof(reply), 0);
  } while (n < 0 && errno == EINTR);
  if (n < static_cast<ssize_t>(sizeof(nlmsghdr))) return std::nullopt;
  const auto* header = reinterpret_cast<const nlmsghdr*>(reply);
  if (!NLMSG_OK(header, static_cast<size_t>(n)) || header->nlmsg_type != SOCK_DIAG_BY_FAMILY ||
      header->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg)))
    return std::nullopt;  // NLMSG_ERROR (ENOENT): no such socket here
  const auto* msg = reinterpret_cast<const inet_diag_msg*>(NLMSG_DATA(header));
  return LocalSocket{msg->idiag_state, static_cast<uid_t>(msg->idiag_uid), msg->idiag_inode};
}

UcxAdmission& UcxAdmission::instance() {
  static UcxAdmission admission;
  return admission;
}

void UcxAdmission::configure(bool enabled, std::vector<IpRange> allow_from) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = enabled;
  allow_from_ = std::move(allow_from);
}

void UcxAdmission::notePeer(const IpAddress& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!peers_.insert(peer).second) return;
  peer_order_.push_back(peer);
  if (peer_order_.size() > kMaxPeers) {
    peers_.erase(peer_order_.front());
    peer_order_.pop_front();
  }
}

void UcxAdmission::notePeer(const std::string& grpc_peer) {
  if (const auto ip = ipOfGrpcPeer(grpc_peer)) notePeer(*ip);
}

bool UcxAdmission::isOwnAddress(const IpAddress& ip) const {
  if (isMappedV4(ip) && ip[12] == 127) return true;  // 127.0.0.0/8
  IpAddress v6_loopback{};
  v6_loopback[15] = 1;
  if (ip == v6_loopback) return true;
  const auto now = std::chrono::steady_clock::now();
  if (own_at_ == std::chrono::steady_clock::time_point{} || now - own_at_ >= std::chrono::seconds(1)) {
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) != 0) return true;  // unknown: decided by the socket's owner, the stricter rule
    own_.clear();
    for (const ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_addr) continue;
      if (i->ifa_addr->sa_family == AF_INET)
        own_.push_back(mapped(reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr));
      else if (i->ifa_addr->sa_family == AF_INET6)
        own_.push_back(fromV6(reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr));
    }
    ::freeifaddrs(list);
    own_at_ = now;
  }
  return std::find(own_.begin(), own_.end(), ip) != own_.end();
}

bool UcxAdmission::admit(const sockaddr_storage& peer, const sockaddr_storage& local, std::string* why) const {
  const auto ip = ipOf(peer);
  if (!ip) return true;  // not TCP/IP (a Unix socket): not UCX's network listener
  bool own = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) return true;
    own = isOwnAddress(*ip);
    if (!own && peers_.count(*ip)) return true;
    if (!own)
      for (const auto& range : allow_from_)
        if (range.contains(*ip)) return true;
  }
  const std::string who = strCat(toString(*ip), ":", portOf(peer));
  if (!own) {
    *why = strCat(who, " is not an address a daemon of the cluster spoke from (nor in --ucx-allow-from)");
    return false;
  }
  const auto socket = findLocalSocket(peer, local);
  // The kernel names an owner it cannot map in this user namespace with the overflow uid: a daemon
  // running as that uid cannot tell its own sockets from anyone's.
  const bool overflow = ::geteuid() == kOverflowUid;
  if (socket && socket->state == kTcpEstablished && socket->inode != 0 && socket->uid == ::geteuid() && !overflow)
    return true;
  *why = overflow ? strCat(who, ": this daemon runs as the overflow uid (", kOverflowUid,
                           "), which cannot tell its own sockets from another user's")
         : !socket || socket->inode == 0
             ? strCat(who, " is an address of this host, and no open socket there names its owner")
         : socket->uid != ::geteuid()
             ? strCat(who, " is a socket of uid ", socket->uid, ", not this daemon's (uid ", ::geteuid(), ")")
             : strCat(who, " is a socket of this daemon's uid that is not established (state ",
                      static_cast<int>(socket->state), ")");
  return false;
}

void UcxAdmission::countRefusal(const std::string& why) {
  const uint64_t n = ++refused_;
  // The first few, then one in a thousand: a flood of connections cannot fill the log either.
  if (n <= 8 || n % 1000 == 0)
    spdlog::warn("UCX: refused a connection before UCX read from it: {} ({} refused so far)", why, n);
}

}  // namespace shardcast::daemon
