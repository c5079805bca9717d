// shardcastd's configuration: every flag but --emulate-gpus (tests only) has an environment
// variable (SHARDCAST_<FLAG>), values may also come from an INI/TOML file (--config); validated
// once and logged once at start-up.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "common/defaults.h"
#include "common/status.h"
#include "common/tls.h"
#include "transport/transport.h"

namespace shardcast::daemon {

struct DaemonConfig {
  std::string node;                     // this daemon's node name (default: hostname)
  std::string listen = kDefaultListen;  // TCP address for clients and peers ("" = none)
  std::string socket = kDefaultSocket;  // Unix socket for local clients ("" = none)
  std::vector<std::string> peers;       // static peer list, host:port
  std::string peer_dns;                 // or: a DNS name (host:port) listing every daemon
  std::string transport = "ucx";        // ucx | loopback
  std::string ucx_tls;                  // UCX_TLS for the data plane ("" = UCX default)
  std::string protocol = "auto";        // auto | put | am
  int64_t ucx_tcp_segment_kib = 1024;   // UCX over TCP: fragment size (0 = UCX's 64 KiB)
  // Clients' host segments handed to the transport itself (zero-copy sends and landings): auto
  // where it cannot fault on them (transport::Capabilities::host_faults_contained), on, or off.
  std::string host_zero_copy = "auto";
  // Device buffers registered with the transport directly where it reaches device memory (auto:
  // a CUDA-aware UCX), or always staged through pinned host memory (staged).
  std::string device_memory = "auto";
  // Who may open a connection to UCX's own listeners (docs/security.md, "UCX's connection
  // handshake"): peers (this uid's sockets on this host, addresses the cluster's daemons spoke
  // from, and ucx_allow_from) or any.
  std::string ucx_accept = "peers";
  std::vector<std::string> ucx_allow_from;  // address ranges (CIDR) admitted besides, with peers
  std::string log_level = "info";
  std::string log_format = "text";  // text (for people) or json (one object per line)
  int peer_timeout_ms = 5000;       // deadline of daemon-to-daemon calls
  // A peer silent this long is forgotten until it answers again: gathers give it 100 ms, and it
  // fails no sync (0: never forgotten).
  int peer_lease_ms = 30000;
  // A coordinator calls at most this many daemons directly per phase (Prepare, Execute, the
  // commit's Finish); a larger cluster's calls go through a tree of Relays (0: always directly).
  int relay_fanout = 64;
  // When a repeated dense sync sends each daemon's Prepare with its first Execute (no Prepare
  // round; ExecuteRequest.prepare, docs/daemon.md "A sync"): "auto" when every destination rank
  // is double-buffered (a daemon failing its Prepare then costs no rank its version), "always"
  // (single-buffered destinations elsewhere may then be left DIRTY by it, holding part of the
  // bytes, until a later sync), "never".
  std::string fold_prepare = "auto";
  int64_t chunk_mib = 64;      // --chunk-mib: chunk size of large transfers
  int64_t staging_mib = 1024;  // per-node landing and staging budget of a sync
  int64_t window_mib = 128;    // --window-mib: bytes in flight to each peer node
  // This node's link rate, Gbit/s (0: not given). Sizes what travels for it where --chunk-mib and
  // --window-mib are not given (sizeForLink), and is the Plan RPC's default cost model.
  double nic_gbps = 0;
  // In effect: the options', or sized for the link (below 1 MiB on slow links).
  int64_t chunk_bytes = int64_t{64} << 20;
  int64_t window_bytes = int64_t{128} << 20;
  int64_t delta_cache_mib = 8192;           // host memory for delta bases (all plans)
  int plan_cache_entries = 16;              // plans kept for syncs that repeat (PlanCache)
  int64_t delta_device_mib = 0;             // GPU memory for delta bases (all GPUs): encoded there
  int64_t delta_dense_every = 0;            // DELTA_AUTO syncs of versions divisible by this go dense
  std::string metrics = kDefaultMetrics;    // Prometheus /metrics host:port ("" = off)
  int sync_lease_ms = 10000;                // a sync whose coordinator is silent this long is aborted
  int max_sync_lease_ms = 60000;            // the longest lease a coordinating peer may ask for
  int owner_grace_s = 300;                  // after a restart, groups stay reserved for their owner uid this long
  int max_local_connections_per_uid = 256;  // open Unix-socket connections per uid (root: any)
  int max_connections_per_address = 256;    // open TCP connections per remote address
  int max_handshaking_connections = 1024;   // TCP connections younger than the handshake timeout, all addresses
  int64_t grpc_memory_mib = 1024;           // gRPC's memory quota: every connection's buffers together
  int shutdown_grace_ms = 10000;            // SIGTERM: then abort whatever is left and exit
  // The longest wait a client may ask for (a Sync's, a WaitVersion's, an Acquire's timeout_ms): a
  // longer one is refused, so no call holds a thread and its CPU past it.
  int64_t max_wait_ms = 3600000;
  // /metrics labels name groups, sources, replica sets and peer nodes (else hashes of the names):
  // the port is plaintext and unauthenticated.
  bool metrics_names = false;
  TlsFiles tls;                                   // mutual TLS on the TCP listener and to peers
  bool insecure = false;                          // plaintext TCP, nobody authenticated (tests on one host)
  std::string client_token_file;                  // TCP clients may also authenticate with this bearer token
  int64_t max_layout_ranks = int64_t{1} << 16;    // planner::Limits::max_ranks
  int64_t max_layout_tensors = int64_t{1} << 17;  // planner::Limits::max_tensors
  // Tests only: this many GPUs emulated in host memory (transport/emulated_gpus.h) instead of the
  // node's (0: the node's own, through CUDA).
  int emulate_gpus = 0;
  // Tests only, with emulate_gpus: the transport reaches the emulated GPUs' memory as a CUDA-aware
  // UCX reaches device memory ("all", or the GPUs' indexes "0,2"); "" = it reaches none (staged).
  std::string emulate_gpu_reach;

  // One line per setting, for the start-up log and `--print-config`.
  std::string describe() const;
  // How this daemon reaches itself: its TCP address (a wildcard host as 127.0.0.1), else its socket.
  std::string selfAddress() const;
};

// Parses argv (and SHARDCAST_* variables, and --config FILE). Returns the config, or a Status whose
// message is the usage error. `exit_code` is set when parsing ends the program (--help: 0, error: 2).
// chunk_bytes and window_bytes: from --chunk-mib and --window-mib where given, else with a link
// rate (nic_gbps > 0) sized for it, else the defaults.
void sizeForLink(DaemonConfig* c, bool chunk_given, bool window_given);
StatusOr<DaemonConfig> parseConfig(int argc, char** argv, int* exit_code, std::string* output);
// The data plane's options: the backend and its settings from the flags, and writes bounded to
// what each target registered unless --insecure (checked by parseConfig: transport::checkOptions).
transport::TransportOptions transportOptions(const DaemonConfig& c);

// The GPUs --emulate-gpu-reach names among `gpus` emulated ones: empty = every one. INVALID_ARGUMENT
// naming the flag for anything but "all" or distinct indexes below `gpus`.
StatusOr<std::set<int>> emulatedGpuReach(const std::string& flag, int gpus);

}  // namespace shardcast::daemon
