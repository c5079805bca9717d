// shardcast::Client: what a trainer or an inference server calls to talk to its node's shardcastd —
// register a rank's tensors, trigger a sync, watch it, wait for a version. Thread-safe (one gRPC
// channel; every call is independent). Errors are Status values carrying the daemon's code and
// message.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/lib/host_tensors.h"
#include "common/fd_passing.h"
#include "common/status.h"
#include "common/tls.h"
#include "proto/shardcast/v1/names.h"
#include "shardcast/v1/service.grpc.pb.h"

namespace shardcast {

// The daemon a client talks to when none is named: $SHARDCAST_ADDRESS (a gRPC target such as
// "host:7070" or "unix:/path"), else the Unix socket $SHARDCAST_SOCKET, else kDefaultSocket.
std::string defaultDaemonTarget();
// "unix:" + path for a bare absolute path, the target unchanged otherwise.
std::string normalizeTarget(const std::string& target);

struct SyncOptions {
  std::chrono::milliseconds timeout{0};  // 0: the daemon's default (300 s)
  bool verify = false;                   // per-chunk xxHash64 checked at every destination node
  bool wait_for_ranks = false;           // wait up to the timeout for ranks not yet registered
  v1::DeltaMode delta = v1::DELTA_OFF;   // delta syncs (v1::DeltaMode, docs/delta.md)
  // The routing: Shardcast's plan, or a baseline it is measured against (v1::SyncStrategy)
  v1::SyncStrategy strategy = v1::STRATEGY_PLANNED;
  std::string sync_id;  // "" = one chosen by the daemon; set it to Watch meanwhile
  // The destination a replica set (v1::SyncOptions): fail unless this many replicas take part
  // (0: 1); cut a replica whose node is silent this long during the sync (0: the sync lease).
  uint32_t min_replicas = 0;
  std::chrono::milliseconds replica_deadline{0};
  // The destination one replica of a set, brought up from a replica holding the version (0: the
  // newest one held), else from the source (v1::SyncOptions.catch_up).
  bool catch_up = false;
};

// How a rank registers: a source (a trainer: it fills its buffers and publishes versions; syncs
// only read it) or a destination (syncs write it). A source may say at once which version its
// buffers already hold (as if published).
struct RegisterOptions {
  v1::Role role = v1::ROLE_DESTINATION;
  uint64_t version = 0;
  // Destinations, optional: a second set of the same buffers (double buffering, twice the
  // memory): syncs write the set not in use and flip at commit (RankStatus.active_set says which
  // set holds the version; acquire pins it while the engine reads).
  std::vector<v1::MemoryHandle> shadow;
  // Set by doubleBuffered(): a registration that meant a shadow set and has none is refused, not
  // registered single-buffered.
  bool double_buffered = false;
  // Read grants: uids besides this group's owner whose syncs may read it (a source) out of this
  // node (RegisterRequest.readers, docs/security.md "Who may sync").
  std::vector<uint32_t> readers;
  // Take over a rank registered already (by this uid). Without it such a registration is refused
  // (ALREADY_EXISTS naming the holder); with it the holder is told (its next call raises).
  bool replace = false;

  // A source rank, READY at `version` when its buffers already hold one.
  static RegisterOptions source(uint64_t version = 0) {
    RegisterOptions o;
    o.role = v1::ROLE_SOURCE;
    o.version = version;
    return o;
  }
  // A double-buffered destination rank.
  static RegisterOptions doubleBuffered(std::vector<v1::MemoryHandle> shadow) {
    RegisterOptions o;
    o.shadow = std::move(shadow);
    o.double_buffered = true;
    return o;
  }
};

// "ready(3)", "updating(4)", "empty", "dirty (sync ... )", with " held" when acquired.
std::string describeRank(const v1::RankStatus& st);

// Lets another thread end a Client::watch early (the watch then returns CANCELLED).
class WatchCancel {
 public:
  void cancel();

 private:
  friend class Client;
  std::mutex mu_;
  grpc::ClientContext* context_ = nullptr;
  bool cancelled_ = false;
};

// How a client reaches a daemon over TCP (the Unix socket needs none of it: the kernel vouches for
// local callers). Defaults from the environment: SHARDCAST_TLS_CA (the cluster CA), with
// SHARDCAST_TLS_CERT and SHARDCAST_TLS_KEY (a client certificate) or SHARDCAST_TOKEN_FILE (the
// daemon's --client-token-file). Without them a TCP channel is plaintext (--insecure daemons).
struct ConnectOptions {
  std::chrono::milliseconds timeout{5000};
  TlsFiles tls = TlsFiles::fromEnv();
  std::string token_file = tokenFileFromEnv();
  // Over the Unix socket: uids the daemon may run as besides root and this process's own
  // (checkDaemonUid); default $SHARDCAST_DAEMON_UID (comma-separated).
  std::vector<uint32_t> daemon_uids = daemonUidsFromEnv();

  static std::string tokenFileFromEnv();
  static std::vector<uint32_t> daemonUidsFromEnv();
};

// The uid of the process serving the Unix socket `path` (SO_PEERCRED, the kernel's word), waited
// for up to `timeout` while nothing listens there yet; PERMISSION_DENIED unless it is root, this
// process's uid or one of `allowed`: a process in the daemon's place on the path is never believed
// (docs/security.md). UNAVAILABLE when nothing serves the path.
StatusOr<uint32_t> checkDaemonUid(const std::string& path, const std::vector<uint32_t>& allowed,
                                  std::chrono::milliseconds timeout);

class Client {
 public:
  // A client of the daemon at `target`; fails with UNAVAILABLE (naming the target) when the daemon
  // does not answer within `connect_timeout`.
  static StatusOr<Client> connect(const std::string& target = defaultDaemonTarget(),
                                  std::chrono::milliseconds connect_timeout = std::chrono::seconds(5));
  static StatusOr<Client> connect(const std::string& target, const ConnectOptions& options);

  const std::string& target() const { return target_; }

  // Ties this client's registrations to its life: opens a session with the daemon (a stream that
  // ends when this process does, however it ends; the daemon then unregisters its ranks and
  // unlinks their shm segments). While it is open, registrations made through this client (and
  // its copies) are re-made by themselves after the daemon restarts, source ranks at the version
  // they last published. The session ends with the last copy of this client.
  Status startSession(std::chrono::milliseconds timeout = std::chrono::seconds(10));
  // How many times the session re-registered after losing its daemon (0 without a session).
  uint64_t reconnects() const;
  // FAILED_PRECONDITION naming each rank of `groups` (every group when empty) that is no longer
  // this client's: its session could not register it again after its daemon restarted, or another
  // process took it over (RegisterOptions::replace); until it is registered again or
  // unregistered. acquire, publish, release, sync and the waits return it for their groups, so a
  // rank that no longer receives syncs is never silent.
  Status checkSession(const std::vector<std::string>& groups = {}) const;

  // Registers `rank` of `layout`'s group with its buffers; the world size is the layout's.
  StatusOr<v1::RegisterResponse> registerRank(const v1::Layout& layout, int32_t rank, const HostTensors& memory,
                                              const RegisterOptions& options = {}) const;
  StatusOr<v1::RegisterResponse> registerRank(const v1::Layout& layout, int32_t rank,
                                              const std::vector<v1::MemoryHandle>& buffers,
                                              const RegisterOptions& options = {}) const;
  Status unregisterRank(const std::string& group, int32_t rank) const;
  // The handle of a buffer in cuMem allocations: their descriptors handed to this client's daemon
  // on the side channel beside its Unix socket (refused over TCP), named by a one-time token. The
  // client keeps duplicates of the descriptors while a registration naming them is recorded in its
  // session, and hands them over again when the session registers the rank after a restart.
  StatusOr<v1::MemoryHandle> cuMemHandle(const CuMemTensor& tensor) const;

  // The fences (see docs/daemon.md). A source rank's owner acquires it before writing (waits
  // until every sync reading it ended) and publishes the version it then holds; a destination
  // rank's engine acquires it to read undisturbed (waits until the sync writing it ended) and
  // releases it to accept updates again.
  StatusOr<v1::RankStatus> acquire(const std::string& group, int32_t rank,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(30)) const;
  StatusOr<v1::RankStatus> publish(const std::string& group, int32_t rank, uint64_t version) const;
  StatusOr<v1::RankStatus> release(const std::string& group, int32_t rank) const;

  // Syncs version `version` of `src` into `dst`; returns once every destination rank has it.
  StatusOr<v1::SyncResponse> sync(const std::string& src, const std::string& dst, uint64_t version,
                                  const SyncOptions& options = {}) const;
  // Calls on_progress for each update of a sync this daemon coordinates, until it ends (OK) or
  // on_progress returns false (CANCELLED).
  Status watch(const std::string& sync_id, const std::function<bool(const v1::SyncProgress&)>& on_progress,
               WatchCancel* cancel = nullptr) const;
  // Waits until every rank of `group` on this node is ready at `version` or newer; returns the
  // version they are all ready at (>= `version`). Never stale weights: DEADLINE_EXCEEDED naming
  // the version the ranks are at when the timeout passed first (timeout 0 = at once). A dirty rank
  // fails it at once (FAILED_PRECONDITION naming the rank and the sync).
  StatusOr<uint64_t> waitVersion(const std::string& group, uint64_t version, std::chrono::milliseconds timeout) const;
  // Every rank's state once they are all ready at `version`, or when the timeout passed: a query,
  // whose version() may be lower than asked (check it; waitVersion does).
  StatusOr<v1::WaitVersionResponse> waitReady(const std::string& group, uint64_t version,
                                              std::chrono::milliseconds timeout) const;

  // `all_nodes`: with every reachable daemon's syncs (StatusResponse.syncs), not only this one's.
  StatusOr<v1::StatusResponse> status(bool all_nodes = false) const;
  StatusOr<v1::ListResponse> list(bool all_nodes) const;
  // `nic_gbps`: the NIC rate the predicted time is for (0: the daemon's default).
  StatusOr<v1::PlanResponse> plan(const std::string& src, const std::string& dst, double nic_gbps = 0,
                                  v1::SyncStrategy strategy = v1::STRATEGY_PLANNED) const;

  // Deadline of unary calls other than sync and waitVersion (which use their own timeouts).
  void setCallTimeout(std::chrono::milliseconds timeout) { call_timeout_ = timeout; }

 private:
  struct SessionState;
  // RegisterResponse.registration of this client's registrations, by (group, rank): acquire,
  // publish, release and unregister act only on them, never on a later one of another process.
  struct Registrations {
    std::mutex mu;
    std::map<std::pair<std::string, int32_t>, uint64_t> ids;
    uint64_t of(const std::string& group, int32_t rank) {
      std::lock_guard<std::mutex> lock(mu);
      auto it = ids.find({group, rank});
      return it == ids.end() ? 0 : it->second;
    }
  };
  Client(std::string target, std::shared_ptr<v1::Shardcast::Stub> stub)
      : target_(std::move(target)), stub_(std::move(stub)) {}
  std::unique_ptr<grpc::ClientContext> context(std::chrono::milliseconds timeout) const;
  StatusOr<v1::RankStatus> releaseRank(const std::string& group, int32_t rank, uint64_t version) const;

  // Duplicates of handed-over descriptors, by the token that names them (cuMemHandle).
  struct HandedAllocations {
    std::mutex mu;
    std::map<std::string, std::vector<OwnedFd>> by_token;
    // Forgets the descriptors of the tokens `req` names.
    void forget(const v1::RegisterRequest& req);
  };
  std::string target_;
  std::vector<uint32_t> daemon_uids_;
  std::shared_ptr<v1::Shardcast::Stub> stub_;
  std::shared_ptr<SessionState> session_;
  std::shared_ptr<HandedAllocations> handed_ = std::make_shared<HandedAllocations>();
  std::shared_ptr<Registrations> registrations_ = std::make_shared<Registrations>();
  std::chrono::milliseconds call_timeout_{std::chrono::seconds(30)};
};

}  // namespace shardcast
