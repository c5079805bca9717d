// Who may open a TCP connection to UCX's own listeners (its tcp interface, a tcp sockcm). UCX has
// no authentication and parses a connecting peer's wire-up with asserting code (an unknown address
// version aborts the process), so the daemon decides before UCX reads a byte (docs/security.md,
// "UCX's connection handshake"): ucx_accept.cc puts this check into every accept() UCX makes.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace shardcast::daemon {

// An IP address, IPv4 as IPv4-mapped IPv6 (::ffff:a.b.c.d).
using IpAddress = std::array<uint8_t, 16>;

// 10.0.0.0/8, fd00::/8, or one address (a /32 or /128).
struct IpRange {
  IpAddress base{};
  int prefix = 128;  // of the mapped IPv6 form
  bool contains(const IpAddress& ip) const;
};
StatusOr<IpRange> parseIpRange(const std::string& text);

// The address of an AF_INET or AF_INET6 socket address; nullopt for any other family.
std::optional<IpAddress> ipOf(const sockaddr_storage& address);
// "ipv4:10.0.0.1:5000" or "ipv6:[::1]:5000" (gRPC's peer strings); nullopt for others ("unix:...").
std::optional<IpAddress> ipOfGrpcPeer(const std::string& peer);
std::string toString(const IpAddress& ip);

// The TCP socket of this network namespace whose own end is `from` and whose peer is `to`, as the
// kernel reports it (NETLINK_SOCK_DIAG, an exact lookup): its state (kTcpEstablished, ...), owner
// and inode (0 for a socket already closed: a TIME_WAIT or FIN_WAIT2 remnant, which reports uid 0
// and owns nothing). nullopt when there is none.
inline constexpr uint8_t kTcpEstablished = 1;  // the kernel's TCP_ESTABLISHED (net/tcp_states.h)
inline constexpr uid_t kOverflowUid = 65534;   // the kernel's default overflowuid: an owner it cannot map
struct LocalSocket {
  uint8_t state = 0;
  uid_t uid = 0;
  uint32_t inode = 0;
};
std::optional<LocalSocket> findLocalSocket(const sockaddr_storage& from, const sockaddr_storage& to);

class UcxAdmission {
 public:
  // The one the process's accept() consults.
  static UcxAdmission& instance();

  // `enabled`: false admits every connection (--ucx-accept=any). `allow_from`: ranges admitted
  // besides the cluster's daemons (--ucx-allow-from: a NIC UCX uses that the daemons' gRPC
  // traffic does not).
  void configure(bool enabled, std::vector<IpRange> allow_from);

  // A daemon of the cluster talked to this one from (or answered at) `peer`, over the
  // authenticated control plane: its UCX connections come from there too. Remembers at most
  // kMaxPeers addresses (the oldest forgotten first).
  void notePeer(const IpAddress& peer);
  void notePeer(const std::string& grpc_peer);

  // Whether a connection from `peer` to `local` may reach UCX. From an address of this host
  // (loopback, or an interface's): only an open, established socket of this daemon's uid, whatever
  // the address (a socket already closed names no owner). From elsewhere: an address a daemon of
  // the cluster spoke from, or one of --ucx-allow-from. `why` (when refused): who it is and why not.
  bool admit(const sockaddr_storage& peer, const sockaddr_storage& local, std::string* why) const;

  // Connections refused so far (the log says the first few, then one in a thousand).
  uint64_t refused() const { return refused_.load(); }
  void countRefusal(const std::string& why);

  static constexpr size_t kMaxPeers = 65536;

 private:
  mutable std::mutex mu_;
  bool enabled_ = false;  // until the daemon configures it: tests and tools link UCX without it
  std::vector<IpRange> allow_from_;
  std::set<IpAddress> peers_;
  std::deque<IpAddress> peer_order_;  // oldest first, for forgetting
  std::atomic<uint64_t> refused_{0};
  // This host's addresses (getifaddrs), looked up at most once a second.
  mutable std::vector<IpAddress> own_;
  mutable std::chrono::steady_clock::time_point own_at_{};
  bool isOwnAddress(const IpAddress& ip) const;  // mu_ held
};

}  // namespace shardcast::daemon
