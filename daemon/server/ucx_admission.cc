// The admission check of UCX's incoming connections (ucx_admission.h).
#include "daemon/server/ucx_admission.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

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

// One "address:port" column of /proc/net/tcp{,6}: the address as the kernel holds it in memory,
// printed a 32-bit word at a time in this host's byte order, then the port in hex.
std::optional<std::pair<IpAddress, uint16_t>> parseEnd(const std::string& column) {
  const size_t colon = column.find(':');
  if (colon == std::string::npos || (colon != 8 && colon != 32)) return std::nullopt;
  std::vector<uint8_t> bytes;
  for (size_t w = 0; w < colon; w += 8) {
    uint32_t word = 0;
    try {
      word = static_cast<uint32_t>(std::stoul(column.substr(w, 8), nullptr, 16));
    } catch (const std::exception&) {
      return std::nullopt;
    }
    uint8_t in_memory[4];
    std::memcpy(in_memory, &word, 4);
    bytes.insert(bytes.end(), in_memory, in_memory + 4);
  }
  IpAddress ip{};
  if (bytes.size() == 4) {
    in_addr v4;
    std::memcpy(&v4, bytes.data(), 4);
    ip = mapped(v4);
  } else {
    std::memcpy(ip.data(), bytes.data(), 16);
  }
  unsigned long port = 0;
  try {
    port = std::stoul(column.substr(colon + 1), nullptr, 16);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (port > 0xffff) return std::nullopt;
  return std::make_pair(ip, static_cast<uint16_t>(port));
}

// Whether `ip` is one of this host's (this network namespace's) own addresses.
bool isOwnAddress(const IpAddress& ip) {
  if (isMappedV4(ip) && ip[12] == 127) return true;  // 127.0.0.0/8
  static const IpAddress kV6Loopback = [] {
    IpAddress a{};
    a[15] = 1;
    return a;
  }();
  if (ip == kV6Loopback) return true;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return true;  // unknown: treated as local, decided by the socket's owner
  bool own = false;
  for (const ifaddrs* i = list; i && !own; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    if (i->ifa_addr->sa_family == AF_INET)
      own = mapped(reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr) == ip;
    else if (i->ifa_addr->sa_family == AF_INET6)
      own = fromV6(reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr) == ip;
  }
  ::freeifaddrs(list);
  return own;
}

std::string readFile(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
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

std::optional<uid_t> localSocketOwner(const std::string& table, const sockaddr_storage& from,
                                      const sockaddr_storage& to) {
  const auto from_ip = ipOf(from), to_ip = ipOf(to);
  if (!from_ip || !to_ip) return std::nullopt;
  std::istringstream lines(table);
  std::string line;
  std::getline(lines, line);  // the header
  while (std::getline(lines, line)) {
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
    std::istringstream f(line);
    std::string sl, local, remote, state, queues, timer, retransmits, uid;
    if (!(f >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid)) continue;
    const auto l = parseEnd(local), r = parseEnd(remote);
    if (!l || !r || l->first != *from_ip || l->second != portOf(from) || r->first != *to_ip || r->second != portOf(to))
      continue;
    if (state == "06") return std::nullopt;  // TIME_WAIT: the kernel names no owner (uid 0)
    try {
      return static_cast<uid_t>(std::stoul(uid));
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
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

bool UcxAdmission::admit(const sockaddr_storage& peer, const sockaddr_storage& local, std::string* why) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) return true;
  }
  const auto ip = ipOf(peer);
  if (!ip) return true;  // not TCP/IP (a Unix socket): not UCX's network listener
  const std::string who = strCat(toString(*ip), ":", portOf(peer));
  if (isOwnAddress(*ip)) {
    const std::string table = readFile(peer.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6");
    const auto owner = localSocketOwner(table, peer, local);
    if (owner && (*owner == ::geteuid() || *owner == 0)) return true;
    *why = owner ? strCat(who, " is a socket of uid ", *owner, ", not this daemon's (uid ", ::geteuid(), ")")
                 : strCat(who, " is an address of this host, and no live socket there names its owner");
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (peers_.count(*ip)) return true;
  for (const auto& range : allow_from_)
    if (range.contains(*ip)) return true;
  *why = strCat(who, " is not an address a daemon of the cluster spoke from (nor in --ucx-allow-from)");
  return false;
}

void UcxAdmission::countRefusal(const std::string& why) {
  const uint64_t n = ++refused_;
  // The first few, then one in a thousand: a flood of connections cannot fill the log either.
  if (n <= 8 || n % 1000 == 0)
    spdlog::warn("UCX: refused a connection before UCX read from it: {} ({} refused so far)", why, n);
}

}  // namespace shardcast::daemon
