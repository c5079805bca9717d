// Prometheus metrics of one daemon, served as text on GET /metrics (cpp-httplib, Debian's
// libcpp-httplib-dev), and GET /healthz for probes that cannot speak TLS (kubelet's gRPC probes
// are plaintext; the gRPC port is mutual TLS). Counters are atomics updated by the sync paths;
// gauges are read on scrape.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/engine/sync_counters.h"

namespace httplib {
class Server;
}

namespace shardcast::daemon {

struct Metrics {
  std::atomic<uint64_t> syncs_ok{0}, syncs_failed{0};
  AtomicSyncCounters moved;                  // every wave of every sync that ran here
  std::atomic<uint64_t> sync_micros_sum{0};  // of committed syncs coordinated here
  std::atomic<uint64_t> syncs_expired{0};    // aborted here because their coordinator's lease ran out
  std::atomic<uint64_t> sessions_ended{0};   // client sessions that ended (ranks unregistered)
  std::atomic<bool> serving{false};          // /healthz: 200 once the gRPC server runs, 503 when stopping
  // Read at scrape time.
  std::function<uint64_t()> registered_bytes, registered_ranks, plan_cache_hits;
  std::function<uint64_t()> delta_base_bytes, delta_base_capacity;  // host memory of delta bases
  // Registered ranks per state: empty, updating, ready, dirty.
  std::function<std::map<std::string, uint64_t>()> rank_states;

  std::string render() const;
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
  int port_ = 0;
};

}  // namespace shardcast::daemon
