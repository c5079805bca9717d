// Prometheus metrics of one daemon, on prometheus-cpp (Debian's prometheus-cpp-dev: its registry,
// metric types and text serializer), served on GET /metrics beside GET /healthz (MetricsServer) for
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
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "daemon/engine/sync_counters.h"
#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

class Metrics {
 public:
  // `names`: labels carry group, source, replica set and peer node names as they are; otherwise
  // each is "h" and the 16 hex digits of the name's XXH64 (the port is unauthenticated: --metrics-names).
  explicit Metrics(bool names = true);

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
  // Client calls waiting here (WaitVersion, Acquire; syncs: InFlight), for a guard's life.
  struct Waiting {
    explicit Waiting(Metrics& m) : gauge(m.waiting_) { gauge.Increment(); }
    ~Waiting() { gauge.Decrement(); }
    prometheus::Gauge& gauge;
  };
  // A name as labels carry it (see the constructor).
  std::string label(const std::string& name) const;

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
  prometheus::Gauge& waiting_;
  const bool names_;
  void observePhases(const v1::SyncResponse& figures, const std::string& result, bool every);
  // Destination group -> the version the latest sync into it prepared here, and its source.
  struct SourceSeen {
    std::string source;
    uint64_t version = 0;
  };
  mutable std::mutex sources_mu_;
  mutable std::map<std::string, SourceSeen> sources_;  // render() forgets groups gone from here
};

// Serves `metrics` on host:port until destroyed: GET (or HEAD) /metrics and /healthz over plain
// HTTP/1.1, one request per connection. The port is unauthenticated, so what a connection may
// cost is bounded (docs/security.md, "The metrics port"): one thread polls every connection
// (a slow one holds no thread), /healthz is answered on it at once, /metrics is rendered on a
// thread of its own (a slow render delays only scrapes), and each connection gets `Limits`.
class MetricsServer {
 public:
  struct Limits {
    size_t max_connections = 64;                   // open at once; past it the oldest one is closed
    size_t max_request_bytes = 8192;               // request line and headers; past it 431, closed
    std::chrono::milliseconds request_time{5000};  // from accept to the request's last header
    std::chrono::milliseconds answer_time{10000};  // to render and send the answer
  };
  static StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, int port, const Metrics& metrics,
                                                        Limits limits);
  // With the default limits.
  static StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, int port, const Metrics& metrics);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  struct Connection;
  using Connections = std::map<uint64_t, Connection>;  // by id, in the order accepted
  explicit MetricsServer(const Metrics& metrics, Limits limits) : metrics_(metrics), limits_(limits) {}
  void serve();  // the poll thread: accepts, reads requests, answers, closes
  // The poll thread's steps.
  void answer(uint64_t id, Connection& c);      // the request is whole: its answer, or a render asked for
  void takeRendered(Connections& connections);  // the answers of the renders done
  bool exchange(uint64_t id, Connection& c);    // a ready connection's read or send; false: close it
  void acceptConnections(Connections& connections, uint64_t& next_id);  // every connection waiting
  void render();  // the render thread: /metrics for every connection waiting for it, one render each round
  void wake() const;

  const Metrics& metrics_;
  const Limits limits_;
  int listener_ = -1;
  int wake_fd_ = -1;  // eventfd: stop, or a render is done
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  // Connection ids waiting for a render, and the rendered answers by id (render -> serve).
  std::mutex render_mu_;
  std::condition_variable render_cv_;
  std::vector<uint64_t> to_render_;
  std::map<uint64_t, std::string> rendered_;
  std::thread serve_thread_;
  std::thread render_thread_;
};

}  // namespace shardcast::daemon
