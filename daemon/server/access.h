// Who may call what (docs/security.md). The client service answers local callers on the Unix
// socket (the kernel names their uid) and, over TCP, callers with a certificate of the cluster CA or
// the bearer token; the Peer service answers only daemons of the cluster (a certificate carrying
// kDaemonIdentity). A --insecure daemon admits every caller and says so at start.
#pragma once

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/registry/registry.h"

namespace shardcast::daemon {

// The Unix socket, accepted here rather than by gRPC so that each connection's peer credentials
// (SO_PEERCRED) are read before gRPC serves it; gRPC then names the connection "fd:N".
class LocalListener {
 public:
  // Binds `path` (mode 0660; an existing file there is replaced: the caller holds its lock).
  // `max_per_uid`: connections one uid other than root may hold open at once; more are closed at
  // accept (docs/security.md, "Limits"): idle connections cannot exhaust the daemon's descriptors.
  static StatusOr<std::unique_ptr<LocalListener>> bind(const std::string& path, int max_per_uid = 256);
  ~LocalListener();

  // Accepts connections on a thread of its own and hands each to `server`.
  void serve(grpc::Server* server);
  // Stops accepting (connections already handed over stay with gRPC).
  void stop();
  // The credentials of the connection gRPC calls `peer` ("fd:N"), if it is one of ours.
  std::optional<ucred> credentials(const std::string& peer) const;

 private:
  LocalListener(std::string path, int fd, int wake, int max_per_uid);
  void run(grpc::Server* server);
  // With mu_ held: forgets connections gRPC has closed (their descriptor is gone or now names
  // another file), then counts `uid`'s.
  int liveConnections(uid_t uid);

  std::string path_;
  int fd_ = -1;
  int wake_ = -1;  // eventfd that ends the accept loop
  std::thread thread_;
  mutable std::mutex mu_;
  struct Connection {
    ucred cred;
    ino_t inode;  // of the socket: a descriptor reused for another file is told apart
  };
  std::map<int, Connection> connections_;  // by descriptor (a reused descriptor is overwritten at accept)
  const int max_per_uid_;
  uint64_t refused_ = 0;  // accept thread only
  // New connections per uid other than root: kConnectBurst at once, then kConnectsPerSecond
  // (a token bucket; accept thread only).
  static constexpr double kConnectsPerSecond = 50, kConnectBurst = 200;
  struct Rate {
    double tokens;
    std::chrono::steady_clock::time_point at;
  };
  std::map<uid_t, Rate> rates_;
  bool connectAllowed(uid_t uid);
};

// The TCP listener, accepted here rather than by gRPC (which hands the connections to gRPC's TLS
// through its external-connection acceptor): at most `max_per_address` connections from one
// remote address at once, more closed at accept (docs/security.md, "Limits"), and the port bound
// without SO_REUSEPORT, so a port another process holds is an error at start ("address in use"),
// never a port two daemons silently share.
// gRPC's handshake timeout for TCP connections (GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS).
inline constexpr std::chrono::milliseconds kHandshakeTimeout{5000};

class TcpListener {
 public:
  // Binds `listen` (host:port, [v6]:port; port 0 picks one) now, before the server starts.
  // `max_handshaking`: connections accepted within the last kHandshakeTimeout, from every address
  // together (those a silent or slow client may still hold in its handshake); a new one past it
  // shuts down the oldest of them that has sent nothing yet, or is refused when every one has
  // (docs/security.md, "Limits").
  static StatusOr<std::unique_ptr<TcpListener>> bind(const std::string& listen, int max_per_address = 256,
                                                     int max_handshaking = 1024);
  ~TcpListener();
  int port() const { return port_; }

  // Accepts on a thread of its own and hands each connection to `acceptor` (made by the server's
  // builder, with the listener's credentials).
  void serve(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor);
  void stop();

 private:
  TcpListener(std::string listen, int fd, int wake, int port, int max_per_address, int max_handshaking);
  void run();
  // Forgets connections gRPC has closed, then counts those from `address`.
  int liveConnections(const std::string& address);
  // Past max_handshaking_ connections younger than kHandshakeTimeout: the oldest of them that has
  // received no byte (silent: no TLS handshake begun) shut down (gRPC sees its end and closes it;
  // the descriptor stays gRPC's). False when every one of them has begun its handshake: the new
  // connection is then refused, no connection that has spoken is cut. After liveConnections.
  bool makeRoomForHandshake();

  std::string listen_;
  int fd_ = -1;
  int wake_ = -1;
  int port_ = 0;
  const int max_per_address_;
  const int max_handshaking_;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
  struct Connection {
    std::string address;
    ino_t inode;
    std::chrono::steady_clock::time_point accepted;
  };
  std::map<int, Connection> connections_;  // accept thread only
  uint64_t refused_ = 0;
  uint64_t evicted_ = 0;
};

// One caller of the client service, as far as the daemon can tell.
struct Caller {
  std::optional<ucred> local;  // on the Unix socket
  bool authenticated = false;  // local, a certificate of the CA, or the token
  std::string who;             // for errors and logs: "uid 1000 (pid 42)", "certificate CN=...", "ipv4:..."

  // The memory this caller may register (its own segments; anything when root or --insecure).
  MemoryCaller memory(bool insecure) const;
};

class AccessPolicy {
 public:
  AccessPolicy(bool insecure, std::string token, const LocalListener* local)
      : insecure_(insecure), token_(std::move(token)), local_(local) {}

  bool insecure() const { return insecure_; }
  // Every handler starts here, with its request. The client service: PERMISSION_DENIED
  // (UNAUTHENTICATED without credentials) unless the caller is local, presents a certificate of
  // the CA, or the token (anyone when insecure); then the request's strings within bounds.
  StatusOr<Caller> client(const grpc::ServerContext& ctx, const google::protobuf::Message& request) const;
  // The Peer service: only daemons of the cluster (certificate with kDaemonIdentity; anyone when
  // insecure), never a caller on the Unix socket; then the request's strings within bounds.
  Status peer(const grpc::ServerContext& ctx, const google::protobuf::Message& request) const;

 private:
  StatusOr<Caller> identify(const grpc::ServerContext& ctx) const;
  Status isDaemon(const grpc::ServerContext& ctx) const;

  const bool insecure_;
  const std::string token_;
  const LocalListener* local_;
};

}  // namespace shardcast::daemon
