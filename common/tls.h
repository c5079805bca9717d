// TLS identities of daemons and clients: PEM files (certificate chain, private key, cluster CA),
// reloaded by gRPC when they change. Every daemon certificate carries the DNS name
// kDaemonIdentity: channels to daemons verify it (whatever address the daemon was reached at), and
// the Peer service admits only callers whose client certificate carries it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace shardcast {

inline constexpr const char* kDaemonIdentity = "shardcast-daemon";

struct TlsFiles {
  std::string cert;   // certificate chain (PEM)
  std::string key;    // its private key (PEM)
  std::string ca;     // the cluster CA bundle that peers' certificates must chain to (PEM)
  int reload_s = 60;  // how often gRPC re-reads the three files

  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
  // A daemon's: all three given and readable; the error names the missing or unreadable one.
  Status check() const;
  // A client's: the CA, and the certificate and key both or neither (a client with a bearer
  // token has no certificate of its own).
  Status checkClient() const;
  // $SHARDCAST_TLS_CERT, $SHARDCAST_TLS_KEY, $SHARDCAST_TLS_CA (clients and the CLI).
  static TlsFiles fromEnv();
};

// Credentials for a channel to a daemon: TLS when `files` are enabled (the daemon's certificate
// verified against the CA and kDaemonIdentity; ours presented when given), plaintext otherwise;
// with `token`, every call also carries "authorization: Bearer <token>" (gRPC sends it only over
// TLS). Adds the channel arguments TLS needs to `args`.
std::shared_ptr<grpc::ChannelCredentials> channelCredentials(const TlsFiles& files, grpc::ChannelArguments* args,
                                                             const std::string& token = "");

// Server credentials of a daemon's TCP listener. `require_client_cert`: a handshake without a
// client certificate signed by the CA fails; otherwise one is requested and, when given, verified.
std::shared_ptr<grpc::ServerCredentials> serverCredentials(const TlsFiles& files, bool require_client_cert);

// The bearer token a client sends to a daemon's TCP listener: the first line of `path`, or an
// error naming the file (missing, unreadable, empty).
StatusOr<std::string> readToken(const std::string& path);

// When the first certificate of PEM file `path` expires (its notAfter, Unix seconds): for the
// daemon's metrics, read again at every scrape since gRPC reloads the file.
StatusOr<int64_t> certificateExpiry(const std::string& path);

}  // namespace shardcast
