// Prometheus metrics of one daemon, on prometheus-cpp (Debian's prometheus-cpp-dev: its registry,
// metric types and text serializer), served on GET /metrics by cpp-httplib beside GET /healthz for
// probes that cannot speak TLS (kubelet's gRPC probes are plaintext; the gRPC port is mutual TLS).
// Syncs coordinated here feed histograms as they end; the sync paths' own atomics (bytes, chunks,
// expiries) and the registry's state are read at scrape time into the same families. Names follow
// Prometheus' conventions: a `shardcast_` prefix, base units, `_total` on counters; labels are
// bounded (result, phase, state, encoding, group, role, source, peer node): never a sync id or a
// tensor name.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/engine/sync_counters.h"
#include "shardcast/v1/service.pb.h"

namespace httplib {
class Server;
}

namespace shardcast::daemon {

class Metrics {
 public:
  Metrics();

  // A sync coordinated here ended: committed or failed after `seconds`. `figures` holds the time
  // of each phase it ran (a failed sync: those it finished and the one it failed in, the others
  // zero and not observed) and, committed, its bytes.
  void syncCommitted(const v1::SyncResponse& figures);
  void syncFailed(double seconds, const v1::SyncResponse& figures = {});
  // A sync from `source` at `version` reached this daemon for destination group `group` (it was
  // prepared here: the coordinator had checked that every source rank published it). The lag
  // gauge measures the group's committed version here against the latest of these.
  void sourceVersionSeen(const std::string& group, const std::string& source, uint64_t version);
  // A sync coordinated here failed at `node` (the node its failure names: a peer, or this one).
  void peerFailed(const std::string& node);
  // A sync coordinated here into replica set `set` committed `committed` replicas and cut `cut`.
  void replicaSetSynced(const std::string& set, size_t committed, size_t cut);
  // Syncs coordinated here that are running (the gauge follows a guard's life).
  struct InFlight {
    explicit InFlight(Metrics& m) : gauge(m.in_flight_) { gauge.Increment(); }
    ~InFlight() { gauge.Decrement(); }
    prometheus::Gauge& gauge;
  };

  AtomicSyncCounters moved;                 // every wave of every sync that ran here
  std::atomic<uint64_t> syncs_expired{0};   // aborted here because their coordinator's lease ran out
  std::atomic<uint64_t> sessions_ended{0};  // client sessions that ended (ranks unregistered)
  std::atomic<bool> serving{false};         // /healthz: 200 once the gRPC server runs, 503 when stopping
  // Read at scrape time.
  std::function<uint64_t()> registered_bytes, registered_ranks, plan_cache_hits, plan_cache_misses;
  std::function<uint64_t()> delta_base_bytes, delta_base_capacity;  // host memory of delta bases
  std::function<uint64_t()> sessions_active;                        // client sessions open now
  // Peer node -> reachable (its gRPC channel connected or connectable, the last call to it
  // answered): the peers this daemon has reached since it started.
  std::function<std::map<std::string, bool>()> peers_up;
  // Registered ranks per state: empty, updating, ready, dirty.
  std::function<std::map<std::string, uint64_t>()> rank_states;
  // Per group registered here: its role, the version its ranks here last committed or published
  // (the lowest of them; 0: none yet) and how many of them are in each state.
  struct GroupFigures {
    std::string role;  // "source" or "destination"
    uint64_t version = 0;
    std::map<std::string, uint64_t> ranks;  // by state name
  };
  std::function<std::map<std::string, GroupFigures>()> groups;
  // With TLS: when this daemon's certificate expires (Unix seconds); unset without TLS.
  std::function<StatusOr<int64_t>()> certificate_expiry;

  // The text exposition format of every family (prometheus::TextSerializer).
  std::string render() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* syncs_;
  prometheus::Family<prometheus::Histogram>* duration_;
  prometheus::Family<prometheus::Histogram>* phase_duration_;
  prometheus::Family<prometheus::Counter>* peer_failures_;
  prometheus::Counter& delta_saved_;
  prometheus::Family<prometheus::Gauge>* set_replicas_;
  prometheus::Family<prometheus::Counter>* replicas_cut_;
  prometheus::Gauge& in_flight_;
  void observePhases(const v1::SyncResponse& figures, const std::string& result, bool every);
  // Destination group -> the version the latest sync into it prepared here, and its source.
  struct SourceSeen {
    std::string source;
    uint64_t version = 0;
  };
  mutable std::mutex sources_mu_;
  mutable std::map<std::string, SourceSeen> sources_;  // render() forgets groups gone from here
};

// Serves `metrics` on host:port until destroyed.
class MetricsServer {
 public:
  static StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, int port, const Metrics& metrics);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> listened_{false};  // listen_after_bind returned (it failed, or was stopped)
  int port_ = 0;
};

}  // namespace shardcast::daemon
