#include "client/lib/client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "common/defaults.h"
#include "common/grpc_status.h"
#include "common/strings.h"
#include "transport/cuda/cuda_support.h"

namespace shardcast {

std::string defaultDaemonTarget() {
  if (const char* a = std::getenv("SHARDCAST_ADDRESS"); a && *a) return normalizeTarget(a);
  if (const char* s = std::getenv("SHARDCAST_SOCKET"); s && *s) return normalizeTarget(s);
  return normalizeTarget(kDefaultSocket);
}

std::string normalizeTarget(const std::string& target) { return target.rfind('/', 0) == 0 ? "unix:" + target : target; }

std::string describeRank(const v1::RankStatus& st) {
  std::string out(v1::rankStateName(st.state()));
  if (st.state() == v1::RANK_READY || st.state() == v1::RANK_UPDATING) out += strCat("(", st.version(), ")");
  if (st.held()) out += " held";
  return out;
}

// The session thread: holds the Session stream open; when it breaks (the daemon went away) it
// opens a new one as soon as the daemon answers and registers every recorded rank again.
struct Client::SessionState {
  struct Recorded {
    v1::RegisterRequest request;
    uint64_t published = 0;   // source: last version published
    bool held = false;        // acquired: re-registered held (a source not as ready)
    uint32_t active_set = 0;  // double-buffered destination: the set last seen in use (acquire)
  };
  std::shared_ptr<v1::Shardcast::Stub> stub;
  std::mutex mu;
  std::condition_variable cv;
  std::string id;  // "" while no session is open
  bool stop = false;
  bool lost = false;  // a session was open and ended: re-register when the next one opens
  grpc::ClientContext* stream = nullptr;
  std::map<std::pair<std::string, int32_t>, Recorded> ranks;
  // Why re-registering a rank after a daemon restart failed: the client's next call about its
  // ranks returns it (Client::checkSession) until the rank is registered again or unregistered.
  std::map<std::pair<std::string, int32_t>, std::string> failed;
  std::shared_ptr<Client::Registrations> registrations;  // the client's, updated on re-registration
  // cuMem allocations' descriptors (Client::cuMemHandle), handed over again on re-registration.
  std::shared_ptr<Client::HandedAllocations> handed;
  std::string fd_channel;
  std::vector<uint32_t> daemon_uids;
  uint64_t reconnects = 0;
  std::thread thread;

  void run() {
    while (true) {
      grpc::ClientContext ctx;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) return;
        stream = &ctx;
      }
      v1::SessionRequest req;
      req.set_client(strCat("c++ pid ", ::getpid()));
      auto reader = stub->Session(&ctx, req);
      v1::SessionEvent ev;
      if (reader->Read(&ev)) {
        std::unique_lock<std::mutex> lock(mu);
        id = ev.session_id();
        if (lost) reregister(lock);
        cv.notify_all();
        lock.unlock();
        while (reader->Read(&ev)) {  // later events: ranks another process took over
          for (const auto& s : ev.superseded()) std::fprintf(stderr, "shardcast: %s\n", s.message().c_str());
          std::lock_guard<std::mutex> told(mu);
          for (const auto& s : ev.superseded()) failed[{s.group(), s.rank()}] = s.message();
        }
      }
      reader->Finish().IgnoreError();
      std::unique_lock<std::mutex> lock(mu);
      stream = nullptr;
      if (!id.empty()) lost = true;
      id.clear();
      if (stop) return;
      cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return stop; });
    }
  }

  // New tokens for the cuMem allocations `req` names: a token names one registration on one daemon.
  Status handOverAgain(v1::RegisterRequest* req) {
    for (auto* set : {req->mutable_buffers(), req->mutable_shadow_buffers()})
      for (auto& b : *set) {
        if (!b.has_cuda_allocations()) continue;
        if (!handed) return absl::InternalError("no descriptors kept for a cuMem buffer");
        std::lock_guard<std::mutex> lock(handed->mu);
        auto it = handed->by_token.find(b.cuda_allocations().token());
        if (it == handed->by_token.end())
          return absl::NotFoundError(strCat("buffer \"", b.buffer(), "\": its descriptors are no longer kept"));
        std::vector<int> raw;
        for (const auto& fd : it->second) raw.push_back(fd.get());
        auto token = handOverFds(fd_channel, raw, daemon_uids);
        if (!token.ok())
          return Status(token.status().code(), strCat("buffer \"", b.buffer(), "\": ", token.status().message()));
        auto fds = std::move(it->second);
        handed->by_token.erase(it);
        handed->by_token[*token] = std::move(fds);
        b.mutable_cuda_allocations()->set_token(*token);
      }
    return absl::OkStatus();
  }

  // With mu held (released around the calls).
  void reregister(std::unique_lock<std::mutex>& lock) {
    lost = false;
    ++reconnects;
    std::vector<v1::RegisterRequest> again;
    for (auto& [key, r] : ranks) {
      if (Status handed_over = handOverAgain(&r.request); !handed_over.ok()) {
        const std::string why = strCat("re-registering group \"", key.first, "\" rank ", key.second,
                                       " after its daemon restarted failed: ", handed_over.message());
        std::fprintf(stderr, "shardcast: %s\n", why.c_str());
        failed[key] = why;
        continue;
      }
      v1::RegisterRequest req = r.request;
      req.set_session_id(id);
      req.set_version(req.role() == v1::ROLE_SOURCE ? r.published : 0);  // held: the floor it publishes above
      // Held as it was (no sync writes what its engine reads, nor reads what its trainer
      // writes), and double-buffered with the set last seen in use, not the older other one.
      req.set_held(r.held);
      req.set_active_set(req.shadow_buffers_size() > 0 ? r.active_set : 0);
      again.push_back(std::move(req));
    }
    lock.unlock();
    for (const auto& req : again) {
      grpc::ClientContext c;
      c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::RegisterResponse out;
      const grpc::Status st = stub->Register(&c, req, &out);
      if (st.ok()) {
        std::lock_guard<std::mutex> relock(mu);
        failed.erase({req.group(), req.rank()});
        if (registrations) {
          std::lock_guard<std::mutex> ids(registrations->mu);
          registrations->ids[{req.group(), req.rank()}] = out.registration();
        }
        continue;
      }
      const std::string why =
          strCat("re-registering group \"", req.group(), "\" rank ", req.rank(), " after its daemon restarted failed: ",
                 absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())), ": ", st.error_message());
      std::fprintf(stderr, "shardcast: %s\n", why.c_str());
      std::lock_guard<std::mutex> relock(mu);
      failed[{req.group(), req.rank()}] = why;
    }
    lock.lock();
  }

  ~SessionState() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
      if (stream) stream->TryCancel();
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
  }
};

Status Client::startSession(std::chrono::milliseconds timeout) {
  if (session_) return absl::OkStatus();
  auto s = std::make_shared<SessionState>();
  s->stub = stub_;
  s->thread = std::thread([raw = s.get()] { raw->run(); });
  std::unique_lock<std::mutex> lock(s->mu);
  if (!s->cv.wait_for(lock, timeout, [&] { return !s->id.empty(); })) {
    lock.unlock();
    return absl::UnavailableError(
        strCat("shardcastd at \"", target_, "\" opened no session within ", timeout.count(), " ms"));
  }
  lock.unlock();
  session_ = std::move(s);
  return absl::OkStatus();
}

uint64_t Client::reconnects() const {
  if (!session_) return 0;
  std::lock_guard<std::mutex> lock(session_->mu);
  return session_->reconnects;
}

std::string ConnectOptions::tokenFileFromEnv() {
  const char* f = std::getenv("SHARDCAST_TOKEN_FILE");
  return f ? f : "";
}

std::vector<uint32_t> ConnectOptions::daemonUidsFromEnv() {
  std::vector<uint32_t> out;
  const char* env = std::getenv("SHARDCAST_DAEMON_UID");
  std::string list = env ? env : "";
  for (size_t at = 0; at < list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string part = list.substr(at, comma - at);
    char* end = nullptr;
    const unsigned long uid = std::strtoul(part.c_str(), &end, 10);
    if (!part.empty() && end == part.c_str() + part.size() && uid <= UINT32_MAX)
      out.push_back(static_cast<uint32_t>(uid));
    at = comma + 1;
  }
  return out;
}

StatusOr<uint32_t> checkDaemonUid(const std::string& path, const std::vector<uint32_t>& allowed,
                                  std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(strCat("socket path \"", path, "\" is too long"));
  std::memcpy(addr.sun_path, path.data(), path.size());
  ucred cred{};
  while (true) {  // a daemon still starting (no socket yet) is waited for, as a channel would
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(strCat("socket(AF_UNIX): ", std::strerror(errno)));
    socklen_t len = sizeof(cred);
    const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 &&
                    ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    const int err = errno;
    ::close(fd);
    if (ok) break;
    if (std::chrono::steady_clock::now() >= deadline)
      return absl::UnavailableError(
          strCat("shardcastd at \"unix:", path, "\" is not reachable (is the daemon running?): ", std::strerror(err)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (cred.uid == 0 || cred.uid == ::geteuid() ||
      std::find(allowed.begin(), allowed.end(), static_cast<uint32_t>(cred.uid)) != allowed.end())
    return static_cast<uint32_t>(cred.uid);
  return absl::PermissionDeniedError(strCat("the process serving \"unix:", path, "\" (pid ", cred.pid, ") runs as uid ",
                                            cred.uid, ", not as root, this process's uid or one of ",
                                            "SHARDCAST_DAEMON_UID: not a daemon this client trusts (if it is your ",
                                            "deployment's shardcastd, set SHARDCAST_DAEMON_UID=", cred.uid, ")"));
}

StatusOr<Client> Client::connect(const std::string& target, std::chrono::milliseconds connect_timeout) {
  ConnectOptions options;
  options.timeout = connect_timeout;
  return connect(target, options);
}

StatusOr<Client> Client::connect(const std::string& target, const ConnectOptions& options) {
  const std::string t = normalizeTarget(target);
  if (t.rfind("unix:", 0) == 0)
    SC_RETURN_IF_ERROR(checkDaemonUid(t.substr(5), options.daemon_uids, options.timeout).status());
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);  // plan summaries of very large models
  // A restarted daemon is reached at once (not after gRPC's reconnect backoff of up to 120 s);
  // each connection attempt (TLS handshake included) still gets 5 s: gRPC's "min reconnect
  // backoff" is that attempt's timeout, and 100 ms fails handshakes on a loaded host.
  // Over the Unix socket an attempt fails at once while the daemon's accept queue is full (another
  // local process connecting in a loop): it is tried again every 20-50 ms, not every second, and
  // takes the first slot the daemon's accept loop frees (docs/security.md, "Limits").
  const bool local = t.rfind("unix:", 0) == 0;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, local ? 20 : 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, local ? 50 : 1000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // not a connection another channel left to an old daemon
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (t.rfind("unix:", 0) != 0 && (options.tls.enabled() || !options.token_file.empty())) {
    SC_RETURN_IF_ERROR(options.tls.checkClient());
    std::string token;
    if (!options.token_file.empty()) {
      SC_ASSIGN_OR_RETURN(token, readToken(options.token_file));
    }
    credentials = channelCredentials(options.tls, &args, token);
  }
  auto channel = grpc::CreateCustomChannel(t, credentials, args);
  const bool tcp = t.rfind("unix:", 0) != 0;
  const bool connected = channel->WaitForConnected(std::chrono::system_clock::now() + options.timeout);
  if (!connected && tcp && options.tls.enabled() && options.tls.cert.empty() && options.token_file.empty())
    return absl::UnavailableError(strCat(
        "shardcastd at \"", t, "\" did not take the connection: only a CA was given (SHARDCAST_TLS_CA), and a daemon ",
        "takes TCP clients with a client certificate of that CA (SHARDCAST_TLS_CERT and SHARDCAST_TLS_KEY) or its ",
        "bearer token (SHARDCAST_TOKEN_FILE); see docs/security.md"));
  if (!connected)
    return absl::UnavailableError(strCat("shardcastd at \"", t,
                                         "\" is not reachable (is the daemon running? set --daemon or ",
                                         "SHARDCAST_ADDRESS; over TCP a daemon needs SHARDCAST_TLS_CA and a client ",
                                         "certificate or token, see docs/security.md)"));
  Client client(t, std::shared_ptr<v1::Shardcast::Stub>(v1::Shardcast::NewStub(channel)));
  client.daemon_uids_ = options.daemon_uids;
  return client;
}

std::unique_ptr<grpc::ClientContext> Client::context(std::chrono::milliseconds timeout) const {
  auto c = std::make_unique<grpc::ClientContext>();
  if (timeout.count() > 0) c->set_deadline(std::chrono::system_clock::now() + timeout);
  return c;
}

StatusOr<v1::RegisterResponse> Client::registerRank(const v1::Layout& layout, int32_t rank, const HostTensors& memory,
                                                    const RegisterOptions& options) const {
  return registerRank(layout, rank, memory.handles(), options);
}

StatusOr<v1::RegisterResponse> Client::registerRank(const v1::Layout& layout, int32_t rank,
                                                    const std::vector<v1::MemoryHandle>& buffers,
                                                    const RegisterOptions& options) const {
  if (options.double_buffered && options.shadow.empty())
    return absl::InvalidArgumentError(strCat("register group \"", layout.group(), "\" rank ", rank,
                                             ": double-buffered with an empty shadow set (give the second set's "
                                             "buffers, one per buffer, or register without doubleBuffered)"));
  // The world is the mesh's size; the daemon validates everything else against the layout.
  int64_t world = 1;
  for (const int64_t s : layout.mesh().shape()) world *= s;
  v1::RegisterRequest req;
  req.set_group(layout.group());
  req.set_rank(rank);
  req.set_world_size(static_cast<int32_t>(world));
  *req.mutable_layout() = layout;
  for (const auto& b : buffers) *req.add_buffers() = b;
  req.set_role(options.role);
  req.set_version(options.version);
  for (const auto& b : options.shadow) *req.add_shadow_buffers() = b;
  for (const uint32_t uid : options.readers) req.add_readers(uid);
  req.set_replace(options.replace);
  v1::RegisterResponse out;
  auto remember = [&] {
    std::lock_guard<std::mutex> lock(registrations_->mu);
    registrations_->ids[{layout.group(), rank}] = out.registration();
  };
  if (!session_) {
    const auto st = stub_->Register(context(call_timeout_).get(), req, &out);
    handed_->forget(req);  // no session registers it again: the descriptors are the daemon's now
    if (!st.ok()) return fromGrpc(st, strCat("register group \"", layout.group(), "\" rank ", rank));
    remember();
    return out;
  }
  // Under the session (waiting for it while the daemon restarts); recorded for re-registration.
  std::unique_lock<std::mutex> lock(session_->mu);
  if (!session_->cv.wait_for(lock, call_timeout_, [&] { return !session_->id.empty(); }))
    return absl::UnavailableError(strCat("register group \"", layout.group(), "\" rank ", rank,
                                         ": no session with shardcastd at \"", target_, "\""));
  req.set_session_id(session_->id);
  v1::RegisterRequest recorded = req;
  recorded.set_replace(false);  // re-made after a restart: a rank the new daemon does not hold
  session_->ranks[{layout.group(), rank}] = {recorded, options.version, false};
  session_->failed.erase({layout.group(), rank});
  session_->registrations = registrations_;
  session_->handed = handed_;
  if (target_.rfind("unix:", 0) == 0) session_->fd_channel = fdChannelPath(target_.substr(5));
  session_->daemon_uids = daemon_uids_;
  lock.unlock();
  const auto st = stub_->Register(context(call_timeout_).get(), req, &out);
  if (!st.ok()) {
    std::lock_guard<std::mutex> relock(session_->mu);
    if (auto it = session_->ranks.find({layout.group(), rank}); it != session_->ranks.end())
      handed_->forget(it->second.request);
    session_->ranks.erase({layout.group(), rank});
    return fromGrpc(st, strCat("register group \"", layout.group(), "\" rank ", rank));
  }
  remember();
  return out;
}

void Client::HandedAllocations::forget(const v1::RegisterRequest& req) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto* set : {&req.buffers(), &req.shadow_buffers()})
    for (const auto& b : *set)
      if (b.has_cuda_allocations()) by_token.erase(b.cuda_allocations().token());
}

StatusOr<v1::MemoryHandle> Client::cuMemHandle(const CuMemTensor& tensor) const {
  const std::string what = strCat("device tensor \"", tensor.name, "\"");
  if (target_.rfind("unix:", 0) != 0)
    return absl::InvalidArgumentError(strCat(what,
                                             ": cuMem allocations register only over the daemon's Unix socket (their "
                                             "file descriptors travel on its side channel), not over TCP"));
  if (tensor.fds.empty() || tensor.fds.size() != tensor.allocation_bytes.size())
    return absl::InvalidArgumentError(strCat(what, ": ", tensor.fds.size(), " descriptors for ",
                                             tensor.allocation_bytes.size(), " allocation sizes"));
  std::vector<OwnedFd> dups;
  std::vector<int> raw;
  for (const int fd : tensor.fds) {
    dups.emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (dups.back().get() < 0)
      return absl::InvalidArgumentError(strCat(what, ": descriptor ", fd, ": ", std::strerror(errno)));
    raw.push_back(dups.back().get());
  }
  auto token = handOverFds(fdChannelPath(target_.substr(5)), raw, daemon_uids_);
  if (!token.ok()) return Status(token.status().code(), strCat(what, ": ", token.status().message()));
  v1::MemoryHandle h;
  h.set_buffer(tensor.name);
  auto* a = h.mutable_cuda_allocations();
  a->set_token(*token);
  for (const uint64_t n : tensor.allocation_bytes) a->add_allocation_bytes(n);
  a->set_offset(tensor.offset);
  a->set_size(tensor.bytes);
  a->set_device(tensor.device);
  a->set_device_uuid(tensor.device_uuid.empty() ? transport::cudaDeviceUuid(tensor.device) : tensor.device_uuid);
  std::lock_guard<std::mutex> lock(handed_->mu);
  handed_->by_token[*token] = std::move(dups);
  return h;
}

Status Client::unregisterRank(const std::string& group, int32_t rank) const {
  if (session_) {
    std::lock_guard<std::mutex> lock(session_->mu);
    if (auto it = session_->ranks.find({group, rank}); it != session_->ranks.end()) handed_->forget(it->second.request);
    session_->ranks.erase({group, rank});
    session_->failed.erase({group, rank});
  }
  v1::UnregisterRequest req;
  req.set_group(group);
  req.set_rank(rank);
  {
    std::lock_guard<std::mutex> lock(registrations_->mu);
    auto it = registrations_->ids.find({group, rank});
    if (it != registrations_->ids.end()) {
      req.set_registration(it->second);
      registrations_->ids.erase(it);
    }
  }
  v1::UnregisterResponse out;
  return fromGrpc(stub_->Unregister(context(call_timeout_).get(), req, &out),
                  strCat("unregister group \"", group, "\" rank ", rank));
}

StatusOr<v1::RankStatus> Client::acquire(const std::string& group, int32_t rank,
                                         std::chrono::milliseconds timeout) const {
  SC_RETURN_IF_ERROR(checkSession({group}));
  v1::AcquireRequest req;
  req.set_group(group);
  req.set_rank(rank);
  req.set_registration(registrations_->of(group, rank));
  req.set_timeout_ms(static_cast<uint32_t>(timeout.count()));
  v1::AcquireResponse out;
  const auto st = stub_->Acquire(context(timeout + call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("acquire group \"", group, "\" rank ", rank));
  if (session_) {
    std::lock_guard<std::mutex> lock(session_->mu);
    if (auto it = session_->ranks.find({group, rank}); it != session_->ranks.end()) {
      it->second.held = true;
      it->second.active_set = out.status().active_set();
    }
  }
  return out.status();
}

StatusOr<v1::RankStatus> Client::publish(const std::string& group, int32_t rank, uint64_t version) const {
  return releaseRank(group, rank, version);
}

StatusOr<v1::RankStatus> Client::release(const std::string& group, int32_t rank) const {
  return releaseRank(group, rank, 0);
}

StatusOr<v1::RankStatus> Client::releaseRank(const std::string& group, int32_t rank, uint64_t version) const {
  SC_RETURN_IF_ERROR(checkSession({group}));
  v1::ReleaseRequest req;
  req.set_group(group);
  req.set_rank(rank);
  req.set_registration(registrations_->of(group, rank));
  req.set_version(version);
  v1::ReleaseResponse out;
  const auto st = stub_->Release(context(call_timeout_).get(), req, &out);
  // Answered, or the daemon that held the rank is gone (or a new one does not have it yet): the
  // re-registration after a restart takes the release as done, not held for good.
  const bool done =
      st.ok() || st.error_code() == grpc::StatusCode::UNAVAILABLE || st.error_code() == grpc::StatusCode::NOT_FOUND;
  if (done && session_) {
    std::lock_guard<std::mutex> lock(session_->mu);
    if (auto it = session_->ranks.find({group, rank}); it != session_->ranks.end()) {
      it->second.held = false;
      if (version) it->second.published = version;
    }
  }
  if (!st.ok())
    return fromGrpc(st, version ? strCat("publish group \"", group, "\" rank ", rank, " version ", version)
                                : strCat("release group \"", group, "\" rank ", rank));
  return out.status();
}

StatusOr<v1::SyncResponse> Client::sync(const std::string& src, const std::string& dst, uint64_t version,
                                        const SyncOptions& options) const {
  SC_RETURN_IF_ERROR(checkSession({src, dst}));
  v1::SyncRequest req;
  req.set_src_group(src);
  req.set_dst_group(dst);
  req.set_version(version);
  req.set_sync_id(options.sync_id);
  req.mutable_options()->set_timeout_ms(static_cast<uint32_t>(options.timeout.count()));
  req.mutable_options()->set_verify(options.verify);
  req.mutable_options()->set_wait_for_ranks(options.wait_for_ranks);
  req.mutable_options()->set_delta(options.delta);
  req.mutable_options()->set_strategy(options.strategy);
  req.mutable_options()->set_min_replicas(options.min_replicas);
  req.mutable_options()->set_catch_up(options.catch_up);
  req.mutable_options()->set_replica_deadline_ms(static_cast<uint32_t>(options.replica_deadline.count()));
  // The daemon enforces the sync's own timeout; the call's deadline leaves it room to report.
  const auto limit =
      (options.timeout.count() > 0 ? options.timeout : std::chrono::milliseconds(300'000)) + std::chrono::seconds(30);
  v1::SyncResponse out;
  const auto st = stub_->Sync(context(limit).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("sync \"", src, "\" -> \"", dst, "\" version ", version));
  return out;
}

void WatchCancel::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  if (context_) context_->TryCancel();
}

Status Client::watch(const std::string& sync_id, const std::function<bool(const v1::SyncProgress&)>& on_progress,
                     WatchCancel* cancel) const {
  v1::WatchRequest req;
  req.set_sync_id(sync_id);
  grpc::ClientContext ctx;
  if (cancel) {
    std::lock_guard<std::mutex> lock(cancel->mu_);
    if (cancel->cancelled_) return absl::CancelledError(strCat("stopped watching sync \"", sync_id, "\""));
    cancel->context_ = &ctx;
  }
  auto reader = stub_->Watch(&ctx, req);
  v1::SyncProgress p;
  bool stopped = false;
  while (reader->Read(&p)) {
    if (!on_progress(p)) {
      stopped = true;
      ctx.TryCancel();
      break;
    }
  }
  const grpc::Status st = reader->Finish();
  if (cancel) {
    std::lock_guard<std::mutex> lock(cancel->mu_);
    cancel->context_ = nullptr;
    stopped |= cancel->cancelled_;
  }
  if (stopped) return absl::CancelledError(strCat("stopped watching sync \"", sync_id, "\""));
  return fromGrpc(st, strCat("watch sync \"", sync_id, "\""));
}

StatusOr<uint64_t> Client::waitVersion(const std::string& group, uint64_t version,
                                       std::chrono::milliseconds timeout) const {
  SC_ASSIGN_OR_RETURN(auto out, waitReady(group, version, timeout));
  if (out.version() >= version) return out.version();
  std::string ranks;
  for (int i = 0; i < out.ranks_size() && i < 8; ++i)
    ranks += strCat(i ? ", " : "", out.ranks(i).rank(), " ", describeRank(out.ranks(i)));
  if (out.ranks_size() > 8) ranks += strCat(" (+", out.ranks_size() - 8, " more)");
  return absl::DeadlineExceededError(strCat("group \"", group, "\" is at version ", out.version(), ", not ", version,
                                            ", after waiting ", timeout.count(),
                                            " ms: its weights are stale (ranks: ", ranks, ")"));
}

Status Client::checkSession(const std::vector<std::string>& groups) const {
  if (!session_) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(session_->mu);
  std::string all;
  for (const auto& [key, why] : session_->failed)
    if (groups.empty() || std::find(groups.begin(), groups.end(), key.first) != groups.end())
      all += strCat(all.empty() ? "" : "; ", why);
  if (all.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(strCat(all, " (register the rank again, or unregister it)"));
}

StatusOr<v1::WaitVersionResponse> Client::waitReady(const std::string& group, uint64_t version,
                                                    std::chrono::milliseconds timeout) const {
  SC_RETURN_IF_ERROR(checkSession({group}));
  v1::WaitVersionRequest req;
  req.set_group(group);
  req.set_version(version);
  req.set_timeout_ms(static_cast<uint32_t>(timeout.count()));
  v1::WaitVersionResponse out;
  const auto st = stub_->WaitVersion(context(timeout + call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("wait for group \"", group, "\" version ", version));
  return out;
}

StatusOr<v1::StatusResponse> Client::status(bool all_nodes) const {
  v1::StatusRequest req;
  req.set_all_nodes(all_nodes);
  v1::StatusResponse out;
  const auto st = stub_->Status(context(call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, "status");
  return out;
}

StatusOr<v1::ListResponse> Client::list(bool all_nodes) const {
  v1::ListRequest req;
  req.set_all_nodes(all_nodes);
  v1::ListResponse out;
  const auto st = stub_->List(context(call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, "list");
  return out;
}

StatusOr<v1::PlanResponse> Client::plan(const std::string& src, const std::string& dst, double nic_gbps,
                                        v1::SyncStrategy strategy) const {
  v1::PlanRequest req;
  req.set_src_group(src);
  req.set_dst_group(dst);
  req.set_nic_gbps(nic_gbps);
  req.set_strategy(strategy);
  v1::PlanResponse out;
  const auto st = stub_->Plan(context(call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("plan \"", src, "\" -> \"", dst, "\""));
  return out;
}

}  // namespace shardcast
