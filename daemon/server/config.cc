#include "daemon/server/config.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "common/strings.h"
#include "daemon/server/ucx_admission.h"

namespace shardcast::daemon {

std::string DaemonConfig::describe() const {
  std::ostringstream os;
  os << "node=" << node << " listen=" << (listen.empty() ? "(none)" : listen)
     << " socket=" << (socket.empty() ? "(none)" : socket)
     << " peers=" << (peers.empty() ? "(none)" : strJoin(peers, ","))
     << " peer_dns=" << (peer_dns.empty() ? "(none)" : peer_dns) << " transport=" << transport
     << " ucx_tls=" << (ucx_tls.empty() ? "(default)" : ucx_tls) << " protocol=" << protocol
     << " host_zero_copy=" << host_zero_copy << " device_memory=" << device_memory << " ucx_accept=" << ucx_accept
     << " ucx_allow_from=" << (ucx_allow_from.empty() ? "(none)" : strJoin(ucx_allow_from, ","))
     << " ucx_tcp_segment_kib=" << ucx_tcp_segment_kib << " log_level=" << log_level << " log_format=" << log_format
     << " peer_timeout_ms=" << peer_timeout_ms << " peer_lease_ms=" << peer_lease_ms << " relay_fanout=" << relay_fanout
     << " fold_prepare=" << fold_prepare << " chunk_kib=" << (chunk_bytes >> 10) << " staging_mib=" << staging_mib
     << " window_kib=" << (window_bytes >> 10) << " nic_gbps=" << nic_gbps << " delta_cache_mib=" << delta_cache_mib
     << " plan_cache_entries=" << plan_cache_entries << " delta_device_mib=" << delta_device_mib
     << " delta_dense_every=" << delta_dense_every << " metrics=" << (metrics.empty() ? "(off)" : metrics)
     << " sync_lease_ms=" << sync_lease_ms << " max_sync_lease_ms=" << max_sync_lease_ms
     << " owner_grace_s=" << owner_grace_s << " max_local_connections_per_uid=" << max_local_connections_per_uid
     << " max_connections_per_address=" << max_connections_per_address
     << " max_handshaking_connections=" << max_handshaking_connections << " grpc_memory_mib=" << grpc_memory_mib
     << " shutdown_grace_ms=" << shutdown_grace_ms << " max_wait_ms=" << max_wait_ms
     << " metrics_names=" << (metrics_names ? "true" : "false") << " tls="
     << (tls.enabled() ? strCat("cert:", tls.cert, ",key:", tls.key, ",ca:", tls.ca, ",reload_s:", tls.reload_s)
                       : "(none)")
     << " insecure=" << (insecure ? "true" : "false")
     << " client_token_file=" << (client_token_file.empty() ? "(none)" : client_token_file)
     << " max_layout_ranks=" << max_layout_ranks << " max_layout_tensors=" << max_layout_tensors
     << " emulate_gpus=" << emulate_gpus
     << " emulate_gpu_reach=" << (emulate_gpu_reach.empty() ? "(none)" : emulate_gpu_reach);
  return os.str();
}

std::string DaemonConfig::selfAddress() const {
  if (listen.empty()) return "unix:" + socket;
  const auto colon = listen.rfind(':');
  const std::string host = listen.substr(0, colon);
  return (host == "0.0.0.0" || host == "[::]" ? "127.0.0.1" : host) + listen.substr(colon);
}

namespace {

Status checkHostPort(const std::string& what, const std::string& v) {
  const auto colon = v.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == v.size())
    return absl::InvalidArgumentError(strCat(what, " \"", v, "\" must be host:port"));
  const std::string port = v.substr(colon + 1);
  if (port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
    return absl::InvalidArgumentError(strCat(what, " \"", v, "\": bad port \"", port, "\""));
  return absl::OkStatus();
}

// Where this daemon serves and how it finds its peers.
void addAddressFlags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--node", c.node, "Node name of this daemon (layouts name nodes)")
      ->envname("SHARDCAST_NODE")
      ->capture_default_str();
  app.add_option("--listen", c.listen, "TCP host:port for clients and peers (empty: none)")
      ->envname("SHARDCAST_LISTEN")
      ->capture_default_str();
  app.add_option("--socket", c.socket, "Unix socket for local clients, mode 0660 (empty: none)")
      ->envname("SHARDCAST_SOCKET")
      ->capture_default_str();
  app.add_option("--peers", c.peers, "Static peer daemons, host:port (comma-separated)")
      ->envname("SHARDCAST_PEERS")
      ->delimiter(',');
  app.add_option("--peer-dns", c.peer_dns, "DNS name:port whose addresses are every daemon (a headless Service)")
      ->envname("SHARDCAST_PEER_DNS");
}

// The data plane: backend, UCX's settings, and what UCX and the transport may touch.
void addTransportFlags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--transport", c.transport, "Data plane backend")
      ->envname("SHARDCAST_TRANSPORT")
      ->check(CLI::IsMember({"ucx", "loopback"}))
      ->capture_default_str();
  app.add_option("--ucx-tls", c.ucx_tls, "UCX transports (UCX_TLS syntax; empty: UCX's default)")
      ->envname("SHARDCAST_UCX_TLS");
  app.add_option("--protocol", c.protocol, "Write protocol: put (RMA), am (active messages) or auto")
      ->envname("SHARDCAST_PROTOCOL")
      ->check(CLI::IsMember({"auto", "put", "am"}))
      ->capture_default_str();
  app.add_option("--host-zero-copy", c.host_zero_copy,
                 "Send from and land in clients' shared-memory segments directly (auto: only over transports the "
                 "kernel does not copy through, RDMA; on: also over tcp, where a client truncating its own segment "
                 "mid-sync aborts this daemon inside UCX; off: always through this daemon's staging and arena)")
      ->envname("SHARDCAST_HOST_ZERO_COPY")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--device-memory", c.device_memory,
                 "GPU buffers: auto registers them with the transport directly where it reaches device memory "
                 "(a CUDA-aware UCX: cuda_ipc, GPUDirect RDMA) and stages them through pinned host memory "
                 "elsewhere; staged always stages them (a fabric whose GPUDirect path is broken or slower)")
      ->envname("SHARDCAST_DEVICE_MEMORY")
      ->check(CLI::IsMember({"auto", "staged"}))
      ->capture_default_str();
  app.add_option("--ucx-accept", c.ucx_accept,
                 "Who may connect to UCX's own listeners, which parse a connecting peer's handshake before any "
                 "check of this daemon (a malformed one aborts the process): peers (sockets of this daemon's uid "
                 "on this host, addresses the cluster's daemons talked from over the authenticated control plane, "
                 "and --ucx-allow-from) or any")
      ->envname("SHARDCAST_UCX_ACCEPT")
      ->check(CLI::IsMember({"peers", "any"}))
      ->capture_default_str();
  app.add_option("--ucx-allow-from", c.ucx_allow_from,
                 "With --ucx-accept peers: address ranges (CIDR, comma-separated) whose connections UCX also takes "
                 "(a NIC the daemons' UCX traffic comes from that their gRPC calls do not)")
      ->envname("SHARDCAST_UCX_ALLOW_FROM")
      ->delimiter(',');
  app.add_option("--ucx-tcp-segment-kib", c.ucx_tcp_segment_kib,
                 "UCX over TCP: segment size, the fragment large writes travel in (0: UCX's default, 64 KiB; "
                 "UCX_TCP_RX_SEG_SIZE in the environment wins)")
      ->envname("SHARDCAST_UCX_TCP_SEGMENT_KIB")
      ->check(CLI::Range(int64_t{0}, int64_t{64} << 10))
      ->capture_default_str();
}

void addLogFlags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--log-level", c.log_level, "trace, debug, info, warn, error, critical, off")
      ->envname("SHARDCAST_LOG_LEVEL")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  app.add_option("--log-format", c.log_format,
                 "text (lines for people) or json (one object per line: time, level, node, and the sync, group "
                 "and rank a line is about)")
      ->envname("SHARDCAST_LOG_FORMAT")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
}

// Calls between daemons: their deadline, folded Prepares, relays, silent peers.
void addPeerFlags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--peer-timeout-ms", c.peer_timeout_ms, "Deadline of calls between daemons")
      ->envname("SHARDCAST_PEER_TIMEOUT_MS")
      ->check(CLI::Range(1, 600000))
      ->capture_default_str();
  app.add_option("--fold-prepare", c.fold_prepare,
                 "When a sync that repeats the last one sends each daemon's Prepare with its first Execute (one "
                 "call round fewer): auto (every destination rank double-buffered), always (a daemon failing its "
                 "Prepare may leave single-buffered destinations elsewhere DIRTY), never")
      ->envname("SHARDCAST_FOLD_PREPARE")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  app.add_option("--relay-fanout", c.relay_fanout,
                 "A coordinator calls at most this many daemons directly per phase; more go through a tree of "
                 "Relays (0: always directly)")
      ->envname("SHARDCAST_RELAY_FANOUT")
      ->check(CLI::Range(0, 65536))
      ->check(
          [](const std::string& v) { return v == "1" ? std::string("a relay fanout is 0 (off) or at least 2") : ""; },
          "0 or at least 2")
      ->capture_default_str();
  app.add_option("--peer-lease-ms", c.peer_lease_ms,
                 "A peer silent this long is forgotten until it answers again: not waited for (100 ms), and "
                 "failing no sync; 0: never")
      ->envname("SHARDCAST_PEER_LEASE_MS")
      ->check(CLI::Range(0, 86400000))
      ->capture_default_str();
}

// --chunk-mib and --window-mib, to tell given values from defaults (sizeForLink).
struct SizeFlags {
  CLI::Option* chunk = nullptr;
  CLI::Option* window = nullptr;
};

// How large transfers travel, and the memory syncs and delta bases get.
SizeFlags addTransferFlags(CLI::App& app, DaemonConfig& c) {
  SizeFlags given;
  given.chunk = app.add_option("--chunk-mib", c.chunk_mib,
                               "Large transfers travel in chunks of this size (pipelined along relays)")
                    ->envname("SHARDCAST_CHUNK_MIB")
                    ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
                    ->capture_default_str();
  app.add_option("--staging-mib", c.staging_mib,
                 "Per-node memory for landing and staging a sync's transfers (bigger syncs run in waves)")
      ->envname("SHARDCAST_STAGING_MIB")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  given.window =
      app.add_option(
             "--window-mib", c.window_mib,
             "Bytes of writes in flight to each peer node (more chunks wait, so each lands early and relays start)")
          ->envname("SHARDCAST_WINDOW_MIB")
          ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
          ->capture_default_str();
  app.add_option("--nic-gbps", c.nic_gbps,
                 "This node's link rate in Gbit/s: chunks of about 8 ms on the link (1-64 MiB) and a window of two "
                 "chunks unless --chunk-mib/--window-mib are given, and the plan's cost model (0: unknown)")
      ->envname("SHARDCAST_NIC_GBPS")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  app.add_option("--delta-cache-mib", c.delta_cache_mib,
                 "Host memory for delta syncs' bases: the bytes last sent of each chunk this node packs, all plans "
                 "(chunks beyond it travel dense; 0: no delta syncs from this node)")
      ->envname("SHARDCAST_DELTA_CACHE_MIB")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--plan-cache-entries", c.plan_cache_entries,
                 "Plans this daemon keeps for syncs that repeat (each pair of layouts, each replica set's "
                 "membership), the least recently used evicted first (a plan's memory grows with its layouts)")
      ->envname("SHARDCAST_PLAN_CACHE_ENTRIES")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--delta-device-mib", c.delta_device_mib,
                 "GPU memory for delta syncs' bases of chunks packed from device memory, over all GPUs of this node: "
                 "their deltas are encoded on the GPU, and delta chunks landing here for ranks in device memory are "
                 "rebuilt on a GPU (one more chunk of device memory while a sync runs); only the changed elements "
                 "cross PCIe (0: on the host, after a copy of every chunk)")
      ->envname("SHARDCAST_DELTA_DEVICE_MIB")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--delta-dense-every", c.delta_dense_every,
                 "Syncs this daemon coordinates with delta DELTA_AUTO go dense (bases refreshed) when their version is "
                 "a multiple of this (0: never)")
      ->envname("SHARDCAST_DELTA_DENSE_EVERY")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  return given;
}

// The metrics endpoint, how long syncs and owners' groups are held, and the limits that keep the
// service up under load.
void addServiceFlags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--metrics", c.metrics, "host:port of the Prometheus /metrics endpoint (empty: off)")
      ->envname("SHARDCAST_METRICS")
      ->capture_default_str();
  app.add_option("--sync-lease-ms", c.sync_lease_ms,
                 "A sync whose coordinator stays silent this long is aborted on every daemon (its destination ranks "
                 "marked dirty); a daemon silent this long fails the sync it takes part in")
      ->envname("SHARDCAST_SYNC_LEASE_MS")
      ->check(CLI::Range(200, 600000))
      ->capture_default_str();
  app.add_option("--max-sync-lease-ms", c.max_sync_lease_ms,
                 "The longest lease a coordinating daemon may give a sync here (a Prepare asking more is refused): "
                 "bounds how long a silent or hostile peer can hold this node's ranks")
      ->envname("SHARDCAST_MAX_SYNC_LEASE_MS")
      ->check(CLI::Range(200, 600000))
      ->capture_default_str();
  app.add_option("--owner-grace-s", c.owner_grace_s,
                 "After a restart, the groups local clients had registered stay reserved for their owner uid this "
                 "long (kept in <socket>.owners): no other uid can register those names meanwhile")
      ->envname("SHARDCAST_OWNER_GRACE_S")
      ->check(CLI::Range(0, 86400))
      ->capture_default_str();
  app.add_option("--max-local-connections-per-uid", c.max_local_connections_per_uid,
                 "Unix-socket connections one uid other than root may hold open at once (more are closed at accept)")
      ->envname("SHARDCAST_MAX_LOCAL_CONNECTIONS_PER_UID")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--max-connections-per-address", c.max_connections_per_address,
                 "TCP connections one remote address may hold open at once (more are closed at accept; peers "
                 "and clients need a few each)")
      ->envname("SHARDCAST_MAX_CONNECTIONS_PER_ADDRESS")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--max-handshaking-connections", c.max_handshaking_connections,
                 "TCP connections accepted within the last handshake timeout (5 s), from all addresses together: "
                 "past it the oldest of them is closed to make room (silent connections spread over many "
                 "addresses cannot hold up peers' handshakes)")
      ->envname("SHARDCAST_MAX_HANDSHAKING_CONNECTIONS")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--grpc-memory-mib", c.grpc_memory_mib,
                 "Memory gRPC may use for every connection's buffers together (a quota: requests wait or fail "
                 "beyond it, the daemon stays up)")
      ->envname("SHARDCAST_GRPC_MEMORY_MIB")
      ->check(CLI::Range(int64_t{64}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--shutdown-grace-ms", c.shutdown_grace_ms,
                 "On SIGTERM: how long syncs and calls in flight get before the daemon aborts them and exits")
      ->envname("SHARDCAST_SHUTDOWN_GRACE_MS")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  app.add_option("--max-wait-ms", c.max_wait_ms,
                 "The longest wait a client may ask for: a Sync's, WaitVersion's or Acquire's timeout_ms above it "
                 "is refused (INVALID_ARGUMENT)")
      ->envname("SHARDCAST_MAX_WAIT_MS")
      ->check(CLI::Range(int64_t{1000}, int64_t{std::numeric_limits<uint32_t>::max()}))
      ->capture_default_str();
}

// Who is authenticated, and what /metrics names.
void addSecurityFlags(CLI::App& app, DaemonConfig& c) {
  app.add_flag("--metrics-names", c.metrics_names,
               "/metrics labels name groups, sources, replica sets and peer nodes (otherwise each is a hash of the "
               "name): the metrics port is plaintext and unauthenticated")
      ->envname("SHARDCAST_METRICS_NAMES");
  app.add_option("--tls-cert", c.tls.cert,
                 "This daemon's certificate chain (PEM; its DNS names include shardcast-daemon)")
      ->envname("SHARDCAST_TLS_CERT");
  app.add_option("--tls-key", c.tls.key, "Its private key (PEM)")->envname("SHARDCAST_TLS_KEY");
  app.add_option("--tls-ca", c.tls.ca, "The cluster CA: peers' and clients' certificates must chain to it (PEM)")
      ->envname("SHARDCAST_TLS_CA");
  app.add_option("--tls-reload-s", c.tls.reload_s, "How often the three TLS files are re-read (rotated certificates)")
      ->envname("SHARDCAST_TLS_RELOAD_S")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
  app.add_flag("--insecure", c.insecure,
               "Plaintext TCP: no peer or client is authenticated and anyone reaching --listen can read and write "
               "registered memory (one trusted host only)")
      ->envname("SHARDCAST_INSECURE");
  app.add_option("--client-token-file", c.client_token_file,
                 "TCP clients may authenticate with this bearer token (first line of the file) instead of a client "
                 "certificate")
      ->envname("SHARDCAST_CLIENT_TOKEN_FILE");
}

// The largest layouts taken, and the GPUs tests emulate.
void addLayoutAndTestFlags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--max-layout-ranks", c.max_layout_ranks,
                 "Largest mesh a layout may have (ranks); bigger layouts are refused at registration")
      ->envname("SHARDCAST_MAX_LAYOUT_RANKS")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 22))
      ->capture_default_str();
  app.add_option("--max-layout-tensors", c.max_layout_tensors, "Most tensors (and fused buffers) one layout may have")
      ->envname("SHARDCAST_MAX_LAYOUT_TENSORS")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--emulate-gpus", c.emulate_gpus,
                 "Tests only: this many GPUs emulated in host memory instead of the node's (CUDA buffers are then "
                 "shared-memory segments named by emulated IPC handles; device copies run only when waited for)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--emulate-gpu-reach", c.emulate_gpu_reach,
                 "Tests only, with --emulate-gpus: the transport reaches the emulated GPUs' memory as a CUDA-aware "
                 "UCX reaches device memory (registered directly, no staging): all, or a list of GPU indexes "
                 "(0,2); the other GPUs' buffers fall back to staging, each named in the log");
}

// What the flags cannot check one by one: addresses, ranges, combinations, files.
Status checkDaemonConfig(const DaemonConfig& c) {
  if (c.node.empty()) return absl::InvalidArgumentError("--node is empty and the hostname is unknown");
  if (!c.listen.empty()) SC_RETURN_IF_ERROR(checkHostPort("--listen", c.listen));
  for (const auto& p : c.peers) SC_RETURN_IF_ERROR(checkHostPort("--peers entry", p));
  if (!c.peer_dns.empty()) SC_RETURN_IF_ERROR(checkHostPort("--peer-dns", c.peer_dns));
  for (const auto& range : c.ucx_allow_from) SC_RETURN_IF_ERROR(parseIpRange(range).status());
  if (!c.metrics.empty()) SC_RETURN_IF_ERROR(checkHostPort("--metrics", c.metrics));
  if (!c.peers.empty() && !c.peer_dns.empty())
    return absl::InvalidArgumentError("give --peers or --peer-dns, not both");
  if (c.listen.empty() && c.socket.empty()) return absl::InvalidArgumentError("--listen and --socket are both empty");
  if (!c.emulate_gpu_reach.empty()) {
    if (c.emulate_gpus == 0) return absl::InvalidArgumentError("--emulate-gpu-reach needs --emulate-gpus");
    SC_RETURN_IF_ERROR(emulatedGpuReach(c.emulate_gpu_reach, c.emulate_gpus).status());
  }
  if (c.max_sync_lease_ms < c.sync_lease_ms)
    return absl::InvalidArgumentError(strCat("--max-sync-lease-ms ", c.max_sync_lease_ms, " is below --sync-lease-ms ",
                                             c.sync_lease_ms, ": this daemon's own syncs would be refused"));
  if (c.insecure && c.tls.enabled())
    return absl::InvalidArgumentError("give --tls-cert/--tls-key/--tls-ca or --insecure, not both");
  if (!c.listen.empty() && !c.insecure && !c.tls.enabled())
    return absl::InvalidArgumentError(
        "--listen serves peers and remote clients, which must be authenticated: give --tls-cert, --tls-key and "
        "--tls-ca "
        "(scripts/certs.sh mints them), or --insecure for plaintext on a trusted host, or --listen \"\" for one node");
  if (c.tls.enabled()) SC_RETURN_IF_ERROR(c.tls.check());
  if (!c.client_token_file.empty()) SC_RETURN_IF_ERROR(readToken(c.client_token_file).status());
  // The backend judges its own settings: UCX refuses put over transports that cannot bound it
  // unless --insecure (tcp, cma and shared memory emulate RMA).
  if (Status st = transport::checkOptions(transportOptions(c)); !st.ok())
    return Status(st.code(), strCat("--transport ", c.transport,
                                    " with --ucx-tls, --protocol and --ucx-tcp-segment-kib: ", st.message()));
  return absl::OkStatus();
}

}  // namespace

void sizeForLink(DaemonConfig* c, bool chunk_given, bool window_given) {
  c->chunk_bytes = c->chunk_mib << 20;
  c->window_bytes = c->window_mib << 20;
  if (c->nic_gbps <= 0) return;
  // A relay forwards a chunk once it has landed whole: each hop of a chain adds one chunk's time
  // on the link to the sync. About 8 ms of it (the nearest power of two: 512 KiB at 0.5 Gbit/s,
  // 1 MiB at 1, 8 MiB at 10, 64 MiB from 100 Gbit/s on; at least 64 KiB) keeps that small against
  // a sync while the per-chunk costs stay negligible; a window of two chunks per peer keeps the
  // link busy and lets each chunk land (and move on) in order.
  const double bytes = c->nic_gbps * 1e9 / 8 * 0.008;
  int64_t chunk = int64_t{64} << 10;
  while (chunk < (int64_t{64} << 20) && static_cast<double>(chunk) * 1.4142 < bytes) chunk *= 2;
  if (!chunk_given) c->chunk_bytes = chunk;
  if (!window_given) c->window_bytes = 2 * c->chunk_bytes;
}

StatusOr<DaemonConfig> parseConfig(int argc, char** argv, int* exit_code, std::string* output) {
  DaemonConfig c;
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) == 0) c.node = host;
  CLI::App app{"shardcastd: the Shardcast per-node daemon (gRPC control plane, UCX data plane)"};
  app.set_config("--config", "",
                 "Read settings from an INI or TOML file (flag names as keys; unknown keys are an error)");
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.set_version_flag("--version", std::string("shardcastd ") + kShardcastVersion);
  // In this order in --help.
  addAddressFlags(app, c);
  addTransportFlags(app, c);
  addLogFlags(app, c);
  addPeerFlags(app, c);
  const SizeFlags sizes = addTransferFlags(app, c);
  addServiceFlags(app, c);
  addSecurityFlags(app, c);
  addLayoutAndTestFlags(app, c);
  bool print_config = false;
  app.add_flag("--print-config", print_config, "Print the effective configuration and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::ostringstream out, err;
    *exit_code = app.exit(e, out, err) == 0 ? 0 : 2;
    *output = out.str() + err.str();
    return absl::InvalidArgumentError(*output);
  }
  SC_RETURN_IF_ERROR(checkDaemonConfig(c));
  sizeForLink(&c, sizes.chunk->count() > 0, sizes.window->count() > 0);
  if (print_config) {
    *exit_code = 0;
    *output = c.describe() + "\n";
    return absl::CancelledError("printed the configuration");
  }
  return c;
}

transport::TransportOptions transportOptions(const DaemonConfig& c) {
  transport::TransportOptions o;
  o.backend = c.transport;
  o.name = c.node;
  o.bounded_writes_only = !c.insecure;
  o.settings = {{"ucx.tls", c.ucx_tls},
                {"ucx.protocol", c.protocol},
                {"ucx.tcp_segment_bytes", std::to_string(c.ucx_tcp_segment_kib << 10)}};
  return o;
}

StatusOr<std::set<int>> emulatedGpuReach(const std::string& flag, int gpus) {
  std::set<int> out;
  if (flag == "all") return out;
  for (size_t at = 0; at <= flag.size();) {
    const size_t comma = std::min(flag.find(',', at), flag.size());
    const std::string part = flag.substr(at, comma - at);
    at = comma + 1;
    char* end = nullptr;
    const long gpu = std::strtol(part.c_str(), &end, 10);
    if (part.empty() || end != part.c_str() + part.size() || gpu < 0 || gpu >= gpus || !out.insert(int(gpu)).second)
      return absl::InvalidArgumentError(strCat("--emulate-gpu-reach \"", flag, "\": give all, or distinct GPU indexes ",
                                               "below --emulate-gpus ", gpus, " separated by commas"));
  }
  return out;
}

}  // namespace shardcast::daemon
