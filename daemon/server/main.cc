// shardcastd: the per-node daemon. Serves the Shardcast service to local clients on a Unix socket
// (mode 0660; each connection's uid read with SO_PEERCRED) and both services on TCP with mutual TLS
// (or plaintext with --insecure), with grpc.health.v1 and server reflection; stops on SIGTERM/SIGINT.
#include <absl/synchronization/mutex.h>
#include <fcntl.h>
#include <grpc/support/log.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <thread>

#include "common/fd_passing.h"
#include "common/logging.h"
#include "common/strings.h"
#include "common/tls.h"
#include "daemon/registry/registry.h"
#include "daemon/server/access.h"
#include "daemon/server/config.h"
#include "daemon/server/fd_channel.h"
#include "daemon/server/metrics.h"
#include "daemon/server/service.h"
#include "daemon/server/ucx_admission.h"
#include "planner/limits.h"
#include "transport/device_staging.h"
#include "transport/emulated_gpus.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

// gRPC core's own log lines (TLS handshake failures, for one) through spdlog, each kind of line
// (its source location) at most once per 10 s with a count of those held back: a plaintext caller
// on the TLS port no longer fills the log.
void grpcLog(gpr_log_func_args* args) {
  static LogLimiter limiter;
  uint64_t held = 0;
  if (!limiter.allow(strCat(args->file, ":", args->line), &held)) return;
  const std::string more = held ? strCat(" (", held, " more like it in the last 10 s)") : std::string();
  if (args->severity == GPR_LOG_SEVERITY_ERROR)
    spdlog::warn("grpc: {}{}", args->message, more);
  else if (args->severity == GPR_LOG_SEVERITY_INFO)
    spdlog::info("grpc: {}{}", args->message, more);
  else
    spdlog::debug("grpc: {}{}", args->message, more);
}

int fail(const std::string& what) {
  spdlog::critical("{}", what);
  return 1;
}

// Blocks SIGTERM/SIGINT in every thread and returns once one arrives.
int waitForSignal(const sigset_t& set) {
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

// Every registered shm segment keeps a descriptor open (to catch truncation before it is a
// SIGBUS): take the hard limit of open files.
void raiseFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
}

// The Unix socket belongs to the daemon holding `<socket>.lock` (flock, released when the process
// ends however it ends): a second daemon never deletes a live daemon's socket. Returns the held
// descriptor, or -1 with `error` set.
int lockSocket(const std::string& socket, std::string* error) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(socket).parent_path(), ec);
  const std::string path = socket + ".lock";
  // O_NOFOLLOW: a symlink planted there by someone who can write the directory is not followed.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    *error = "cannot open " + path + ": " + std::strerror(errno);
    return -1;
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {0};
    const ssize_t n = ::pread(fd, pid, sizeof(pid) - 1, 0);
    *error = "another shardcastd (pid " + std::string(n > 0 ? pid : "?") + ") serves " + socket +
             ": refusing to take its socket (stop it, or give this one another --socket)";
    ::close(fd);
    return -1;
  }
  const std::string me = std::to_string(::getpid());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    // The pid is for the message above only.
  }
  return fd;
}

// SIGTERM and SIGINT, blocked in the calling thread before any other starts (so in every thread),
// for waitForSignal.
sigset_t blockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// Where parseConfig ended the program: its output (help, version, the configuration) or usage
// error, and the exit code.
int endParse(const Status& status, int exit_code, const std::string& output) {
  if (!output.empty())
    (exit_code == 0 ? std::cout : std::cerr) << output;
  else
    std::cerr << "shardcastd: " << status.message() << "\n";
  return output.empty() ? 2 : exit_code;
}

// Logging (gRPC's lines too), the open-file limit and the layout limits, from the configuration.
Status applyProcessSettings(const DaemonConfig& config) {
  SC_RETURN_IF_ERROR(setupLogging(config.log_level, config.log_format, config.node));
  gpr_set_log_function(grpcLog);
  spdlog::info("shardcastd {} starting: {}", kShardcastVersion, config.describe());
  raiseFileLimit();
  planner::Limits limits;
  limits.max_ranks = config.max_layout_ranks;
  limits.max_tensors = config.max_layout_tensors;
  planner::setLimits(limits);
  return absl::OkStatus();
}

// The data plane, once UCX's admission check is configured: every connection its listeners
// accept is checked (ucx_accept.cc).
StatusOr<std::unique_ptr<transport::Context>> startTransport(const DaemonConfig& config) {
  std::vector<IpRange> allow_from;
  for (const auto& text : config.ucx_allow_from) allow_from.push_back(*parseIpRange(text));  // checked
  UcxAdmission::instance().configure(config.ucx_accept == "peers", std::move(allow_from));
  auto transport = transport::createContext(transportOptions(config));
  if (!transport.ok())
    return absl::Status(transport.status().code(), "transport: " + std::string(transport.status().message()));
  spdlog::info("data plane: {}", (*transport)->describe());
  return transport;
}

// The groups local callers owned before a restart, and whether clients' segments go to the
// transport itself (--host-zero-copy; on over a transport that cannot contain their faults warns).
Status configureRegistry(Registry& registry, const DaemonConfig& config, const transport::Context& transport) {
  if (!config.socket.empty())  // only local callers own groups; the socket's lock is held
    SC_RETURN_IF_ERROR(registry.keepOwners(config.socket + ".owners", std::chrono::seconds(config.owner_grace_s)));
  if (config.host_zero_copy != "auto") registry.setHostZeroCopy(config.host_zero_copy == "on");
  if (config.host_zero_copy == "on" && !transport.capabilities().host_faults_contained)
    spdlog::warn(
        "--host-zero-copy on over {}: a client that truncates its shared-memory segment mid-sync aborts "
        "this daemon (docs/security.md)",
        transport.describe());
  return absl::OkStatus();
}

// Another daemon already serving this node name: refuse loudly rather than split the node.
Status checkNodeIsOurs(PeerSet& peers, const DaemonConfig& config) {
  v1::DescribeRequest by_digest;  // (node names are all this needs)
  by_digest.set_layout_digests(true);
  if (auto views = peers.describeAll(by_digest); views.ok())
    for (const auto& v : *views)
      if (v.described.ok() && v.described->node() == config.node)
        return absl::AlreadyExistsError("another shardcastd (at " + v.address + ") already serves node \"" +
                                        config.node + "\": give every daemon its own --node");
  peers.forgetSilence();  // peers starting with this one were not silent, only not up yet
  return absl::OkStatus();
}

// What /metrics reads at each scrape.
void connectMetrics(Metrics& metrics, const DaemonConfig& config, Registry& registry, SyncEngine& engine,
                    PeerSet& peers) {
  metrics.registered_bytes = [&] { return registry.registeredBytes(); };
  metrics.registered_ranks = [&] { return static_cast<uint64_t>(registry.registeredRanks()); };
  metrics.plan_cache_hits = [&] { return engine.plans().hits(); };
  metrics.plan_cache_misses = [&] { return engine.plans().misses(); };
  if (config.tls.enabled()) metrics.certificate_expiry = [&] { return certificateExpiry(config.tls.cert); };
  metrics.groups = [&] {
    std::map<std::string, Metrics::GroupFigures> out;
    for (const auto& g : registry.groups()) {
      auto& figures = out[g.group()];
      figures.role = g.role() == v1::ROLE_SOURCE ? "source" : "destination";
      figures.version = g.committed_version();
      for (const auto& r : g.rank_states()) ++figures.ranks[std::string(v1::rankStateName(r.state()))];
    }
    return out;
  };
  metrics.delta_base_bytes = [&] { return engine.deltaBases().bytes(); };
  metrics.delta_base_capacity = [&] { return engine.deltaBases().capacity(); };
  metrics.sessions_active = [&] { return static_cast<uint64_t>(registry.sessionCount()); };
  metrics.peers_up = [&] { return peers.reachability(); };
  metrics.rank_states = [&] {
    std::map<std::string, uint64_t> out;
    for (const auto& [state, n] : registry.stateCounts()) out[std::string(v1::rankStateName(state))] = n;
    return out;
  };
}

// The /metrics endpoint; null with --metrics "".
StatusOr<std::unique_ptr<MetricsServer>> startMetricsServer(const DaemonConfig& config, const Metrics& metrics) {
  if (config.metrics.empty()) return std::unique_ptr<MetricsServer>();
  const auto colon = config.metrics.rfind(':');
  return MetricsServer::start(config.metrics.substr(0, colon), std::stoi(config.metrics.substr(colon + 1)), metrics);
}

// The Unix socket for local clients and, beside it, the channel for descriptors of cuMem
// allocations; both null with --socket "".
struct LocalEndpoints {
  std::unique_ptr<LocalListener> listener;
  std::unique_ptr<FdChannel> fd_channel;
};

StatusOr<LocalEndpoints> bindLocal(const DaemonConfig& config, Registry& registry) {
  LocalEndpoints local;
  if (config.socket.empty()) return local;
  SC_ASSIGN_OR_RETURN(local.listener, LocalListener::bind(config.socket, config.max_local_connections_per_uid));
  SC_ASSIGN_OR_RETURN(local.fd_channel, FdChannel::bind(fdChannelPath(config.socket), registry.handedFds()));
  return local;
}

// The bearer token TCP clients may authenticate with ("" without --client-token-file).
StatusOr<std::string> clientToken(const DaemonConfig& config) {
  if (config.client_token_file.empty()) return std::string();
  return readToken(config.client_token_file);
}

// Message sizes, connection timeouts and the memory quota of every gRPC connection.
void limitServer(grpc::ServerBuilder& builder, const DaemonConfig& config) {
  // Requests: the largest legal one is a Prepare with two layouts (a Register has one, plus its
  // handles), read before any handler checks who sent it: no more than that. Replies: a Describe
  // of every group's layout and every rank's buffers (planner::Limits::max_describe_bytes).
  const auto& lim = planner::limits();
  builder.SetMaxReceiveMessageSize(static_cast<int>(2 * lim.max_layout_message_bytes + (size_t{64} << 20)));
  builder.SetMaxSendMessageSize(std::numeric_limits<int>::max());
  // A TCP connection that has not finished its TLS handshake within 5 s is closed (gRPC's default
  // is 120 s: 2,000 silent connections took a daemon off its peers), and one idle for 10 minutes
  // too (clients and peers reconnect by themselves). Every connection's buffers come out of one
  // memory quota, so that concurrent huge requests cannot take the daemon's memory
  // (docs/security.md, "Limits"). The builder holds its own reference to the quota.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, static_cast<int>(kHandshakeTimeout.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 600000);
  grpc::ResourceQuota quota("shardcastd");
  quota.Resize(static_cast<size_t>(config.grpc_memory_mib) << 20);
  builder.SetResourceQuota(quota);
}

// The TCP listener (--listen) and the acceptor it hands connections to, with mutual TLS (or a
// bearer token instead of a client certificate) or, --insecure, plaintext; both null without it.
struct TcpEndpoint {
  std::unique_ptr<TcpListener> listener;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
};

StatusOr<TcpEndpoint> bindTcp(grpc::ServerBuilder& builder, const DaemonConfig& config, bool has_token) {
  TcpEndpoint tcp;
  if (config.listen.empty()) return tcp;
  if (config.insecure)
    spdlog::warn(
        "--insecure: {} is PLAINTEXT and unauthenticated: anyone who reaches it can register memory, read "
        "and write weights and commit versions; use only on one trusted host",
        config.listen);
  SC_ASSIGN_OR_RETURN(tcp.listener, TcpListener::bind(config.listen, config.max_connections_per_address,
                                                      config.max_handshaking_connections));
  tcp.acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
      config.insecure ? grpc::InsecureServerCredentials()
                      : serverCredentials(config.tls, /*require_client_cert=*/!has_token));
  return tcp;
}

// The start-up log lines, and the stdout line supervisors and tests wait for: the daemon is ready.
void announceReady(const DaemonConfig& config, bool has_token, int tcp_port, int metrics_port) {
  if (config.tls.enabled())
    spdlog::info("mutual TLS: certificate {}, CA {} (re-read every {} s); TCP clients need a certificate of the CA{}",
                 config.tls.cert, config.tls.ca, config.tls.reload_s, has_token ? " or the bearer token" : "");
  spdlog::info("serving node \"{}\" on {}{}", config.node, config.listen.empty() ? "" : config.listen + " ",
               config.socket.empty() ? "" : "unix:" + config.socket);
  std::cout << "shardcastd ready node=" << config.node << " port=" << tcp_port << " metrics_port=" << metrics_port
            << std::endl;
}

// Bounds the shutdown: whatever still runs after the grace period (a call to a stopped peer, a
// transport close that cannot flush) is abandoned and the process exits.
void exitAfterGrace(std::chrono::milliseconds grace, const std::string& socket) {
  std::thread([grace, socket] {
    std::this_thread::sleep_for(grace + std::chrono::seconds(2));
    spdlog::error("shutdown took longer than the grace period: exiting now");
    spdlog::default_logger()->flush();
    if (!socket.empty()) ::unlink(socket.c_str());
    ::_exit(1);
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  // gRPC locks abseil mutexes on every call, and Debian's abseil keeps a lock-order graph for
  // deadlock detection on each (GraphCycles: about 3% of 32 daemons' CPU in a control-plane
  // profile). The daemon's own locks are std::mutex; nothing here relies on that check.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const sigset_t signals = blockStopSignals();
  int exit_code = 0;
  std::string output;
  auto config = parseConfig(argc, argv, &exit_code, &output);
  if (!config.ok()) return endParse(config.status(), exit_code, output);
  if (Status st = applyProcessSettings(*config); !st.ok()) return fail(std::string(st.message()));
  std::string error;
  const int socket_lock = config->socket.empty() ? -1 : lockSocket(config->socket, &error);
  if (!error.empty()) return fail(error);
  // Declared before the transport, which may reach them (--emulate-gpu-reach): it goes first.
  std::unique_ptr<transport::EmulatedGpus> emulated;
  auto transport = startTransport(*config);
  if (!transport.ok()) return fail(std::string(transport.status().message()));

  if (config->emulate_gpus > 0) {
    emulated = std::make_unique<transport::EmulatedGpus>(config->emulate_gpus, /*abort_on_hazard=*/true);
    spdlog::warn("GPUs: {} emulated in host memory (--emulate-gpus, for tests); this node's own are not used",
                 config->emulate_gpus);
    if (!config->emulate_gpu_reach.empty()) {  // checked with the flags
      *transport = transport::reachEmulatedGpus(std::move(*transport), *emulated,
                                                *emulatedGpuReach(config->emulate_gpu_reach, config->emulate_gpus));
      spdlog::warn("data plane: {} (--emulate-gpu-reach, for tests)", (*transport)->describe());
    }
  }
  if (config->device_memory == "staged") {
    *transport = transport::stageDeviceMemory(std::move(*transport));
    spdlog::info("data plane: {}", (*transport)->describe());
  }
  Registry registry(config->node, **transport, emulated ? *emulated : transport::cudaRuntime());
  if (Status st = configureRegistry(registry, *config, **transport); !st.ok()) return fail(std::string(st.message()));
  PeerSet peers(*config, registry.instance());
  if (Status st = checkNodeIsOurs(peers, *config); !st.ok()) return fail(std::string(st.message()));
  Metrics metrics(config->metrics_names);
  PeerLimits peer_limits;
  peer_limits.max_lease = std::chrono::milliseconds(config->max_sync_lease_ms);
  SyncEngine engine(config->node, registry, **transport, metrics, static_cast<uint64_t>(config->window_bytes), nullptr,
                    static_cast<uint64_t>(config->delta_cache_mib) << 20,
                    static_cast<uint64_t>(config->delta_device_mib) << 20, peer_limits);
  engine.plans().setCapacity(static_cast<size_t>(config->plan_cache_entries));
  connectMetrics(metrics, *config, registry, engine, peers);
  auto metrics_server = startMetricsServer(*config, metrics);
  if (!metrics_server.ok()) return fail(std::string(metrics_server.status().message()));
  auto local = bindLocal(*config, registry);
  if (!local.ok()) return fail(std::string(local.status().message()));
  auto token = clientToken(*config);
  if (!token.ok()) return fail(std::string(token.status().message()));
  const AccessPolicy access(config->insecure, *token, local->listener.get());
  ProgressBoard progress;
  ShardcastService shardcast(*config, access, registry, peers, engine, metrics, progress, (*transport)->describe());
  PeerService peer(access, registry, peers, engine, progress);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  limitServer(builder, *config);
  auto tcp = bindTcp(builder, *config, !token->empty());
  if (!tcp.ok()) return fail(std::string(tcp.status().message()));
  builder.RegisterService(&shardcast);
  builder.RegisterService(&peer);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return fail("cannot serve on " + config->listen);
  // The whole server ("") is SERVING from here; each service by its name too, for probes that ask
  // for one (Kubernetes' grpc probe `service:`, `shardcast health --service`).
  for (const char* service : {v1::Shardcast::service_full_name(), v1::Peer::service_full_name()})
    server->GetHealthCheckService()->SetServingStatus(service, true);
  if (tcp->listener) tcp->listener->serve(std::move(tcp->acceptor));
  if (local->listener) local->listener->serve(server.get());
  if (local->fd_channel) local->fd_channel->serve();
  metrics.serving = true;
  announceReady(*config, !token->empty(), tcp->listener ? tcp->listener->port() : 0,
                *metrics_server ? (*metrics_server)->port() : 0);

  const int sig = waitForSignal(signals);
  const auto grace = std::chrono::milliseconds(config->shutdown_grace_ms);
  spdlog::info("signal {} received: shutting down (grace {} ms)", sig, grace.count());
  exitAfterGrace(grace, config->socket);
  metrics.serving = false;
  shardcast.stop();     // session streams end (their clients re-register with the next daemon)
  registry.shutdown();  // waiting acquires and version waits return
  engine.abortAll("the daemon is shutting down");
  if (local->listener) local->listener->stop();
  local->fd_channel.reset();  // stops, and removes its socket file
  if (tcp->listener) tcp->listener->stop();
  server->Shutdown(std::chrono::system_clock::now() + grace);
  if (!config->socket.empty()) ::unlink(config->socket.c_str());
  server.reset();
  spdlog::info("stopped");
  if (socket_lock >= 0) ::close(socket_lock);
  return 0;
}
